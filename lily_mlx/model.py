"""Qwen3.5/3.6 hybrid MoE (Gated DeltaNet + gated attention) as an MLX module graph.

Follows mlx-lm's model protocol: `model(inputs [B, L], cache) -> logits [B, L, V]`, `layers`,
`make_cache()`, `sanitize`, `quant_predicate`, `cast_predicate`. Module names are the MLX-layout
checkpoint keys (`language_model.model.layers.N...`), so converted checkpoints load as they are
and stock mlx-lm reads what we write.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask, create_ssm_mask, scaled_dot_product_attention
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache, RotatingKVCache

from . import memory, ops
from .ops import packing
from .config import ModelConfig
from .layers import FusedLinears, GatedRMSNorm, Linear, RMSNorm, SwitchLinear, added, embedded, normed, output_weights

# A prefill below memory.MIN_TOKENS is otherwise built whole in Python before the GPU starts (its first eval). H200 run
# 29, interleaved rounds: 512 tokens 44.1 vs 58.7 ms, peak weights + 0.57 vs + 3.95 GB; 2048 and 8192 unchanged.
ops.register_switch("prefill_overlap", "short prefills: each decoder layer dispatched to the GPU as soon as it is "
                    "built, so the GPU runs while Python builds the next")


# MLX's CPU cost per decode step grows with its graph's constants and kernel inputs (bench/step_dispatch.py); packed,
# a quantized weight is one of each instead of three. On by default on CUDA with the decode chains
# (ops.chain_takes), as they were measured; opt-in on Metal.
ops.register_switch("packed_weights", "each quantized weight's codes, scales and biases in one array, read by the "
                    "decode kernels as one input", default_on="cuda")
# Further: every constant input of a decode chain launch (a layer's weights and norms) in one array, so a chain
# launch takes 3-10 inputs instead of 10-14 and the step ~175 constants instead of ~675. As packed_weights.
ops.register_switch("bundled_weights", "each decode chain launch's constant inputs (packed weights, norm weights, "
                    "DeltaNet conv weight, A_log, dt_bias) in one array, read as one input", default_on="cuda")


# New tokens after a cache that already holds some take the decode kernels (each DeltaNet or attention layer one
# launch for all of them), up to this many: a speculative verify forward (lily_mlx.speculative, 2-5 tokens) is then
# about a decode step's primitives at the 35B shape, where the prefill path's per-token DeltaNet recurrence and
# generic attention make it ~3,300.
DECODE_TOKENS_MAX = 8


class Attention(nn.Module):
    """Gated full attention: q_proj emits [q | gate] per head; q/k RMSNorm; partial RoPE."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = self.head_dim**-0.5
        self.rope_dims, self.rope_theta = cfg.rope_dims, cfg.rope_theta
        H, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = Linear(H, self.n_heads * self.head_dim * 2, bias=bias)
        self.k_proj = Linear(H, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(H, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, H, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.fused_qkv = FusedLinears(self, ("q_proj", "k_proj", "v_proj"))

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        return self._run(x, None, mask, cache, None)

    def add_to(self, h: mx.array, norm: RMSNorm, mask=None, cache=None) -> mx.array:
        """h + self(norm(h)): the norm folded into the input projection, the add into o_proj."""
        return self._run(h, norm, mask, cache, h)

    def _run(self, x, norm, mask, cache, residual):
        B, L, _ = x.shape
        D, Hq, Hkv = self.head_dim, self.n_heads, self.n_kv_heads
        if L == 1:
            kv = _decode_kv(cache, mask)
        else:  # a few tokens after a cache (a speculative verify): the decode attention, token t seeing 0..t
            kv = _decode_kv(cache, None) if L <= DECODE_TOKENS_MAX and _decodes_tokens(cache, mask) else None
        if kv is not None:  # decode tokens over a cache the fused decode attention reads in place
            keys, values, offset, plane, row_start, row_pos = kv
            args = (self.q_norm["weight"], self.k_norm["weight"], self.q_norm.eps, keys, values, offset)
            kw = dict(n_heads=Hq, n_kv_heads=Hkv, rope_dims=self.rope_dims, rope_theta=self.rope_theta,
                      scale=self.scale, plane=plane, row_start=row_start, row_pos=row_pos)
            o = None if residual is None else output_weights(self.o_proj, residual, x.dtype)
            if o is not None:  # through o_proj and the residual add in one op; with attn_chain the projection too
                source = None if norm is None else (x, (norm["weight"], norm.eps), self.fused_qkv.quantized())
                h, k_new, v_new = ops.attention_decode_add(lambda: self.fused_qkv(x, norm), *args, o[0], residual,
                                                           group_size=o[1], bits=o[2], source=source,
                                                           kv_write=getattr(cache, "kv_write", False), **kw)
                cache.update_and_fetch(k_new, v_new)
                return h
            out, k_new, v_new = ops.attention_decode(self.fused_qkv(x, norm), *args, **kw)
            cache.update_and_fetch(k_new, v_new)
            return self.o_proj(out) if residual is None else added(self.o_proj, out, residual)
        proj = self.fused_qkv(x, norm)  # [B, L, Hq*2D + 2*Hkv*D]
        q, k, v = mx.split(proj, [Hq * 2 * D, Hq * 2 * D + Hkv * D], axis=-1)
        q, gate = mx.split(q.reshape(B, L, Hq, 2 * D), 2, axis=-1)
        gate = gate.reshape(B, L, -1)
        q = self.q_norm(q).transpose(0, 2, 1, 3)  # [B, Hq, L, D]
        k = self.k_norm(k.reshape(B, L, Hkv, D)).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, Hkv, D).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q = ops.rope(q, self.rope_dims, self.rope_theta, offset)
        k = ops.rope(k, self.rope_dims, self.rope_theta, offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if hasattr(cache, "bits"):  # mlx-lm's QuantizedKVCache (kv_bits): its own quantized attention
            out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        else:
            out = ops.attention(q, k, v, scale=self.scale, mask=mask)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1) * mx.sigmoid(gate)
        return self.o_proj(out) if residual is None else added(self.o_proj, out, residual)


def _decodes_tokens(cache, mask) -> bool:
    """Whether several new tokens may take the decode attention: mlx-lm's plain KVCache holding tokens under the
    causal mask, or a compiled decoder's single-sequence cache (decode_tokens)."""
    if type(cache) is KVCache:
        return cache.keys is not None and (mask is None or isinstance(mask, str))
    return getattr(cache, "decode_tokens", False)


def _decode_kv(cache, mask):
    """(keys, values, offset [1] int32, plane, row_start, row_pos) of a cache that ops.attention_decode reads in
    place: mlx-lm's plain KVCache already holding tokens (unmasked), its left-padded BatchKVCache (switch
    batched_attn_decode: the kernel masks the padding itself), or a compiled decoder's cache; else None."""
    if type(cache) is KVCache and cache.keys is not None and mask is None:
        return cache.keys, cache.values, mx.array([cache.offset], dtype=mx.int32), 0, None, None
    if (type(cache) is BatchKVCache and cache.keys is not None and getattr(cache, "_right_padding", None) is None
            and ops.enabled("batched_attn_decode")):
        return (cache.keys, cache.values, mx.array([cache._idx], dtype=mx.int32), 0,
                cache.left_padding.astype(mx.int32), cache.offset.astype(mx.int32))
    view = getattr(cache, "decode_view", None)
    return None if view is None else view()


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.Hk, self.Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.Dk, self.Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.Hk * self.Dk, self.Hv * self.Dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_width = cfg.linear_conv_kernel_dim
        H = cfg.hidden_size
        self.in_proj_qkv = Linear(H, self.conv_dim)
        self.in_proj_z = Linear(H, self.value_dim)
        self.in_proj_b = Linear(H, self.Hv)
        self.in_proj_a = Linear(H, self.Hv)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_width, groups=self.conv_dim, bias=False)
        self.dt_bias = mx.ones((self.Hv,))
        self.A_log = mx.zeros((self.Hv,))
        self.norm = GatedRMSNorm(self.Dv, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, H)
        self.fused_in = FusedLinears(self, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        return self._run(x, None, mask, cache, None)

    def add_to(self, h: mx.array, norm: RMSNorm, mask=None, cache=None) -> mx.array:
        """h + self(norm(h)): the norm folded into the input projection, the add into out_proj."""
        return self._run(h, norm, mask, cache, h)

    def _run(self, x, norm, mask, cache, residual):
        B, T, _ = x.shape
        proj = lambda: self.fused_in(x, norm)  # [B, T, qkv | z | b | a]
        conv_state = cache[0] if cache is not None and cache[0] is not None else None
        if conv_state is None:
            conv_state = mx.zeros((B, self.conv_width - 1, self.conv_dim), dtype=x.dtype)
        lengths = cache.lengths if cache is not None else None
        state = cache[1] if cache is not None else None
        # One token, or a few after a cache (a speculative verify): the fused decode step where a kernel applies
        # (the same composition otherwise).
        decode = T == 1 or (T <= DECODE_TOKENS_MAX and mask is None and lengths is None and state is not None)
        # Where the GPU picks a verify's start, the cache holds a second pair and the pick (decode_step's alt). One
        # token's kept states are its inputs, and deltanet_mix takes one pair: picked here.
        alt = getattr(cache, "alt", None)
        if alt is not None and (T == 1 or not decode):
            (conv_state, state), alt = ops.picked_states(conv_state, state, alt), None
        args = (self.conv1d.weight, conv_state, self.A_log, self.dt_bias, self.norm["weight"], state)
        kw = dict(num_key_heads=self.Hk, eps=self.norm.eps, mask=mask, lengths=lengths)
        h, kept = None, ()
        # A speculative verify's cache (decode.CompiledVerifier) keeps the states after all but the last token too.
        keep = getattr(cache, "keep", False)
        if decode:
            source = None if norm is None else (x, (norm["weight"], norm.eps), self.fused_in.quantized())
            o = None if residual is None or source is None else output_weights(self.out_proj, residual, x.dtype)
            chained = None if o is None or lengths is not None else ops.deltanet_decode_add(
                *source, (*o[0], o[2], o[1]), residual, *args, num_key_heads=self.Hk, eps=self.norm.eps, mask=mask,
                keep=keep and T > 1, alt=alt)
            if chained is not None:  # the output projection and the residual add included
                h, conv_state, state, *kept = chained
            else:
                out, conv_state, state, *kept = ops.deltanet_decode_step(proj, *args, source=source,
                                                                         keep=keep and T > 1, alt=alt, **kw)
        else:
            if keep:
                raise ValueError(f"a verify cache keeps its states over at most {DECODE_TOKENS_MAX} tokens, got {T}")
            out, conv_state, state = ops.deltanet_mix(proj(), *args, **kw)  # out [B, T, Hv*Dv]
        if cache is not None:
            if keep:  # one token: the states before it are the inputs
                cache.kept = tuple(kept) or (args[1], args[-1])
            cache[0], cache[1] = conv_state, state
            cache.advance(T)
        if h is not None:
            return h
        return self.out_proj(out) if residual is None else added(self.out_proj, out, residual)


class MLP(nn.Module):
    def __init__(self, dims: int, hidden: int):
        super().__init__()
        self.gate_proj = Linear(dims, hidden)
        self.up_proj = Linear(dims, hidden)
        self.down_proj = Linear(hidden, dims)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class SwitchGLU(nn.Module):
    def __init__(self, dims: int, hidden: int, num_experts: int):
        super().__init__()
        self.gate_proj = SwitchLinear(dims, hidden, num_experts)
        self.up_proj = SwitchLinear(dims, hidden, num_experts)
        self.down_proj = SwitchLinear(hidden, dims, num_experts)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x [..., H], indices [..., k] -> [..., k, H]."""
        y, inv_order = self._experts(x, indices)
        if inv_order is not None:
            y = mx.unflatten(y[inv_order], 0, indices.shape)
        return y.squeeze(-2)

    def combined(self, x: mx.array, indices: mx.array, scores: mx.array, dtype, shared=None, residual=None) -> mx.array:
        """sum_j scores[..., j] * self(x, indices)[..., j, :] -> [..., H] in dtype (float32 products and sum), then the
        MoE block's tail (ops.moe_block_tail: shared = (hs, router logits), residual); sorted rows go back to token
        order inside the weighted sum (ops.combine_sorted_experts)."""
        y, inv_order = self._experts(x, indices)
        if inv_order is None:
            return ops.moe_block_tail(ops.weighted_top_k(y.squeeze(-2), scores, dtype), shared, residual)
        return ops.combine_sorted_experts(y.reshape(-1, y.shape[-1]), inv_order, scores, dtype, shared, residual)

    def _experts(self, x: mx.array, indices: mx.array) -> tuple[mx.array, Optional[mx.array]]:
        """The SwiGLU experts' rows: ([..., k, 1, H], None) in token order, or sorted by expert ([T * k, 1, H],
        inv_order: the sorted row of each flat (token, j))."""
        x = mx.expand_dims(x, (-2, -3))  # [..., 1, 1, H]
        # Many tokens: sort by expert so each expert's rows are contiguous (as mlx-lm does).
        do_sort = indices.size >= 64
        idx, inv_order, starts, x_rows = indices, None, None, None
        if do_sort:
            idx, inv_order, x_rows, starts = ops.sort_by_expert(indices, self.gate_proj["weight"].shape[0])
            x = x.flatten(0, -3)  # [T, 1, H]: moe_gemm reads the sorted rows' tokens in place
            if starts is None or not ops.enabled("moe_gemm_gather"):  # gather them once for both projections
                x, x_rows = x[x_rows], None
        kw = dict(sorted_indices=do_sort, expert_starts=starts)
        h = nn.silu(self.gate_proj(x, idx, x_rows=x_rows, **kw)) * self.up_proj(x, idx, x_rows=x_rows, **kw)
        return self.down_proj(h, idx, **kw), inv_order


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H = cfg.hidden_size
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(H, cfg.num_experts)
        self.switch_mlp = SwitchGLU(H, cfg.moe_intermediate_size, cfg.num_experts)
        self.shared_expert = MLP(H, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(H, 1)
        self.router = FusedLinears(self, ("gate", "shared_expert_gate"))  # logits [..., E + 1]

    def __call__(self, x: mx.array) -> mx.array:
        """x [..., H] -> the MoE output."""
        return self._run(x, None, None)

    def add_to(self, h: mx.array, norm: RMSNorm) -> mx.array:
        """h + self(norm(h)); for a few tokens the fused decode path (norm, routing and residual inside)."""
        return self._run(h, norm, h)

    def _run(self, x, norm, residual):
        # The fused op for as many tokens as its kernels take (8: a server batch of 8 rows at top-8 included), and
        # below SwitchGLU's sorting threshold, where its fallback is the very same unsorted gather.
        tokens = x.size // x.shape[-1]
        if (residual is not None and (tokens <= ops.DECODE_KERNEL_ROWS or tokens * self.top_k < 64)
                and self._quantized_alike()):
            logits = lambda: self.router(x, norm)  # [..., E + 1]: the router's, then the shared-expert gate's
            wg, wu, wd, sg, su, sd = ((l["weight"], l["scales"], l["biases"]) for l in self._projections())
            first = self.switch_mlp.gate_proj
            return ops.moe_decode(x, norm["weight"], norm.eps, logits, wg, wu, wd, sg, su, sd, top_k=self.top_k,
                                  normalize=self.norm_topk_prob, group_size=first.group_size, bits=first.bits,
                                  router=self.router.quantized())
        xn = x if norm is None else norm(x)
        logits = self.router(xn)
        E = logits.shape[-1] - 1
        inds, scores = ops.moe_route(logits, self.top_k, self.norm_topk_prob, E)  # [..., k]
        return self.switch_mlp.combined(xn, inds, scores, x.dtype, (self.shared_expert(xn), logits), residual)

    def _projections(self):
        sw, se = self.switch_mlp, self.shared_expert
        return sw.gate_proj, sw.up_proj, sw.down_proj, se.gate_proj, se.up_proj, se.down_proj

    def _quantized_alike(self) -> bool:
        first = self.switch_mlp.gate_proj
        return all("scales" in l and "bias" not in l and (l.group_size, l.bits) == (first.group_size, first.bits)
                   for l in self._projections())


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, is_linear: Optional[bool] = None):
        super().__init__()
        self.is_linear = cfg.is_linear(layer_idx) if is_linear is None else is_linear
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = Attention(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoeBlock(cfg)

    def __call__(self, x, mask=None, cache=None):
        return self.moe_block(self.mixer_block(x, mask, cache))

    def mixer_block(self, x, mask=None, cache=None):
        mixer = self.linear_attn if self.is_linear else self.self_attn
        return mixer.add_to(x, self.input_layernorm, mask, cache)  # x + mixer(norm(x))

    def moe_block(self, h):
        return self.mlp.add_to(h, self.post_attention_layernorm)  # h + moe(norm(h))


class TextModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        kinds = [l.is_linear for l in self.layers]
        self.ssm_idx = kinds.index(True) if True in kinds else None
        self.fa_idx = kinds.index(False) if False in kinds else None

    def __call__(self, inputs, cache=None, input_embeddings=None, return_hidden=False):
        h = self.hidden(inputs, cache, input_embeddings)
        out = self.norm(h)
        return (out, h) if return_hidden else out

    def hidden(self, inputs, cache=None, input_embeddings=None) -> mx.array:
        """The last layer's output before the final norm [B, L, H]."""
        h = input_embeddings if input_embeddings is not None else embedded(self.embed_tokens, inputs)
        if cache is None:
            cache = [None] * len(self.layers)
        fa_mask = create_attention_mask(h, cache[self.fa_idx]) if self.fa_idx is not None else None
        ssm_mask = create_ssm_mask(h, cache[self.ssm_idx]) if self.ssm_idx is not None else None
        # Under mx.compile, grad or vmap nothing may be evaluated: no run-ahead bound and no overlap there.
        dispatching = h.shape[1] > 1 and memory.dispatch(h)
        ahead = memory.layers_ahead(h.shape[1]) if dispatching else None
        overlap = dispatching and ahead is None and ops.enabled("prefill_overlap")
        queued = []
        for layer, c in zip(self.layers, cache):
            mask = ssm_mask if layer.is_linear else fa_mask
            if ahead is None:
                h = layer(h, mask=mask, cache=c)
                if overlap:  # the GPU runs this layer while Python builds the next
                    memory.dispatch(h, [] if c is None else c.state)
                continue
            # A bounded prefill: dispatch half a layer (its mixer, then its MoE block), then wait for the half
            # 2 * ahead - 1 back; half-layer steps keep one DeltaNet mixer's temporaries (1 GB at 2048 tokens) from
            # being queued beside the previous layer's.
            for half in (lambda x: layer.mixer_block(x, mask, c), layer.moe_block):
                h = half(h)
                mx.async_eval(h, [] if c is None else c.state)
                queued.append(h)
                if len(queued) > 2 * ahead - 1:
                    mx.eval(queued.pop(0))
        return h


class LanguageModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = TextModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)

    def logits(self, h: mx.array) -> mx.array:
        """Logits of the final-normed hidden state h."""
        if self.cfg.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def __call__(self, inputs, cache=None, input_embeddings=None):
        h = self.model.hidden(inputs, cache, input_embeddings)
        if self.cfg.tie_word_embeddings:
            return self.logits(self.model.norm(h))
        return normed(self.lm_head, h, self.model.norm)  # the final norm folded into the lm_head


class MTP(nn.Module):
    """The checkpoint's multi-token-prediction head (`mtp.*`): fc([norm(embed(t+1)) | norm(h_t)]) ->
    full-attention MoE decoder layer(s) -> norm -> the main lm_head. Kept for speculative decoding.
    h_t is the main model's output after its final norm (what lm_head scores), as vLLM feeds Qwen3-Next's head."""

    def __init__(self, cfg: ModelConfig, num_layers: int):
        super().__init__()
        H = cfg.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(H, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(H, cfg.rms_norm_eps)
        self.fc = Linear(2 * H, H)
        self.layers = [DecoderLayer(cfg, 0, is_linear=False) for _ in range(num_layers)]
        self.norm = RMSNorm(H, cfg.rms_norm_eps)

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache=None) -> mx.array:
        h = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)], axis=-1))
        cache = cache or [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask=mask, cache=c)
        return self.norm(h)


# Norm weights that HF checkpoints store zero-centred (w - 1); the DeltaNet gated norm is not one of them.
_ZERO_CENTRED_NORMS = re.compile(
    r"(\.input_layernorm|\.post_attention_layernorm|\.q_norm|\.k_norm|model\.norm|^mtp\.norm"
    r"|\.pre_fc_norm_embedding|\.pre_fc_norm_hidden)\.weight$"
)
_PER_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class Model(nn.Module):
    def __init__(self, cfg: ModelConfig, mtp_layers: int = 0):
        super().__init__()
        self.config = cfg
        self.model_type = cfg.model_type
        self.args = cfg
        self.language_model = LanguageModel(cfg)
        if mtp_layers:
            self.mtp = MTP(cfg, mtp_layers)

    def __call__(self, inputs: mx.array, cache=None, input_embeddings=None) -> mx.array:
        return self.language_model(inputs, cache=cache, input_embeddings=input_embeddings)

    def fuse_projections(self, pack: bool = False) -> None:
        """Concatenate the projections that share an input (DeltaNet qkv|z|b|a, attention q|k|v, router |
        shared-expert gate) so each runs as one matmul; the parts keep working as views. Idempotent; run
        at load, and again after anything replaces weights (the fused path is skipped until then). `pack`: every
        quantized weight packed too (pack_weights; the compiled decoders ask for it with switch packed_weights, after
        loading, so a checkpoint's arrays are gone before their packed copies are made)."""
        # Every compiled decoder calls this; with nothing replaced since the last call (the same parameter arrays), it
        # has nothing to do, and one pass over the parameters costs less than its two walks of the modules.
        key = (pack, self.parameter_ids())
        if getattr(self, "_fused_for", None) == key:
            return
        for fused in self.fused_groups():
            if fused.fuse(pack) and pack:
                mx.clear_cache()  # see pack_weights
        if pack:
            self.pack_weights()
        object.__setattr__(self, "_fused_for", (pack, self.parameter_ids()))  # not a parameter: outside the tree

    def parameter_ids(self) -> tuple[int, ...]:
        """The ids of every parameter array, in tree order: new arrays anywhere (an update, a re-fuse) give new ids."""
        return tuple(id(a) for _, a in tree_flatten(self.parameters()))

    def fused_groups(self):
        """Every FusedLinears of the model (DeltaNet in-projections, attention q|k|v, router | shared-expert gate)."""
        for _, m in self.named_modules():
            for fused in (getattr(m, "fused_in", None), getattr(m, "fused_qkv", None), getattr(m, "router", None)):
                if isinstance(fused, FusedLinears):
                    yield fused

    def pack_weights(self) -> int:
        """Pack each quantized weight not yet packed (ops/packing.py): its weight, scales and biases become views of
        one array, which the decode kernels take as one input. Fused parts stay views of their fused, packed
        concatenation. Values are unchanged and nothing is held twice. Returns how many were packed."""
        fused_parts = {id(p) for f in self.fused_groups() if f.current() for p in f.parts()}
        n = 0
        for _, m in self.named_modules():
            if id(m) in fused_parts or not all(isinstance(m.get(k), mx.array) for k in ("weight", "scales", "biases")):
                continue
            w, s, b = m["weight"], m["scales"], m["biases"]
            if packing.lookup(w, s, b) is None and packing.why_not(w, s, b) is None:
                _, w, s, b = packing.pack(w, s, b)
                m.update({"weight": w, "scales": s, "biases": b})
                # MLX would keep the old buffers for reuse, and its memory limit does not count other processes on
                # the GPU: three 35B processes on an 80 GB card ran out of memory (H100, run 47).
                mx.clear_cache()
                n += 1
        return n

    def bundle_weights(self, run) -> int:
        """Bundle the constant inputs of each launch that run() makes whose kernel takes them as one
        (kernels.KernelSpec.bundle; ops/packing.py): the model's arrays become views of the bundle, which that
        kernel's bundled variant then takes. run() is traced with nothing launched (kernels.captured), so it may be
        any decode step. A launch whose inputs are not all the model's own arrays is left alone. Values are
        unchanged and nothing is held twice. Returns how many bundles were made."""
        from .ops import kernels

        with kernels.captured() as launches:
            run()
        made = 0
        while launches:  # popped, so each layer's old arrays go as its bundle is made (peak: weights + a bundle)
            spec, inputs = launches.pop(0)
            if not spec.bundle or kernels.bundled_args(spec, inputs, []) is not None:
                continue
            members = kernels.bundle_members(spec, dict(zip(spec.input_names, inputs)))
            old = [a for m in members for a in (m if packing.is_weight(m) else (m,))]
            places = self._array_places()
            if any(id(a) not in places for a in old) or any(
                    packing.why_not(*m) is not None for m in members if packing.is_weight(m)):
                continue
            views = packing.bundle(members)[1]
            new = [a for v in views for a in (v if packing.is_weight(v) else (v,))]
            fused = {}
            for before, after in zip(old, new):
                for owner, key in places[id(before)]:
                    if isinstance(owner, FusedLinears):
                        owner.arrays[key] = after
                        fused[id(owner)] = owner
                    else:
                        owner[key] = after
            for f in fused.values():
                f.assign(f.arrays)
            del inputs, members, old, views, new
            mx.clear_cache()  # see pack_weights
            made += 1
        return made

    def _array_places(self) -> dict[int, list]:
        """id(array) -> [(owner, key)]: where each of the model's arrays is held, by a module or a fused group."""
        places: dict[int, list] = {}
        for _, m in self.named_modules():
            for k, v in m.items():
                if isinstance(v, mx.array):
                    places.setdefault(id(v), []).append((m, k))
        for f in self.fused_groups():
            for k, v in (f.arrays or {}).items():
                places.setdefault(id(v), []).append((f, k))
        return places

    @property
    def layers(self):
        return self.language_model.model.layers

    def mtp_hidden(self, hidden: mx.array, next_tokens: mx.array, cache=None) -> mx.array:
        """The MTP head's final-norm output [B, L, H] (what the lm_head scores for token t+2) from hidden [B, L, H]
        (the text model's final-norm output at t) and token t+1 [B, L]; cache: one KV cache per MTP layer."""
        if "mtp" not in self:
            raise ValueError("this checkpoint has no MTP head (no mtp.* tensors)")
        return self.mtp(embedded(self.language_model.model.embed_tokens, next_tokens), hidden, cache)

    def mtp_logits(self, hidden: mx.array, next_tokens: mx.array, cache=None) -> mx.array:
        """Logits [B, L, V] for token t+2 (see mtp_hidden)."""
        return self.language_model.logits(self.mtp_hidden(hidden, next_tokens, cache))

    def mtp_draft(self, hidden: mx.array, next_tokens: mx.array, cache=None,
                  pick: Optional[mx.array] = None) -> mx.array:
        """The MTP head's greedy draft [B] int32 for the token after the last of next_tokens, or after position pick
        ([1] int32, an array so the GPU may choose it) (see mtp_hidden): the lm_head scores that position only."""
        h = self.mtp_hidden(hidden, next_tokens, cache)
        h = h[:, -1] if pick is None else mx.take(h, pick, axis=1)[:, 0]  # [B, H]
        return ops.argmax(self.language_model.logits(h)).astype(mx.int32)

    def make_cache(self, max_kv_size: Optional[int] = None) -> list[Any]:
        """DeltaNet layers: [conv state, recurrent state]; attention layers: a KV cache, a rotating
        window of `max_kv_size` (keeping the first 4 tokens, as mlx-lm does) when given."""
        def kv():
            return KVCache() if max_kv_size is None else RotatingKVCache(max_size=max_kv_size, keep=4)

        return [ArraysCache(size=2) if l.is_linear else kv() for l in self.layers]

    @staticmethod
    def checkpoint_layout(keys) -> str:
        """'mlx' (language_model.model.*, norms already shifted) or 'hf' (model.language_model.* / model.*)."""
        keys = list(keys)
        if any(k.startswith("language_model.") for k in keys):
            return "mlx"
        return "hf"

    @staticmethod
    def rename(key: str, layout: str) -> Optional[str]:
        """Checkpoint key -> our key, or None for tensors we skip (the vision tower)."""
        if key.startswith(("model.visual.", "visual.", "vision_tower.")):
            return None
        if key.startswith("mtp."):
            return key
        if layout == "mlx":
            return key
        if key.startswith("model.language_model."):
            return "language_model.model." + key[len("model.language_model."):]
        if key.startswith("model."):
            return "language_model.model." + key[len("model."):]
        if key == "lm_head.weight":
            return "language_model.lm_head.weight"
        return key

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return self.sanitize_with_origins(weights)[0]

    def sanitize_with_origins(self, weights: dict[str, mx.array]):
        """All checkpoint renaming in one place: any of the three layouts -> our parameter names.

        Returns (weights, origin) where origin maps each new key to the checkpoint key it came from.
        """
        layout = self.checkpoint_layout(weights)
        out: dict[str, mx.array] = {}
        origin: dict[str, str] = {}
        experts: dict[tuple[str, str], dict[int, tuple[str, mx.array]]] = {}

        def put(new_key, value, old_key):
            out[new_key] = value
            origin[new_key] = old_key

        for old, value in weights.items():
            key = self.rename(old, layout)
            if key is None:
                continue
            m = _PER_EXPERT.match(key)
            if m:
                experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = (old, value)
            elif key.endswith(".mlp.experts.gate_up_proj"):
                prefix = key[: -len(".experts.gate_up_proj")]
                mid = value.shape[-2] // 2  # [E, 2I, H], gate rows first
                # contiguous copies: MLX's CUDA kernels mis-read these strided views (seen on 0.32.4)
                put(f"{prefix}.switch_mlp.gate_proj.weight", mx.contiguous(value[..., :mid, :]), old)
                put(f"{prefix}.switch_mlp.up_proj.weight", mx.contiguous(value[..., mid:, :]), old)
            elif key.endswith(".mlp.experts.down_proj"):
                put(key[: -len(".experts.down_proj")] + ".switch_mlp.down_proj.weight", value, old)
            else:
                if key.endswith("conv1d.weight") and value.ndim == 3 and value.shape[-1] != 1:
                    value = mx.contiguous(value.moveaxis(2, 1))  # HF [C, 1, W] -> MLX [C, W, 1]
                if layout == "hf" and value.ndim == 1 and _ZERO_CENTRED_NORMS.search(key):
                    value = value + 1.0
                put(key, value, old)
        for (prefix, proj), by_index in experts.items():
            n = max(by_index) + 1
            missing = sorted(set(range(n)) - set(by_index))
            if missing:
                raise KeyError(f"{prefix}.experts: {proj} tensors missing for experts {missing}")
            first = by_index[0][0]
            put(f"{prefix}.switch_mlp.{proj}.weight", mx.stack([by_index[e][1] for e in range(n)]), first)
        if self.config.tie_word_embeddings:
            out.pop("language_model.lm_head.weight", None)
        return out, origin

    @property
    def quant_predicate(self):
        def predicate(path: str, _module):
            if path.endswith("mlp.gate") or path.endswith("shared_expert_gate"):
                return {"group_size": 64, "bits": 8}
            return True

        return predicate

    @property
    def cast_predicate(self):
        return lambda path: not path.endswith("A_log")
