"""The CPU cost of one custom-kernel launch inside an mx.compile'd graph, by source length, input count
and the way the source reaches MLX (inline text, or an #include of a file: CUDA only, NVRTC reads it).
Decode is bound by this cost (BENCHMARKS.md, the decode-step profile), so it decides how kernels are cut.

    python -m bench.launch_cost [--launches 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

BODY = "int i = threadIdx.x; out[i] = x0[i] + 1.0f;\n"


def kernel(pad: int, n_inputs: int, include_dir: Path | None):
    filler = "// " + "x" * pad + "\n" if pad else ""
    header = filler
    if include_dir is not None:  # the padding lives in a file; the hashed source is one line
        path = include_dir / f"pad{pad}.h"
        path.write_text(filler)
        header = f'#include "{path}"\n'
    names = [f"x{i}" for i in range(n_inputs)]
    return mx.fast.cuda_kernel(name=f"cost_{pad}_{n_inputs}_{int(include_dir is not None)}", input_names=names,
                               output_names=["out"], source=BODY, header=header)


def per_launch_us(step, args, launches: int, reps: int = 30) -> float:
    """Median CPU time to dispatch one compiled step, per primitive in it (pipelined, as generate runs)."""
    out = step(*args)
    mx.eval(out)
    times = []
    nxt = step(*args)
    mx.async_eval(nxt)
    for _ in range(reps):
        cur = nxt
        t0 = time.perf_counter()
        nxt = step(*args)
        mx.async_eval(nxt)
        times.append(time.perf_counter() - t0)
        mx.eval(cur)
    mx.eval(nxt)
    return 1e6 * statistics.median(times) / launches


def custom_chain(k, n_inputs: int, launches: int):
    def step(x, *rest):
        for _ in range(launches):
            x = k(inputs=[x, *rest], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(32,)],
                  output_dtypes=[mx.float32])[0]
        return x
    return mx.compile(step)


def builtin_chain(launches: int):
    idx = mx.arange(32)[::-1]

    def step(x):
        for _ in range(launches):
            x = mx.take(x, idx)  # a gather: compile fuses elementwise runs, not gathers
        return x
    return mx.compile(step)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.launch_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args(argv)
    if not mx.cuda.is_available():
        print("needs MLX's CUDA backend", file=sys.stderr)
        return 2
    n = args.launches
    x = mx.zeros((32,), mx.float32)
    rows = [{"what": "builtin take", "us": per_launch_us(builtin_chain(n), [x], n)}]
    with tempfile.TemporaryDirectory() as tmp:
        for via_include in (False, True):
            for pad in (0, 2048, 8192, 32768):
                for n_inputs in (1, 8):
                    if via_include and pad == 0:
                        continue
                    k = kernel(pad, n_inputs, Path(tmp) if via_include else None)
                    xs = [x] + [mx.zeros((32,), mx.float32) for _ in range(n_inputs - 1)]
                    us = per_launch_us(custom_chain(k, n_inputs, n), xs, n)
                    rows.append({"what": f"custom, {'#include' if via_include else 'inline'} source +{pad} B, "
                                         f"{n_inputs} inputs", "us": us})
    for r in rows:
        print(f"{r['what']:50} {r['us']:7.2f} us/launch", flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"mlx": mx.__version__, "launches": n, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
