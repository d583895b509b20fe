"""Inside a decode step's chained kernels: each block's SM and phase, when it started, took its ticket, resumed after
the phase before, passed its mark (the x row staged, its weight loads issued, or the attention's new rows ready) and
ended, by the GPU's %globaltimer (experiment define LILY_CHAIN_TRACE, sync_cuda.h).
The timeline (run 38) has every chain slower than the kernels it replaces; this shows where inside it the time
goes: the tickets' ramp and latency, the wake-up after each phase, a phase's tail, or the blocks' own work.

    LILY_MLX_KERNEL_DEFINES=LILY_CHAIN_TRACE=4096 LILY_MLX_ENABLE=moe_chain,deltanet_chain_out,attn_chain \\
        python -m bench.chain_trace --model PATH --context 64 4096 [--compiled]

The steps run eagerly (every launch has counters of its own to read back), or with --compiled through the compiled
decoder as generate runs them (each launch site's counters a constant of the trace, read after each step through a
copy made on the GPU; only there bundled_weights applies). Counters in managed memory (switch device_counters off)
stall a launch's first tickets once the host has touched their page: every block started in the first ~0.1 us got
its ticket 6-17 us later (runs 43-49), a stall of the trace's own making, since the compiled step's kernels take as
long without it (run 50, H100: 2,506 us a step with device_counters off, 2,522 on; tickets then 0.2-0.5 us). Needs
MLX's CUDA backend. The traced build can take more registers than the kernel it traces, so fewer of its blocks fit
an SM: moe_chain 128 against 96 (NVRTC), 4 blocks an SM against 5 (ncu, run 68), so its phase 1 starts later here.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

def phases(records: np.ndarray) -> dict:
    """records [blocks, 6] int32 of one launch (SM | phase << 16, start time, then ticket, resume, mark and end after
    it; ns, the start mod 2^32) -> the launch's span and, per phase, its blocks and SMs, the first and last start,
    the first and last resume (after the wait), the last end, a block's mean ticket latency (start to ticket), time
    after its wait to its mark (the x row staged, its weight loads issued, or the attention's new rows ready;
    negative where the loads go out before the wait, as in moe_chain's down phase) and after its wait to its end
    (mean and most), which block of the phase ended last, its slowest blocks, and the wake-up (first resume after the
    phase before's last end); times in us from the launch's first start."""
    sm, phase = records[:, 0] & 0xFFFF, records[:, 0] >> 16
    t = records[:, 1].astype(np.int64)
    t = (t - t[0] + 2**31) % 2**32 - 2**31  # the low 32 bits wrap every 4.3 s
    t -= t.min()
    ticket, resumed, marked, ended = (t + records[:, i] for i in (2, 3, 4, 5))
    # Blocks resident at once, on the GPU and on its fullest SM: whether a later phase's blocks could start early.
    out, before_end = {"span_us": float(ended.max()) / 1e3, "peak_blocks": _peak_running(t, ended),
                       "peak_per_sm": max(_peak_running(t[sm == s], ended[sm == s]) for s in set(sm.tolist())),
                       "phases": []}, None
    for p in sorted(set(phase.tolist())):
        m = phase == p
        row = {"phase": p, "blocks": int(m.sum()), "sms": int(len(set(sm[m].tolist()))),
               "tickets_us": [float(t[m].min()) / 1e3, float(t[m].max()) / 1e3],
               "resumed_us": [float(resumed[m].min()) / 1e3, float(resumed[m].max()) / 1e3],
               "ended_us": float(ended[m].max()) / 1e3,
               "ticket_us": float((ticket[m] - t[m]).mean()) / 1e3,
               "to_mark_us": float((marked[m] - resumed[m]).mean()) / 1e3,
               "work_us": float((ended[m] - resumed[m]).mean()) / 1e3,
               "work_max_us": float((ended[m] - resumed[m]).max()) / 1e3,
               # rows are in ticket order: the block that ended last, by its place in the phase (attn_chain's
               # attention phase: kv head x splits + split)
               "last_block": int(np.argmax(ended[m])),
               "slowest": _slowest(m, sm, t, resumed, marked, ended)}
        if before_end is not None:
            row["wake_us"] = row["resumed_us"][0] - before_end
        before_end = row["ended_us"]
        out["phases"].append(row)
    return out


def _slowest(m, sm, t, resumed, marked, ended, n: int = 3) -> list[dict]:
    """The n blocks of a phase (mask m) with the most work after their wait: place in the phase, SM and times (us)."""
    idx = np.flatnonzero(m)
    return [{"block": int(i), "sm": int(sm[idx[i]]), **{f"{k}_us": float(v[idx[i]]) / 1e3 for k, v in
             (("start", t), ("resumed", resumed), ("marked", marked), ("ended", ended))}}
            for i in np.argsort(-(ended[m] - resumed[m]), kind="stable")[:n]]


def _peak_running(starts: np.ndarray, ends: np.ndarray) -> int:
    """The most intervals [start, end) open at one time."""
    events = sorted([(int(e), -1) for e in ends] + [(int(s), 1) for s in starts])  # an end before a start at one time
    return int(np.max(np.cumsum([d for _, d in events])))


def _mode(values: list) -> int:
    return int(np.bincount(np.asarray(values)).argmax())


def mean_of(launches: list[dict]) -> dict:
    """The launches' phases() averaged field by field (launches of one kernel share their phases), but for the block
    that ended last (the one that did so most often) and the slowest blocks (the first launch's)."""
    avg = lambda xs: [float(v) for v in np.mean(np.array(xs, dtype=float), axis=0)] if isinstance(xs[0], list) \
        else float(np.mean(xs))
    out = {"launches": len(launches), **{k: avg([la[k] for la in launches])
                                         for k in ("span_us", "peak_blocks", "peak_per_sm")}, "phases": []}
    for i, first in enumerate(launches[0]["phases"]):
        rows = [la["phases"][i] for la in launches if len(la["phases"]) > i]
        out["phases"].append({k: (first[k] if k in ("phase", "slowest") else _mode([r[k] for r in rows])
                                  if k == "last_block" else avg([r[k] for r in rows if k in r])) for k in first})
    return out


def trace(model, context: int, steps: int, vocab: int, compiled: bool = False,
          tokens: int = 1) -> dict[str, list[dict]]:
    """phases() of every chained launch over `steps` decode steps after a `context`-token prefill, by kernel: eager
    steps (of `tokens` tokens each: more is MTP's verify forward, which the chains take at 2), or with `compiled` the
    compiled decoder's (as generate runs them; each launch site's counters are a constant of the trace, so its
    records are those of the step just run, read after each)."""
    import mlx.core as mx

    from lily_mlx.decode import CompiledDecoder
    from lily_mlx.ops import kernels

    from .profile_decode import greedy_next, prefilled_cache

    blocks = kernels.chain_trace_blocks()
    if not blocks:
        raise SystemExit(f"chain_trace: set {kernels.DEFINES_ENV}=LILY_CHAIN_TRACE=<blocks>, e.g. 4096")
    cache, tok = prefilled_cache(model, context, vocab), mx.array([[1]])
    if compiled and tokens != 1:
        raise SystemExit("chain_trace: --compiled traces one-token steps only")
    step_fn = CompiledDecoder(model, cache, reserve=steps + 16) if compiled else \
        lambda t: model(mx.repeat(t.reshape(1, 1), tokens, axis=1), cache=cache)[:, -1]
    launches, last, real = {}, {}, kernels.call

    def spy(name, backend, inputs, template, grid, threadgroup, *args, **kwargs):
        out = real(name, backend, inputs, template, grid, threadgroup, *args, **kwargs)
        if kernels.records_trace(name):
            sync = inputs[kernels.SPECS[name].input_names.index("sync")]
            launches[id(sync)] = (name, sync, grid[0] // threadgroup[0])
        return out

    by_kernel = defaultdict(list)
    kernels.call = spy
    try:
        for step in range(2 + steps):  # two to trace and compile
            if not compiled:
                launches.clear()
            tok = greedy_next(step_fn(tok))
            mx.eval(tok)
            if step < 2:
                continue
            for name, sync, n in launches.values():
                if n > blocks:
                    raise SystemExit(f"chain_trace: {name} launches {n} blocks, past LILY_CHAIN_TRACE={blocks}")
                # A copy made on the GPU: reading the counters themselves would move their page to the host, and the
                # next launch's first ticket waits ~17 us for it to come back (H200, run 43).
                rec = np.array(sync + 0)[kernels.SYNC_SLOTS:].reshape(-1, kernels.TRACE_FIELDS)[:n]
                if rec[:, 5].any() and last.get(id(sync)) != rec.tobytes():  # ran in this step
                    by_kernel[name].append(phases(rec))
                last[id(sync)] = rec.tobytes()
    finally:
        kernels.call = real
    if not by_kernel:
        raise SystemExit("chain_trace: no chained launch ran (LILY_MLX_ENABLE names the chains; CUDA backend only)")
    return by_kernel


def main(argv=None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import lily_mlx
    from lily_mlx import ops
    from lily_mlx.ops import kernels

    ap = argparse.ArgumentParser(prog="python -m bench.chain_trace", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--context", type=int, nargs="+", default=[64])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--compiled", action="store_true", help="the compiled decoder's steps, not eager ones")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1], help="tokens an eager step (2: MTP's verify)")
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args(argv)
    model, _ = lily_mlx.load(args.model)
    report = {"model": args.model, "switches": {n: ops.enabled(n) for n in sorted(ops.KERNEL_NAMES)},
              "defines": kernels.experiment_values(), "compiled": args.compiled, "contexts": []}
    for ctx, tokens in ((c, t) for c in args.context for t in args.tokens):
        traced = trace(model, ctx, args.steps, model.config.vocab_size, args.compiled, tokens)
        kinds = {name: mean_of(ls) for name, ls in traced.items()}
        report["contexts"].append({"context": ctx, "tokens": tokens, "kernels": kinds})
        for name, k in kinds.items():
            print(f"context {ctx}, {tokens} token{'s' if tokens > 1 else ''} a step, {name}: {k['span_us']:.1f} us "
                  f"from the first block's start to the last end "
                  f"({k['launches']} launches); at most {k['peak_blocks']:.0f} blocks at once, "
                  f"{k['peak_per_sm']:.0f} on one SM")
            for p in k["phases"]:
                wake = f", woke {p['wake_us']:.2f} us after the phase before" if "wake_us" in p else ""
                print(f"  phase {p['phase']}: {p['blocks']:.0f} blocks on {p['sms']:.0f} SMs, tickets "
                      f"{p['tickets_us'][0]:.2f}-{p['tickets_us'][1]:.2f}, resumed {p['resumed_us'][0]:.2f}-"
                      f"{p['resumed_us'][1]:.2f}{wake}, ended by {p['ended_us']:.2f}; a block's ticket "
                      f"{p['ticket_us']:.2f} us, work {p['work_us']:.2f} us ({p['to_mark_us']:.2f} to its mark), "
                      f"at most {p['work_max_us']:.2f}; last to end most often: block {p['last_block']} of the phase",
                      flush=True)
                print("    slowest (first launch): " + "; ".join(
                    f"block {b['block']} on SM {b['sm']}: started {b['start_us']:.2f}, resumed {b['resumed_us']:.2f}, "
                    f"marked {b['marked_us']:.2f}, ended {b['ended_us']:.2f}" for b in p["slowest"]), flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
