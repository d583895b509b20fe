"""moe_gemm on the shapes the prefill gives it, for ncu and for timing body variants on the GPU machine:

    ncu --clock-control none -k regex:moe_gemm --launch-skip 2 --launch-count 1 --section SpeedOfLight \
        python3 kernels/scratch/moe_gemm_cases.py --cases gate512 --reps 3
    python3 kernels/scratch/moe_gemm_cases.py            # median us of each case and variant

Cases: the routed experts' gate and down projections at a 512- and a 2048-token prefill (top-8 of 256, random
routing), and one expert as a dense projection (the DeltaNet in_proj_qkv at 2048 rows). Variants: the default body,
staged (moe_gemm_staged), direct16 and direct32 (moe_gemm_direct at that row tile), each of these "+gather": rows
read from the unsorted tokens through the sort order (moe_gemm_gather), as the gate and up projections are.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.kernels import wall_time  # noqa: E402
from lily_mlx import ops  # noqa: E402
from lily_mlx.ops import moe_gemm as mg  # noqa: E402

VARIANTS = ["default", "staged", "direct16", "direct32"]

CASES = {  # name: (rows, experts, N, K)
    "gate512": (4096, 256, 512, 2048),
    "down512": (4096, 256, 2048, 512),
    "gate2048": (16384, 256, 512, 2048),
    "down2048": (16384, 256, 2048, 512),
    "dense2048": (2048, 1, 8192, 2048),
}


def case(rows: int, E: int, N: int, K: int, gather: bool = False, bm: int = mg.BM):
    w, s, b = mx.quantize(mx.random.normal((E, N, K), key=mx.random.key(1)) * K**-0.5, group_size=64, bits=4)
    s, b = s.astype(mx.bfloat16), b.astype(mx.bfloat16)
    experts = mx.random.randint(0, E, (rows,), key=mx.random.key(2))
    order = mx.argsort(experts)
    idx = experts[order].astype(mx.uint32)
    x = (mx.random.normal((rows, 1, K), key=mx.random.key(3)) * 0.5).astype(mx.bfloat16)
    x_rows = (order // 8).astype(mx.int32) if gather else None  # top-8: rows / 8 tokens
    x = x[: rows // 8] if gather else x
    starts = mg.expert_starts(idx, E, bm)
    mx.eval(w, s, b, idx, x, starts, *([x_rows] if gather else []))
    return lambda: ops.gather_matmul(x, w, idx, scales=s, biases=b, group_size=64, bits=4, sorted_indices=True,
                                     expert_starts=starts, x_rows=x_rows)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variants", nargs="+", default=[v + g for v in VARIANTS for g in ("", "+gather")],
                    choices=[v + g for v in VARIANTS for g in ("", "+gather")])
    args = ap.parse_args()
    for name in args.cases:
        rows, E, N, K = CASES[name]
        for variant in args.variants:
            body, _, gather = variant.partition("+")
            if (gather and E == 1) or (gather and K != 2048):
                continue  # a dense projection has no sort order to read through; down reads the sorted rows
            bm = int(body[len("direct"):]) if body.startswith("direct") else mg.BM
            fn = case(*CASES[name], gather=bool(gather), bm=bm)
            with ops.switched("moe_gemm_staged", body == "staged"):
                us = 1e6 * wall_time(lambda: mx.eval(fn()), reps=args.reps)
            print(f"{name:10} {variant:8} {us:9.1f} us  {2 * rows * N * K / us / 1e6:7.1f} TFLOP/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
