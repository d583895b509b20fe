"""Builds the 35B-A3B decode step's CUDA kernels on a machine without a GPU, into the folder MLX reads custom kernels
from before it builds them (ops/kernel_cache.py), packed for a device machine to start with: gpu_checks.sh unpacks
`.ptx-cache/lily-kernels.tar.xz` into MLX_PTX_CACHE_DIR, so a fresh device spends no NVRTC time on these.

    python scripts/prebuild_kernels.py [--out .ptx-cache/lily-kernels.tar.xz] [--jobs 2] [--arch 90]

Needs NVRTC from the nvidia wheels (pip install nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96
nvidia-cuda-cccl==13.0.85). Each configuration gpu_checks.sh times (switches, LILY_MLX_PLAN, LILY_MLX_KERNEL_DEFINES,
context) is traced in a process of its own, as the plans and defines are read once a process; the kernel sources are
the ones MLX generates there (module names hash them), built with MLX's options for sm_<arch>a.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import lily_mlx  # noqa: E402,F401  (registers every switch)
from lily_mlx import ops  # noqa: E402

# CUDA's own defaults that shape the compiled step's launches (every chain, packed and bundled weights, kv_scatter)
# off; "-name" switches one off.
STEP_DEFAULTS = ("moe_chain", "deltanet_chain_out", "attn_chain", "packed_weights", "bundled_weights", "kv_scatter")
assert set(STEP_DEFAULTS) <= set(ops.backend_defaults("cuda")), "a step default is no longer on by default on CUDA"
UNCHAINED = ",".join("-" + n for n in STEP_DEFAULTS)
# With cuda_source_files a kernel's source #includes files by absolute path, so its module name holds that path:
# gpu_checks.sh writes them to the same folder on the device.
KERNEL_SOURCES = "/tmp/lily-kernel-sources"
# (switches, LILY_MLX_PLAN, LILY_MLX_KERNEL_DEFINES) of the decode steps gpu_checks.sh runs
CONFIGS = [
    ("", "", ""), (UNCHAINED, "", ""), (UNCHAINED + ",packed_weights", "", ""), ("-kv_scatter", "", ""),
    ("-device_scalars", "", ""), ("-bundled_weights", "", ""), ("-deltanet_chain_out,deltanet_chain", "", ""),
    ("", "", "LILY_CHAIN_TRACE=4096"), ("-kv_write", "", ""), ("", "attn_decode.STAGE_ROWS=1024", ""),
]
CONTEXTS = (64, 4096)
# MTP's verify forward over 2 and 3 tokens (gpu_checks.sh's verify timelines, bench.mtp), by default (verify_keep on
# CUDA), with the chains at every row, without verify_keep, with deltanet_chain's input projection at 4 and 2 rows a
# lane segment, attn_chain's at 4 and 5, and traced (bench.chain_trace --tokens 2), at context 64: (switches,
# LILY_MLX_PLAN, LILY_MLX_KERNEL_DEFINES, tokens). The first also traces the resident loop's forward (mtp_resident).
ROWS_CHAINS = "moe_chain,deltanet_chain_out,attn_chain"
VERIFY_CONFIGS = [("", "", "", 2), ("", "", "", 3), (ROWS_CHAINS, "", "", 3), ("-verify_keep", "", "", 2),
                  ("", "deltanet_chain.IN_RPS=4", "", 2), ("", "deltanet_chain.IN_RPS=2", "", 2),
                  ("", "attn_chain.IN_RPS=4", "", 2), ("", "attn_chain.IN_RPS=5", "", 2),
                  ("", "", "LILY_CHAIN_TRACE=4096", 2)]


def trace(context: int) -> None:
    """This process's configuration (from its environment): one JSON line {kernel name: full source} a launch."""
    spec = importlib.util.spec_from_file_location("cuda_registers", ROOT / "scripts" / "cuda_registers.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    switches = tuple(s for s in os.environ.get("LILY_PREBUILD_SWITCHES", "").split(",") if s)
    tokens = int(os.environ.get("LILY_PREBUILD_TOKENS", "1"))
    resident = os.environ.get("LILY_PREBUILD_RESIDENT") == "1"
    for *_, source in tool.decode_step_launches(switches, context, tokens=tokens, resident=resident):
        print(json.dumps({"kernel": re.search(r"__global__ void (custom_kernel_\w+)\(", source).group(1),
                          "source": source}))


def sources(jobs: int) -> dict[str, tuple[str, str]]:
    """{module name: (kernel name, source)} over every configuration and context."""
    from lily_mlx.ops import kernel_cache

    runs = [(c + (1,), ctx) for c in CONFIGS for ctx in CONTEXTS] + [(c, 64) for c in VERIFY_CONFIGS]

    def one(run):
        (switches, plan, defines, tokens), ctx = run
        env = dict(os.environ, LILY_PREBUILD_SWITCHES=switches, LILY_MLX_PLAN=plan, LILY_MLX_KERNEL_DEFINES=defines,
                   LILY_PREBUILD_TOKENS=str(tokens), LILY_PREBUILD_RESIDENT=str(int(run[0] == VERIFY_CONFIGS[0])))
        env.setdefault("LILY_MLX_KERNEL_CACHE", KERNEL_SOURCES)
        r = subprocess.run([sys.executable, __file__, "--trace", str(ctx)], env=env, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"prebuild_kernels: tracing {run} failed:\n{r.stderr[-3000:]}")
        return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]

    found = {}
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for launches in pool.map(one, runs):
            for launch in launches:
                found[kernel_cache.module_name(launch["kernel"], launch["source"])] = (launch["kernel"], launch["source"])
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / ".ptx-cache" / "lily-kernels.tar.xz")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--arch", type=int, default=90, help="the device's compute capability (H100, H200: 90)")
    ap.add_argument("--trace", type=int, metavar="CONTEXT", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.trace is not None:
        trace(a.trace)
        return 0
    from lily_mlx.ops import kernel_cache

    nvrtc = kernel_cache.Nvrtc()
    with tempfile.TemporaryDirectory() as tmp:
        options = kernel_cache.offline_options(nvrtc, Path(tmp) / "include", divmod(a.arch, 10))
        found = sources(a.jobs)
        print(f"{len(found)} kernel instances over {len(CONFIGS)} configurations x {len(CONTEXTS)} contexts and "
              f"{len(VERIFY_CONFIGS)} verify configurations", flush=True)
        cache = Path(tmp) / "ptx"

        def build(item):
            name, (kernel, source) = item
            full = "mlx::core::cu::" + kernel
            binary, lowered = nvrtc.compile(source, name + ".cu", full, options,
                                            {kernel_cache.UTILS_NAME: kernel_cache.UTILS_STANDIN})
            kernel_cache.store(kernel_cache.ptx_path(cache, name), full, lowered, binary)
            return kernel

        with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
            for i, kernel in enumerate(pool.map(build, sorted(found.items())), 1):
                print(f"  {i}/{len(found)} {kernel[:90]}", flush=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(a.out, "w:xz") as tar:
            tar.add(cache, arcname=".")
    print(f"{a.out}: {a.out.stat().st_size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
