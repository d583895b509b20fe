"""The CPU cost of one custom-kernel launch inside an mx.compile'd graph, by source length, input count
and the way the source reaches MLX (inline text, or an #include of a file: CUDA only, NVRTC reads it), and
by its arity: inputs, outputs, and inputs whose shape the body reads (MLX passes those as extra arguments).
Decode is bound by this cost (BENCHMARKS.md, the decode-step profile), so it decides how kernels are cut:
a decode step passes ~2,200 input arrays to its ~250 launches.

    python -m bench.launch_cost [--launches 200] [--sweep sources arity] [--json out.json]
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
ARITY_PAD = 8192  # about our decode kernels' source size


def kernel(pad: int, n_inputs: int, include_dir: Path | None, n_outputs: int = 1, shaped: int = 0):
    """A trivial kernel whose first output is x0 + 1; the other outputs are left unwritten, and the first
    `shaped` inputs have their shape and ndim read (so MLX passes them)."""
    filler = "// " + "x" * pad + "\n" if pad else ""
    header = filler
    if include_dir is not None:  # the padding lives in a file; the hashed source is one line
        path = include_dir / f"pad{pad}.h"
        path.write_text(filler)
        header = f'#include "{path}"\n'
    names = [f"x{i}" for i in range(n_inputs)]
    body = BODY + "".join(f"if (x{i}_ndim < 0) out[0] = x{i}_shape[0];\n" for i in range(shaped))
    return mx.fast.cuda_kernel(name=f"cost_{pad}_{n_inputs}_{int(include_dir is not None)}_{n_outputs}_{shaped}",
                               input_names=names, output_names=["out"] + [f"o{i}" for i in range(1, n_outputs)],
                               source=body, header=header)


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


def custom_chain(k, n_inputs: int, launches: int, n_outputs: int = 1):
    def step(x, *rest):
        for _ in range(launches):
            x = k(inputs=[x, *rest], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(32,)] * n_outputs,
                  output_dtypes=[mx.float32] * n_outputs)[0]
        return x
    return mx.compile(step)


def launch_row(what: str, k, n_inputs: int, n: int, n_outputs: int = 1) -> dict:
    x = mx.zeros((32,), mx.float32)
    xs = [x] + [mx.zeros((32,), mx.float32) for _ in range(n_inputs - 1)]
    return {"what": what, "inputs": n_inputs, "outputs": n_outputs,
            "us": per_launch_us(custom_chain(k, n_inputs, n, n_outputs), xs, n)}


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
    ap.add_argument("--sweep", nargs="+", choices=("sources", "arity"), default=["sources", "arity"])
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args(argv)
    if not mx.cuda.is_available():
        print("needs MLX's CUDA backend", file=sys.stderr)
        return 2
    n = args.launches
    rows = [{"what": "builtin take", "us": per_launch_us(builtin_chain(n), [mx.zeros((32,), mx.float32)], n)}]
    with tempfile.TemporaryDirectory() as tmp:
        for via_include in (False, True) if "sources" in args.sweep else ():
            for pad in (0, 2048, 8192, 32768):
                for n_inputs in (1, 8):
                    if via_include and pad == 0:
                        continue
                    k = kernel(pad, n_inputs, Path(tmp) if via_include else None)
                    rows.append(launch_row(f"custom, {'#include' if via_include else 'inline'} source +{pad} B, "
                                           f"{n_inputs} inputs", k, n_inputs, n))
    if "arity" in args.sweep:
        for n_inputs in (1, 2, 4, 8, 16):
            rows.append(launch_row(f"custom +{ARITY_PAD} B, {n_inputs} inputs", kernel(ARITY_PAD, n_inputs, None),
                                   n_inputs, n))
        for n_outputs in (3, 5):
            rows.append(launch_row(f"custom +{ARITY_PAD} B, 1 input, {n_outputs} outputs",
                                   kernel(ARITY_PAD, 1, None, n_outputs), 1, n, n_outputs))
        rows.append(launch_row(f"custom +{ARITY_PAD} B, 8 inputs, all 8 shapes read",
                               kernel(ARITY_PAD, 8, None, shaped=8), 8, n))
    for r in rows:
        print(f"{r['what']:50} {r['us']:7.2f} us/launch", flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"mlx": mx.__version__, "launches": n, "rows": rows}, indent=2))
    return 0

if __name__ == "__main__":
    sys.exit(main())
