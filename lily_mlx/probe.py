"""Look inside a forward pass: router choices, DeltaNet gates and state norms, per-layer contributions.

    from lily_mlx.probe import trace
    t = trace(model, tokenizer.encode("some text"))
    t.expert_counts()            # [layers, experts]: how often each expert is in a token's top-k
    t.layers[0].decay            # [B, T, Hv] DeltaNet decay gates g = exp(log g)
    t.layers[0].state_norm       # [B, n, Hv] ||S|| after each `state_stride` tokens
    t.logprobs                   # [B, T-1] log p(next token)

`trace` runs the model's own modules one layer at a time, calling each exactly as DecoderLayer and
TextModel do, and records what it needs on the side; nothing in the model is patched or wrapped, so
generation pays nothing for this module. Its logits equal `model(inputs)` (tests/test_probe.py).
`ablate` removes chosen sublayers' contributions to the residual stream, to measure what each adds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_attention_mask, create_ssm_mask

from . import ops
from .model import Model
from .ops import reference

SUBLAYERS = ("mixer", "moe")


@dataclass
class LayerTrace:
    """One decoder layer of one traced forward pass (numpy arrays, batch-first)."""

    index: int
    kind: str  # "deltanet" or "attention"
    residual_norm: np.ndarray  # [B, T] ||h|| entering the layer
    mixer_norm: np.ndarray  # [B, T] ||what the DeltaNet / attention sublayer adds to h||
    moe_norm: np.ndarray  # [B, T] ||what the MoE block adds||
    router_indices: np.ndarray  # [B, T, k] the experts each token is sent to
    router_weights: np.ndarray  # [B, T, k] their combine weights (renormalised when the config says so)
    shared_gate: np.ndarray  # [B, T] sigmoid(shared_expert_gate(x)): the shared expert's weight
    decay: Optional[np.ndarray] = None  # DeltaNet: [B, T, Hv] g = exp(-exp(A_log) softplus(a + dt_bias))
    beta: Optional[np.ndarray] = None  # DeltaNet: [B, T, Hv] write strength sigmoid(b)
    state_norm: Optional[np.ndarray] = None  # DeltaNet: [B, n, Hv] Frobenius norm of S per value head
    state_positions: Optional[np.ndarray] = None  # [n] tokens consumed when each state_norm was taken


@dataclass
class Trace:
    tokens: np.ndarray  # [B, T]
    layers: list[LayerTrace]
    logprobs: np.ndarray  # [B, T-1] log p(tokens[:, t+1] | tokens[:, :t+1]), float32
    num_experts: int
    ablated: tuple = ()
    logits: Optional[mx.array] = field(default=None, repr=False)  # [B, T, V] when keep_logits=True

    def expert_counts(self) -> np.ndarray:
        """[layers, experts]: how many (token, top-k slot) choices picked each expert."""
        out = np.zeros((len(self.layers), self.num_experts), dtype=np.int64)
        for lt in self.layers:
            out[lt.index] = np.bincount(lt.router_indices.ravel(), minlength=self.num_experts)
        return out

    def nll(self) -> float:
        """Mean negative log-likelihood (nats/token) of the traced tokens."""
        return float(-self.logprobs.astype(np.float64).mean())


def _norm(x: mx.array) -> mx.array:
    return mx.linalg.norm(x.astype(mx.float32), axis=-1)


def _parse_ablate(ablate: Iterable[tuple[int, str]], num_layers: int) -> set[tuple[int, str]]:
    out = set()
    for item in ablate:
        i, what = item
        if what not in SUBLAYERS or not -num_layers <= i < num_layers:
            raise ValueError(f"ablate entry {item!r}: expected (layer index < {num_layers}, one of {SUBLAYERS})")
        out.add((i % num_layers, what))
    return out


def _deltanet_side(mod, x: mx.array, state_stride: int):
    """Gates of a GatedDeltaNet on normed input x, and its state norm every `state_stride` tokens.

    The states come from running the module itself over x in segments with a cache, as chunked prefill
    does, so they are the states the model carries (up to the chunked/sequential rounding)."""
    from mlx_lm.models.cache import ArraysCache

    log_g, beta = reference.deltanet_gates(mod.in_proj_a(x), mod.in_proj_b(x), mod.A_log, mod.dt_bias)
    cache = ArraysCache(size=2)
    norms, positions = [], []
    T = x.shape[1]
    for s in range(0, T, state_stride):
        e = min(s + state_stride, T)
        mod(x[:, s:e], None, cache)
        norms.append(mx.sqrt((cache[1] * cache[1]).sum(axis=(-2, -1))))  # [B, Hv]
        positions.append(e)
        if len(norms) % 64 == 0:  # bound the lazy graph on long prompts
            mx.eval(norms[-64:], cache[0], cache[1])
    return mx.exp(log_g), beta, mx.stack(norms, axis=1), np.array(positions)


def trace(model: Model, inputs, *, ablate: Iterable[tuple[int, str]] = (), state_stride: int = 1,
          keep_logits: bool = False) -> Trace:
    """One forward pass of `model` over `inputs` (token ids [T] or [B, T]) with its internals recorded.

    ablate: (layer index, "mixer" | "moe") pairs whose output is not added to the residual stream
    (the recorded norms are still those of what the sublayer computed).
    state_stride: tokens between DeltaNet state-norm samples (1: after every token).
    keep_logits: also return the [B, T, V] logits (large for a full-size vocabulary).
    """
    if not isinstance(model, Model):
        raise TypeError(f"trace needs a lily_mlx Model (lily_mlx.load), got {type(model).__name__}")
    if state_stride < 1:
        raise ValueError(f"state_stride must be >= 1, got {state_stride}")
    tokens = inputs if isinstance(inputs, mx.array) else mx.array(np.asarray(inputs))
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2 or tokens.shape[1] < 1:
        raise ValueError(f"inputs must be token ids [T] or [B, T], got shape {tuple(tokens.shape)}")
    tm = model.language_model.model
    cut = _parse_ablate(ablate, len(tm.layers))

    # As TextModel.__call__ with no cache.
    h = tm.embed_tokens(tokens)
    fa_mask = create_attention_mask(h, None) if tm.fa_idx is not None else None
    ssm_mask = create_ssm_mask(h, None) if tm.ssm_idx is not None else None
    layers = []
    for i, layer in enumerate(tm.layers):
        # As DecoderLayer.__call__, with each sublayer's contribution kept apart.
        x = layer.input_layernorm(h)
        mixer = layer.linear_attn if layer.is_linear else layer.self_attn
        mixed = mixer(x, ssm_mask if layer.is_linear else fa_mask, None)
        h_mid = h if (i, "mixer") in cut else h + mixed
        xn = layer.post_attention_layernorm(h_mid)
        if (i, "moe") in cut:
            moe_out, h_next = layer.mlp(xn), h_mid
        else:
            h_next = layer.mlp.add_to(h_mid, layer.post_attention_layernorm)  # the model's own (fused) path
            moe_out = h_next - h_mid
        moe = layer.mlp
        inds, weights = ops.moe_route(moe.gate(xn), moe.top_k, moe.norm_topk_prob)
        rec = {
            "residual_norm": _norm(h), "mixer_norm": _norm(mixed), "moe_norm": _norm(moe_out),
            "router_indices": inds, "router_weights": weights,
            "shared_gate": mx.sigmoid(moe.shared_expert_gate(xn).astype(mx.float32))[..., 0],
        }
        if layer.is_linear:
            rec["decay"], rec["beta"], rec["state_norm"], positions = _deltanet_side(mixer, x, state_stride)
        mx.eval(h_next, rec)  # one layer at a time: the graph and memory stay one layer deep
        arrays = {k: np.array(v) for k, v in rec.items()}
        if layer.is_linear:
            arrays["state_positions"] = positions
        layers.append(LayerTrace(index=i, kind="deltanet" if layer.is_linear else "attention", **arrays))
        h = h_next

    logits = model.language_model.logits(tm.norm(h))
    lf = logits[:, :-1].astype(mx.float32)
    lp = mx.take_along_axis(lf, tokens[:, 1:, None], axis=-1)[..., 0] - mx.logsumexp(lf, axis=-1)
    mx.eval(lp)
    return Trace(tokens=np.array(tokens), layers=layers, logprobs=np.array(lp), num_experts=model.config.num_experts,
                 ablated=tuple(sorted(cut)), logits=logits if keep_logits else None)
