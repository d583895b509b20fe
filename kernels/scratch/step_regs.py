"""Registers and spills, as NVRTC builds them with MLX's options, of the compiled 35B decode step's launches whose
kernel name matches a regex: a quicker loop than scripts/cuda_registers.py --decode-step while editing a body.
    python kernels/scratch/step_regs.py REGEX [--enable moe_chain,...] [--context 64]
"""
import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "tests")]
import cuda_registers as cr  # noqa: E402
from lily_mlx.ops import kernel_cache  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("regex")
ap.add_argument("--enable", default="")
ap.add_argument("--context", type=int, default=64)
a = ap.parse_args()
nvrtc = kernel_cache.Nvrtc()
seen = set()
with tempfile.TemporaryDirectory() as tmp:
    options = kernel_cache.offline_options(nvrtc, Path(tmp)) + ["--ptxas-options=-v"]
    for name, blocks, threads, smem, source in cr.decode_step_launches(tuple(s for s in a.enable.split(",") if s), a.context):
        if not re.search(a.regex, name) or source in seen:
            continue
        seen.add(source)
        kernel = "mlx::core::cu::" + re.search(r"__global__ void (\w+)\(", source).group(1)
        log = []
        nvrtc.compile(source, "k.cu", kernel, options, {kernel_cache.UTILS_NAME: kernel_cache.UTILS_STANDIN}, log)
        regs, spill, static = cr.resources(log[0], "")
        print(f"{name:28s} {blocks:5d} x {threads:4d}  {regs:3d} regs  {spill:4d} B spilled  {static / 1024:.1f} KB smem")
