"""Registers, spills and block size of every CUDA kernel instance, through nvcc's ptxas (no GPU needed).

A block whose threads times a lane's registers pass the SM's 64K registers fails at launch with "too many resources
requested for launch" (H200 run 32); this finds such instances before a GPU does, and the spills a launch bound
costs. Needs nvcc (CUDA 12+) on PATH or in /usr/local/cuda/bin; takes minutes (about 2 s an instance a core).
    python scripts/cuda_registers.py [spec ...] [--where "M == 2 and DV == 128"] [--jobs 2]
Prints one line an instance; exits 1 when some instance cannot launch.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import lily_mlx.ops  # noqa: E402,F401  registers every spec
from lily_mlx.ops import kernels, moe_gemm  # noqa: E402
from test_metal_compile import CUDA_UTILS_STANDIN  # noqa: E402

SM_REGISTERS = 64 * 1024


def block_threads(spec: kernels.KernelSpec, t: dict) -> int:
    """The threads a block of this instance as its dispatcher launches it."""
    if "WARPS" in t:
        return 32 * t["WARPS"]
    if "THREADS" in t:
        return t["THREADS"]
    if spec.name == "attn_decode":
        return 32 * (t["HQ"] // t["HKV"])
    if spec.name == "moe_gemm_direct":
        return moe_gemm.DIRECT_THREADS
    if spec.name.startswith("moe_gemm"):
        return moe_gemm.THREADS
    if spec.name == "flash_attn":
        from lily_mlx.ops import flash_attn

        return 32 * flash_attn.WARPS
    raise KeyError(f"no block size known for {spec.name}")


def ptxas(source: str, include: Path) -> tuple[int, int]:
    """(registers a lane, spill store bytes) of the one kernel in source."""
    with tempfile.NamedTemporaryFile("w", suffix=".cu", dir=include.parent, delete=False) as f:
        f.write(source)
    try:
        r = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90a", f"-I{include}", "-x", "cu", "-c", f.name,
                            "-o", os.devnull, "-Xptxas", "-v"], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    regs, spill = re.search(r"Used (\d+) registers", r.stderr), re.search(r"(\d+) bytes spill stores", r.stderr)
    if r.returncode or regs is None:
        raise RuntimeError(r.stderr[-2000:])
    return int(regs.group(1)), int(spill.group(1)) if spill else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("specs", nargs="*", help="kernel names (default: all)")
    ap.add_argument("--where", default="True", help="a Python condition on the template arguments")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    a = ap.parse_args(argv)
    if shutil.which("nvcc") is None:
        os.environ["PATH"] = "/usr/local/cuda/bin" + os.pathsep + os.environ["PATH"]
    if shutil.which("nvcc") is None:
        sys.exit("nvcc not found: install the CUDA toolkit or put it on PATH")
    root = Path(tempfile.mkdtemp(prefix="cuda_registers_"))
    include = root / "include"
    (include / "mlx/backend/cuda/device").mkdir(parents=True)
    (include / "mlx/backend/cuda/device/utils.cuh").write_text(CUDA_UTILS_STANDIN)
    jobs = []
    for name in a.specs or sorted(kernels.SPECS):
        spec = kernels.SPECS[name]
        for inst in spec.instances():
            t = {k: (str(v).removeprefix("mlx.core.") if not isinstance(v, (int, bool)) else v)
                 for k, v in inst.template}
            if eval(a.where, {}, dict(t)):
                jobs.append((spec, t, kernels.full_source(spec, "cuda", inst)[1]))
    failed = 0
    with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
        for (spec, t, _), (regs, spill) in zip(jobs, pool.map(lambda j: ptxas(j[2], include), jobs)):
            threads = block_threads(spec, t)
            fits = regs * threads <= SM_REGISTERS
            failed += not fits
            shown = " ".join(f"{k}={v}" for k, v in t.items() if not k.endswith("_BITS"))
            print(f"{spec.name:24s} {regs:3d} regs x {threads:4d} threads{'' if fits else ' CANNOT LAUNCH'}"
                  f"{f', {spill} B spilled' if spill else ''}  {shown}", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
