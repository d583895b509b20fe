"""Where a lily_mlx prefill's time goes: the whole prompt's wall time, then each part of a DeltaNet layer,
an attention layer and the MoE block timed alone on T tokens at the model's shapes, with the FLOPs each
does, so the table says which part to replace with a kernel first (issue 5).

    python -m bench.profile_prefill --model PATH [--tokens 512 2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional
from unittest import mock

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .kernels import wall_time


def prefill_runner(model, tokens: int, vocab: int, step: int = 2048, headroom: Optional[int] = None,
                   layers: Optional[int] = None):
    """One whole prefill of the prompt as generate runs it (lily_mlx.memory.bounded_prefill: a bound None takes its
    environment variable, unset: the default), as a function."""
    from lily_mlx.memory import bounded_prefill

    prompt = mx.array(np.random.default_rng(tokens).integers(0, vocab, (1, tokens)))

    def run():
        cache = model.make_cache()
        with bounded_prefill(headroom, layers):
            for i in range(0, tokens, step):
                model(prompt[:, i:i + step], cache=cache)
                mx.eval([c.state for c in cache])
    return run


@contextlib.contextmanager
def _switched_all(flips):
    """Each (switch, on) of flips forced for the block."""
    from lily_mlx import ops

    with contextlib.ExitStack() as stack:
        for name, on in flips:
            stack.enter_context(ops.switched(name, on))
        yield


def interleaved_times(runs: dict, rounds: int) -> dict:
    """{label: (median seconds, peak GB)} of each configuration's prefill: every label's `enter()` context set up
    around its run, one warm-up run each, then `rounds` rounds that run every label once, in an order rotated each
    round, so the VM's drifting speed (10-30% between minutes, BENCHMARKS.md) hits all alike."""
    labels = list(runs)
    times = {k: [] for k in labels}
    peaks = {k: 0.0 for k in labels}

    def once(label: str) -> float:
        run, enter = runs[label]
        with enter():
            mx.clear_cache()
            mx.reset_peak_memory()
            t0 = time.perf_counter()
            run()
            t = time.perf_counter() - t0
            peaks[label] = max(peaks[label], mx.get_peak_memory() / 1e9)
        return t

    for label in labels:
        once(label)
    for r in range(rounds):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            times[label].append(once(label))
    return {k: (statistics.median(times[k]), peaks[k]) for k in labels}


def peak_mb(fn) -> float:
    """MB of memory fn()'s evaluation holds at its peak over what was in use before it (its temporaries and output)."""
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    out = fn()
    mx.eval(out)
    return (mx.get_peak_memory() - base) / 1e6


def part_times(model, T: int) -> dict:
    """Each part alone on T tokens (no cache): milliseconds and the dense-equivalent TFLOP/s."""
    from lily_mlx import ops

    lm = model.language_model
    layers = lm.model.layers
    dn = next(l for l in layers if l.is_linear)
    at = next(l for l in layers if not l.is_linear)
    g, a, moe = dn.linear_attn, at.self_attn, dn.mlp
    H = model.config.hidden_size
    h = (mx.random.normal((1, T, H)) * 0.5).astype(mx.bfloat16)
    proj = g.fused_in(h, dn.input_layernorm)
    conv = mx.zeros((1, g.conv_width - 1, g.conv_dim), mx.bfloat16)
    y_dn = mx.zeros((1, T, g.value_dim), mx.bfloat16)
    y_at = mx.zeros((1, T, a.n_heads * a.head_dim), mx.bfloat16)
    xn = dn.post_attention_layernorm(h)
    inds, _ = ops.moe_route(moe.router(xn)[..., :-1], moe.top_k, moe.norm_topk_prob)
    mx.eval(h, proj, conv, y_dn, y_at, xn, inds)
    E_act, I, Is = moe.top_k, model.config.moe_intermediate_size, model.config.shared_expert_intermediate_size
    D, Hq, Hkv = a.head_dim, a.n_heads, a.n_kv_heads
    parts = {
        "deltanet in_proj (norm + qkv|z|b|a)": (lambda: g.fused_in(h, dn.input_layernorm), 2 * T * H * proj.shape[-1]),
        "deltanet_mix (conv, gates, chunked recurrence, gated norm)": (
            lambda: ops.deltanet_mix(proj, g.conv1d.weight, conv, g.A_log, g.dt_bias, g.norm["weight"], None,
                                     num_key_heads=g.Hk, eps=1e-6)[0],
            2 * T * g.Hv * g.Dv * g.Dk * 4),
        "deltanet out_proj": (lambda: g.out_proj(y_dn), 2 * T * g.value_dim * H),
        "router (gate | shared gate)": (lambda: moe.router(xn), 2 * T * H * (model.config.num_experts + 1)),
        "routed experts (SwitchGLU, top-k)": (lambda: moe.switch_mlp(xn, inds), 2 * T * E_act * 3 * H * I),
        "shared expert": (lambda: moe.shared_expert(xn), 2 * T * 3 * H * Is),
        "MoE block whole (router to combine)": (lambda: moe(xn), 2 * T * (E_act * 3 * H * I + 3 * H * Is)),
        "attention layer whole (no cache)": (lambda: a(h), 2 * T * H * (Hq * 3 * D + 2 * Hkv * D) + 2 * T * T * Hq * D),
        "attention o_proj": (lambda: a.o_proj(y_at), 2 * T * Hq * D * H),
        "DeltaNet decoder layer whole (no cache)": (lambda: dn(h), 0),
        "attention decoder layer whole (no cache)": (lambda: at(h, mask="causal"), 0),
    }
    out = {}
    for name, (fn, flops) in parts.items():
        t = wall_time(lambda: mx.eval(fn()), reps=5)
        out[name] = {"ms": 1e3 * t, "tflops": flops / t / 1e12, "peak_mb": peak_mb(fn)}
    experts = "routed experts (SwitchGLU, top-k)"
    mixer = "deltanet_mix (conv, gates, chunked recurrence, gated norm)"
    variants = [("moe_dequant_gemm", False, experts), ("dequant", not ops.enabled("dequant"), experts),
                ("deltanet_chunk", not ops.enabled("deltanet_chunk"), mixer)]
    variants += [("dense_dequant_gemm", True, name) for name in parts if "proj" in name or name == "shared expert"]
    for switch, on, name in variants:
        with ops.switched(switch, on):
            fn, flops = parts[name]
            t = wall_time(lambda: mx.eval(fn()), reps=5)
        out[f"{name}, {switch} {'on' if on else 'off'}"] = {"ms": 1e3 * t, "tflops": flops / t / 1e12}
    return out


def mixer_parts(model, T: int) -> dict:
    """The DeltaNet mixer of one layer on T tokens, split the way deltanet_mix composes it (each part alone,
    its inputs made beforehand): milliseconds per part, so the next kernel goes where the time is."""
    from lily_mlx import ops
    from lily_mlx.ops import reference

    dn = next(l for l in model.language_model.model.layers if l.is_linear)
    g = dn.linear_attn
    H, C, Hv, Dv = model.config.hidden_size, g.conv_dim, g.Hv, g.Dv
    h = (mx.random.normal((1, T, H)) * 0.5).astype(mx.bfloat16)
    proj = g.fused_in(h, dn.input_layernorm)
    qkv, z, b, a = mx.split(proj, [C, C + Hv * Dv, C + Hv * Dv + Hv], axis=-1)
    conv0 = mx.zeros((1, g.conv_width - 1, C), mx.bfloat16)
    conv_out, _ = ops.causal_conv1d(qkv, g.conv1d.weight, conv0)
    q, k, v = mx.split(conv_out, [g.key_dim, 2 * g.key_dim], axis=-1)
    q = reference.l2_normalize(q.reshape(1, T, g.Hk, g.Dk)) * (g.Dk ** -0.5)
    k = reference.l2_normalize(k.reshape(1, T, g.Hk, g.Dk))
    v = v.reshape(1, T, Hv, Dv)
    log_g, beta = reference.deltanet_gates(a, b, g.A_log, g.dt_bias)
    intra = reference.chunk_intra(q, k, v, log_g, beta)
    y = (mx.random.normal((1, T, Hv, Dv)) * 0.1).astype(mx.bfloat16)
    mx.eval(qkv, z, conv0, q, k, v, log_g, beta, intra, y)
    parts = {
        "conv1d + SiLU": lambda: ops.causal_conv1d(qkv, g.conv1d.weight, conv0)[0],
        "l2 norms + gates": lambda: (reference.l2_normalize(conv_out[..., :g.key_dim].reshape(1, T, g.Hk, g.Dk)),
                                     *reference.deltanet_gates(a, b, g.A_log, g.dt_bias)),
        "chunk_intra, MLX ops (every chunk's u, w, qk at once)": lambda: reference.chunk_intra(q, k, v, log_g, beta),
        "chunk_intra (deltanet_intra where on)": lambda: ops.chunk_intra(q, k, v, log_g, beta),
        "chunk scan (deltanet_chunk where on)": lambda: ops.chunk_scan(*intra),
        "gated RMSNorm": lambda: ops.gated_rms_norm(y, z.reshape(1, T, Hv, Dv), g.norm["weight"], 1e-6),
        "whole mixer (ops.deltanet_mix)": lambda: ops.deltanet_mix(
            proj, g.conv1d.weight, conv0, g.A_log, g.dt_bias, g.norm["weight"], None, num_key_heads=g.Hk, eps=1e-6)[0],
    }
    return {name: 1e3 * wall_time(lambda: mx.eval(fn()), reps=5) for name, fn in parts.items()}


def moe_parts(model, T: int) -> dict:
    """The MoE block of one layer on T tokens, split the way SparseMoeBlock and SwitchGLU compose it (each part
    alone, its inputs made beforehand): milliseconds per part, the GEMMs against the sorting and combining around
    them."""
    from lily_mlx import ops

    moe = next(l for l in model.language_model.model.layers if l.is_linear).mlp
    sw = moe.switch_mlp
    E, k = moe.gate.weight.shape[0], moe.top_k
    xn = (mx.random.normal((1, T, model.config.hidden_size)) * 0.5).astype(mx.bfloat16)
    logits = moe.router(xn)
    inds, scores = ops.moe_route(logits[..., :E], k, moe.norm_topk_prob)
    flat = inds.flatten()
    order = mx.argsort(flat)
    inv_order = mx.argsort(order)
    x = mx.expand_dims(xn, (-2, -3)).flatten(0, -3)[order // k]
    idx = flat[order]
    starts = ops.sorted_expert_starts(idx, E)
    kw = dict(sorted_indices=True, expert_starts=starts)
    g, u = sw.gate_proj(x, idx, **kw), sw.up_proj(x, idx, **kw)
    h = mx.random.normal(g.shape).astype(g.dtype) * 0.1
    y = sw.down_proj(h, idx, **kw)
    yk = mx.unflatten(y[inv_order], 0, inds.shape).squeeze(-2)
    mx.eval(xn, logits, inds, scores, order, inv_order, x, idx, starts, g, u, y, yk)
    parts = {
        "router + top-k": lambda: ops.moe_route(moe.router(xn)[..., :E], k, moe.norm_topk_prob),
        "argsort (order)": lambda: mx.argsort(flat),
        "argsort (inverse)": lambda: mx.argsort(order),
        "gather x rows": lambda: mx.expand_dims(xn, (-2, -3)).flatten(0, -3)[order // k],
        "expert starts": lambda: ops.sorted_expert_starts(idx, E),
        "gate projection": lambda: sw.gate_proj(x, idx, **kw),
        "up projection": lambda: sw.up_proj(x, idx, **kw),
        "SiLU(gate) * up": lambda: nn.silu(g) * u,
        "down projection": lambda: sw.down_proj(h, idx, **kw),
        "unsort rows": lambda: mx.unflatten(y[inv_order], 0, inds.shape),
        "weighted combine": lambda: ops.weighted_top_k(yk, scores, xn.dtype),
        "unsort + weighted combine (moe_combine where on)": lambda: ops.combine_sorted_experts(
            y.reshape(-1, y.shape[-1]), inv_order, scores, xn.dtype),
        "shared expert + its gate": lambda: mx.sigmoid(logits[..., E:]) * moe.shared_expert(xn),
        "routed experts whole (SwitchGLU)": lambda: sw(xn, inds),
        "MoE block whole": lambda: moe(xn),
    }
    return {name: 1e3 * wall_time(lambda: mx.eval(fn()), reps=5) for name, fn in parts.items()}


def expert_sweep(model, tokens=(4, 8, 16, 32, 64, 128, 256, 2048)) -> list:
    """Routed experts of one layer by token count, three ways: MLX's quantized gather, dequantize + MLX's grouped
    GEMM, and moe_gemm (dequantized in the tile): where ops.DEQUANT_GEMM_MIN_ROWS should sit, and whether
    moe_gemm should take every sorted batch."""
    from lily_mlx import ops

    moe = next(l for l in model.language_model.model.layers if l.is_linear).mlp
    rows = []
    for T in tokens:
        xn = (mx.random.normal((1, T, model.config.hidden_size)) * 0.5).astype(mx.bfloat16)
        inds, _ = ops.moe_route(moe.router(xn)[..., :-1], moe.top_k, moe.norm_topk_prob)
        mx.eval(xn, inds)
        run = lambda: wall_time(lambda: mx.eval(moe.switch_mlp(xn, inds)), reps=5)
        with ops.disabled("moe_dequant_gemm", "moe_gemm"):
            t_q = run()
        # each path at every count, whatever the dispatcher's rule
        with mock.patch.multiple(ops, DEQUANT_GEMM_MIN_ROWS=0, MOE_GEMM_MIN_ROWS=0):
            with ops.disabled("moe_gemm"):
                t_d = run()
            with ops.switched("moe_gemm", True):
                t_m = run()
        rows.append({"tokens": T, "rows": T * moe.top_k, "gather_qmm_ms": 1e3 * t_q, "dequant_gemm_ms": 1e3 * t_d,
                     "moe_gemm_ms": 1e3 * t_m})
    return rows


def dense_sweep(model, tokens=(64, 256, 512, 2048, 8192)) -> list:
    """Issue 5's dense projections at M > 16 rows, three ways each: MLX's quantized matmul, dequantize + a dense
    GEMM (the dispatcher's rule from ops.DENSE_DEQUANT_MIN_ROWS), and moe_gemm with one expert (dequantized in the
    tile). Two shapes: the DeltaNet in_proj_qkv (2048 -> 8192 at 35B) and its out_proj (4096 -> 2048)."""
    from lily_mlx import ops
    from lily_mlx.ops import moe_gemm, reference

    g = next(l for l in model.language_model.model.layers if l.is_linear).linear_attn
    rows = []
    for name, layer in (("in_proj_qkv", g.in_proj_qkv), ("out_proj", g.out_proj)):
        w, s, b = layer["weight"], layer["scales"], layer["biases"]
        q = dict(group_size=layer.group_size, bits=layer.bits)
        K = w.shape[1] * 32 // layer.bits
        for T in tokens:
            x = (mx.random.normal((T, K)) * 0.5).astype(mx.bfloat16)
            zeros = mx.zeros((T,), mx.int32)
            mx.eval(x, zeros)
            paths = {
                "quantized_matmul": lambda: reference.quantized_matmul(x, w, s, b, **q),
                "dequant_gemm": lambda: x @ ops.dequantize(w, s, b, dtype=x.dtype, **q).T,
                "moe_gemm": lambda: None if ops.backend() == "cpu" else moe_gemm.gather_matmul(
                    x[:, None, :], w[None], zeros, scales=s[None], biases=b[None], backend=ops.backend(), **q),
            }
            row = {"proj": name, "rows": T, "N": w.shape[0], "K": K}
            for path, fn in paths.items():
                row[path + "_ms"] = None if fn() is None else 1e3 * wall_time(lambda: mx.eval(fn()), reps=5)
            rows.append(row)
    return rows


def main(argv=None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import lily_mlx
    from lily_mlx import ops

    ap = argparse.ArgumentParser(prog="python -m bench.profile_prefill", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds of every configuration, interleaved (lengths "
                                                          "over 16,384 tokens: one)")
    ap.add_argument("--json", dest="json_path")
    ap.add_argument("--ab-switch", nargs="+", default=[], metavar="NAME",
                    help="also time the whole prefill with each of these switches flipped (a+b: both), in the same "
                         "process")
    ap.add_argument("--whole-only", action="store_true", help="time the whole prefill only, not each part")
    ap.add_argument("--headroom", type=float, nargs="*", default=[2.0], metavar="GB",
                    help="also time each length with the run-ahead bounded at these headrooms (lily_mlx.memory)")
    ap.add_argument("--layers-ahead", type=int, nargs="+", default=[], metavar="N",
                    help="also time each length with at most N decoder layers dispatched ahead of the GPU (0: unbounded)")
    ap.add_argument("--no-bounded", action="store_true", help="skip the bounded run-ahead variants")
    ap.add_argument("--flash-min-scores", type=int, nargs="+", default=[], metavar="N",
                    help="also time each length with flash_attn taken from N scores (ops.FLASH_MIN_SCORES)")
    ap.add_argument("--dense-min-weights", type=int, nargs="+", default=[], metavar="N",
                    help="also time each length with dense projections dequantized from N weight elements "
                         "(ops.DENSE_DEQUANT_MIN_WEIGHTS)")
    ap.add_argument("--moe-parts", action="store_true", help="also time each part of the MoE block at each length")
    ap.add_argument("--sweep", action="store_true", help="also sweep the routed experts' three paths by token count")
    ap.add_argument("--dense-sweep", action="store_true", help="also sweep two dense projections' three paths by rows")
    ap.add_argument("--sweep-tokens", type=int, nargs="+", metavar="N",
                    help="the token counts of both sweeps (default: 4 to 2,048 for the experts, 64 to 8,192 dense)")
    args = ap.parse_args(argv)
    model, _ = lily_mlx.load(args.model)
    cfg = model.config
    n_dn = sum(l.is_linear for l in model.language_model.model.layers)
    n_at = len(model.language_model.model.layers) - n_dn
    report = {"model": args.model, "mlx": mx.__version__, "date": time.strftime("%Y-%m-%d"), "rows": []}
    weights_gb = sum(v.nbytes for _, v in tree_flatten(model.parameters())) / 1e9
    report["weights_gb"] = weights_gb

    def save():  # after every length and sweep: a step cut short by its time limit keeps what it measured
        if args.json_path:
            Path(args.json_path).write_text(json.dumps(report, indent=2))
    print(f"weights {weights_gb:.2f} GB", flush=True)
    for T in args.tokens:
        rounds = args.rounds if T <= 16384 else 1
        default_run = prefill_runner(model, T, cfg.vocab_size)
        nothing = contextlib.nullcontext
        # label -> (run, context around it), in the order printed; "" is the defaults.
        runs, bounds = {"": (default_run, nothing)}, {}  # bounds: label -> its run-ahead bound's record
        for gb in [] if args.no_bounded else args.headroom:
            label = f"run-ahead bounded ({gb:g} GB headroom)"
            runs[label] = (prefill_runner(model, T, cfg.vocab_size, headroom=int(gb * 2**30)), nothing)
            bounds[label] = {"headroom_gb": gb}
        for n in [] if args.no_bounded else args.layers_ahead:
            label = f"run-ahead {f'bounded ({n} layers ahead)' if n else 'unbounded'}"
            runs[label] = (prefill_runner(model, T, cfg.vocab_size, layers=n), nothing)
            bounds[label] = {"layers_ahead": n}
        for n in args.flash_min_scores:
            runs[f"flash_attn from {n} scores"] = (default_run, lambda n=n: mock.patch.object(ops, "FLASH_MIN_SCORES", n))
        for n in args.dense_min_weights:
            runs[f"dense dequant from {n} weights"] = (
                default_run, lambda n=n: mock.patch.object(ops, "DENSE_DEQUANT_MIN_WEIGHTS", n))
        for names in args.ab_switch:  # a+b flips both
            flips = [(name, not ops.enabled(name)) for name in names.split("+")]
            runs[" ".join(f"{name} {'on' if on else 'off'}" for name, on in flips)] = (
                default_run, lambda flips=flips: _switched_all(flips))
        ops.declined.clear()
        timed = interleaved_times(runs, rounds)
        row = {"tokens": T, "rounds": rounds, "flipped": {}}
        for label, (t, pk) in timed.items():
            rec = {"prefill_s": t, "tok_s": T / t, "peak_gb": pk}
            print(f"{'  ' + label if label else f'{T} tokens, whole prefill'}: {t * 1e3:.1f} ms ({T / t:.0f} tok/s), "
                  f"peak {pk:.2f} GB (weights + {pk - weights_gb:.2f})", flush=True)
            if not label:
                row.update(rec)
            elif label in bounds:
                row.setdefault("bounded", []).append({**bounds[label], **rec})
            else:
                row["flipped"][label] = rec
        row["declined"] = dict(ops.declined)
        if ops.declined:
            print(f"  kernels that declined calls (calls, all configurations): {ops.declined}", flush=True)
        if not args.whole_only:
            row["parts"] = part_times(model, T)
            print(f"  per layer, alone ({n_dn} DeltaNet + {n_at} attention layers, MoE in each):", flush=True)
            for name, p in row["parts"].items():
                peak = f", peak +{p['peak_mb']:7.1f} MB" if "peak_mb" in p else ""
                print(f"  {name:60} {p['ms']:8.2f} ms {p['tflops']:7.1f} TFLOP/s{peak}", flush=True)
            row["mixer_parts_ms"] = mixer_parts(model, T)
            print("  the DeltaNet mixer, part by part:", flush=True)
            for name, ms in row["mixer_parts_ms"].items():
                print(f"    {name:58} {ms:8.2f} ms", flush=True)
        if args.moe_parts:
            row["moe_parts_ms"] = moe_parts(model, T)
            print(f"  the MoE block at {T} tokens, part by part:", flush=True)
            for name, ms in row["moe_parts_ms"].items():
                print(f"    {name:58} {ms:8.3f} ms", flush=True)
        report["rows"].append(row)
        save()
    sweep_tokens = {} if args.sweep_tokens is None else {"tokens": tuple(args.sweep_tokens)}
    report["expert_sweep"] = expert_sweep(model, **sweep_tokens) if args.sweep else []
    save()
    for r in report["expert_sweep"]:
        print(f"experts at {r['tokens']:4} tokens ({r['rows']:5} rows): quantized gather {r['gather_qmm_ms']:7.3f} ms, "
              f"dequantize + grouped GEMM {r['dequant_gemm_ms']:7.3f} ms, moe_gemm {r['moe_gemm_ms']:7.3f} ms", flush=True)
    report["dense_sweep"] = dense_sweep(model, **sweep_tokens) if args.dense_sweep else []
    for r in report["dense_sweep"]:
        ms = {k: "n/a" if r[k + "_ms"] is None else f"{r[k + '_ms']:7.3f} ms" for k in ("quantized_matmul", "dequant_gemm", "moe_gemm")}
        print(f"{r['proj']} {r['K']} -> {r['N']} at {r['rows']:5} rows: quantized matmul {ms['quantized_matmul']}, "
              f"dequantize + GEMM {ms['dequant_gemm']}, moe_gemm {ms['moe_gemm']}", flush=True)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
