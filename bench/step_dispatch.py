"""MLX's CPU cost to dispatch one compiled decode step, apart from the GPU and from the CUDA backend's own per-launch
work (bench/launch_cost.py measures that).

The 35B-A3B layer stack (40 layers, its quantization and layer pattern; tiny widths, since the cost follows the
graph, not the sizes) is traced as the CUDA path builds it, every custom-kernel launch a stand-in primitive over the
same inputs, then timed on this machine's default device as generate_step runs it, pipelined: the compiled call
(MLX replays the traced graph: a map entry for each constant, an array for each primitive) and the async_eval that
walks it. Configurations in interleaved rounds, medians of this thread's CPU time. Also per step: the kernel source
MLX's CUDA backend hashes at every launch (CustomKernel::eval_gpu names its JIT module by it; about 0.3 us a KB on the
H200, bench/launch_cost.py), inline and with cuda_source_files.

    python -m bench.step_dispatch [--rounds 5] [--steps 60] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from bench import random_model

# Widths small enough to build in a second (the counts and the cost do not depend on them).
NARROW = dict(hidden_size=128, vocab_size=1024, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
              num_experts=16, moe_intermediate_size=64, shared_expert_intermediate_size=64)
CHAINS = ("moe_chain", "deltanet_chain_out", "attn_chain")
SWITCHES = CHAINS + ("packed_weights", "bundled_weights")  # each configuration's are on, the others off
CONFIGS = {"unchained": (), "packed_weights": ("packed_weights",), "chains": CHAINS,
           "chains+packed_weights": CHAINS + ("packed_weights",),
           "chains+packed+bundled": SWITCHES}  # the CUDA defaults


def layer_stack(layers: int = 40):
    """The 35B-A3B layer stack at NARROW widths, `layers` deep (one attention layer in four): 4-bit weights (8-bit
    router), bf16, projections fused."""
    from lily_mlx.config import ModelConfig
    from lily_mlx.model import Model

    cfg = ModelConfig.from_dict(random_model.config_json("35b-a3b", dict(NARROW, num_hidden_layers=layers), 0, 4, 64,
                                                         "bfloat16"))
    model = Model(cfg)
    nn.quantize(model, class_predicate=lambda p, m: model.quant_predicate(p, m) if hasattr(m, "to_quantized") else False)
    model.update(tree_map_with_path(
        lambda p, x: x.astype(mx.bfloat16) if x.dtype == mx.float32 and not p.endswith("A_log") else x,
        model.parameters()))
    model.fuse_projections()
    mx.eval(model.parameters())
    return model


def standin(name, backend, inputs, template, grid, group, output_shapes, output_dtypes, init_value, smem):
    """kernels.launch's stand-in: one primitive over the launch's inputs, with its outputs' shapes and dtypes."""
    outs = [mx.broadcast_to(mx.array(0, dtype=d), s) for s, d in zip(output_shapes, output_dtypes)]
    return mx.depends(outs, list(inputs))


@contextlib.contextmanager
def cuda_builds_traced(into):
    """The CUDA path traced on this CPU: each kernel launch a stand-in that adds (name, full source) to the set
    `into()` returns (MLX names a build by its full source's hash: a source is one build), on a GPU of 132 SMs."""
    from lily_mlx import ops
    from lily_mlx.ops import kernels

    def recorded(name, backend, inputs, template, grid, group, output_shapes, output_dtypes, init_value, smem):
        into().add((name, kernels.launch_source(name, ops.enabled("cuda_source_files"), inputs, template,
                                                output_dtypes)[1]))
        return standin(name, backend, inputs, template, grid, group, output_shapes, output_dtypes, init_value, smem)

    with mock.patch.object(kernels, "launch", recorded), mock.patch.object(ops, "backend", lambda: "cuda"), \
            mock.patch.object(kernels, "sm_count", lambda: 132):
        yield


def hashed_bytes(name, inputs, template, output_dtypes, folder: Path) -> tuple[int, int]:
    """The bytes of source MLX's CUDA backend hashes at each launch of this kernel: inline, and as cuda_source_files
    writes it (#include stubs of files in `folder`)."""
    from lily_mlx.ops import kernels, metal_source

    spec = kernels.SPECS[name]
    src = kernels.body(spec, "cuda")
    hdr = kernels.spec_header(spec, "cuda", src)
    shaped = [(a.dtype, tuple(a.shape)) for a in inputs]
    stub, stub_hdr = kernels.included(spec, src, hdr, folder)
    return tuple(len(metal_source.cuda_source(name, spec.input_names, spec.output_names, s, h, shaped, output_dtypes,
                                              template)[1]) for s, h in ((src, hdr), (stub, stub_hdr)))


def decoder(model, switches: tuple, capacity: int) -> tuple:
    """(a compiled decoder over an 8-token prefill traced under `switches`, (kernel, input count, source bytes
    hashed inline, and via files) of each launch it traced)."""
    from lily_mlx import ops
    from lily_mlx.decode import CompiledDecoder
    from lily_mlx.ops import kernels

    cache = model.make_cache()
    model(mx.array([list(range(1, 9))]), cache=cache)
    launched = []
    folder = Path(tempfile.mkdtemp())

    def counted(name, backend, inputs, template, grid, group, output_shapes, output_dtypes, *rest):
        launched.append((name, len(inputs), *hashed_bytes(name, inputs, template, output_dtypes, folder)))
        return standin(name, backend, inputs, template, grid, group, output_shapes, output_dtypes, *rest)

    with contextlib.ExitStack() as stack:
        stack.enter_context(ops.disabled())  # restores every switch afterwards
        for n in SWITCHES:
            ops.set_enabled(n, n in switches)
        dec = CompiledDecoder(model, cache, reserve=capacity)
        with mock.patch.object(kernels, "launch", counted):
            mx.eval(dec(mx.array([[1]])))  # the trace
    shutil.rmtree(folder)
    return dec, launched


def timed(dec, steps: int) -> tuple[float, float]:
    """(call, call + async_eval) ms of thread CPU a step, medians, each step dispatched before the last is waited on."""
    tok = mx.array([[1]])
    calls, totals = [], []
    nxt = dec(tok)
    mx.async_eval(nxt)
    for _ in range(steps):
        cur = nxt
        c0 = time.thread_time()
        nxt = dec(tok)
        c1 = time.thread_time()
        mx.async_eval(nxt)
        totals.append(time.thread_time() - c0)
        calls.append(c1 - c0)
        mx.eval(cur)
    mx.eval(nxt)
    return 1e3 * statistics.median(calls), 1e3 * statistics.median(totals)


def measure(rounds: int, steps: int) -> dict:
    from lily_mlx import ops
    from lily_mlx.ops import kernels

    counts = {}
    with mock.patch.object(kernels, "launch", standin), mock.patch.object(ops, "backend", lambda: "cuda"):
        model = layer_stack()
        decoders = {}
        for name, switches in CONFIGS.items():
            decoders[name], launched = decoder(model, switches, rounds * (steps + 2) + 8)
            counts[name] = {"launches": len(launched), "kernel_inputs": sum(n for _, n, _, _ in launched),
                            "source_kb": sum(b for *_, b, _ in launched) / 1024,
                            "source_kb_via_files": sum(b for *_, b in launched) / 1024}
        times = {name: [] for name in CONFIGS}
        for r in range(rounds):
            for name in (list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS))):
                times[name].append(timed(decoders[name], steps))
    return {name: {**counts[name], "call_ms": statistics.median(t[0] for t in times[name]),
                   "dispatch_ms": statistics.median(t[1] for t in times[name]),
                   "rounds_dispatch_ms": [t[1] for t in times[name]]} for name in CONFIGS}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.step_dispatch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args(argv)
    rows = measure(args.rounds, args.steps)
    print(f"{'configuration':24} {'launches':>8} {'inputs':>7} {'hashed KB':>9} {'(files)':>8} {'call ms':>8} "
          f"{'+async_eval ms':>15}")
    for name, r in rows.items():
        print(f"{name:24} {r['launches']:8d} {r['kernel_inputs']:7d} {r['source_kb']:9.0f} "
              f"{r['source_kb_via_files']:8.0f} {r['call_ms']:8.3f} {r['dispatch_ms']:15.3f}")
    if args.json_path:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        Path(args.json_path).write_text(json.dumps(
            {"date": datetime.date.today().isoformat(), "mlx": mx.__version__, "device": str(mx.default_device()),
             "commit": commit, "rounds": args.rounds, "steps": args.steps, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
