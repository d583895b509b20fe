"""Plain-MLX reference ops: the oracle every kernel is tested against, and the CPU path.

Shapes follow mlx-lm's conventions: activations [B, T, ...], DeltaNet state [B, Hv, Dv, Dk] in
float32, attention tensors [B, H, T, D]. Quantized weights are MLX affine codes: uint32 words packed
low bits first, w = scale * q + bias per group of `group_size` input columns.
"""

from __future__ import annotations

import math
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

SUPPORTED_BITS = (2, 4, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)


def unpack_codes(w: mx.array, bits: int) -> mx.array:
    """uint32 words [..., K*bits/32] -> integer codes [..., K], low bits first."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} is not supported; expected one of {SUPPORTED_BITS}")
    per_word = 32 // bits
    shifts = mx.arange(per_word, dtype=mx.uint32) * bits
    codes = (w[..., None] >> shifts) & ((1 << bits) - 1)  # [..., words, per_word]
    return codes.reshape(*w.shape[:-1], w.shape[-1] * per_word)


def dequantize(w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> mx.array:
    """Affine codes [..., N, K*bits/32] with scales/biases [..., N, K/group] -> weights [..., N, K] in scales' dtype."""
    codes = unpack_codes(w, bits).astype(mx.float32)
    K = codes.shape[-1]
    grouped = codes.reshape(*codes.shape[:-1], K // group_size, group_size)
    out = grouped * scales[..., None].astype(mx.float32) + biases[..., None].astype(mx.float32)
    return out.reshape(*codes.shape).astype(scales.dtype)


def quantized_matmul(x, w, scales, biases, *, group_size: int, bits: int) -> mx.array:
    """x [..., K] @ dequant(w)[N, K]^T -> [..., N] (MLX's affine quantized matmul)."""
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)


def quantized_matmul_oracle(x, w, scales, biases, *, group_size: int, bits: int) -> mx.array:
    """Same as quantized_matmul through an explicit unpack, in float32: the oracle for kernels."""
    wf = dequantize(w, scales, biases, group_size, bits).astype(mx.float32)
    return (x.astype(mx.float32) @ wf.T).astype(x.dtype)


def gather_matmul(x, w, indices, *, scales=None, biases=None, group_size=64, bits=4, sorted_indices=False):
    """Expert matmul: x [..., 1, 1, K] (or [..., k, 1, K]) with expert weights w [E, N, K], indices [..., k] -> [..., k, 1, N]."""
    if scales is None:
        if x.dtype != mx.float32 and mx.default_device() == mx.cpu:
            # MLX's CPU GatherMM takes float32 only
            y = mx.gather_mm(x.astype(mx.float32), w.astype(mx.float32).swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
            return y.astype(x.dtype)
        return mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
    return mx.gather_qmm(
        x, w, scales, biases, rhs_indices=indices, transpose=True,
        group_size=group_size, bits=bits, sorted_indices=sorted_indices,
    )


def gather_matmul_oracle(x, w, indices, *, scales=None, biases=None, group_size=64, bits=4):
    """Expert matmul by explicit gather of each selected expert's weights, in float32."""
    wf = w if scales is None else dequantize(w, scales, biases, group_size, bits)
    sel = wf[indices].astype(mx.float32)  # [..., k, N, K]
    xf = x.astype(mx.float32)
    return (xf @ sel.swapaxes(-1, -2)).astype(x.dtype)  # [..., k, 1, N]


def rms_norm(x: mx.array, weight: Optional[mx.array], eps: float) -> mx.array:
    return mx.fast.rms_norm(x, weight, eps)


def gated_rms_norm(x: mx.array, z: mx.array, weight: mx.array, eps: float) -> mx.array:
    """rmsnorm(x) * weight * silu(z), the gate in float32 (the DeltaNet output norm; weight not shifted)."""
    y = mx.fast.rms_norm(x, weight, eps)
    return (nn.silu(z.astype(mx.float32)) * y.astype(mx.float32)).astype(x.dtype)


def l2_normalize(x: mx.array, eps: float = 1e-6) -> mx.array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32 (as flash-linear-attention does)."""
    x = x.astype(mx.float32)
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def causal_conv1d(x: mx.array, weight: mx.array, state: mx.array, lengths: Optional[mx.array] = None):
    """Depthwise causal conv + SiLU. x [B, T, C], weight [C, W, 1], state [B, W-1, C] (the previous inputs).

    Returns (silu(conv) [B, T, C], the W-1 inputs before position `lengths` (default T) [B, W-1, C]);
    `lengths` [B] serves right-padded batches, whose state must end at each row's last real token.
    """
    W = weight.shape[1]
    xs = mx.concatenate([state.astype(x.dtype), x], axis=1)  # [B, T+W-1, C]
    out = mx.conv1d(xs, weight.astype(x.dtype), groups=x.shape[-1])
    if lengths is None:
        new_state = xs[:, xs.shape[1] - (W - 1):, :]
    else:
        ends = mx.clip(lengths, 0, x.shape[1])
        new_state = mx.take_along_axis(xs, (ends[:, None] + mx.arange(W - 1))[..., None], axis=1)
    return nn.silu(out), new_state


def deltanet_gates(a: mx.array, b: mx.array, A_log: mx.array, dt_bias: mx.array):
    """log g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b), both float32 [B, T, Hv]."""
    log_g = -mx.exp(A_log.astype(mx.float32)) * nn.softplus(a.astype(mx.float32) + dt_bias.astype(mx.float32))
    return log_g, mx.sigmoid(b.astype(mx.float32))


def masked_gates(log_g, beta, mask):
    """A masked (padding) token is an exact no-op on the state: decay 1 (log_g 0), write 0 (beta 0)."""
    if mask is None:
        return log_g, beta
    return mx.where(mask[..., None], log_g, 0.0), mx.where(mask[..., None], beta, 0.0)


def _delta_prologue(q, k, v, log_g, beta, state, mask):
    """Shared set-up of both forms: float32 inputs, key heads repeated per value head, a zero state."""
    B, _, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    log_g, beta = masked_gates(log_g, beta, mask)
    q, k = q.astype(mx.float32), k.astype(mx.float32)
    if Hv > Hk:
        q, k = mx.repeat(q, Hv // Hk, axis=2), mx.repeat(k, Hv // Hk, axis=2)
    return q, k, v.astype(mx.float32), log_g, beta, state


def gated_delta_sequential(q, k, v, log_g, beta, state=None, mask=None):
    """Gated delta rule, one token at a time.

    q, k [B, T, Hk, Dk] (already L2-normalised, q scaled by Dk^-0.5); v [B, T, Hv, Dv];
    log_g, beta [B, T, Hv]; state [B, Hv, Dv, Dk] float32; mask [B, T] bool or None.
    Per token: S = g S; delta = (v - S k) beta; S += delta k^T; y = S q.
    Returns y [B, T, Hv, Dv] (v's dtype) and the new state.
    """
    q, k, vf, log_g, beta, state = _delta_prologue(q, k, v, log_g, beta, state, mask)
    g = mx.exp(log_g)
    ys = []
    for t in range(q.shape[1]):
        state = state * g[:, t, :, None, None]
        kv = (state * k[:, t, :, None, :]).sum(-1)  # [B, Hv, Dv]
        delta = (vf[:, t] - kv) * beta[:, t, :, None]
        state = state + delta[..., None] * k[:, t, :, None, :]
        ys.append((state * q[:, t, :, None, :]).sum(-1))
    return mx.stack(ys, axis=1).astype(v.dtype), state


def _unit_lower_inverse(A: mx.array) -> mx.array:
    """(I + A)^-1 for strictly lower-triangular A [..., C, C], by (I - A)(I + A^2)(I + A^4)... (A is nilpotent)."""
    C = A.shape[-1]
    eye = mx.eye(C, dtype=A.dtype)
    inv = eye - A
    power = A @ A
    span = 2
    while span < C:
        inv = inv + inv @ power
        power = power @ power
        span *= 2
    return inv


def chunk_intra(q, k, v, log_g, beta, state=None, mask=None, chunk_size: int = 64):
    """The parallel (intra-chunk) part of the chunked form, every chunk at once, all float32.

    Arguments as gated_delta_sequential's. Inside a chunk of C tokens with cumulative log-decay G:
    T = (I + strict_tril(beta k k^T * e^{G_i - G_j}))^-1, u = T beta v, w = T beta e^G k,
    qk = tril(q k^T e^{G_i - G_j}), q_dec = e^G q, k_dec = e^{G_C - G} k, g_last = e^{G_C}.
    Returns (u [B, Hv, N, C, Dv], w, q_dec [B, Hv, N, C, Dk], qk [B, Hv, N, C, C], k_dec [B, Hv, N, C, Dk],
    g_last [B, Hv, N], state [B, Hv, Dv, Dk]) with N = ceil(T / C), the tail padded with no-op tokens.
    """
    B, T = q.shape[:2]
    Hv = v.shape[2]
    q, k, vf, log_g, beta, state = _delta_prologue(q, k, v, log_g, beta, state, mask)
    C = chunk_size
    pad = (-T) % C
    if pad:
        # Padded tail tokens are no-ops (decay 1, beta 0) and their outputs are dropped.
        widths = [(0, 0), (0, pad), (0, 0), (0, 0)]
        q, k, vf = (mx.pad(t, widths) for t in (q, k, vf))
        log_g, beta = (mx.pad(t, [(0, 0), (0, pad), (0, 0)]) for t in (log_g, beta))
    N = (T + pad) // C

    def chunks(t):  # [B, T, Hv, D] -> [B, Hv, N, C, D]
        return t.reshape(B, N, C, Hv, -1).transpose(0, 3, 1, 2, 4)

    q, k, vf = chunks(q), chunks(k), chunks(vf)
    G = log_g.reshape(B, N, C, Hv).transpose(0, 3, 1, 2).cumsum(-1)  # [B, Hv, N, C]
    bt = beta.reshape(B, N, C, Hv).transpose(0, 3, 1, 2)[..., None]
    diff = G[..., :, None] - G[..., None, :]  # [B, Hv, N, C, C]: G_i - G_j
    lower_incl = mx.tril(mx.ones((C, C), dtype=mx.bool_))
    decay = mx.where(lower_incl, mx.exp(mx.where(lower_incl, diff, 0.0)), 0.0)
    kk = k @ k.swapaxes(-1, -2)  # [B, Hv, N, C, C]
    A = mx.tril(bt * kk * decay, k=-1)
    Tinv = _unit_lower_inverse(A)
    u = Tinv @ (bt * vf)  # [B, Hv, N, C, Dv]
    w = Tinv @ (bt * mx.exp(G)[..., None] * k)  # [B, Hv, N, C, Dk]
    qk = (q @ k.swapaxes(-1, -2)) * decay  # [B, Hv, N, C, C]
    q_dec = q * mx.exp(G)[..., None]
    k_dec = k * mx.exp(G[..., -1:] - G)[..., None]
    return u, w, q_dec, qk, k_dec, mx.exp(G[..., -1]), state


def chunk_scan_reference(u, w, q_dec, qk, k_dec, g_last, state):
    """The sequential (inter-chunk) part, chunk by chunk: the oracle of the deltanet_chunk kernel.

    Shapes as chunk_intra returns them. Per chunk n: v' = u_n - w_n S^T; y_n = q_dec_n S^T + qk_n v';
    S <- g_last_n S + v'^T k_dec_n. Returns (y [B, Hv, N, C, Dv] float32, the new state).
    """
    ys = []
    for n in range(u.shape[2]):
        S_t = state.swapaxes(-1, -2)  # [B, Hv, Dk, Dv]
        v_new = u[:, :, n] - w[:, :, n] @ S_t
        ys.append(q_dec[:, :, n] @ S_t + qk[:, :, n] @ v_new)
        state = state * g_last[:, :, n, None, None] + v_new.swapaxes(-1, -2) @ k_dec[:, :, n]
    return mx.stack(ys, axis=2), state


def gated_delta_chunked(q, k, v, log_g, beta, state=None, mask=None, chunk_size: int = 64, scan=chunk_scan_reference,
                        intra=chunk_intra):
    """Gated delta rule in the chunked WY / UT-transform form (as in flash-linear-attention).

    Same arguments and result as gated_delta_sequential: `intra` (chunk_intra's signature), then `scan`
    over the chunks (chunk_scan_reference's); the dispatcher passes ones that may run the kernels.
    """
    B, T = q.shape[:2]
    Hv, Dv = v.shape[2:]
    y, state = scan(*intra(q, k, v, log_g, beta, state, mask, chunk_size))
    y = y.reshape(B, Hv, -1, Dv).transpose(0, 2, 1, 3)[:, :T]  # [B, T, Hv, Dv]
    return y.astype(v.dtype), state


def rope(x: mx.array, dims: int, base: float, offset) -> mx.array:
    """Rotary embedding on the first `dims` features of x [B, H, T, D] (non-interleaved halves)."""
    return mx.fast.rope(x, dims, traditional=False, base=base, scale=1.0, offset=offset)


def rope_oracle(x: mx.array, dims: int, base: float, offset: int) -> mx.array:
    """rope by explicit cos/sin tables (rotate_half convention), float32."""
    T = x.shape[-2]
    inv_freq = 1.0 / (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims))
    pos = mx.arange(offset, offset + T, dtype=mx.float32)
    freqs = pos[:, None] * inv_freq[None, :]
    cos, sin = mx.cos(freqs), mx.sin(freqs)
    xf = x.astype(mx.float32)
    x1, x2, rest = xf[..., : dims // 2], xf[..., dims // 2: dims], xf[..., dims:]
    out = mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
    return out.astype(x.dtype)


def attention(q, k, v, *, scale: float, mask=None) -> mx.array:
    """Softmax attention with GQA. q [B, Hq, L, D], k/v [B, Hkv, S, D]; mask None, 'causal', bool or additive [.., L, S]."""
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def attention_query_blocked(q, k, v, *, scale: float, mask=None, max_scores: int) -> mx.array:
    """attention() over blocks of queries, so at most about `max_scores` scores exist at once (the unfused
    attention MLX falls back to, e.g. head_dim 256 on CUDA, holds all B*Hq*L*S). Causal masks are
    bottom-right aligned (the queries are the last L of S positions), so a block of queries [i0, i1) is
    the causal attention of the keys up to S - L + i1: the upper triangle is skipped, not computed."""
    B, Hq, L, _ = q.shape
    S = k.shape[2]
    rows = max(1, max_scores // (B * Hq * S))
    if rows >= L:
        return attention(q, k, v, scale=scale, mask=mask)
    causal = isinstance(mask, str)
    if causal and mask != "causal":
        raise ValueError(f"attention mask {mask!r}: only 'causal' is a string mask")
    outs = []
    for i0 in range(0, L, rows):
        i1 = min(L, i0 + rows)
        end = S - L + i1 if causal else S
        m = mask if mask is None or causal else mask[..., i0:i1, :end]
        outs.append(attention(q[:, :, i0:i1], k[:, :, :end], v[:, :, :end], scale=scale, mask=m))
    return mx.concatenate(outs, axis=2)  # [B, Hq, L, D]


def attention_oracle(q, k, v, *, scale: float, mask=None) -> mx.array:
    """attention by explicit scores and softmax in float32."""
    Hq, L = q.shape[1], q.shape[2]
    Hkv, S = k.shape[1], k.shape[2]
    rep = Hq // Hkv
    kf = mx.repeat(k.astype(mx.float32), rep, axis=1)
    vf = mx.repeat(v.astype(mx.float32), rep, axis=1)
    scores = (q.astype(mx.float32) * scale) @ kf.swapaxes(-1, -2)  # [B, Hq, L, S]
    if isinstance(mask, str) and mask == "causal":
        mask = mx.arange(L)[:, None] + (S - L) >= mx.arange(S)[None, :]
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, -math.inf)
        else:
            scores = scores + mask.astype(mx.float32)
    return (mx.softmax(scores, axis=-1) @ vf).astype(q.dtype)


def attention_decode(proj, q_norm_weight, k_norm_weight, eps: float, keys, values, offset, *, n_heads: int,
                     n_kv_heads: int, rope_dims: int, rope_theta: float, scale: float, plane: int = 0,
                     row_start=None, row_pos=None):
    """Decode tokens of gated attention from the fused projection [B, T, ...]; see ops.attention_decode. The cache's
    first `offset` positions and the new rows (token t sees tokens 0..t) are attended to without copying the cache."""
    (B, T, _), (PB, Hkv, cap, D) = proj.shape, keys.shape
    if PB != B:  # stacked planes: this layer's rows
        keys, values = keys[plane * B:(plane + 1) * B], values[plane * B:(plane + 1) * B]
    Hq, rep = n_heads, n_heads // n_kv_heads
    q, k, v = mx.split(proj, [Hq * 2 * D, Hq * 2 * D + Hkv * D], axis=-1)
    q, gate = mx.split(q.reshape(B, T, Hq, 2 * D), 2, axis=-1)
    pos = offset.reshape(())
    rpos = pos if row_pos is None else row_pos  # per row: mx.fast.rope takes a [B] offset
    q = rope(rms_norm(q, q_norm_weight, eps).transpose(0, 2, 1, 3), rope_dims, rope_theta, rpos)  # [B, Hq, T, D]
    k = rope(rms_norm(k.reshape(B, T, Hkv, D), k_norm_weight, eps).transpose(0, 2, 1, 3), rope_dims, rope_theta, rpos)
    v = v.reshape(B, T, Hkv, D).transpose(0, 2, 1, 3)  # [B, Hkv, T, D]
    qg = q.astype(mx.float32).reshape(B, Hkv, rep * T, D) * scale  # rows: (query head in the group, token)
    s_cache = qg @ keys.astype(mx.float32).swapaxes(-1, -2)  # [B, Hkv, rep*T, cap]
    visible = mx.arange(cap) < pos  # [cap], or [B, 1, 1, cap] for a left-padded batch
    if row_start is not None:
        visible = visible & (mx.arange(cap) >= row_start[:, None, None, None])
    s_cache = mx.where(visible, s_cache, -math.inf)
    causal = mx.tile(mx.arange(T)[:, None] >= mx.arange(T)[None, :], (rep, 1))  # [rep*T, T]: token t sees 0..t
    s_new = mx.where(causal, qg @ k.astype(mx.float32).swapaxes(-1, -2), -math.inf)  # [B, Hkv, rep*T, T]
    p = mx.softmax(mx.concatenate([s_cache, s_new], axis=-1), axis=-1)
    out = p[..., :cap] @ values.astype(mx.float32) + p[..., cap:] @ v.astype(mx.float32)  # [B, Hkv, rep*T, D]
    out = out.reshape(B, Hq, T, D).transpose(0, 2, 1, 3).astype(proj.dtype).reshape(B, T, Hq * D)
    return out * mx.sigmoid(gate.reshape(B, T, Hq * D)), k.astype(keys.dtype), v.astype(keys.dtype)


def logprobs(logits: mx.array) -> mx.array:
    """[..., V] -> logits - logsumexp(logits) over V, in the logits' dtype (mlx_lm's generate_step)."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def moe_route(logits: mx.array, top_k: int, normalize: bool):
    """Softmax router in float32, top-k, optional renormalisation. logits [..., E] -> (indices [..., k], weights [..., k])."""
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    inds = mx.argpartition(-probs, kth=top_k - 1, axis=-1)[..., :top_k]
    scores = mx.take_along_axis(probs, inds, axis=-1)
    if normalize:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    return inds, scores


def weighted_top_k(y: mx.array, scores: mx.array, dtype) -> mx.array:
    """The top-k experts' outputs y [..., k, H] summed weighted by scores [..., k] -> [..., H] in dtype (the products
    and the sum in float32 where scores are)."""
    return (y * scores[..., None]).sum(axis=-2).astype(dtype)


def moe_combine(y: mx.array, inv_order: mx.array, scores: mx.array, dtype) -> mx.array:
    """Expert output rows y [R, H] sorted by expert, inv_order [R] (the row of each flat (token, j)), scores [..., k]
    -> sum_j scores[..., j] * y[inv_order[(token, j)]] [..., H] in dtype."""
    return weighted_top_k(mx.unflatten(y[inv_order], 0, scores.shape), scores, dtype)  # y unsorted: [..., k, H]
