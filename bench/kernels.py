"""Kernel benchmark (`lily-mlx bench --kernels`): every custom kernel against MLX's nearest built-in.

qmv against mx.quantized_matmul for each of the model's projection shapes at batch 1, then the other
kernels at the 35B-A3B shapes against the path the dispatcher takes with their switch off (MLX's own
ops): the MoE block's two launches (gather_qmm), the DeltaNet decode step, decode attention at 256 and
4096 positions, the prefill's chunk scan, intra-chunk part and flash attention, the expert dequantize, qmv_attn
(against the kernels' unfolded path) and dequant_rows (the embedding lookup). Each row checks its kernel first (a
failing row reports no timing), then times both through MLX as the model calls them: a chain of calls
evaluated at once, rotating over enough input copies that the 60 MB L2 cannot serve them. Times are
wall-clock per call, so they include MLX's per-primitive cost (about 4-5 us), which bounds the small
shapes. Bandwidth counts the bytes a call must read and write once; the peak is a large `mx.sum`
measured in the same run.

    python bench/kernels.py [--json PATH] [--reps 5] [--shapes model|tiny]

`--shapes tiny` runs the same rows at toy sizes, on any backend (on the CPU both sides are MLX's path):
a check of the harness itself, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Optional
from unittest import mock

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
TINY_SHAPES = [(256, 64, 4, "toy"), (128, 33, 8, "toy, 8-bit")]
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


def read_peak(reps: int, elements: int = 1 << 30) -> float:
    """Bytes/s of mx.sum over `elements` random bf16 (2 GiB by default)."""
    a = mx.random.normal((elements,), dtype=mx.bfloat16)
    mx.eval(a)
    t = wall_time(lambda: mx.eval(mx.sum(a)), reps)
    del a
    return 2 * elements / t



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

    be = ops.backend()

    def ours(x, w, s, b, **kw):  # the kernel itself; on the CPU (--shapes tiny) the dispatcher's MLX path
        if be == "cpu":
            return ops.quantized_matmul(x, w, s, b, group_size=GROUP, bits=bits)
        return qmv.qmv(x, w, s, b, group_size=GROUP, bits=bits, backend=be, **kw)

    w, s, b = weights[0]
    y = ours(x, w, s, b, init_value=float("nan"))
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
        ours_fn = lambda: mx.eval([ours(x, *weights[i % copies]) for i in range(calls)])  # noqa: E731
        row["us"] = wall_time(ours_fn, reps) / calls * 1e6
        row["gbs"] = nbytes / row["us"] / 1e3
        row["pct_peak"] = 100 * row["gbs"] * 1e9 / peak
        row["speedup"] = row["stock_us"] / row["us"]
    return row


# Op rows: (switch, what) -> a builder (dims) returning (ours(i), nbytes, copies); "theirs" is ours with the switch
# off. The 35B-A3B dimensions, and toy ones for --shapes tiny.
DIMS = {"model": dict(H=2048, E=256, I=512, IS=512, K=8, Hk=16, Hv=32, Dk=128, Dv=128, W=4, Hq=16, Hkv=2, D=256,
                      rope=64, T=2048, C=64, V=248320, prefill_rows=16384),
        "tiny": dict(H=128, E=8, I=64, IS=64, K=2, Hk=2, Hv=4, Dk=32, Dv=32, W=4, Hq=4, Hkv=2, D=64, rope=16, T=128,
                     C=64, V=1000, prefill_rows=256)}
BF16 = mx.bfloat16


def _copies(nbytes: int) -> int:
    return max(1, min(64, math.ceil(3 * L2_BYTES / max(nbytes, 1))))


def _quant(shape, key, bits=4):
    return mx.quantize(mx.random.normal(shape, key=mx.random.key(key)) * 0.05, group_size=GROUP, bits=bits)


def moe_row(d):
    """The MoE block at one token: top-k experts' gate/up/down and the shared expert (two launches)."""
    H, E, I, IS, K = d["H"], d["E"], d["I"], d["IS"], d["K"]
    gate, up, down = _quant((E, I, H), 1), _quant((E, I, H), 2), _quant((E, H, I), 3)
    sg, su, sd = _quant((IS, H), 4), _quant((IS, H), 5), _quant((H, IS), 6)
    mx.eval(gate, up, down, sg, su, sd)
    per_expert = 3 * I * H // 2 + 3 * 2 * 2 * I * H // GROUP  # codes + bf16 scales/biases of gate, up, down
    nbytes = (K * per_expert + 3 * IS * H // 2) + 4 * H
    copies = 64  # the routing varies per call, so different experts are read
    xs = [(mx.random.normal((1, 1, H), key=mx.random.key(10 + i)) * 0.5).astype(BF16) for i in range(copies)]
    logits = [mx.random.normal((1, 1, E + 1), key=mx.random.key(100 + i)).astype(BF16) for i in range(copies)]
    mx.eval(xs, logits)

    def ours(i):
        return ops.moe_decode(xs[i], None, 1e-6, logits[i], gate, up, down, sg, su, sd, top_k=K, normalize=True,
                              group_size=GROUP, bits=4)
    return ours, nbytes, copies


def deltanet_step_row(d):
    """One token of a Gated DeltaNet layer from its fused projection: conv, gates, the float32 state update."""
    Hk, Hv, Dk, Dv, W = d["Hk"], d["Hv"], d["Dk"], d["Dv"], d["W"]
    C = 2 * Hk * Dk + Hv * Dv
    state_bytes = Hv * Dv * Dk * 4
    copies = _copies(2 * state_bytes)
    conv_w = (mx.random.normal((C, W, 1), key=mx.random.key(1)) * 0.3).astype(BF16)
    a_log, dt_bias = mx.zeros((Hv,)), mx.zeros((Hv,))
    norm_w = mx.ones((Dv,), dtype=BF16)
    projs = [(mx.random.normal((1, 1, C + Hv * Dv + 2 * Hv), key=mx.random.key(i)) * 0.5).astype(BF16)
             for i in range(copies)]
    convs = [mx.zeros((1, W - 1, C), dtype=BF16) for _ in range(copies)]
    states = [mx.random.normal((1, Hv, Dv, Dk), key=mx.random.key(50 + i)) * 0.1 for i in range(copies)]
    mx.eval(conv_w, projs, convs, states)
    nbytes = 2 * state_bytes + 2 * (C + Hv * Dv) * 2 + 2 * (W - 1) * C * 2

    def ours(i):
        return ops.deltanet_decode_step(projs[i], conv_w, convs[i], a_log, dt_bias, norm_w, states[i],
                                        num_key_heads=Hk, eps=1e-6)[0]
    return ours, nbytes, copies


def _attn_inputs(d, context: int):
    """A fused attention projection, q/k norms, `copies` KV caches of `context` positions, the offset; the bytes
    one call reads of a cache, and the copy count."""
    Hq, Hkv, D = d["Hq"], d["Hkv"], d["D"]
    kv_bytes = 2 * Hkv * context * D * 2
    copies = _copies(kv_bytes)
    proj = (mx.random.normal((1, 1, Hq * 2 * D + 2 * Hkv * D), key=mx.random.key(1)) * 0.5).astype(BF16)
    norm = mx.ones((D,), dtype=BF16)
    cap = context + 8
    caches = [(mx.random.normal((1, Hkv, cap, D), key=mx.random.key(2 * i)).astype(BF16),
               mx.random.normal((1, Hkv, cap, D), key=mx.random.key(2 * i + 1)).astype(BF16)) for i in range(copies)]
    off = mx.array([context], dtype=mx.int32)
    mx.eval(proj, norm, caches, off)
    kw = dict(n_heads=Hq, n_kv_heads=Hkv, rope_dims=d["rope"], rope_theta=1e7, scale=D ** -0.5)
    return (proj, norm, norm, 1e-6), caches, off, kw, kv_bytes, copies


def attn_row(d, context: int):
    """One decode token of gated attention over `context` cached positions (GQA, partial RoPE)."""
    head, caches, off, kw, kv_bytes, copies = _attn_inputs(d, context)
    return (lambda i: ops.attention_decode(*head, *caches[i], off, **kw)[0]), kv_bytes, copies


def attn_oproj_row(d, context: int = 256):
    """Decode attention through o_proj and the residual add over a short cache (split in 17 at 256 positions):
    with qmv_attn the splits merge inside the GEMV, without it attn_combine runs between."""
    head, caches, off, kw, kv_bytes, copies = _attn_inputs(d, context)
    H, K = d["H"], d["Hq"] * d["D"]
    w, s, b = _quant((H, K), 11)
    h = (mx.random.normal((1, 1, H), key=mx.random.key(12)) * 0.5).astype(BF16)
    mx.eval(w, s, b, h)

    def ours(i):
        return ops.attention_decode_add(*head, *caches[i], off, (w, s, b), h, group_size=GROUP, bits=4, **kw)[0]
    return ours, kv_bytes + H * K // 2 + 2 * 2 * H * K // GROUP, copies


def logprobs_row(d):
    """A sampling step over the vocabulary at one token: logprobs and the greedy token (bytes: the logits read, the
    logprobs written)."""
    V = d["V"]
    copies = _copies(4 * V)
    logits = [(mx.random.normal((1, V), key=mx.random.key(20 + i)) * 3).astype(BF16) for i in range(copies)]
    mx.eval(logits)
    return (lambda i: ops.to_logprobs(logits[i], greedy=True)), 4 * V, copies


def embed_row(d):
    """The embedding lookup of one token from the 4-bit table [V, H]."""
    V, H = d["V"], d["H"]
    w, s, b = _quant((V, H), 13)
    copies = 64
    ids = [mx.array([[(7919 * i) % V]], dtype=mx.int32) for i in range(copies)]
    mx.eval(w, s, b, ids)
    nbytes = H // 2 + 2 * 2 * H // GROUP + 2 * H
    return (lambda i: ops.embedding_lookup(ids[i], w, s, b, group_size=GROUP, bits=4)), nbytes, copies


def chunk_row(d):
    """The prefill's scan over chunks of one DeltaNet layer (T tokens), from chunk_intra's outputs."""
    Hv, Dk, Dv, T, C = d["Hv"], d["Dk"], d["Dv"], d["T"], d["C"]
    N = T // C
    keys = mx.random.split(mx.random.key(7), 6)
    u = mx.random.normal((1, Hv, N, C, Dv), key=keys[0]) * 0.1
    w, q_dec, k_dec = (mx.random.normal((1, Hv, N, C, Dk), key=keys[i]) * 0.1 for i in (1, 2, 3))
    qk = mx.tril(mx.random.normal((1, Hv, N, C, C), key=keys[4]) * 0.1)
    g_last = mx.exp(-mx.abs(mx.random.normal((1, Hv, N), key=keys[5])) * 0.1)
    state = mx.zeros((1, Hv, Dv, Dk))
    mx.eval(u, w, q_dec, k_dec, qk, g_last, state)
    nbytes = 4 * (u.size * 2 + w.size * 3 + qk.size + g_last.size + 2 * state.size)
    return (lambda i: ops.chunk_scan(u, w, q_dec, qk, k_dec, g_last, state)[0]), nbytes, 1


def dequant_row(d):
    """One projection of every expert (E x I x H codes) to bf16: the grouped GEMM's operand in prefill."""
    E, I, H = d["E"], d["I"], d["H"]
    w, s, b = _quant((E, I, H), 9)
    mx.eval(w, s, b)
    nbytes = E * I * H // 2 + 2 * 2 * E * I * H // GROUP + 2 * E * I * H
    return (lambda i: ops.dequantize(w, s, b, group_size=GROUP, bits=4, dtype=BF16)), nbytes, 1


def moe_gemm_row(d, down: bool = False, rows: Optional[int] = None):
    """Every routed expert's gate (or down) projection on a 2048-token prefill's sorted rows (16,384 at top-8, or
    `rows`), against dequantize + MLX's grouped GEMM: bytes are the codes read once and x read and y written once."""
    E, I, H, rows = d["E"], d["I"], d["H"], rows or d["prefill_rows"]
    K, N = (I, H) if down else (H, I)
    w, s, b = _quant((E, N, K), 10)
    idx = mx.sort(mx.random.randint(0, E, (rows,), key=mx.random.key(11))).astype(mx.uint32)
    x = (mx.random.normal((rows, 1, K), key=mx.random.key(12)) * 0.5).astype(BF16)
    mx.eval(w, s, b, idx, x)
    nbytes = E * N * K // 2 + 2 * 2 * E * N * K // GROUP + 2 * rows * (K + N)
    return (lambda i: ops.gather_matmul(x, w, idx, scales=s, biases=b, group_size=GROUP, bits=4,
                                        sorted_indices=True)), nbytes, 1


def _combine_inputs(d):
    """A 2048-token prefill's expert rows (16,384 at top-8, sorted by expert), their token order and scores."""
    E, H, rows, k = d["E"], d["H"], d["prefill_rows"], d["K"]
    y = (mx.random.normal((rows, H), key=mx.random.key(13)) * 0.5).astype(BF16)
    inv = mx.argsort(mx.random.randint(0, E, (rows,), key=mx.random.key(14)))
    scores = mx.softmax(mx.random.normal((rows // k, k), key=mx.random.key(15)), axis=-1)
    mx.eval(y, inv, scores)
    return y, inv, scores


def combine_row(d):
    """The rows back in token order, weighted and summed: bytes are the rows read once and the output written once."""
    y, inv, scores = _combine_inputs(d)
    T, H = scores.shape[0], y.shape[1]
    return (lambda i: ops.combine_sorted_experts(y, inv, scores, BF16)), 2 * y.size + 2 * T * H, 1


def combine_shared_row(d):
    """combine_row's rows and the MoE block's end (the sigmoid-gated shared expert, the residual): bytes are the rows,
    the shared expert's output and the residual read once and the output written once."""
    y, inv, scores = _combine_inputs(d)
    T, H, E = scores.shape[0], y.shape[1], d["E"]
    hs, res = (mx.random.normal((T, H), key=mx.random.key(s)).astype(BF16) for s in (16, 17))
    logits = mx.random.normal((T, E + 1), key=mx.random.key(18)).astype(BF16)
    mx.eval(hs, res, logits)
    nbytes = 2 * y.size + 2 * T * H + 2 * 2 * T * H + 2 * T * (E + 1)
    return (lambda i: ops.combine_sorted_experts(y, inv, scores, BF16, (hs, logits), res)), nbytes, 1


def mixer_row(d):
    """The prefill DeltaNet mixer of one layer (T tokens) after its input projection, deltanet_prep's prologue against
    the composition: bytes are the projection read, the output written and the float32 state read and written."""
    Hk, Hv, Dk, Dv, T, W = d["Hk"], d["Hv"], d["Dk"], d["Dv"], d["T"], d["W"]
    C = 2 * Hk * Dk + Hv * Dv
    keys = mx.random.split(mx.random.key(19), 6)
    proj = mx.random.normal((1, T, C + Hv * Dv + 2 * Hv), key=keys[0]).astype(BF16)
    conv_w = (mx.random.normal((C, W, 1), key=keys[1]) * 0.5).astype(BF16)
    conv_state = mx.random.normal((1, W - 1, C), key=keys[2]).astype(BF16)
    A_log = mx.random.uniform(-1.0, 1.0, (Hv,), key=keys[3])
    dt_bias = mx.random.normal((Hv,), key=keys[4]).astype(BF16)
    norm_w = mx.ones((Dv,), dtype=BF16)
    state = 0.1 * mx.random.normal((1, Hv, Dv, Dk), key=keys[5])
    mx.eval(proj, conv_w, conv_state, A_log, dt_bias, norm_w, state)
    nbytes = 2 * proj.size + 2 * T * Hv * Dv + 2 * 4 * state.size
    return (lambda i: ops.deltanet_mix(proj, conv_w, conv_state, A_log, dt_bias, norm_w, state, num_key_heads=Hk,
                                       eps=1e-6)), nbytes, 1


def intra_row(d):
    """The prefill's intra-chunk part of one DeltaNet layer (T tokens) from normalised q, k and the gates: every
    output returned, so the MLX side computes them all too."""
    Hk, Hv, Dk, Dv, T, C = d["Hk"], d["Hv"], d["Dk"], d["Dv"], d["T"], d["C"]
    keys = mx.random.split(mx.random.key(8), 5)
    q = (reference.l2_normalize(mx.random.normal((1, T, Hk, Dk), key=keys[0])) * Dk**-0.5).astype(BF16)
    k = reference.l2_normalize(mx.random.normal((1, T, Hk, Dk), key=keys[1])).astype(BF16)
    v = mx.random.normal((1, T, Hv, Dv), key=keys[2]).astype(BF16)
    log_g = -mx.abs(mx.random.normal((1, T, Hv), key=keys[3])) * 0.05
    beta = mx.sigmoid(mx.random.normal((1, T, Hv), key=keys[4]))
    mx.eval(q, k, v, log_g, beta)
    nbytes = 2 * (q.size * 2 + v.size) + 4 * 2 * log_g.size + 4 * Hv * T * (Dv + 3 * Dk + C) + 4 * Hv * (T // C)
    return (lambda i: ops.chunk_intra(q, k, v, log_g, beta, chunk_size=C)[:6]), nbytes, 1


def flash_row(d, T: int):
    """Causal prefill attention of one layer over T tokens (GQA, head_dim D), the dispatcher's score rule set
    aside so the kernel runs at any length: bytes are q, k, v read and the output written once."""
    Hq, Hkv, D = d["Hq"], d["Hkv"], d["D"]
    keys = mx.random.split(mx.random.key(9), 3)
    q = mx.random.normal((1, Hq, T, D), key=keys[0]).astype(BF16)
    k, v = (mx.random.normal((1, Hkv, T, D), key=keys[i]).astype(BF16) for i in (1, 2))
    mx.eval(q, k, v)

    def ours(i):
        with mock.patch.object(ops, "FLASH_MIN_SCORES", 0):
            return ops.attention(q, k, v, scale=D**-0.5, mask="causal")
    return ours, 2 * (2 * q.size + 2 * k.size), 1


OP_ROWS = [
    ("moe_gate_up+moe_down_combine", "MoE block, 1 token (top-k experts + shared)", moe_row),
    ("deltanet_step", "DeltaNet decode step, 1 token", deltanet_step_row),
    ("attn_decode", "decode attention, 256 cached", lambda d: attn_row(d, 256)),
    ("attn_decode", "decode attention, 4096 cached", lambda d: attn_row(d, 4096)),
    ("attn_decode_wide", "decode attention, 256 cached, 16-byte lanes (vs strided lanes)", lambda d: attn_row(d, 256)),
    ("attn_decode_wide", "decode attention, 4096 cached, 16-byte lanes (vs strided lanes)",
     lambda d: attn_row(d, 4096)),
    ("logprobs", "logprobs and greedy token, 1 token (vs logsumexp, subtract, argmax)", logprobs_row),
    ("deltanet_chunk", "prefill chunk scan, one layer", chunk_row),
    ("deltanet_intra", "prefill intra-chunk part, one layer (vs MLX's ops)", intra_row),
    ("flash_attn", "causal prefill attention, one layer, T tokens (vs MLX's unfused attention)",
     lambda d: flash_row(d, d["T"])),
    ("flash_attn", "the same at 4T tokens", lambda d: flash_row(d, 4 * d["T"])),
    ("dequant", "every expert's gate projection to bf16", dequant_row),
    ("moe_gemm", "experts' gate projection, a 2048-token prefill's sorted rows (vs dequantize + grouped GEMM)", moe_gemm_row),
    ("moe_gemm", "experts' down projection, the same rows", lambda d: moe_gemm_row(d, down=True)),
    ("moe_gemm_staged", "experts' gate projection, the staged variant (vs the default body)", moe_gemm_row),
    ("moe_gemm_bounded", "experts' down projection, a 512-token prefill's 4096 rows, 3 blocks an SM (vs the "
     "default body)", lambda d: moe_gemm_row(d, down=True, rows=d["prefill_rows"] // 4)),
    ("moe_combine", "the experts' rows back in token order, weighted and summed (vs unsort + sum)", combine_row),
    ("moe_combine_shared", "moe_combine and the MoE block's end: gated shared expert, residual (vs moe_combine "
     "+ 3 ops)", combine_shared_row),
    ("deltanet_prep", "prefill DeltaNet mixer, one layer, T tokens (its prologue in one launch vs the composition)",
     mixer_row),
    ("qmv_attn", "attention + o_proj + residual, 256 cached (vs attn_combine + qmv)", attn_oproj_row),
    ("dequant_rows", "embedding lookup, 1 token (vs MLX's gathers + dequantize)", embed_row),
]


@contextlib.contextmanager
def _forced_on(names):
    """These switches on (opt-in ones too) for the block; every switch restored after."""
    with ops.disabled():
        for n in names:
            ops.set_enabled(n, True)
        yield


def bench_op(switch: str, build, dims: dict, peak: float, reps: int) -> dict:
    """One op: our kernel's output against the switch-off path's first, then both timed the same way."""
    names = switch.split("+")
    ours, nbytes, copies = build(dims)
    def flat(out):  # one array, or every output of a multi-output op, as one float32 vector for the check
        return mx.concatenate([a.reshape(-1).astype(mx.float32) for a in (out if isinstance(out, tuple) else (out,))])

    with _forced_on(names):
        y = flat(ours(0))
    with ops.disabled(*names):
        ref = flat(ours(0))
    err = float("nan") if mx.isnan(y).any().item() else (mx.linalg.norm(y - ref) / mx.linalg.norm(ref)).item()
    row = {"bytes": nbytes, "copies": copies, "err": err, "ok": bool(err < 2e-2)}
    calls = max(copies, 16)
    with ops.disabled(*names):
        row["stock_us"] = wall_time(lambda: mx.eval([ours(i % copies) for i in range(calls)]), reps) / calls * 1e6
    row["stock_gbs"] = nbytes / row["stock_us"] / 1e3
    if row["ok"]:
        with _forced_on(names):
            row["us"] = wall_time(lambda: mx.eval([ours(i % copies) for i in range(calls)]), reps) / calls * 1e6
        row["gbs"] = nbytes / row["us"] / 1e3
        row["pct_peak"] = 100 * row["gbs"] * 1e9 / peak
        row["speedup"] = row["stock_us"] / row["us"]
    return row


def print_row(name: str, what: str, r: dict) -> None:
    """One markdown row: ours, MLX's, the speedup and the check's error (FAIL and no timing when it failed)."""
    ours = f"{r['us']:.1f} | {r['gbs']:.0f} | {r['pct_peak']:.0f}%" if r["ok"] else "FAIL | - | -"
    speedup = f"{r['speedup']:.2f}x" if r["ok"] else "-"
    print(f"| {name} | {what} | {r['bytes'] / 1e6:.2f} | {ours} | {r['stock_us']:.1f} | {r['stock_gbs']:.0f} | {speedup} | "
          f"{r['err']:.1e} |", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rows", metavar="REGEX", help="only the kernel rows whose switch matches (no qmv shapes)")
    ap.add_argument("--shapes", choices=sorted(DIMS), default="model",
                    help="model: the 35B-A3B shapes (a GPU); tiny: toy sizes, a check of the harness on any backend")
    args = ap.parse_args(argv)
    if ops.backend() == "cpu" and args.shapes == "model":
        print("no GPU backend: the kernels run on CUDA or Metal only (--shapes tiny checks the harness here)",
              file=sys.stderr)
        return 2
    peak = read_peak(args.reps, 1 << 30 if args.shapes == "model" else 1 << 22)
    rows = []
    print(f"read peak (mx.sum over {'2 GiB' if args.shapes == 'model' else '8 MiB'} of bf16): {peak / 1e9:.0f} GB/s\n")
    print("| shape | what | MB | qmv us | qmv GB/s | % peak | mx.qmm us | mx.qmm GB/s | speedup | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for K, N, bits, what in [] if args.rows else (SHAPES if args.shapes == "model" else TINY_SHAPES):
        r = bench_shape(K, N, bits, peak, args.reps)
        r["what"] = what
        rows.append(r)
        print_row(f"1x{K}->{N} {bits}-bit", what, r)
    print("\n| kernel | what | MB | ours us | ours GB/s | % peak | MLX us | MLX GB/s | speedup | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for switch, what, build in OP_ROWS:
        if args.rows and not re.search(args.rows, switch):
            continue
        r = bench_op(switch, build, DIMS[args.shapes], peak, args.reps)
        r.update(kernel=switch, what=what)
        rows.append(r)
        print_row(switch, what, r)
    if args.json:
        args.json.write_text(json.dumps({"peak_bytes_per_s": peak, "shapes": args.shapes, "rows": rows}, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
