"""Print the parity table: our logits vs transformers and stock mlx-lm on the tiny random model, per layout.

Run from the repo root: `python bench/parity.py` (uses tests/tiny.py to write the checkpoints).
"""

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("MLX_ENABLE_TF32", "0")  # full float32 matmuls on CUDA, for parity
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def main():
    import torch
    from mlx_lm.utils import load_model as stock_load

    import tiny
    from lily_mlx import load_model

    root = Path(tempfile.mkdtemp())
    hf = tiny.hf_model()
    paths = {"hf": tiny.write_hf(hf, root / "hf"), "hf_sharded": tiny.write_hf(hf, root / "hfs", shards=3),
             "per_expert": tiny.write_per_expert(hf, root / "pe")}
    paths["mlx"] = tiny.write_mlx(paths["hf"], root / "mlx")
    paths["mlx_bf16"] = tiny.write_mlx(paths["hf"], root / "mlx_bf16", dtype="bfloat16")
    paths["mlx_q4"] = tiny.write_mlx(paths["hf"], root / "mlx_q4", quantize=True, group_size=32, bits=4)
    ids = np.random.default_rng(0).integers(0, 512, size=(1, 37))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    print(f"device: {mx.default_device()}  mlx {mx.__version__}")
    print("| layout | vs transformers (fp32) | vs stock mlx-lm | greedy argmax = stock |")
    print("| --- | --- | --- | --- |")
    for name, path in paths.items():
        ours = np.array(load_model(path)[0](mx.array(ids)).astype(mx.float32))
        try:
            stock = np.array(stock_load(path)[0](mx.array(ids)).astype(mx.float32))
            vs_stock, agree = f"{rel(ours, stock):.2e}", f"{(ours.argmax(-1) == stock.argmax(-1)).mean():.3f}"
        except Exception as e:  # per-expert layout: stock cannot load it; bf16 experts on CPU: MLX limit
            vs_stock, agree = f"n/a ({type(e).__name__})", "n/a"
        print(f"| {name} | {rel(ours, ref):.2e} | {vs_stock} | {agree} |")


if __name__ == "__main__":
    main()
