"""Where a prefill's GPU time goes, kernel by kernel (ncu's own kernel durations, no launch gaps), on the first
`--layers` decoder layers of a model (4: three DeltaNet layers and an attention layer, the 35B-A3B's pattern):

    ncu --csv --metrics gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,dram__bytes_read.sum \
        python3 kernels/scratch/prefill_ncu.py --model /tmp/r35 --tokens 512 > raw.csv
    python3 kernels/scratch/prefill_ncu.py --summarize raw.csv

The script prefills twice (the first compiles every kernel); the summary keeps the second half of the launches.
It also prints how the routed rows fall on the experts in each layer (the row tiles each body would run).
With `--decode-steps S` it then runs S compiled decode steps after the prompt, twice (`--tokens` is the context), and
`--summarize raw.csv --decode` keeps the second half of the launches after the prefill's last. Under
`ncu --profile-from-start off` only the second run's decode steps are profiled (cuProfilerStart/Stop around them), so
metrics that replay each launch, such as dram__bytes_read.sum, stay affordable; the summary then keeps every launch.
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.gpu_timeline import short_name  # noqa: E402


def profiler(on: bool) -> None:
    """cuProfilerStart/Stop on MLX's context (the driver's primary one): the range `ncu --profile-from-start off` profiles."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        print(f"no profiler range: {e}", file=sys.stderr)
        return
    err = (cuda.cuProfilerStart if on else cuda.cuProfilerStop)()
    if err:
        print(f"cuProfiler{'Start' if on else 'Stop'} returned CUresult {err}", file=sys.stderr)


def prefill(model_path: str, tokens: int, layers: int, decode_steps: int = 0) -> None:
    import mlx.core as mx
    import numpy as np

    import lily_mlx
    from lily_mlx import ops

    splits = []
    real = ops.sort_by_expert  # SwitchGLU's one way in, moe_sort or MLX's argsorts

    def spy(indices, experts):
        splits.append(np.bincount(np.array(indices.astype(mx.int32)).reshape(-1), minlength=experts))
        return real(indices, experts)

    ops.sort_by_expert = spy
    model, _ = lily_mlx.load(model_path, lazy=True)
    text = model.language_model.model
    text.layers = text.layers[:layers]
    kinds = [l.is_linear for l in text.layers]
    text.ssm_idx, text.fa_idx = (kinds.index(k) if k in kinds else None for k in (True, False))
    mx.eval(model.parameters())  # only the layers kept are ever read
    prompt = mx.array(np.random.default_rng(tokens).integers(0, model.config.vocab_size, (1, tokens)))
    for _ in range(2):
        cache = model.make_cache()
        mx.eval(model(prompt, cache=cache), [c.state for c in cache])
    if decode_steps:
        from lily_mlx import ops
        from lily_mlx.decode import CompiledDecoder

        for run in range(2):
            cache = model.make_cache()
            mx.eval(model(prompt, cache=cache), [c.state for c in cache])
            decoder, y = CompiledDecoder(model, cache), prompt[:, -1:]
            mx.eval(decoder(y))  # the trace and its compiles, outside the profiled range
            if run:
                profiler(True)
            for _ in range(decode_steps):  # generate_step's sampling: logprobs, then the greedy sampler
                y = ops.to_logprobs(decoder(y), greedy=True)[1][:, None]
                mx.eval(y)
        profiler(False)
        return
    for i, counts in enumerate(splits[len(splits) // 2:]):
        tiles = {bm: int(np.sum(-(-counts // bm))) for bm in (16, 32, 64)}
        print(f"layer {i}: {counts.sum()} rows, {np.count_nonzero(counts)} experts, max {counts.max()}, "
              f"row tiles {tiles}, rows a used expert {np.percentile(counts[counts > 0], [10, 50, 90]).tolist()}")


PREFILL_ONLY = re.compile(r"deltanet_chunk|deltanet_intra|deltanet_prep|flash_attn|moe_gemm|moe_sort")


UNITS = {"Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "usecond": 1e3, "msecond": 1e6}  # to bytes, nanoseconds


def summarize(path: str, decode: bool = False) -> None:
    launches = defaultdict(dict)  # ID -> metric -> value, and the kernel's name
    for row in csv.DictReader(io.StringIO("".join(l for l in open(path) if l.startswith('"')))):
        launch = launches[int(row["ID"])]
        launch["name"] = row["Kernel Name"]
        scale = UNITS.get(row.get("Metric Unit", ""), 1.0)  # ncu scales units per value unless --print-units base
        launch[row["Metric Name"]] = float(row["Metric Value"].replace(",", "")) * scale
    ids = sorted(launches)
    if not ids:
        raise SystemExit(f"{path}: no kernel launches in ncu's CSV (did ncu stop before the program ended?)")
    prefills = [i for i, n in enumerate(ids) if PREFILL_ONLY.search(launches[n]["name"])]
    if decode and not prefills:  # profiled from cuProfilerStart: only the second run's decode steps
        second = ids
    else:
        if decode:  # the second run's decode steps: after its prefill's last launch
            ids = ids[prefills[-1] + 1:]
        second = ids[len(ids) // 2:]
    by = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
    for i in second:
        l = launches[i]
        # A kernel's instances apart by grid (the decode step's qmv serves five projections) where ncu measured it.
        grid = int(l.get("launch__grid_size", 0))
        b = by[short_name(l["name"]) + (f" [{grid} blocks]" if grid else "")]
        b[0] += 1
        b[1] += l.get("gpu__time_duration.sum", 0.0) / 1e3  # ns -> us
        b[2] = l.get("launch__registers_per_thread", 0.0)
        b[3] += l.get("sm__warps_active.avg.pct_of_peak_sustained_active", 0.0)
        b[4] += l.get("dram__bytes_read.sum", 0.0)
    total = sum(b[1] for b in by.values())
    print(f"{len(second)} launches, {total:.0f} us of kernel time")
    print(f"{'kernel':70} {'calls':>6} {'us':>9} {'share':>6} {'regs':>5} {'warps %':>8} {'us/call':>8} {'GB/s':>6}")
    for name, (n, us, regs, occ, read) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        print(f"{name[:70]:70} {n:6d} {us:9.1f} {100 * us / total:5.1f}% {regs:5.0f} {occ / n:8.1f} {us / n:8.1f} "
              f"{read / us / 1e3 if us else 0:6.0f}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--decode-steps", type=int, default=0)
    ap.add_argument("--summarize", metavar="CSV")
    ap.add_argument("--decode", action="store_true", help="summarize the decode steps after the last prefill")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize, args.decode)
    else:
        prefill(args.model, args.tokens, args.layers, args.decode_steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
