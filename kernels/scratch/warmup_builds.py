"""How many CUDA kernel instances the server's warm-up builds at the 35B-A3B widths (4 layers, zero weights; the
CUDA path traced on this CPU with stand-ins), and what building them with NVRTC costs here, one at a time.
    python kernels/scratch/warmup_builds.py [--max-batch 32] [--prefill-step 512] [--build N]"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_map_with_path  # noqa: E402

from bench import random_model  # noqa: E402
from bench.step_dispatch import cuda_builds_traced  # noqa: E402
from lily_mlx.config import ModelConfig  # noqa: E402
from lily_mlx.model import Model  # noqa: E402
from lily_mlx.ops import kernel_cache  # noqa: E402
from lily_mlx.server.engine import Engine  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--max-batch", type=int, default=32)
ap.add_argument("--prefill-step", type=int, default=512)
ap.add_argument("--build", type=int, default=0, help="build this many of the instances with NVRTC and time them")
a = ap.parse_args()
cfg = ModelConfig.from_dict(random_model.config_json("35b-a3b", {"num_hidden_layers": 4}, 0, 4, 64, "bfloat16"))
model = Model(cfg)
nn.quantize(model, class_predicate=lambda p, m: model.quant_predicate(p, m) if hasattr(m, "to_quantized") else False)
model.update(tree_map_with_path(lambda p, x: mx.zeros(x.shape, mx.bfloat16 if x.dtype == mx.float32 and not
                                                      p.endswith("A_log") else x.dtype), model.parameters()))
found: set = set()  # (kernel name, full source): MLX names a build by its source

with cuda_builds_traced(lambda: found):
    model.fuse_projections()
    eng = Engine(lambda: None, max_batch=a.max_batch, prefill_step=a.prefill_step)
    eng.model = model
    t0 = time.time()
    eng._warm_up()
print(f"warm-up traced in {time.time() - t0:.0f} s: {len(found)} instances")
by = {}
for name, _ in found:
    by[name] = by.get(name, 0) + 1
for name, n in sorted(by.items(), key=lambda x: -x[1]):
    print(f"  {n:4d} {name}")
if a.build:
    import re
    import tempfile
    nvrtc = kernel_cache.Nvrtc()
    with tempfile.TemporaryDirectory() as tmp:
        options = kernel_cache.offline_options(nvrtc, Path(tmp) / "include")
        for name, source in list(found)[:a.build]:
            kernel = re.search(r"__global__ void (custom_kernel_\w+)\(", source).group(1)
            t = time.time()
            nvrtc.compile(source, "k.cu", "mlx::core::cu::" + kernel, options,
                          {kernel_cache.UTILS_NAME: kernel_cache.UTILS_STANDIN})
            print(f"  built {name} in {time.time() - t:.1f} s", flush=True)
