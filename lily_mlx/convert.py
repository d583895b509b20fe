"""`lily-mlx convert`: any layout we read -> an MLX-layout checkpoint (optionally quantized) that stock
mlx-lm loads, including from the per-expert layout stock mlx-lm cannot read."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Optional

import mlx.core as mx

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json",
)
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def convert(
    hf_path: str,
    mlx_path: str = "mlx_model",
    quantize: bool = False,
    q_group_size: int = 64,
    q_bits: int = 4,
    dtype: Optional[str] = None,
    revision: Optional[str] = None,
) -> Path:
    """Mirror of mlx_lm.convert.convert for this architecture; returns the output folder."""
    from mlx_lm.utils import save_model

    from .loading import load_model, resolve_model_path

    src = resolve_model_path(hf_path, revision=revision)
    out = Path(mlx_path)
    if out.exists():
        raise FileExistsError(f"{out}: already exists; remove it or pick another --mlx-path")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    q = {"bits": q_bits, "group_size": q_group_size} if quantize else None
    model, config = load_model(src, lazy=True, quantize=q, dtype=DTYPES.get(dtype))
    out.mkdir(parents=True)
    save_model(out, model, donate_model=True)
    if dtype is not None:
        config["torch_dtype"] = dtype
    if q is not None:
        config["quantization_config"] = config["quantization"]
    (out / "config.json").write_text(json.dumps(config, indent=4, sort_keys=True))
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


def main(argv=None) -> int:
    from .config import ConfigError
    from .loading import CheckpointError

    p = argparse.ArgumentParser(prog="lily-mlx convert", description="Write an MLX-layout checkpoint (flags follow mlx_lm.convert).")
    p.add_argument("--hf-path", "--model", required=True, help="source folder or hub repo (any layout lily_mlx reads)")
    p.add_argument("--mlx-path", default="mlx_model", help="output folder")
    p.add_argument("-q", "--quantize", action="store_true", help="quantize (8-bit router and shared-expert gate)")
    p.add_argument("--q-group-size", type=int, default=64, choices=(32, 64, 128))
    p.add_argument("--q-bits", type=int, default=4, choices=(2, 4, 8))
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast float parameters")
    p.add_argument("--revision", default=None)
    args = p.parse_args(argv)
    try:
        out = convert(args.hf_path, args.mlx_path, args.quantize, args.q_group_size, args.q_bits, args.dtype, args.revision)
    except (FileNotFoundError, FileExistsError, ConfigError, CheckpointError, ValueError) as e:
        print(f"lily-mlx convert: error: {e}", file=sys.stderr)
        return 2
    print(f"[lily-mlx convert] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
