"""Kernel benchmark (the start of `lily-mlx bench --kernels`): qmv vs mx.quantized_matmul.

For each of the model's projection shapes at batch 1: check qmv against the float32 oracle first
(a failing row reports no timing), then time both through MLX, as the model calls them: a chain of
calls evaluated at once, rotating over enough weight copies that the 60 MB L2 cannot serve them.
Times are wall-clock per call, so they include MLX's per-primitive cost (about 4-5 us), which
bounds the small shapes. Bandwidth counts w + scales + biases + x + y once; the peak is a large
`mx.sum` measured in the same run.

    python bench/kernels.py [--json PATH] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from lily_mlx import ops  # noqa: E402
from lily_mlx.ops import qmv, reference  # noqa: E402

# (K, N, bits, what): the model's dense projections at decode.
SHAPES = [
    (2048, 8192, 4, "attn q+gate / DeltaNet qkv"),
    (2048, 248320, 4, "lm_head"),
    (512, 2048, 4, "shared expert down"),
    (2048, 512, 4, "shared expert gate, up / attn k, v"),
    (2048, 256, 8, "router"),
    (2048, 1, 8, "shared-expert gate"),
]
GROUP = 64
L2_BYTES = 60e6


def wall_time(fn, reps: int = 5) -> float:
    """Median wall seconds of fn() over reps runs, after one warm-up run (compile, allocate)."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def read_peak(reps: int) -> float:
    """Bytes/s of mx.sum over 2 GiB of random bf16."""
    a = mx.random.normal((1 << 30,), dtype=mx.bfloat16)
    mx.eval(a)
    t = wall_time(lambda: mx.eval(mx.sum(a)), reps)
    del a
    return (1 << 31) / t


def bench_shape(K: int, N: int, bits: int, peak: float, reps: int) -> dict:
    nbytes = N * K * bits // 8 + 2 * N * (K // GROUP) * 2 + K * 2 + N * 2
    copies = max(1, min(64, math.ceil(3 * L2_BYTES / nbytes)))
    weights = []
    for i in range(copies):
        w, s, b = mx.quantize(mx.random.normal((N, K), key=mx.random.key(i)) * 0.05, group_size=GROUP, bits=bits)
        mx.eval(w, s, b)
        weights.append((w, s, b))
    x = mx.random.normal((1, K), key=mx.random.key(1000)).astype(mx.bfloat16)
    row = {"K": K, "N": N, "bits": bits, "group": GROUP, "bytes": nbytes, "copies": copies}

    w, s, b = weights[0]
    y = qmv.qmv(x, w, s, b, group_size=GROUP, bits=bits, backend=ops.backend(), init_value=float("nan"))
    with mx.stream(mx.cpu):
        ref = reference.quantized_matmul_oracle(x.astype(mx.float32), w, s.astype(mx.float32), b.astype(mx.float32),
                                                group_size=GROUP, bits=bits)
        ref = mx.array(ref)
    stock = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=GROUP, bits=bits)

    def rel(a):
        a = a.astype(mx.float32)
        return (mx.linalg.norm(a - ref) / mx.linalg.norm(ref)).item()

    row["err"] = float("nan") if y is None or mx.isnan(y).any().item() else rel(y)
    row["stock_err"] = rel(stock)
    row["ok"] = bool(row["err"] < 8e-3)

    calls = max(copies, 64)
    stock_fn = lambda: mx.eval([mx.quantized_matmul(x, *weights[i % copies], transpose=True, group_size=GROUP,  # noqa: E731
                                                    bits=bits) for i in range(calls)])
    row["stock_us"] = wall_time(stock_fn, reps) / calls * 1e6
    row["stock_gbs"] = nbytes / row["stock_us"] / 1e3
    if row["ok"]:
        be = ops.backend()
        ours_fn = lambda: mx.eval([qmv.qmv(x, *weights[i % copies], group_size=GROUP, bits=bits, backend=be)  # noqa: E731
                                   for i in range(calls)])
        row["us"] = wall_time(ours_fn, reps) / calls * 1e6
        row["gbs"] = nbytes / row["us"] / 1e3
        row["pct_peak"] = 100 * row["gbs"] * 1e9 / peak
        row["speedup"] = row["stock_us"] / row["us"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    if ops.backend() == "cpu":
        print("no GPU backend: qmv runs on CUDA or Metal only", file=sys.stderr)
        return 2
    peak = read_peak(args.reps)
    rows = []
    print(f"read peak (mx.sum over 2 GiB bf16): {peak / 1e9:.0f} GB/s\n")
    print("| shape | what | MB | qmv us | qmv GB/s | % peak | mx.qmm us | mx.qmm GB/s | speedup | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for K, N, bits, what in SHAPES:
        r = bench_shape(K, N, bits, peak, args.reps)
        r["what"] = what
        rows.append(r)
        shape = f"1x{K}->{N} {bits}-bit"
        if r["ok"]:
            print(f"| {shape} | {what} | {r['bytes'] / 1e6:.2f} | {r['us']:.1f} | {r['gbs']:.0f} | {r['pct_peak']:.0f}% | "
                  f"{r['stock_us']:.1f} | {r['stock_gbs']:.0f} | {r['speedup']:.2f}x | {r['err']:.1e} |")
        else:
            print(f"| {shape} | {what} | {r['bytes'] / 1e6:.2f} | FAIL | - | - | {r['stock_us']:.1f} | "
                  f"{r['stock_gbs']:.0f} | - | {r['err']:.1e} |")
        sys.stdout.flush()
    if args.json:
        args.json.write_text(json.dumps({"peak_bytes_per_s": peak, "rows": rows}, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
