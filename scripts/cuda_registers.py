"""Registers, spills and block size of every CUDA kernel instance, as NVRTC builds them with MLX's options (the
nvidia wheels' NVRTC, as scripts/prebuild_kernels.py takes it), or through nvcc's ptxas without it (no GPU needed).
nvcc's numbers can differ: attn_chain took 128 registers a lane there and 168 under NVRTC, as on the H200.

A block whose threads times a lane's registers pass the SM's 64K registers fails at launch with "too many resources
requested for launch" (H200 run 32); this finds such instances before a GPU does, and the spills a launch bound
costs. Needs NVRTC or nvcc (CUDA 12+, on PATH or in /usr/local/cuda/bin); takes minutes (about 2 s an instance a
core).
    python scripts/cuda_registers.py [spec ...] [--where "M == 2 and DV == 128"] [--jobs 2]
Prints one line an instance; exits 1 when some instance cannot launch.

    python scripts/cuda_registers.py --decode-step [--enable moe_chain,...] [--context 64] [--sms 132]
The launches of one compiled decode step of the 35B-A3B shape (its widths, 4 layers: three DeltaNet and one
attention layer, zero weights), each with its grid, its registers and shared memory, the blocks an SM holds (and
what limits them) and the waves its grid takes on the GPU: a memory-bound kernel whose last wave is a sliver runs
that wave's loads with the rest of the GPU idle.
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
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import lily_mlx.ops  # noqa: E402,F401  registers every spec
from lily_mlx.ops import kernel_cache, kernels, moe_gemm  # noqa: E402
from test_metal_compile import CUDA_UTILS_STANDIN  # noqa: E402

SM_REGISTERS = kernels.SM_REGISTERS
SM_SHARED = 228 * 1024  # sm_90: per SM, of which a block may have 227 KB
BLOCK_SHARED_RESERVED = 1024  # the runtime's own shared memory per resident block (sm_80+)
SM_THREADS = 2048
SM_BLOCKS = 32
_nvrtc: Optional[tuple] = None  # (Nvrtc, MLX's options) once nvcc_include found NVRTC


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


def ptxas(source: str, include: Path) -> tuple[int, int, int]:
    """(registers a lane, spill store bytes, static shared memory bytes) of the one kernel in source."""
    if _nvrtc is not None:
        nvrtc, options = _nvrtc
        kernel = "mlx::core::cu::" + re.search(r"__global__ void (\w+)\(", source).group(1)
        log: list[str] = []
        nvrtc.compile(source, "kernel.cu", kernel, options + ["--ptxas-options=-v"],
                      {kernel_cache.UTILS_NAME: kernel_cache.UTILS_STANDIN}, log)
        return resources(log[0], "")
    with tempfile.NamedTemporaryFile("w", suffix=".cu", dir=include.parent, delete=False) as f:
        f.write(source)
    try:
        r = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90a", f"-I{include}", "-x", "cu", "-c", f.name,
                            "-o", os.devnull, "-Xptxas", "-v"], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    return resources(r.stderr, r.stderr[-2000:] if r.returncode else "")


def resources(log: str, error: str) -> tuple[int, int, int]:
    """(registers, spill store bytes, static shared bytes) from ptxas's -v lines."""
    regs, spill = re.search(r"Used (\d+) registers", log), re.search(r"(\d+) bytes spill stores", log)
    smem = re.search(r"(\d+) bytes smem", log)
    if error or regs is None:
        raise RuntimeError(error or log[-2000:])
    return int(regs.group(1)), int(spill.group(1)) if spill else 0, int(smem.group(1)) if smem else 0


def blocks_per_sm(regs: int, threads: int, shared: int) -> tuple[int, str]:
    """(blocks an sm_90 SM holds at once, what limits them) for a block of `threads` lanes of `regs` registers and
    `shared` bytes of shared memory (static + dynamic). Registers are given a warp in units of 256."""
    warps = -(-threads // 32)
    warp_regs = -(-max(regs, 1) * 32 // 256) * 256
    limits = {"registers": (SM_REGISTERS // warp_regs) // warps,
              "shared memory": SM_SHARED // (shared + BLOCK_SHARED_RESERVED),
              "threads": SM_THREADS // (32 * warps), "blocks": SM_BLOCKS}
    limiter = min(limits, key=limits.get)
    return limits[limiter], limiter


def waves(blocks: int, per_sm: int, sms: int) -> tuple[int, float]:
    """(waves a grid of `blocks` takes on `sms` SMs holding `per_sm` each, the last wave's share of the GPU)."""
    slots = per_sm * sms
    n = -(-blocks // slots)
    return n, (blocks - (n - 1) * slots) / slots


def nvcc_include() -> Path:
    """A folder of MLX's device header stand-in for ptxas runs (NVRTC loaded with MLX's options, or else nvcc put on
    PATH); the caller removes its parent."""
    global _nvrtc
    include = Path(tempfile.mkdtemp(prefix="cuda_registers_")) / "include"
    try:
        nvrtc = kernel_cache.Nvrtc()
        _nvrtc = nvrtc, kernel_cache.offline_options(nvrtc, include.parent / "nvrtc")
        return include
    except OSError:
        pass
    if shutil.which("nvcc") is None:
        os.environ["PATH"] = "/usr/local/cuda/bin" + os.pathsep + os.environ["PATH"]
    if shutil.which("nvcc") is None:
        sys.exit("neither NVRTC nor nvcc found: pip install nvidia-cuda-nvrtc (see scripts/prebuild_kernels.py)")
    (include / "mlx/backend/cuda/device").mkdir(parents=True)
    (include / "mlx/backend/cuda/device/utils.cuh").write_text(CUDA_UTILS_STANDIN)
    return include


def decode_step_launches(switches: tuple[str, ...], context: int, widths: Optional[dict] = None,
                         sms: int = 132, tokens: int = 1, resident: bool = False, rows: int = 1) -> list[tuple]:
    """(kernel, grid blocks, block threads, dynamic shared bytes, full CUDA source) of each launch of one compiled
    decode step at the 35B-A3B widths (or `widths` overriding them; 4 layers, zero weights) under `switches` (names
    on, "-name" off, the rest as CUDA's defaults), traced on the CPU as the CUDA path builds it on a GPU of `sms`
    multiprocessors, with a cache of capacity about `context`; over `tokens` > 1, MTP's verify forward instead, and
    with `resident` then the resident loop's forward too (mtp_resident: its states picked on the GPU); with `rows` > 1,
    the server's step of that many slots taken (SlotBatchDecoder, capacity about 512)."""
    import contextlib
    from unittest import mock

    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_map_with_path

    from bench import random_model
    from bench.step_dispatch import standin
    from lily_mlx import ops
    from lily_mlx.config import ModelConfig
    from lily_mlx.decode import CompiledDecoder, CompiledVerifier, SlotBatchDecoder
    from lily_mlx.model import Model

    cfg = ModelConfig.from_dict(random_model.config_json("35b-a3b", {**(widths or {}), "num_hidden_layers": 4}, 0, 4, 64,
                                                              "bfloat16"))
    model = Model(cfg)
    nn.quantize(model, class_predicate=lambda p, m: model.quant_predicate(p, m) if hasattr(m, "to_quantized") else False)
    # Zeros of the quantized shapes: the launches need shapes and dtypes, never values.
    model.update(tree_map_with_path(lambda p, x: mx.zeros(x.shape, mx.bfloat16 if x.dtype == mx.float32 and not
                                                          p.endswith("A_log") else x.dtype), model.parameters()))
    launched = []

    def counted(name, backend, inputs, template, grid, group, output_shapes, output_dtypes, init_value, smem):
        source = kernels.launch_source(name, ops.enabled("cuda_source_files"), inputs, template, output_dtypes)[1]
        threads = group[0] * group[1] * group[2]
        blocks = (-(-grid[0] // group[0])) * (-(-grid[1] // group[1])) * (-(-grid[2] // group[2]))
        launched.append((name, blocks, threads, smem, source))
        return standin(name, backend, inputs, template, grid, group, output_shapes, output_dtypes, init_value, smem)

    with contextlib.ExitStack() as stack:
        for n in switches:  # "-name": off
            stack.enter_context(ops.switched(n.removeprefix("-"), not n.startswith("-")))
        stack.enter_context(mock.patch.object(kernels, "launch", standin))
        stack.enter_context(mock.patch.object(ops, "backend", lambda: "cuda"))
        stack.enter_context(mock.patch.object(kernels, "sm_count", lambda: sms))
        model.fuse_projections()
        cache = model.make_cache()
        model(mx.array([[1]]), cache=cache)
        if rows > 1:
            dec = SlotBatchDecoder(model, cache, rows)
            for _ in range(rows):
                dec.join(cache)
        else:
            dec = (CompiledDecoder if tokens == 1 else CompiledVerifier)(model, cache, reserve=context)
        with mock.patch.object(kernels, "launch", counted):
            tokens_in = mx.ones((rows, tokens), dtype=mx.int32)
            mx.eval(dec(tokens_in))
            if resident:
                states = list(dec.states)
                mx.eval(dec.selected(tokens_in, mx.array([dec.offset], dtype=mx.int32), mx.array([True]), states,
                                     states, dec.offset + tokens))
    return launched


def decode_step_table(switches: tuple[str, ...], context: int, sms: int, jobs: int, tokens: int = 1,
                      rows: int = 1) -> list[dict]:
    """One row a distinct launch of decode_step_launches, in step order: its calls in the 4 layers, grid, block,
    registers, shared memory, blocks an SM (and the limit), waves on `sms` SMs and the last wave's share."""
    launched = decode_step_launches(switches, context, sms=sms, tokens=tokens, rows=rows)
    rows: dict[tuple, dict] = {}
    for name, blocks, threads, smem, source in launched:
        key = (name, blocks, threads, smem, source)
        rows.setdefault(key, {"kernel": name, "calls": 0, "blocks": blocks, "threads": threads})["calls"] += 1
    include = nvcc_include()
    try:
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            built = list(pool.map(lambda k: ptxas(k[4], include), rows))
    finally:
        shutil.rmtree(include.parent, ignore_errors=True)
    for (key, row), (regs, spill, static) in zip(rows.items(), built):
        shared = static + key[3]
        per_sm, limiter = blocks_per_sm(regs, row["threads"], shared)
        n, last = waves(row["blocks"], per_sm, sms)
        row.update(regs=regs, spill=spill, shared=shared, per_sm=per_sm, limiter=limiter, waves=n, last_wave=last)
    return list(rows.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("specs", nargs="*", help="kernel names (default: all)")
    ap.add_argument("--where", default="True", help="a Python condition on the template arguments")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--decode-step", action="store_true", help="the launches of one 35B-shaped decode step instead")
    ap.add_argument("--enable", default="", help="--decode-step: switches on (-name: off), comma-separated")
    ap.add_argument("--context", type=int, default=64, help="--decode-step: the cache's capacity, about")
    ap.add_argument("--sms", type=int, default=132, help="--decode-step: the GPU's SMs (H100 SXM and H200: 132)")
    ap.add_argument("--tokens", type=int, default=1, help="--decode-step: tokens a step (more: MTP's verify forward)")
    ap.add_argument("--rows", type=int, default=1, help="--decode-step: the server's step of this many slots instead")
    a = ap.parse_args(argv)
    if a.decode_step:
        switches = tuple(n for n in a.enable.split(",") if n)
        if a.rows > 1 and a.tokens > 1:
            ap.error("--rows and --tokens: the server's slot step decodes one token a row")
        print(f"decode step, {a.rows} row(s) x {a.tokens} token(s), 35B-A3B widths, 4 layers, context ~{a.context}, {a.sms} SMs, "
              f"switches on: {', '.join(switches) or 'defaults'}")
        print(f"{'kernel':26s} {'calls':>5s} {'blocks':>6s} {'threads':>7s} {'regs':>4s} {'smem KB':>7s} "
              f"{'blocks/SM':>9s} {'limit':13s} {'waves':>5s} {'last wave':>9s}")
        for r in decode_step_table(switches, a.context, a.sms, a.jobs, a.tokens, a.rows):
            print(f"{r['kernel']:26s} {r['calls']:5d} {r['blocks']:6d} {r['threads']:7d} {r['regs']:4d} "
                  f"{r['shared'] / 1024:7.1f} {r['per_sm']:9d} {r['limiter']:13s} {r['waves']:5d} "
                  f"{r['last_wave']:9.0%}" + (f"  {r['spill']} B spilled" if r["spill"] else ""))
        return 0
    include = nvcc_include()
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
        for (spec, t, _), (regs, spill, _) in zip(jobs, pool.map(lambda j: ptxas(j[2], include), jobs)):
            threads = block_threads(spec, t)
            fits = regs * threads <= SM_REGISTERS
            failed += not fits
            shown = " ".join(f"{k}={v}" for k, v in t.items() if not k.endswith("_BITS"))
            print(f"{spec.name:24s} {regs:3d} regs x {threads:4d} threads{'' if fits else ' CANNOT LAUNCH'}"
                  f"{f', {spill} B spilled' if spill else ''}  {shown}", flush=True)
    shutil.rmtree(include.parent, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
