"""Where a pipelined decode step's GPU time goes on the timeline: kernels running, or the GPU idle between them.

ncu times each kernel alone (serialized, caches flushed), so its sum says nothing of the gaps MLX leaves between
launches, and it overstates a small kernel (qmv 2048->8192: 6.4 us in back-to-back graph replays, 14 us under ncu).
This traces the real step instead: CUPTI's kernel records, through torch.profiler in the same process (MLX and
torch share the device's primary context), over steps dispatched as generate_step does (the next step queued
before waiting on this one). Per step it reports the window, the time some kernel was running (busy), the idle
rest and its largest gaps, and the kernels by total time.

    LILY_MLX_ENABLE=moe_chain,deltanet_chain_out,attn_chain python -m bench.gpu_timeline --model PATH --context 64

Needs MLX's CUDA backend and torch with CUDA in the same environment.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import defaultdict
from pathlib import Path


def timeline(kernels: list[tuple], steps: int, top: int = 12) -> dict:
    """kernels: (name, start us, duration us[, launch shape]) of `steps` steps' launches -> per-step busy and idle
    time (us), the largest idle gaps, the kernels by total time, and by launch (name and shape: one qmv's rows are
    not another's). Overlapping kernels count once toward busy."""
    if not kernels:
        raise ValueError("no kernel records: CUPTI saw none of MLX's launches (is MLX on the CUDA backend?)")
    if steps < 1:
        raise ValueError(f"steps must be positive, got {steps}")
    kernels = sorted(kernels, key=lambda k: k[1])
    start = kernels[0][1]
    end = max(k[1] + k[2] for k in kernels)
    busy, gaps, cover = 0.0, [], start
    for _, s, d, *_ in kernels:
        if s > cover:
            gaps.append(s - cover)
        busy += max(0.0, s + d - max(s, cover))
        cover = max(cover, s + d)
    by_name: dict[str, list] = defaultdict(lambda: [0, 0.0])
    by_launch: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for name, _, d, *shape in kernels:
        for group, key in ((by_name, short_name(name)), (by_launch, " ".join([short_name(name), *shape]))):
            group[key][0] += 1
            group[key][1] += d
    gaps.sort(reverse=True)
    window = end - start
    return {
        "steps": steps, "kernels": len(kernels),
        "window_us": window / steps, "busy_us": busy / steps, "idle_us": (window - busy) / steps,
        "busy_share": busy / window if window else 1.0,
        "gaps_over_5us": sum(1 for g in gaps if g > 5) / steps,
        "idle_in_gaps_over_5us": sum(g for g in gaps if g > 5) / steps,
        "largest_gaps_us": gaps[:top],
        "by_kernel": sorted(([n, c / steps, t / steps] for n, (c, t) in by_name.items()), key=lambda r: -r[2])[:top],
        "by_launch": sorted(([n, c / steps, t / steps, t / c] for n, (c, t) in by_launch.items()),
                            key=lambda r: -r[2])[:2 * top],
    }


def launch_shape(args: dict) -> list[str]:
    """A kernel record's launch as torch.profiler reports it: [blocks x threads, registers] (empty without them)."""
    def size(v) -> int:  # [x, y, z], or the same as text
        n = 1
        for d in re.findall(r"\d+", str(v)):
            n *= int(d)
        return n

    grid, block = args.get("grid"), args.get("block")
    if not grid or not block:
        return []
    shape = f"[{size(grid)} x {size(block)}"
    regs = args.get("registers per thread")
    return [shape + (f", {regs} regs]" if regs is not None else "]")]


def short_name(name: str) -> str:
    """A kernel's name without its argument list and template noise (custom kernels by their lily name)."""
    name = re.sub(r"\(.*", "", name)
    m = re.search(r"custom_kernel_(\w+?)_(bfloat16|float16|float32|float|half)", name)
    return m.group(1) if m else name[:70]


def cuda_profiler_ready() -> None:
    """torch's CUDA context up for CUPTI (MLX and torch share the device's primary context), or a clear exit."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_timeline: torch sees no CUDA device, so CUPTI cannot trace MLX's kernels")
    torch.cuda.init()


def kernel_records(prof) -> list[tuple]:
    """A finished torch.profiler run's kernel records: (name, start us, duration us[, launch shape])."""
    trace = Path("/tmp/lily_gpu_timeline.json")
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    return [(e["name"], float(e["ts"]), float(e.get("dur", 0.0)), *launch_shape(e.get("args", {}))) for e in events
            if e.get("ph") == "X" and e.get("cat") == "kernel"]


def stepper(model, context: int, steps: int, vocab: int, tokens: int = 1, batch: int = 1):
    """step(tokens [batch, 1]) -> logits [batch, V] over a cache prefilled with `context` tokens, with room for
    `steps` steps and more: the compiled decode step at one token and one row; MTP's compiled verify forward
    (lily_mlx.speculative) over `tokens` new tokens, fed the one token `tokens` times; at `batch` rows, the server's
    batch of that many copies of the prompt (SlotBatchDecoder, every slot taken; eager without compiled_decode)."""
    import mlx.core as mx

    from lily_mlx.decode import CompiledDecoder, CompiledVerifier, SlotBatchDecoder
    from lily_mlx.server.engine import _as_batch

    from .profile_decode import prefilled_cache

    if batch > 1 and tokens > 1:
        raise SystemExit("gpu_timeline: --batch times the decode step (one token), not MTP's verify")
    cache = prefilled_cache(model, context, vocab)
    if batch > 1:
        if SlotBatchDecoder.applicable(model, cache):
            slots = SlotBatchDecoder(model, cache, batch)
            for _ in range(batch):
                slots.join(cache)
            return slots
        cache = _as_batch(cache, batch)
        return lambda tok: model(tok, cache=cache)[:, -1, :]
    if tokens == 1:
        return CompiledDecoder(model, cache, reserve=2 * steps + 16)
    verifier = CompiledVerifier(model, cache, reserve=(2 * steps + 16) * tokens)
    return lambda tok: verifier(mx.repeat(tok.reshape(1, 1), tokens, axis=1))[1][:, -1]  # the last position's


def trace_steps(model, context: int, steps: int, vocab: int, tokens: int = 1,
                batch: int = 1) -> list[tuple[str, float, float]]:
    """The kernel records of `steps` pipelined steps of stepper()'s step, each fed the greedy tokens of the last."""
    import mlx.core as mx
    from torch.profiler import ProfilerActivity, profile

    from .profile_decode import greedy_next

    cuda_profiler_ready()
    dec = stepper(model, context, steps, vocab, tokens, batch)
    tok = mx.ones((batch, 1), dtype=mx.uint32)
    for _ in range(4):  # the trace and its compiles
        tok = greedy_next(dec(tok))
        mx.eval(tok)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        nxt = greedy_next(dec(tok))
        mx.async_eval(nxt)
        for _ in range(steps - 1):
            cur = nxt
            nxt = greedy_next(dec(cur))
            mx.async_eval(nxt)
            mx.eval(cur)
        mx.eval(nxt)
    return kernel_records(prof)


def trace_mtp(model, accept: float, tokens: int, vocab: int) -> tuple[list[tuple], int]:
    """The kernel records of MTP decoding (lily_mlx.speculative) at a set acceptance (bench.mtp.set_acceptance), from
    the first token after a 64-token prompt to the last of `tokens`, and how many verify forwards ran."""
    import mlx.core as mx
    import numpy as np
    from torch.profiler import ProfilerActivity, profile

    from lily_mlx.generation import generate_step
    from lily_mlx.speculative import mtp_generate_step

    from .mtp import counted_forwards, set_acceptance

    cuda_profiler_ready()
    prompt = mx.array(np.random.default_rng(0).integers(0, vocab, 64))
    sequence = prompt.tolist() + [t for t, _ in generate_step(prompt, model, max_tokens=tokens)]
    with set_acceptance(sequence, accept, vocab):  # the traces and compiles
        list(mtp_generate_step(prompt, model, max_tokens=tokens))
    calls: list = []
    prof = profile(activities=[ProfilerActivity.CUDA])
    with set_acceptance(sequence, accept, vocab), counted_forwards(calls):
        steps = mtp_generate_step(prompt, model, max_tokens=tokens)
        next(steps)  # the prompt's prefill, untraced
        mx.synchronize()
        calls.clear()
        prof.start()
        for _ in steps:
            pass
        mx.synchronize()
        prof.stop()
    return kernel_records(prof), len(calls)


def main(argv=None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import lily_mlx
    from lily_mlx import ops

    ap = argparse.ArgumentParser(prog="python -m bench.gpu_timeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--context", type=int, nargs="+", default=[64])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1],
                    help="tokens a step: 1 is the decode step, more MTP's verify forward over that many")
    ap.add_argument("--batch", type=int, default=1,
                    help="rows a decode step: the server's batch of this many copies of the prompt")
    ap.add_argument("--mtp", type=float, nargs="+", default=[], metavar="ACCEPT",
                    help="instead, MTP decoding of 128 tokens at these set acceptances: a step is a verify forward "
                         "with what MTP launches around it")
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args(argv)
    model, _ = lily_mlx.load(args.model)
    report = {"model": args.model, "switches": {n: ops.enabled(n) for n in sorted(ops.KERNEL_NAMES)},
              "lily_env": {k: v for k, v in os.environ.items() if k.startswith("LILY_")}, "contexts": []}
    if args.mtp:
        runs = (({"mtp_accept": a}, f"MTP at acceptance {a}", *trace_mtp(model, a, 128, model.config.vocab_size))
                for a in args.mtp)
    else:
        rows = f", {args.batch} rows" if args.batch > 1 else ""
        runs = (({"context": c, "tokens": n, "batch": args.batch}, f"context {c}, {n} token{'s' if n > 1 else ''}{rows}",
                 trace_steps(model, c, args.steps, model.config.vocab_size, n, args.batch), args.steps)
                for c in args.context for n in args.tokens)
    for keys, label, records, steps in runs:
        t = {**keys, **timeline(records, steps)}
        report["contexts"].append(t)
        print(f"{label} a step: {t['window_us']:.0f} us a step on the GPU's timeline, kernels running "
              f"{t['busy_us']:.0f} us ({100 * t['busy_share']:.0f}%), idle {t['idle_us']:.0f} us, of it "
              f"{t['idle_in_gaps_over_5us']:.0f} us in {t['gaps_over_5us']:.1f} gaps over 5 us; "
              f"{t['kernels'] / steps:.0f} kernels a step ({steps} steps)", flush=True)
        print("  largest gaps (us): " + ", ".join(f"{g:.0f}" for g in t["largest_gaps_us"]))
        for name, calls, us in t["by_kernel"]:
            print(f"  {name:60} {calls:6.1f} calls {us:8.1f} us a step")
        print("  by launch (blocks x threads, registers as built):")
        for name, calls, us, per_call in t["by_launch"]:
            print(f"  {name:60} {calls:6.1f} calls {us:8.1f} us a step {per_call:7.1f} us a call")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
