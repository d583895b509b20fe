"""Where a lily_mlx decode step's time goes: the compiled step's wall time, synchronous and pipelined,
the CPU time MLX takes to dispatch it, and each fused op of a layer timed alone at the model's shapes
(a chain of independent calls evaluated at once, so each figure includes MLX's per-primitive cost).

    python -m bench.profile_decode --model PATH [--context 256 4096] [--steps 32] [--no-ops] [--ab-switch NAME]
        [--verify-tokens 2 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from .kernels import wall_time


def prefilled_cache(model, context: int, vocab: int) -> list:
    """A prompt cache holding `context` random tokens, prefilled in 2048-token steps."""
    prompt = mx.array(np.random.default_rng(context).integers(0, vocab, (1, context)))
    cache = model.make_cache()
    for i in range(0, context, 2048):
        model(prompt[:, i:i + 2048], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def timed_steps(step, steps: int) -> dict:
    """step() -> one step's outputs, lazy, each step fed the one before's: 3 warm-up steps (the trace), then ms a step
    synchronous and pipelined (as generate_step: the next step dispatched before waiting on this one), with the
    dispatch's median wall and thread CPU time."""
    for _ in range(3):
        mx.eval(step())
    t0 = time.perf_counter()
    for _ in range(steps):
        mx.eval(step())
    sync = (time.perf_counter() - t0) / steps
    dispatch, dispatch_cpu = [], []
    t0 = time.perf_counter()
    nxt = step()
    mx.async_eval(nxt)
    for _ in range(steps):
        cur = nxt
        t1, c1 = time.perf_counter(), time.thread_time()
        nxt = step()
        mx.async_eval(nxt)
        dispatch.append(time.perf_counter() - t1)
        dispatch_cpu.append(time.thread_time() - c1)
        mx.eval(cur)
    mx.eval(nxt)
    piped = (time.perf_counter() - t0) / (steps + 1)
    return {"sync_ms": 1e3 * sync, "pipelined_ms": 1e3 * piped, "dispatch_ms": 1e3 * statistics.median(dispatch),
            # This thread's CPU time for the same dispatch: what the VM's steal and preemption leave out of the wall figure.
            "dispatch_cpu_ms": 1e3 * statistics.median(dispatch_cpu)}


def greedy_next(logits: mx.array) -> mx.array:
    """logits [B, V] -> the next tokens [B, 1] as generate_step picks them with the greedy sampler: through the
    logprobs (ops.to_logprobs: one launch with switch logprobs, else logsumexp, subtract and argmax)."""
    from lily_mlx import ops

    return ops.to_logprobs(logits, greedy=True)[1][:, None]


def step_times(model, context: int, steps: int, vocab: int) -> dict:
    from lily_mlx.decode import CompiledDecoder

    cache = prefilled_cache(model, context, vocab)
    dec = CompiledDecoder(model, cache, reserve=steps * 3 + 8)
    tok = mx.array([[1]])

    def step():
        nonlocal tok
        tok = greedy_next(dec(tok))
        return tok

    t = timed_steps(step, steps)
    return {"context": context, **t, "tok_s": 1e3 / t["pipelined_ms"]}


def verify_times(model, context: int, steps: int, vocab: int, tokens: int) -> dict:
    """The compiled speculative verify step (lily_mlx.speculative) over `tokens` new tokens: synchronous (each verify
    waits for the one before, as MTP decoding's accept decision does) and pipelined, in ms, with its dispatch."""
    from lily_mlx.decode import CompiledVerifier

    cache = prefilled_cache(model, context, vocab)
    verifier = CompiledVerifier(model, cache, reserve=(2 * steps + 6) * tokens + 8)
    toks = mx.ones((1, tokens), dtype=mx.int32)
    return {"context": context, "tokens": tokens, **timed_steps(lambda: verifier(toks), steps)}


def switch_ab(model, context: int, steps: int, vocab: int, name: str, rounds: int = 7) -> dict:
    """Pipelined step time with switch `name` on vs off, in ONE process: two compiled decoders over the same
    prefilled cache, timed in alternating rounds, so the VM's drifting CPU speed hits both alike. Each arm is built,
    traced and timed under its own setting: the eager sampling step reads the switches at every call, and a trace
    made later (a new input dtype, a grown cache) reads them when it is made."""
    from lily_mlx import ops
    from lily_mlx.decode import CompiledDecoder

    cache = prefilled_cache(model, context, vocab)
    decoders = {}
    for on in (True, False):
        # a+b flips both; a decoder takes its shared trace, keyed on the switches, when made
        with ops.switched(name.split("+"), on):
            dec = CompiledDecoder(model, cache, reserve=(rounds + 1) * (steps + 2) + 8)
            mx.eval(greedy_next(dec(mx.array([[1]]))))
        decoders[on] = dec
    if decoders[True]._fn is decoders[False]._fn:
        raise RuntimeError(f"switch {name}: both settings share one compiled step, so the A/B would time one graph")
    times, cpu = {True: [], False: []}, {True: [], False: []}
    for r in range(rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            dec, tok = decoders[on], mx.array([[1]])
            with ops.switched(name.split("+"), on):
                t0 = time.perf_counter()
                nxt = greedy_next(dec(tok))
                mx.async_eval(nxt)
                dispatch_cpu = []
                for _ in range(steps):
                    cur = nxt
                    c0 = time.thread_time()
                    nxt = greedy_next(dec(cur))
                    mx.async_eval(nxt)
                    dispatch_cpu.append(time.thread_time() - c0)
                    mx.eval(cur)
                mx.eval(nxt)
            times[on].append(1e3 * (time.perf_counter() - t0) / (steps + 1))
            cpu[on].append(1e3 * statistics.median(dispatch_cpu))
    # The dispatch's thread CPU time is the steadier figure on a VM whose wall time drifts 10-30% between rounds.
    return {"context": context, "switch": name, "on_ms": statistics.median(times[True]),
            "off_ms": statistics.median(times[False]), "rounds_on_ms": times[True], "rounds_off_ms": times[False],
            "dispatch_cpu_on_ms": statistics.median(cpu[True]), "dispatch_cpu_off_ms": statistics.median(cpu[False]),
            "rounds_dispatch_cpu_on_ms": cpu[True], "rounds_dispatch_cpu_off_ms": cpu[False]}


def native_profile(model, context: int, vocab: int, path: Path, seconds: float, rate: int = 200) -> dict:
    """Where the pipelined decode loop's CPU time goes, native frames included: py-spy attached to this process
    for `seconds` once the step is traced and warm (so it samples neither imports nor the model load), stacks
    written raw to `path` (gzipped), the frames that hold the most samples returned."""
    import gzip
    import shutil
    import subprocess

    from lily_mlx.decode import CompiledDecoder

    spy = shutil.which("py-spy")
    if spy is None:
        return {"error": "py-spy is not installed"}
    cache = prefilled_cache(model, context, vocab)
    dec = CompiledDecoder(model, cache, reserve=int(seconds * 1000) + 64)  # < 1 ms a step would be news
    nxt = mx.array([[1]])
    for _ in range(3):
        nxt = greedy_next(dec(nxt))
        mx.eval(nxt)
    raw = path.with_suffix("")
    proc = subprocess.Popen([spy, "record", "--pid", str(os.getpid()), "--native", "-r", str(rate), "-d", str(max(1, round(seconds))),
                             "-f", "raw", "-o", str(raw)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    steps = 0
    while proc.poll() is None and steps < int(seconds * 1000):
        cur = nxt
        nxt = greedy_next(dec(cur))
        mx.async_eval(nxt)
        mx.eval(cur)
        steps += 1
    err = proc.communicate()[1]
    if proc.returncode != 0 or not raw.is_file():
        return {"error": f"py-spy exited {proc.returncode}: {err.strip()[-500:]}", "steps": steps}
    with raw.open("rb") as f, gzip.open(path, "wb") as g:
        shutil.copyfileobj(f, g)
    summary = summarize_stacks(raw.read_text().splitlines(), within="native_profile")  # the decoding thread
    raw.unlink()
    return {"steps": steps, "raw": str(path), **summary}


def summarize_stacks(lines, within: str = "", top: int = 40) -> dict:
    """py-spy raw lines ('frame;frame;... count') -> the frames holding the most samples, inclusive and self, over
    the stacks that pass through a frame named `within`."""
    import collections
    import re

    incl, own, total = collections.Counter(), collections.Counter(), 0
    for line in lines:
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = [re.sub(r" \([^()]*\)$", "", f)[:160] for f in stack.split(";")]
        if within and within not in frames:
            continue
        total += int(n)
        for f in set(frames):
            incl[f] += int(n)
        own[frames[-1]] += int(n)
    pct = lambda c: [(f, round(100 * k / max(total, 1), 1)) for f, k in c.most_common(top)]
    return {"samples": total, "inclusive_pct": pct(incl), "self_pct": pct(own)}


def op_times(model, context: int, reps: int = 20) -> dict:
    """Each fused op of a DeltaNet layer, an attention layer and the lm_head, alone, in microseconds."""
    from lily_mlx import ops
    from lily_mlx.layers import added, normed

    lm = model.language_model
    layers = lm.model.layers
    dn = next(l for l in layers if l.is_linear)
    at = next(l for l in layers if not l.is_linear)
    H = model.config.hidden_size
    h = (mx.random.normal((1, 1, H)) * 0.5).astype(mx.bfloat16)
    mx.eval(h)
    g, a = dn.linear_attn, at.self_attn
    conv = mx.zeros((1, g.conv_width - 1, g.conv_dim), mx.bfloat16)
    state = mx.zeros((1, g.Hv, g.Dv, g.Dk), mx.float32)
    proj = g.fused_in(h, dn.input_layernorm)
    keys = mx.zeros((1, a.n_kv_heads, context + 8, a.head_dim), mx.bfloat16)
    aproj = a.fused_qkv(h, at.input_layernorm)
    off = mx.array([context], dtype=mx.int32)
    out_dn = mx.zeros((1, 1, g.value_dim), mx.bfloat16)
    out_at = mx.zeros((1, 1, a.n_heads * a.head_dim), mx.bfloat16)
    mx.eval(conv, state, proj, keys, aproj, off, out_dn, out_at)
    moe = dn.mlp
    calls = {
        "deltanet in_proj (norm + qkv|z|b|a)": lambda: g.fused_in(h, dn.input_layernorm),
        "deltanet_step": lambda: ops.deltanet_decode_step(proj, g.conv1d.weight, conv, g.A_log, g.dt_bias,
                                                          g.norm["weight"], state, num_key_heads=g.Hk, eps=1e-6)[0],
        "deltanet out_proj + residual": lambda: added(g.out_proj, out_dn, h),
        "router (norm + gate|shared gate)": lambda: moe.router(h, dn.post_attention_layernorm),
        "MoE block with its router (SparseMoeBlock.add_to)": lambda: moe.add_to(h, dn.post_attention_layernorm),
        "attention in_proj (norm + q|k|v)": lambda: a.fused_qkv(h, at.input_layernorm),
        f"attn_decode (cache {context})": lambda: ops.attention_decode(
            aproj, a.q_norm["weight"], a.k_norm["weight"], 1e-6, keys, keys, off, n_heads=a.n_heads,
            n_kv_heads=a.n_kv_heads, rope_dims=a.rope_dims, rope_theta=a.rope_theta, scale=a.scale)[0],
        "attention o_proj + residual": lambda: added(a.o_proj, out_at, h),
        "lm_head (final norm + vocabulary)": lambda: normed(lm.lm_head, h, lm.model.norm),
    }
    out = {}
    for name, fn in calls.items():
        t = wall_time(lambda: mx.eval([fn() for _ in range(reps)]))
        with ops.disabled("all"):
            t_ref = wall_time(lambda: mx.eval([fn() for _ in range(reps)]))
        out[name] = {"fused_us": 1e6 * t / reps, "unfused_us": 1e6 * t_ref / reps}
    return out


def main(argv=None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import lily_mlx

    ap = argparse.ArgumentParser(prog="python -m bench.profile_decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--context", type=int, nargs="+", default=[256, 4096])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--no-ops", action="store_true", help="time the whole step only, not each fused op")
    ap.add_argument("--ab-switch", help="also time the step with this switch on vs off, alternating in one process "
                                        "(a+b: both flipped together)")
    ap.add_argument("--verify-tokens", type=int, nargs="*", default=[],
                    help="also time MTP speculative decoding's compiled verify step over this many tokens")
    ap.add_argument("--py-spy", dest="py_spy", type=Path, metavar="PATH.gz",
                    help="also profile the warm decode loop's CPU time with py-spy (native frames), stacks to PATH.gz")
    ap.add_argument("--py-spy-seconds", type=float, default=20.0)
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args(argv)
    model, tokenizer = lily_mlx.load(args.model)
    vocab = model.config.vocab_size
    from lily_mlx import ops

    switches = {name: ops.enabled(name) for name in sorted(ops.KERNEL_NAMES)}
    # MLX's own knobs (MLX_USE_CUDA_GRAPHS, MLX_MAX_OPS_PER_BUFFER, ...) change the dispatch cost: record them.
    mlx_env = {k: v for k, v in os.environ.items() if k.startswith("MLX_")}
    # Ours too: the switches' environment, experiment defines and launch shapes (LILY_MLX_KERNEL_DEFINES, LILY_MLX_PLAN).
    lily_env = {k: v for k, v in os.environ.items() if k.startswith("LILY_")}
    report = {"model": args.model, "mlx": mx.__version__, "mlx_env": mlx_env, "lily_env": lily_env, "switches": switches,
              "steps": [], "ops": {}}
    print("off:", ", ".join(n for n, on in switches.items() if not on) or "none",
          f"; MLX environment {mlx_env}" if mlx_env else "", flush=True)
    for ctx in args.context:
        r = step_times(model, ctx, args.steps, vocab)
        report["steps"].append(r)
        print(f"context {ctx}: step {r['sync_ms']:.2f} ms synchronous, {r['pipelined_ms']:.2f} ms pipelined "
              f"({r['tok_s']:.1f} tok/s), dispatch {r['dispatch_ms']:.2f} ms wall, {r['dispatch_cpu_ms']:.2f} ms thread CPU",
              flush=True)
        for n in args.verify_tokens:
            v = verify_times(model, ctx, args.steps, vocab, n)
            report.setdefault("verify", []).append(v)
            print(f"  verify step, {n} tokens: {v['sync_ms']:.2f} ms synchronous, {v['pipelined_ms']:.2f} ms pipelined, "
                  f"dispatch {v['dispatch_cpu_ms']:.2f} ms thread CPU (one token a step: {r['sync_ms']:.2f} ms "
                  "synchronous)", flush=True)
        if args.ab_switch:
            ab = switch_ab(model, ctx, args.steps, vocab, args.ab_switch)
            report.setdefault("switch_ab", []).append(ab)
            print(f"  {args.ab_switch} on {ab['on_ms']:.2f} ms, off {ab['off_ms']:.2f} ms per pipelined step; dispatch thread "
                  f"CPU on {ab['dispatch_cpu_on_ms']:.2f}, off {ab['dispatch_cpu_off_ms']:.2f} ms "
                  f"(medians of {len(ab['rounds_on_ms'])} alternating rounds)", flush=True)
        if args.py_spy:
            prof = native_profile(model, ctx, vocab, args.py_spy, args.py_spy_seconds)
            report.setdefault("native_profile", []).append({"context": ctx, **prof})
            if "error" in prof:
                print(f"  native profile: {prof['error']}", flush=True)
            else:
                print(f"  native profile: {prof['samples']} samples over {prof['steps']} steps; most inclusive:", flush=True)
                for f, pct in prof["inclusive_pct"][:25]:
                    print(f"    {pct:5.1f}%  {f}", flush=True)
                print("  most self:", flush=True)
                for f, pct in prof["self_pct"][:15]:
                    print(f"    {pct:5.1f}%  {f}", flush=True)
        if args.no_ops:
            continue
        report["ops"][ctx] = op_times(model, ctx)
        for name, t in report["ops"][ctx].items():
            print(f"  {name:40} fused {t['fused_us']:8.1f} us   unfused {t['unfused_us']:8.1f} us", flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
