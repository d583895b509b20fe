"""The plain-MLX reference ops against explicit float64 numpy oracles and MLX's built-ins, on odd shapes."""

import numpy as np
import mlx.core as mx
import pytest
from mlx_lm.models.gated_delta import gated_delta_ops

from lily_mlx.ops import reference as R


def rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert np.isfinite(a).all(), "non-finite output"
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_dequantize_matches_mlx(bits, group_size):
    w = mx.random.normal((7, 3 * group_size), key=mx.random.key(bits + group_size))
    q, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    ours = R.dequantize(q, s, b, group_size, bits)
    # equal up to the rounding of s*q + b (a fused multiply-add on some backends)
    assert rel(ours, mx.dequantize(q, s, b, group_size=group_size, bits=bits)) < 1e-6


@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 64), (8, 64), (4, 128)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_quantized_matmul_oracle(bits, group_size, dtype):
    w = mx.random.normal((33, 2 * group_size * 3), key=mx.random.key(1))
    q, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    s, b = s.astype(dtype), b.astype(dtype)  # checkpoints store scales in the model's dtype
    x = mx.random.normal((3, w.shape[1]), key=mx.random.key(2)).astype(dtype)
    got = R.quantized_matmul(x, q, s, b, group_size=group_size, bits=bits)
    want = R.quantized_matmul_oracle(x, q, s, b, group_size=group_size, bits=bits)
    assert got.shape == (3, 33) and got.dtype == dtype
    # MLX's CPU kernel rounds partial sums to bf16, hence the loose bf16 bound; the oracle is float32.
    assert rel(got.astype(mx.float32), want.astype(mx.float32)) < (1e-5 if dtype == mx.float32 else 5e-2)


@pytest.mark.parametrize("quantized", [False, True])
def test_gather_matmul_oracle(quantized):
    E, N, K, k = 5, 24, 64, 2
    w = mx.random.normal((E, N, K), key=mx.random.key(3))
    x = mx.random.normal((2, 3, 1, 1, K), key=mx.random.key(4))
    idx = mx.array(np.random.default_rng(0).integers(0, E, size=(2, 3, k)))
    kw = {}
    if quantized:
        q, s, b = mx.quantize(w, group_size=32, bits=4)
        w, kw = q, dict(scales=s, biases=b, group_size=32, bits=4)
    got = R.gather_matmul(x, w, idx, **kw)
    want = R.gather_matmul_oracle(x, w, idx, **kw)
    assert got.shape == (2, 3, k, 1, N)
    assert rel(got, want) < 1e-5


def _delta_inputs(B, T, Hk, Hv, Dk, Dv, seed=0, dtype=mx.float32):
    keys = mx.random.split(mx.random.key(seed), 8)
    q = (R.l2_normalize(mx.random.normal((B, T, Hk, Dk), key=keys[0])) * Dk**-0.5).astype(dtype)
    k = R.l2_normalize(mx.random.normal((B, T, Hk, Dk), key=keys[1])).astype(dtype)
    v = mx.random.normal((B, T, Hv, Dv), key=keys[2]).astype(dtype)
    a, b = mx.random.normal((B, T, Hv), key=keys[3]), mx.random.normal((B, T, Hv), key=keys[4])
    A_log = mx.log(mx.random.uniform(0.5, 4.0, (Hv,), key=keys[5]))
    log_g, beta = R.deltanet_gates(a, b, A_log, mx.random.normal((Hv,), key=keys[6]))
    state = 0.1 * mx.random.normal((B, Hv, Dv, Dk), key=keys[7])
    return q, k, v, log_g, beta, state


def _delta_f64(q, k, v, log_g, beta, state, mask=None):
    q, k, v, log_g, beta, S = (np.array(t.astype(mx.float32)).astype(np.float64) for t in (q, k, v, log_g, beta, state))
    rep = v.shape[2] // q.shape[2]
    q, k = np.repeat(q, rep, 2), np.repeat(k, rep, 2)
    ys = []
    for t in range(q.shape[1]):
        live = np.ones(q.shape[0], bool) if mask is None else np.array(mask)[:, t]
        S_new = S * np.exp(log_g[:, t])[..., None, None]
        delta = (v[:, t] - (S_new * k[:, t, :, None, :]).sum(-1)) * beta[:, t, :, None]
        S_new = S_new + delta[..., None] * k[:, t, :, None, :]
        S = np.where(live[:, None, None, None], S_new, S)
        ys.append((S_new * q[:, t, :, None, :]).sum(-1))
    return np.stack(ys, 1), S


@pytest.mark.parametrize("T", [1, 3, 63, 64, 65, 130])
def test_gated_delta_forms_match_float64(T):
    B, Hk, Hv, Dk, Dv = 2, 2, 6, 16, 24
    q, k, v, log_g, beta, state = _delta_inputs(B, T, Hk, Hv, Dk, Dv, seed=T)
    y0, S0 = _delta_f64(q, k, v, log_g, beta, state)
    for fn in (R.gated_delta_sequential, R.gated_delta_chunked):
        y, S = fn(q, k, v, log_g, beta, state)
        assert y.shape == (B, T, Hv, Dv) and S.shape == (B, Hv, Dv, Dk) and S.dtype == mx.float32
        assert rel(y, y0) < 1e-5 and rel(S, S0) < 1e-5, fn.__name__


def test_gated_delta_sequential_matches_mlx_lm():
    q, k, v, log_g, beta, state = _delta_inputs(1, 9, 2, 4, 16, 24, seed=5)
    y, S = R.gated_delta_sequential(q, k, v, log_g, beta, state)
    y_ref, S_ref = gated_delta_ops(q, k, v, mx.exp(log_g), beta, state)
    assert rel(y, y_ref) < 1e-6 and rel(S, S_ref) < 1e-6


@pytest.mark.parametrize("fn", [R.gated_delta_sequential, R.gated_delta_chunked])
def test_gated_delta_mask_is_a_no_op_on_the_state(fn):
    T = 70
    q, k, v, log_g, beta, state = _delta_inputs(2, T, 2, 4, 16, 24, seed=7)
    mask = mx.array(np.arange(T)[None, :] >= np.array([[0], [29]]))  # row 1 left-padded by 29
    y, S = fn(q, k, v, log_g, beta, state, mask)
    y0, S0 = _delta_f64(q, k, v, log_g, beta, state, mask)
    assert rel(S, S0) < 1e-5
    assert rel(np.array(y)[1, 29:], y0[1, 29:]) < 1e-5 and rel(np.array(y)[0], y0[0]) < 1e-5


def test_gated_delta_chunk_sizes_agree_and_state_carries():
    q, k, v, log_g, beta, state = _delta_inputs(1, 100, 2, 4, 16, 24, seed=9)
    y_a, S_a = R.gated_delta_chunked(q, k, v, log_g, beta, state, chunk_size=64)
    y_b, S_b = R.gated_delta_chunked(q, k, v, log_g, beta, state, chunk_size=16)
    y1, S1 = R.gated_delta_chunked(q[:, :37], k[:, :37], v[:, :37], log_g[:, :37], beta[:, :37], state)
    y2, S2 = R.gated_delta_chunked(q[:, 37:], k[:, 37:], v[:, 37:], log_g[:, 37:], beta[:, 37:], S1)
    assert rel(y_b, y_a) < 1e-5 and rel(S_b, S_a) < 1e-5
    assert rel(mx.concatenate([y1, y2], axis=1), y_a) < 1e-5 and rel(S2, S_a) < 1e-5


def test_gated_delta_bf16_drift_over_4096_tokens():
    T = 4096
    q, k, v, log_g, beta, state = _delta_inputs(1, T, 1, 2, 16, 8, seed=11, dtype=mx.bfloat16)
    y_c, S_c = R.gated_delta_chunked(q, k, v, log_g, beta, state)
    y0, S0 = _delta_f64(q, k, v, log_g, beta, state)
    # bf16 only rounds the outputs; the float32 state must not drift over the long scan.
    assert rel(S_c, S0) < 1e-4
    assert rel(y_c.astype(mx.float32), y0) < 1e-2


def test_causal_conv1d_matches_explicit_and_carries_state():
    B, T, C, W = 2, 11, 12, 4
    x = mx.random.normal((B, T, C), key=mx.random.key(0))
    w = mx.random.normal((C, W, 1), key=mx.random.key(1))
    s0 = mx.random.normal((B, W - 1, C), key=mx.random.key(2))
    out, s = R.causal_conv1d(x, w, s0)
    xs = np.concatenate([np.array(s0), np.array(x)], 1)
    want = np.stack([(xs[:, t:t + W] * np.array(w)[:, :, 0].T[None]).sum(1) for t in range(T)], 1)
    want = want / (1 + np.exp(-want))
    assert rel(out, want) < 1e-5 and np.array_equal(np.array(s), xs[:, -(W - 1):])
    o1, s1 = R.causal_conv1d(x[:, :5], w, s0)
    o2, s2 = R.causal_conv1d(x[:, 5:], w, s1)
    assert rel(mx.concatenate([o1, o2], 1), out) < 1e-6 and mx.array_equal(s2, s)
    _, s_len = R.causal_conv1d(x, w, s0, lengths=mx.array([5, 11]))
    assert np.array_equal(np.array(s_len)[0], xs[0, 5:5 + W - 1]) and np.array_equal(np.array(s_len)[1], xs[1, -(W - 1):])


def test_gated_rms_norm():
    x = mx.random.normal((3, 5, 24), key=mx.random.key(0))
    z = mx.random.normal((3, 5, 24), key=mx.random.key(1))
    w = mx.random.normal((24,), key=mx.random.key(2))
    xn, zn, wn = np.array(x), np.array(z), np.array(w)
    want = xn / np.sqrt((xn**2).mean(-1, keepdims=True) + 1e-6) * wn * zn / (1 + np.exp(-zn))
    assert rel(R.gated_rms_norm(x, z, w, 1e-6), want) < 1e-5


@pytest.mark.parametrize("offset", [0, 17])
def test_rope_matches_oracle(offset):
    x = mx.random.normal((2, 3, 9, 24), key=mx.random.key(offset))
    assert rel(R.rope(x, 6, 10000.0, offset), R.rope_oracle(x, 6, 10000.0, offset)) < 1e-5


@pytest.mark.parametrize("L,S", [(1, 1), (1, 19), (7, 7), (5, 12)])
def test_attention_matches_oracle(L, S):
    q = mx.random.normal((2, 6, L, 24), key=mx.random.key(0))
    k = mx.random.normal((2, 2, S, 24), key=mx.random.key(1))
    v = mx.random.normal((2, 2, S, 24), key=mx.random.key(2))
    for mask in (None, "causal", mx.array(np.random.default_rng(0).random((2, 1, L, S)) > 0.3) | mx.eye(L, S, k=S - L, dtype=mx.bool_)):
        if isinstance(mask, str) and L == 1:
            continue
        got = R.attention(q, k, v, scale=24**-0.5, mask=mask)
        assert rel(got, R.attention_oracle(q, k, v, scale=24**-0.5, mask=mask)) < 1e-5


def test_moe_route():
    logits = mx.random.normal((4, 7, 9), key=mx.random.key(0))
    inds, w = R.moe_route(logits, 3, True)
    p = np.exp(np.array(logits)) / np.exp(np.array(logits)).sum(-1, keepdims=True)
    top = np.sort(np.argsort(-p, -1)[..., :3], -1)
    assert np.array_equal(np.sort(np.array(inds), -1), top)
    picked = np.take_along_axis(p, np.array(inds), -1)
    assert rel(w, picked / picked.sum(-1, keepdims=True)) < 1e-6


@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, 64)])
def test_gather_matmul_dequantized_matches_quantized_gather(bits, group_size):
    """The prefill experts' path (ops.gather_matmul_dequantized: all experts dequantized, then gather_mm on
    rows sorted by expert) against the quantized gather, float32, odd widths, an expert given no rows."""
    from lily_mlx import ops

    E, N, K, rows = 7, 40, 3 * group_size, 37
    q, s, b = mx.quantize(mx.random.normal((E, N, K), key=mx.random.key(5)), group_size=group_size, bits=bits)
    idx = mx.array(np.sort(np.random.default_rng(1).choice([0, 1, 3, 4, 6], size=rows)))  # expert 2, 5: none
    x = mx.random.normal((rows, 1, K), key=mx.random.key(6))
    kw = dict(scales=s, biases=b, group_size=group_size, bits=bits)
    got = ops.gather_matmul_dequantized(x, q, idx, **kw)
    want = R.gather_matmul(x, q, idx, sorted_indices=True, **kw)
    assert got.shape == want.shape == (rows, 1, N)
    assert rel(got, want) < 1e-5


def test_gather_matmul_takes_the_dequantized_gemm_only_on_cuda_past_the_threshold(monkeypatch):
    """The dispatcher's rule for prefill experts: sorted rows >= ops.DEQUANT_GEMM_MIN_ROWS on CUDA, switch on."""
    from lily_mlx import ops

    E, N, K = 3, 8, 64
    q, s, b = mx.quantize(mx.random.normal((E, N, K), key=mx.random.key(7)), group_size=32, bits=4)
    kw = dict(scales=s, biases=b, group_size=32, bits=4)
    taken = []
    monkeypatch.setattr(ops, "gather_matmul_dequantized", lambda *a, **k: taken.append(1) or R.gather_matmul(*a, **k))
    monkeypatch.setattr(ops, "DEQUANT_GEMM_MIN_ROWS", 6)
    for backend, rows, sort, switch_on, expect in [("cuda", 6, True, True, 1), ("cuda", 5, True, True, 0),
                                                   ("cuda", 6, False, True, 0), ("cuda", 6, True, False, 0),
                                                   ("metal", 6, True, True, 0), ("cpu", 6, True, True, 0)]:
        monkeypatch.setattr(ops, "backend", lambda: backend)
        taken.clear()
        idx, x = mx.zeros((rows,), dtype=mx.uint32), mx.random.normal((rows, 1, K))
        with ops.disabled(*([] if switch_on else ["moe_dequant_gemm"])):
            ops.gather_matmul(x, q, idx, sorted_indices=sort, **kw)
        assert len(taken) == expect, (backend, rows, sort, switch_on)


def test_many_rows_projection_dequantized_gemm_dispatch_and_result(monkeypatch):
    """ops.quantized_matmul / norm_ / _add past DENSE_DEQUANT_MIN_ROWS and _MIN_WEIGHTS on CUDA with
    dense_dequant_gemm on: dequantize + dense GEMM, equal to MLX's quantized matmul (float32); fewer rows, a
    smaller weight, off, or not CUDA: MLX's."""
    from lily_mlx import ops

    N, K, rows = 40, 96, 7
    q, s, b = mx.quantize(mx.random.normal((N, K), key=mx.random.key(8)), group_size=32, bits=4)
    x = mx.random.normal((1, rows, K), key=mx.random.key(9))
    nw, res = 1 + 0.1 * mx.random.normal((K,), key=mx.random.key(10)), mx.random.normal((1, rows, N))
    kw = dict(group_size=32, bits=4)
    want = R.quantized_matmul(x, q, s, b, **kw)
    calls = []
    real = ops.dequantize  # with the dequant kernel off (it has tests of its own): mx.dequantize
    monkeypatch.setattr(ops, "dequantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(ops, "DENSE_DEQUANT_MIN_ROWS", rows)
    monkeypatch.setattr(ops, "DENSE_DEQUANT_MIN_WEIGHTS", N * K)
    for backend, on, taken in [("cuda", True, 1), ("cuda", False, 0), ("metal", True, 0), ("cpu", True, 0)]:
        monkeypatch.setattr(ops, "backend", lambda: backend)
        calls.clear()
        with ops.disabled("qmv", "dequant"), ops.switched("dense_dequant_gemm", on):  # qmv: the few-row kernel
            got = ops.quantized_matmul(x, q, s, b, **kw)
            normed = ops.norm_quantized_matmul(x, nw, 1e-6, q, s, b, **kw)
            added = ops.quantized_matmul_add(x, q, s, b, res, **kw)
        assert len(calls) == 3 * taken, (backend, on)
        assert rel(got, want) < 1e-5 and rel(added, res + want) < 1e-5
        assert rel(normed, R.quantized_matmul(R.rms_norm(x, nw, 1e-6), q, s, b, **kw)) < 1e-5
    monkeypatch.setattr(ops, "backend", lambda: "cuda")
    calls.clear()
    with ops.disabled("qmv", "dequant"), ops.switched("dense_dequant_gemm", True):
        ops.quantized_matmul(x[:, :rows - 1], q, s, b, **kw)
        monkeypatch.setattr(ops, "DENSE_DEQUANT_MIN_WEIGHTS", N * K + 1)
        ops.quantized_matmul(x, q, s, b, **kw)
    assert not calls


@pytest.mark.parametrize("mask_kind", ["causal", None, "array"])
def test_query_blocked_attention_equals_attention(mask_kind, monkeypatch):
    """Prefill attention in blocks of queries (bounded scores) equals one call: causal with a cached prefix
    (L < S, bottom-right), no mask, a boolean array mask; GQA 6:2, odd L and S, a ragged last block."""
    from lily_mlx import ops

    B, Hq, Hkv, L, S, D = 2, 6, 2, 37, 53, 24
    keys = mx.random.split(mx.random.key(11), 4)
    q = mx.random.normal((B, Hq, L, D), key=keys[0])
    k, v = mx.random.normal((B, Hkv, S, D), key=keys[1]), mx.random.normal((B, Hkv, S, D), key=keys[2])
    mask = mask_kind
    if mask_kind == "array":
        mask = mx.random.uniform(key=keys[3], shape=(B, 1, L, S)) < 0.7
        mask = mask | (mx.arange(S)[None, None, None, :] == 0)  # every query sees at least one key
    want = R.attention(q, k, v, scale=D**-0.5, mask=mask)
    max_scores = B * Hq * S * 8  # blocks of 8 queries: 4 full, one of 5
    got = R.attention_query_blocked(q, k, v, scale=D**-0.5, mask=mask, max_scores=max_scores)
    assert rel(got, want) < 1e-5
    monkeypatch.setattr(ops, "MAX_ATTENTION_SCORES", max_scores)
    calls = []
    real = R.attention
    monkeypatch.setattr(R, "attention", lambda *a, **kw: calls.append(a[0].shape[2]) or real(*a, **kw))
    assert rel(ops.attention(q, k, v, scale=D**-0.5, mask=mask), want) < 1e-5
    assert calls == [8, 8, 8, 8, 5]
