"""lily_mlx.probe: a traced forward pass equals the model's own, and what it records is what the model computes."""

import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import lily_mlx
from lily_mlx.loading import resolve_model_path
from lily_mlx.probe import trace

from conftest import subprocess_env

TEXT = "Return a list of the keys in the dictionary, sorted by their values. If the key is missing, raise KeyError."


@pytest.fixture(scope="module")
def embedded():
    # float32: the checks below compare against numpy at float32 rounding (the shipped weights are bf16)
    model, _ = lily_mlx.load_model(resolve_model_path("embedded"), dtype=mx.float32)
    return model, lily_mlx.load("embedded")[1]


@pytest.fixture(scope="module")
def embedded_q4():
    # 4-bit: the MoE block takes its fused residual path for few tokens, which trace must go through too.
    return lily_mlx.load_model(resolve_model_path("embedded"), quantize=True)[0]


def _ids(tok, n=None):
    ids = tok.encode(TEXT)
    return ids if n is None else ids[:n]


@pytest.mark.parametrize("which", ["float", "q4"])
def test_trace_logits_equal_the_models(embedded, embedded_q4, which):
    model, tok = embedded
    model = model if which == "float" else embedded_q4
    ids = _ids(tok, 8 if which == "q4" else None)  # 8 tokens x top-2: below the sorting threshold (fused path)
    t = trace(model, ids, keep_logits=True)
    ref = model(mx.array(ids)[None])
    assert mx.array_equal(t.logits, ref).item()
    lf = np.array(ref[0, :-1].astype(mx.float32), dtype=np.float64)
    want = lf[np.arange(len(ids) - 1), ids[1:]] - np.log(np.exp(lf - lf.max(-1, keepdims=True)).sum(-1)) - lf.max(-1)
    np.testing.assert_allclose(t.logprobs[0], want, rtol=0, atol=1e-4)
    assert t.nll() == pytest.approx(-want.mean(), abs=1e-4)


def test_router_and_gates_are_the_models(embedded):
    model, tok = embedded
    ids = _ids(tok)
    T, cfg = len(ids), model.config
    t = trace(model, ids)
    kinds = ["deltanet" if l.is_linear else "attention" for l in model.layers]
    assert [l.kind for l in t.layers] == kinds and [l.index for l in t.layers] == list(range(len(kinds)))
    counts = t.expert_counts()
    assert counts.shape == (cfg.num_hidden_layers, cfg.num_experts)
    assert (counts.sum(axis=1) == T * cfg.num_experts_per_tok).all()

    # Layer 0 by hand, in numpy: its input is the normed embedding, so every gate is checkable directly.
    layer = model.layers[0]
    x = layer.input_layernorm(model.language_model.model.embed_tokens(mx.array(ids)[None]))
    la = layer.linear_attn
    a = np.array(la.in_proj_a(x), dtype=np.float64)
    b = np.array(la.in_proj_b(x), dtype=np.float64)
    softplus = np.logaddexp(0, a + np.array(la.dt_bias, dtype=np.float64))
    decay = np.exp(-np.exp(np.array(la.A_log, dtype=np.float64)) * softplus)
    l0 = t.layers[0]
    np.testing.assert_allclose(l0.decay, decay, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(l0.beta, 1 / (1 + np.exp(-b)), rtol=1e-5, atol=1e-6)
    for lt in t.layers:
        assert lt.router_indices.shape == lt.router_weights.shape == (1, T, cfg.num_experts_per_tok)
        assert ((lt.router_indices >= 0) & (lt.router_indices < cfg.num_experts)).all()
        np.testing.assert_allclose(lt.router_weights.sum(-1), 1.0, atol=1e-5)  # norm_topk_prob
        assert ((lt.shared_gate > 0) & (lt.shared_gate < 1)).all()
        assert lt.residual_norm.shape == lt.mixer_norm.shape == lt.moe_norm.shape == (1, T)
        assert (lt.mixer_norm > 0).all() and (lt.moe_norm > 0).all()


@pytest.mark.parametrize("stride", [1, 5])
def test_state_norms_match_the_prefill_cache(embedded, stride):
    """The last sampled state is the one a normal prefill leaves in the cache (chunked vs stepwise: rounding only)."""
    model, tok = embedded
    ids = _ids(tok)
    t = trace(model, ids, state_stride=stride)
    cache = model.make_cache()
    mx.eval(model(mx.array(ids)[None], cache=cache))
    for lt, c in zip(t.layers, cache):
        if lt.kind != "deltanet":
            assert lt.state_norm is None and lt.decay is None
            continue
        want = np.sqrt((np.array(c[1], dtype=np.float64) ** 2).sum(axis=(-2, -1)))  # [B, Hv]
        np.testing.assert_allclose(lt.state_norm[:, -1], want, rtol=1e-4)
        expected_positions = list(range(stride, len(ids), stride)) + [len(ids)]
        assert lt.state_positions.tolist() == sorted(set(expected_positions))
        assert lt.state_norm.shape[1] == len(lt.state_positions)


def test_ablation(embedded):
    model, tok = embedded
    ids = _ids(tok)
    base = trace(model, ids, state_stride=len(ids), keep_logits=True)
    last = len(model.layers) - 1
    # Removing the last MoE block by hand: the final norm and lm_head applied to the residual before it.
    cut = trace(model, ids, ablate=[(-1, "moe")], state_stride=len(ids), keep_logits=True)
    assert cut.ablated == ((last, "moe"),)
    lm = model.language_model
    h = lm.model.embed_tokens(mx.array(ids)[None])
    mask = "causal"
    for i, layer in enumerate(model.layers):
        mixer = layer.linear_attn if layer.is_linear else layer.self_attn
        h = h + mixer(layer.input_layernorm(h), None if layer.is_linear else mask, None)
        if i < last:
            h = h + layer.mlp(layer.post_attention_layernorm(h))
    np.testing.assert_allclose(np.array(cut.logits), np.array(lm.logits(lm.model.norm(h))), rtol=1e-5, atol=1e-5)
    # Sublayers upstream of the cut record the same; logprobs differ.
    np.testing.assert_array_equal(cut.layers[0].mixer_norm, base.layers[0].mixer_norm)
    assert not np.allclose(cut.logprobs, base.logprobs)


def test_batch_and_errors(embedded):
    model, tok = embedded
    ids = _ids(tok, 12)
    t = trace(model, mx.array([ids, ids[::-1]]), state_stride=4)
    assert t.tokens.shape == (2, 12) and t.logprobs.shape == (2, 11)
    assert t.layers[0].state_norm.shape == (2, 3, model.config.linear_num_value_heads)
    single = trace(model, ids[::-1], state_stride=4)
    np.testing.assert_allclose(t.logprobs[1], single.logprobs[0], atol=1e-5)
    with pytest.raises(ValueError, match="ablate"):
        trace(model, ids, ablate=[(0, "attention")])
    with pytest.raises(ValueError, match="ablate"):
        trace(model, ids, ablate=[(99, "moe")])
    with pytest.raises(ValueError, match="state_stride"):
        trace(model, ids, state_stride=0)
    with pytest.raises(TypeError, match="lily_mlx Model"):
        trace(object(), ids)


def test_not_imported_by_generation():
    """The probe is off the hot path: loading and generating never import it."""
    code = ("import sys, lily_mlx; m, t = lily_mlx.load('embedded'); lily_mlx.generate(m, t, 'Return', max_tokens=2); "
            "assert 'lily_mlx.probe' not in sys.modules, 'probe imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
