"""The fused MoE decode kernels (moe_gate_up, moe_down_combine) against a float64 oracle.

CPU: both kernels' Metal sources run by the shim's SIMT emulator (tests/emulator.py), the model's
logits through ops.moe_decode (its unfused fallback on CPU) against the plain block, and the
dispatcher rules. `cuda` / `metal`: the same cases through MLX on the GPU.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import lily_mlx
import lily_mlx.ops as ops
from emulator import GXX, Emulator
from switch_ab import decode_rel_err
from lily_mlx import model as model_mod
from lily_mlx.ops import kernels, moe, reference

NAN = float("nan")

# (M, k, E, H, I, Is, group, bits, x dtype, routing, norm). routing: None (random logits), a list of
# each token's experts in order (made the top logits), or "nan-row" (token 1's logits are NaN: no
# valid expert, so its slots (gate/up) and its row (down) must come out NaN). norm: the post-attention
# RMSNorm inside gate/up; normalize (renormalised top-k weights) is on except where k == 3.
# Planned lanes per row: gate/up 2, 1, 4, 32, 2, 4, 4, 8; down 1, 1, 2, 2, 16, 2, 2, 4.
CASES = [
    (1, 2, 5, 64, 32, 96, 32, 4, mx.float32, None, False),
    (3, 2, 7, 96, 64, 32, 32, 4, mx.bfloat16, [[3, 1], [6, 3], [0, 2]], True),
    (3, 2, 5, 128, 64, 192, 64, 4, mx.bfloat16, None, True),
    (1, 2, 7, 2048, 64, 128, 64, 4, mx.bfloat16, None, True),
    (2, 2, 5, 64, 512, 512, 64, 4, mx.bfloat16, None, False),
    (2, 2, 5, 64, 32, 64, 32, 8, mx.float32, "nan-row", True),
    (3, 2, 7, 128, 64, 128, 64, 4, mx.float32, [[1, 2], [4, 0], [2, 1]], False),
    (2, 3, 40, 256, 128, 256, 128, 4, mx.float32, None, True),
]

# The emulated runs: every case at its planned launch, and three at forced rows per lane segment and
# warps (the 35B-A3B gate/up plan is RPS 2, WARPS 4, or WARPS 8 under LILY_MLX_PLAN; the small shapes plan RPS 1,
# WARPS 4).
EMULATED = [(c, None) for c in CASES] + [(CASES[3], {"rps": 2, "warps": 8}), (CASES[2], {"rps": 4, "warps": 8}),
                                         (CASES[3], {"rps": 2, "warps": 4})]


def _id(c):
    M, k, E, H, I, IS, gs, bits, dt, routing, norm = c
    r = "" if routing is None else ("-nanrow" if routing == "nan-row" else "-forced")
    return f"M{M}-k{k}-E{E}-H{H}-I{I}-Is{IS}-g{gs}-b{bits}-{str(dt).split('.')[-1]}{r}{'-norm' if norm else ''}"


def _quant(rng, lead, rows, cols, gs, bits):
    """Random MLX affine codes [*lead, rows, cols*bits/32] with bf16 scales and biases centring them."""
    w = mx.array(rng.integers(0, 1 << 32, (*lead, rows, cols * bits // 32), dtype=np.uint32))
    s = rng.uniform(0.5, 1.5, (*lead, rows, cols // gs)) * (0.1 / (1 << bits))
    b = -s * ((1 << bits) / 2) + 0.01 * rng.standard_normal(s.shape)
    return w, mx.array(s.astype(np.float32)).astype(mx.bfloat16), mx.array(b.astype(np.float32)).astype(mx.bfloat16)


def _normal(rng, shape, dtype=mx.float32, scale=1.0):
    return mx.array((scale * rng.standard_normal(shape)).astype(np.float32)).astype(dtype)


def _case(c, seed=0):
    M, k, E, H, I, IS, gs, bits, dt, routing, norm = c
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((M, E + 1)).astype(np.float32)  # column E: the shared-expert gate
    if isinstance(routing, list):
        for m, experts in enumerate(routing):
            logits[m, experts] = 4.0 - 0.5 * np.arange(len(experts))
    elif routing == "nan-row":
        logits[1, :E] = np.nan
    scores = rng.uniform(0.1, 1.0, (M, k))
    experts = np.argsort(rng.uniform(size=(M, E)), axis=-1)[:, :k]
    return {
        "x": _normal(rng, (M, H), dt, scale=3.0),
        "norm": (mx.array(rng.uniform(0.5, 1.5, H).astype(np.float32)).astype(dt), 1e-6) if norm else None,
        "logits": mx.array(logits).astype(dt),
        "normalize": k != 3,
        "gate": _quant(rng, (E,), I, H, gs, bits), "up": _quant(rng, (E,), I, H, gs, bits),
        "shared_gate": _quant(rng, (), IS, H, gs, bits), "shared_up": _quant(rng, (), IS, H, gs, bits),
        "down": _quant(rng, (E,), H, I, gs, bits), "shared_down": _quant(rng, (), H, IS, gs, bits),
        # down's own inputs, independent of gate/up's: any routing, h and hs
        "inds": mx.array(experts.astype(np.int32)),
        "scores": mx.array((scores / scores.sum(-1, keepdims=True)).astype(np.float32)),
        "residual": _normal(rng, (M, H), dt),
        "h": _normal(rng, (M, k, I)),
        "hs": _normal(rng, (M, IS)),
    }


def _f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


def _deq(q, gs, bits) -> np.ndarray:
    w, s, b = q
    return _f64(reference.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), gs, bits))


def _silu(v):
    return v / (1.0 + np.exp(-v))


def oracle_route(a, k):
    """(ids [M, k] in descending logit order, ties to the lower id; weights [M, k]); NaN rows -> ids E, NaN."""
    E = a["gate"][0].shape[0]
    lg = _f64(a["logits"])[:, :E]
    bad = np.isnan(lg).any(-1)
    lg = np.where(bad[:, None], 0.0, lg)
    ids = np.argsort(-lg, axis=-1, kind="stable")[:, :k]
    top = np.take_along_axis(lg, ids, -1)
    p = np.exp(top - top[:, :1])
    w = p / (p.sum(-1, keepdims=True) if a["normalize"] else np.exp(lg - top[:, :1]).sum(-1, keepdims=True))
    return np.where(bad[:, None], E, ids), np.where(bad[:, None], np.nan, w)


def _normed_x(a) -> np.ndarray:
    """x as the kernel stages it: mx.fast.rms_norm's roundings, T(w * T(x * rsqrt(mean(x^2) + eps)))."""
    x = a["x"]
    if a["norm"] is None:
        return _f64(x)
    w, eps = a["norm"]
    xf = np.array(x.astype(mx.float32))
    r = 1.0 / np.sqrt((xf.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps)
    t = mx.array((xf * r).astype(np.float32)).astype(x.dtype).astype(mx.float32)
    return _f64((w.astype(mx.float32) * t).astype(x.dtype))


def oracle_gate_up(a, k, gs, bits):
    """(h [M, k, I], hs [M, Is], ids, weights) in float64; a token without valid experts has NaN slots."""
    x = _normed_x(a)
    ids, w = oracle_route(a, k)
    wg, wu = _deq(a["gate"], gs, bits), _deq(a["up"], gs, bits)
    ok = ids < wg.shape[0]
    sel = np.where(ok, ids, 0)
    g = np.einsum("mh,mkih->mki", x, wg[sel])
    u = np.einsum("mh,mkih->mki", x, wu[sel])
    h = np.where(ok[..., None], _silu(g) * u, np.nan)
    hs = _silu(x @ _deq(a["shared_gate"], gs, bits).T) * (x @ _deq(a["shared_up"], gs, bits).T)
    return h, hs, ids, w


def oracle_down(a, gs, bits):
    """y [M, H] in float64 from a["h"], a["hs"], a["inds"], a["scores"]; an id outside [0, E) makes its token NaN."""
    inds = np.array(a["inds"])
    wd = _deq(a["down"], gs, bits)
    E = wd.shape[0]
    valid = (inds >= 0) & (inds < E)
    yd = np.einsum("mki,mkhi->mkh", _f64(a["h"]), wd[np.where(valid, inds, 0)])
    y = (yd * _f64(a["scores"])[..., None]).sum(axis=1)
    gate = 1.0 / (1.0 + np.exp(-_f64(a["logits"])[:, E:E + 1]))
    y = y + gate * (_f64(a["hs"]) @ _deq(a["shared_down"], gs, bits).T) + _f64(a["residual"])
    return np.where(valid.all(-1)[:, None], y, np.nan)


def rel_errors(got: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(norm-wise relative error, max |error| / max |ref|) over the rows the oracle defines."""
    keep = ~np.isnan(ref)
    assert np.array_equal(np.isnan(got), ~keep), "NaN where the oracle has a value (unwritten output?) or vice versa"
    d, r = got[keep] - ref[keep], ref[keep]
    return float(np.linalg.norm(d) / np.linalg.norm(r)), float(np.abs(d).max() / np.abs(r).max())


TOL_F32 = 2e-5  # the kernels accumulate in float32; gate/up writes float32 whatever x's dtype
TOL_NORMED = 1e-3  # a normalised bf16 x may round the other way from the oracle's in a few elements
TOL_OUT = {mx.float32: 2e-5, mx.bfloat16: 8e-3, mx.float16: 2e-3}  # down: one rounding to x's dtype


def _gate_up_tol(a):
    return TOL_NORMED if a["norm"] is not None and a["x"].dtype != mx.float32 else TOL_F32


def _check_gate_up(c, a, got):
    M, k, E, H, I, IS, gs, bits = c[:8]
    h, hs, ids, w = got
    h_ref, hs_ref, ids_ref, w_ref = oracle_gate_up(a, k, gs, bits)
    assert h.dtype == mx.float32 and ids.dtype == mx.int32 and w.dtype == mx.float32
    assert np.array_equal(np.array(ids), ids_ref), f"{_id(c)}: routing {np.array(ids)} != {ids_ref}"
    assert rel_errors(_f64(w), w_ref)[0] < 1e-6
    tol = _gate_up_tol(a)
    errs = rel_errors(_f64(h), h_ref), rel_errors(_f64(hs), hs_ref)
    assert errs[0][0] < tol and errs[1][0] < tol, f"{_id(c)}: gate/up relative errors {errs}"
    return max(errs[0][1], errs[1][1])


def _check_down(c, a, y):
    dt, gs, bits = c[8], c[6], c[7]
    assert y.dtype == dt
    err = rel_errors(_f64(y), oracle_down(a, gs, bits))
    assert err[0] < TOL_OUT[dt], f"{_id(c)}: down relative error {err}"
    return err[1]


def _gate_up_args(a):
    nw = kernels.placeholder(a["x"].dtype) if a["norm"] is None else a["norm"][0]
    return [a["x"], nw, a["logits"], *a["gate"], *a["up"], *a["shared_gate"], *a["shared_up"]]


def _down_args(a):
    return [a["h"], a["hs"], a["inds"], a["scores"], a["logits"], *a["down"], *a["shared_down"], a["residual"]]


@pytest.mark.skipif(GXX is None, reason="g++ is not installed")
def test_metal_emulated_matches_oracle(tmp_path):
    """Both kernels' Metal sources on the CPU emulator (outputs start as NaN bytes), every case, one build; the
    cases whose weights pack also through the packed-weight variants, bit for bit the same."""
    emu, checks = Emulator(tmp_path, packed_twins=True), []
    for c, forced in EMULATED:
        M, k, E, H, I, IS, gs, bits, dt = c[:9]
        a = _case(c)
        p = moe.plan_gate_up(M, k, H, I, IS, bits, **(forced or {}))
        inst = moe.gate_up_instance(dt, mx.bfloat16, M, k, E, H, I, IS, bits, gs, plan=p, normalize=a["normalize"],
                                    norm_dtype=None if a["norm"] is None else dt, eps=1e-6)
        threads = 32 * p["WARPS"]
        emu.add(moe.GATE_UP_SPEC, inst, _gate_up_args(a), (p["blocks"] * threads, 1, 1), (threads, 1, 1),
                [(M, k, I), (M, IS), (M, k), (M, k)])
        p = moe.plan_down(M, k, H, I, IS, bits, **(forced or {}))
        inst = moe.down_instance(dt, mx.bfloat16, M, k, E, H, I, IS, bits, gs, plan=p)
        threads = 32 * p["WARPS"]
        emu.add(moe.DOWN_SPEC, inst, _down_args(a), (p["blocks"] * threads, 1, 1), (threads, 1, 1), [(M, H)])
        checks.append((c, a))
    outs = emu.run()
    worst = {}
    for i, (c, a) in enumerate(checks):
        gate_up, (y,) = outs[2 * i], outs[2 * i + 1]
        for which, err in (("gate_up", _check_gate_up(c, a, gate_up)), ("down", _check_down(c, a, y))):
            key = f"{which} {str(c[8]).split('.')[-1]}"
            worst[key] = max(worst.get(key, 0.0), err)
    print("emulated max |err| / max |ref|:", {k: f"{e:.1e}" for k, e in sorted(worst.items())})


def test_oracles_reject_wrong_answers():
    """The checks above can fail: a dropped shared expert, swapped experts, a wrong routing order."""
    c = CASES[2]
    a = _case(c)
    y = oracle_down(a, c[6], c[7])
    assert rel_errors(oracle_down(dict(a, hs=mx.zeros_like(a["hs"])), c[6], c[7]), y)[0] > 1e-2
    assert rel_errors(oracle_down(dict(a, inds=a["inds"][:, ::-1]), c[6], c[7]), y)[0] > 1e-2
    ids, _ = oracle_route(a, c[1])
    assert (ids[:, 0] == np.array(a["logits"][:, :c[2]].astype(mx.float32)).argmax(-1)).all()
    h = oracle_gate_up(a, c[1], c[6], c[7])[0]
    assert rel_errors(oracle_gate_up(dict(a, norm=None), c[1], c[6], c[7])[0], h)[0] > 1e-2
    with pytest.raises(AssertionError, match="NaN"):
        rel_errors(np.where(np.arange(y.size).reshape(y.shape) == 3, np.nan, y), y)


# ---- the model and the dispatcher (CPU) -------------------------------------------------------------

def _plain_moe_add_to(self, h, norm):
    # SparseMoeBlock before the fused path: separate router and shared-expert gate, the residual added after.
    x = norm(h)
    inds, scores = ops.moe_route(self.gate(x), self.top_k, self.norm_topk_prob)
    y = (self.switch_mlp(x, inds) * scores[..., None]).sum(axis=-2).astype(x.dtype)
    return h + (y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x))


def test_model_logits_match_the_plain_block(tiny_checkpoints, monkeypatch):
    """Prefill and a decode step of the 4-bit tiny model: the decode step goes through ops.moe_decode
    (on CPU its unfused fallback) and the logits match the plain block's to float32 rounding."""
    model, _ = lily_mlx.load_model(tiny_checkpoints[0]["mlx_q4"])
    calls = []
    real = ops.moe_decode
    monkeypatch.setattr(ops, "moe_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompt, step = mx.array([[5, 9, 33, 7, 101]]), mx.array([[42]])

    def run():
        cache = model.make_cache()
        first = model(prompt, cache=cache)
        return first, model(step, cache=cache)

    fused = run()
    assert len(calls) == 2 * len(model.layers), "ops.moe_decode was not taken at prefill and decode"
    with monkeypatch.context() as m:
        m.setattr(model_mod.SparseMoeBlock, "add_to", _plain_moe_add_to)
        plain = run()
    for f, p in zip(fused, plain):
        assert f.dtype == p.dtype and rel_errors(_f64(f), _f64(p))[0] < 1e-5
    layer, norm = model.layers[0].mlp, model.layers[0].post_attention_layernorm
    x = mx.zeros((1, 1, 64))
    sw, se = layer.switch_mlp, layer.shared_expert
    q = lambda l: (l["weight"], l["scales"], l["biases"])  # noqa: E731
    assert layer.router.current(), "router and shared-expert gate were not fused at load"
    assert moe.unsupported_gate_up(x, (norm["weight"], norm.eps), layer.router(x), q(sw.gate_proj), q(sw.up_proj),
                                   q(se.gate_proj), q(se.up_proj), layer.top_k, 32, 4) is None


def test_block_takes_the_fused_op_for_every_row_count_its_kernels_take(monkeypatch):
    """A batch of 8 rows at top-8 (64 expert slots, SwitchGLU's sorting threshold) still takes ops.moe_decode,
    whose kernels take up to 8 tokens; 9 rows take the sorted gather. Both paths give the plain block's output."""
    from bench import random_model
    from lily_mlx.config import ModelConfig
    from bench.step_dispatch import NARROW

    cfg = ModelConfig.from_dict(random_model.config_json("35b-a3b", dict(NARROW, num_hidden_layers=4), 0, 4, 64, "float32"))
    model = model_mod.Model(cfg)  # quantized as a checkpoint is (4-bit, the router 8-bit), projections fused
    nn.quantize(model, class_predicate=lambda p, m: model.quant_predicate(p, m) if hasattr(m, "to_quantized") else False)
    model.fuse_projections()
    block, norm = model.layers[0].mlp, model.layers[0].post_attention_layernorm
    assert block.top_k == 8 and ops.DECODE_KERNEL_ROWS == 8
    calls = []
    real = ops.moe_decode
    monkeypatch.setattr(ops, "moe_decode", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    for rows in (8, 9):
        h = mx.random.normal((rows, 1, cfg.hidden_size), key=mx.random.key(rows))
        got = block.add_to(h, norm)
        with monkeypatch.context() as m:
            m.setattr(model_mod.SparseMoeBlock, "add_to", _plain_moe_add_to)
            want = block.add_to(h, norm)
        assert rel_errors(_f64(got), _f64(want))[0] < 1e-5
    assert calls == [8]


def _raising_kernel(*args, **kwargs):
    raise AssertionError("a moe kernel ran where the unfused ops should")


def _moe_decode(a, c, router=None):
    return ops.moe_decode(a["x"], None if a["norm"] is None else a["norm"][0], 1e-6, a["logits"], a["gate"], a["up"],
                          a["down"], a["shared_gate"], a["shared_up"], a["shared_down"], top_k=c[1],
                          normalize=a["normalize"], group_size=c[6], bits=c[7], router=router)


@pytest.mark.parametrize("name", ["moe_gate_up", "moe_down_combine"])
def test_dispatch_switch_and_never_on_cpu(name, monkeypatch):
    c = CASES[2]
    a = _case(c)
    # kept off: no GPU here (moe_route: the unfused fallback's router)
    other = {"moe_down_combine" if name == "moe_gate_up" else "moe_gate_up", "moe_route"}
    monkeypatch.setitem(ops._kernels, name, _raising_kernel)
    monkeypatch.setattr(ops, "backend", lambda: "cuda")
    monkeypatch.setattr(ops, "_disabled", {name, *other})
    out = _moe_decode(a, c)  # switched off: the unfused ops
    monkeypatch.setattr(ops, "_disabled", set(other))
    with pytest.raises(AssertionError, match="kernel ran"):
        _moe_decode(a, c)
    monkeypatch.setattr(ops, "backend", lambda: "cpu")
    monkeypatch.setattr(ops, "_disabled", set())
    assert mx.array_equal(out, _moe_decode(a, c)).item()


def test_unfused_composition_matches_the_oracle():
    c = (3, 2, 5, 128, 64, 192, 64, 4, mx.float32, None, True)
    a = _case(c)
    gs, bits = c[6], c[7]
    ids, w = oracle_route(a, c[1])
    xn = reference.rms_norm(a["x"], a["norm"][0], 1e-6)
    inds, scores = ops.moe_route(a["logits"][:, :c[2]], c[1], True)
    h, hs = moe.gate_up_unfused(xn, inds, a["gate"], a["up"], a["shared_gate"], a["shared_up"], group_size=gs, bits=bits)
    h_ref, hs_ref, ids_ref, _ = oracle_gate_up(a, c[1], gs, bits)
    # moe_route's slot order is unspecified: line its slots up with the oracle's (descending logits)
    pos = np.array([[list(np.array(inds)[m]).index(e) for e in ids_ref[m]] for m in range(3)])
    assert rel_errors(_f64(h)[np.arange(3)[:, None], pos], h_ref)[0] < 1e-5 and rel_errors(_f64(hs), hs_ref)[0] < 1e-5
    y = _moe_decode(a, c)
    b = dict(a, h=mx.array(h_ref.astype(np.float32)), hs=mx.array(hs_ref.astype(np.float32)),
             inds=mx.array(ids_ref.astype(np.int32)), scores=mx.array(w.astype(np.float32)), residual=a["x"])
    assert rel_errors(_f64(y), oracle_down(b, gs, bits))[0] < 1e-5


def test_unsupported_arguments_are_declined():
    c = CASES[0]
    a = _case(c)
    gu = (a["x"], None, a["logits"], a["gate"], a["up"], a["shared_gate"], a["shared_up"])
    assert moe.unsupported_gate_up(*gu, 2, 32, 4) is None
    assert "bits" in moe.unsupported_gate_up(*gu, 2, 32, 2)
    assert "group_size" in moe.unsupported_gate_up(*gu, 2, 16, 4)
    assert "tokens" in moe.unsupported_gate_up(mx.zeros((9, 64)), None, mx.zeros((9, 6)), *gu[3:], 2, 32, 4)
    assert "top-k" in moe.unsupported_gate_up(*gu, 6, 32, 4)
    assert "logits" in moe.unsupported_gate_up(gu[0], None, a["logits"][:, :4], *gu[3:], 2, 32, 4)
    assert "norm" in moe.unsupported_gate_up(gu[0], (mx.ones((32,)), 1e-6), *gu[2:], 2, 32, 4)
    mixed = (a["shared_gate"][0], a["shared_gate"][1].astype(mx.float32), a["shared_gate"][2])
    assert "pointer type" in moe.unsupported_gate_up(*gu[:5], mixed, a["shared_up"], 2, 32, 4)
    assert moe.unsupported_gate_up(*gu, 2, 64, 4) == "shapes"  # scales are per 32 columns
    dn = _down_args(a)[:5] + [a["down"], a["shared_down"], a["residual"]]
    assert moe.unsupported_down(*dn, 32, 4) is None
    assert moe.unsupported_down(a["h"][:, :1], *dn[1:], 32, 4) == "shapes"
    assert "logits" in moe.unsupported_down(*dn[:4], a["logits"][:, :5], *dn[5:], 32, 4)  # no shared-gate column
    big = (mx.zeros((1, 2, 4096)), mx.zeros((1, 4096)), a["inds"][:1], a["scores"][:1], a["logits"][:1],
           _quant(np.random.default_rng(0), (5,), 64, 4096, 32, 4), _quant(np.random.default_rng(1), (), 64, 4096, 32, 4),
           a["residual"][:1])
    assert "staged" in moe.unsupported_down(*big, 32, 4)
    assert moe.gate_up(mx.zeros((9, 64)), None, mx.zeros((9, 6)), *gu[3:], top_k=2, normalize=True, group_size=32,
                       bits=4, backend="cuda") is None


@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("shape", [(8, 2048, 512, 512), (2, 64, 32, 96), (10, 4096, 1024, 1024), (2, 96, 64, 32)])
@pytest.mark.parametrize("bits", [4, 8])
def test_plans_respect_kernel_limits(M, shape, bits):
    k, H, I, IS = shape
    cpc = 128 // bits
    p = moe.plan_gate_up(M, k, H, I, IS, bits)
    assert (H // cpc) % p["LANES"] == 0 and p["WARPS"] >= 4
    rb = p["WARPS"] * (32 // p["LANES"]) * p["RPS"]
    assert p["blocks"] == M * k * math.ceil(I / rb) + M * math.ceil(IS / rb)
    p = moe.plan_down(M, k, H, I, IS, bits)
    assert (I // cpc) % p["LANES"] == 0 and (IS // cpc) % p["LANES"] == 0
    assert p["blocks"] == M * math.ceil(H / (p["WARPS"] * (32 // p["LANES"]) * p["RPS"]))


# ---- on the GPU (cuda / metal) ----------------------------------------------------------------------

def _gpu_check(backend, c):
    M, k, E, H, I, IS, gs, bits, dt = c[:9]
    a = _case(c)
    got = moe.gate_up(a["x"], a["norm"], a["logits"], a["gate"], a["up"], a["shared_gate"], a["shared_up"], top_k=k,
                      normalize=a["normalize"], group_size=gs, bits=bits, backend=backend, init_value=NAN)
    _check_gate_up(c, a, got)
    y = moe.down_combine(*_down_args(a)[:5], a["down"], a["shared_down"], a["residual"], group_size=gs, bits=bits,
                         backend=backend, init_value=NAN)
    _check_down(c, a, y)


def _gpu_chain_at_model_shape(backend, M, dt):
    """35B-A3B's MoE (E 256, H 2048, I = Is = 512, top-8, group 64, the norm inside): gate/up kernel ->
    down kernel against the oracle, and ops.moe_decode taking both kernels."""
    c = (M, 8, 256, 2048, 512, 512, 64, 4, dt, None, True)
    a = _case(c, seed=M)
    got = moe.gate_up(a["x"], a["norm"], a["logits"], a["gate"], a["up"], a["shared_gate"], a["shared_up"], top_k=8,
                      normalize=True, group_size=64, bits=4, backend=backend, init_value=NAN)
    _check_gate_up(c, a, got)
    b = dict(a, h=got[0], hs=got[1], inds=got[2], scores=got[3], residual=a["x"])
    y = moe.down_combine(*_down_args(b)[:5], a["down"], a["shared_down"], a["x"], group_size=64, bits=4,
                         backend=backend, init_value=NAN)
    _check_down(c, b, y)
    assert mx.array_equal(_moe_decode(a, c), y).item(), "ops.moe_decode did not take the kernels"


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_moe_kernels_cuda(case):
    _gpu_check("cuda", case)


@pytest.mark.cuda
@pytest.mark.parametrize("M,dt", [(1, mx.bfloat16), (3, mx.bfloat16), (8, mx.float32), (1, mx.float16)])
def test_moe_kernels_cuda_model_shape(M, dt):
    _gpu_chain_at_model_shape("cuda", M, dt)


@pytest.mark.metal
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_moe_kernels_metal(case):
    _gpu_check("metal", case)


@pytest.mark.metal
@pytest.mark.parametrize("M,dt", [(1, mx.bfloat16), (3, mx.float32)])
def test_moe_kernels_metal_model_shape(M, dt):
    _gpu_chain_at_model_shape("metal", M, dt)


@pytest.mark.cuda
@pytest.mark.parametrize("dt", [mx.float32, mx.bfloat16])
def test_prefill_experts_dequantized_gemm_cuda(dt):
    """ops.gather_matmul on many sorted rows (the prefill experts) takes dequantize + grouped GEMM on CUDA;
    it agrees with the quantized gather and with the float32 oracle, at the model's widths and 256 experts."""
    E, N, K, rows = 256, 512, 2048, 2048 * 8
    assert rows >= ops.DEQUANT_GEMM_MIN_ROWS
    q, s, b = mx.quantize(mx.random.normal((E, N, K), key=mx.random.key(0)) * 0.05, group_size=64, bits=4)
    s, b = s.astype(mx.bfloat16), b.astype(mx.bfloat16)
    idx = mx.sort(mx.random.randint(0, E - 3, (rows,), key=mx.random.key(1)))  # the last 3 experts get no rows
    x = mx.random.normal((rows, 1, K), key=mx.random.key(2)).astype(dt)
    kw = dict(scales=s, biases=b, group_size=64, bits=4, sorted_indices=True)
    with ops.disabled("moe_gemm"):  # moe_gemm has tests of its own (test_moe_gemm.py)
        got = ops.gather_matmul(x, q, idx, **kw)
        with ops.disabled("moe_dequant_gemm"):
            quantized = ops.gather_matmul(x, q, idx, **kw)
    want = reference.gather_matmul_oracle(x[:4096], q, idx[:4096], scales=s, biases=b, group_size=64, bits=4)
    tol = 3e-3 if dt == mx.float32 else 1e-2  # float32 GEMMs run in TF32 on CUDA by default
    for y, ref in ((got, quantized), (got[:4096], want)):
        yf, rf = y.astype(mx.float32), ref.astype(mx.float32)
        assert y.shape == ref.shape and not mx.isnan(yf).any().item()
        assert (mx.linalg.norm(yf - rf) / mx.linalg.norm(rf)).item() < tol


# ---- the packed pair (moe_packed): gate/up's four outputs and down's four inputs as one float32 buffer ------------

def _pack(h, hs, inds, weights):
    """The layout moe.packed_width describes, built with MLX ops: a token's h, hs, ids (as floats), weights."""
    lead = hs.shape[:-1]
    ids = inds.astype(mx.float32)
    return mx.concatenate([h.astype(mx.float32).reshape(*lead, -1), hs.astype(mx.float32), ids,
                           weights.astype(mx.float32)], axis=-1)


def _unpack(packed, k, I, IS):
    lead = packed.shape[:-1]
    h, hs = packed[..., :k * I].reshape(*lead, k, I), packed[..., k * I:k * I + IS]
    ids = packed[..., k * I + IS:k * I + IS + k].astype(mx.int32)
    return h, hs, ids, packed[..., k * I + IS + k:]


PACKED_EMULATED = [CASES[1], CASES[5], CASES[7]]  # forced routing, a NaN row (its ids and slots), k = 3 of 40


@pytest.mark.skipif(GXX is None, reason="g++ is not installed")
def test_packed_pair_emulated_matches_oracle(tmp_path):
    """moe_gate_up_packed's buffer, unpacked by the layout, against the oracle; moe_down_combine_packed reading a
    buffer packed by the layout (the case's own h, hs, ids, weights) against the oracle; with packed weights too."""
    emu, checks = Emulator(tmp_path, packed_twins=True), []
    for c in PACKED_EMULATED:
        M, k, E, H, I, IS, gs, bits, dt = c[:9]
        a = _case(c)
        p = moe.plan_gate_up(M, k, H, I, IS, bits)
        inst = moe.gate_up_instance(dt, mx.bfloat16, M, k, E, H, I, IS, bits, gs, plan=p, normalize=a["normalize"],
                                    norm_dtype=None if a["norm"] is None else dt, eps=1e-6)
        threads = 32 * p["WARPS"]
        emu.add(moe.GATE_UP_PACKED_SPEC, moe._packed(inst, False), _gate_up_args(a), (p["blocks"] * threads, 1, 1),
                (threads, 1, 1), [(M, moe.packed_width(k, I, IS))])
        p = moe.plan_down(M, k, H, I, IS, bits)
        inst = moe._packed(moe.down_instance(dt, mx.bfloat16, M, k, E, H, I, IS, bits, gs, plan=p), True)
        threads = 32 * p["WARPS"]
        packed = _pack(a["h"], a["hs"], a["inds"], a["scores"])
        emu.add(moe.DOWN_PACKED_SPEC, inst, [packed, *_down_args(a)[4:]], (p["blocks"] * threads, 1, 1),
                (threads, 1, 1), [(M, H)])
        checks.append((c, a))
    outs = emu.run()
    for i, (c, a) in enumerate(checks):
        (packed,), (y,) = outs[2 * i], outs[2 * i + 1]
        _check_gate_up(c, a, _unpack(packed, c[1], c[4], c[5]))
        _check_down(c, a, y)


def test_packed_pair_is_opt_in_and_needs_both_kernels(monkeypatch):
    c = CASES[2]
    a = _case(c)
    calls = []
    monkeypatch.setitem(ops._kernels, "moe_packed", lambda *args, **kw: calls.append(kw) or None)
    for name in ("moe_gate_up", "moe_down_combine", "moe_route"):
        monkeypatch.setitem(ops._kernels, name, lambda *args, **kw: None)  # decline: the unfused ops run
    monkeypatch.setattr(ops, "backend", lambda: "cuda")
    want = _moe_decode(a, c)
    assert not calls  # opt-in
    with ops.switched("moe_packed", True):
        assert mx.array_equal(_moe_decode(a, c), want).item() and len(calls) == 1
        assert calls[0] == {"top_k": 2, "normalize": True, "group_size": 64, "bits": 4}
        with ops.disabled("moe_down_combine"):
            _moe_decode(a, c)
        assert len(calls) == 1


def test_packed_pair_declines_before_launching():
    """decode_packed checks both kernels apply before it launches either: 9 tokens is past MAX_M."""
    c = CASES[0]
    a = _case(c)
    x = mx.zeros((9, c[3]))
    assert moe.decode_packed(x, None, mx.zeros((9, c[2] + 1)), a["gate"], a["up"], a["down"], a["shared_gate"],
                             a["shared_up"], a["shared_down"], top_k=2, normalize=True, group_size=32, bits=4,
                             backend="cuda") is None
    assert moe.down_combine_packed(mx.zeros((1, 7)), a["logits"], a["down"], a["shared_down"], a["residual"], top_k=2,
                                   group_size=32, bits=4, backend="cuda") is None  # the buffer's width is wrong


def _gpu_packed(backend, c):
    """The packed pair against the four-array pair on the GPU: the same sums, so bit-identical in 16-bit outputs."""
    M, k, E, H, I, IS, gs, bits, dt = c[:9]
    a = _case(c)
    q = dict(group_size=gs, bits=bits, backend=backend, init_value=NAN)
    args = (a["x"], a["norm"], a["logits"], a["gate"], a["up"], a["shared_gate"], a["shared_up"])
    packed = moe.gate_up(*args, top_k=k, normalize=a["normalize"], packed=True, **q)
    parts = moe.gate_up(*args, top_k=k, normalize=a["normalize"], **q)
    for got, want in zip(_unpack(packed, k, I, IS), parts):
        assert mx.array_equal(got, want, equal_nan=True).item()
    y = moe.down_combine_packed(packed, a["logits"], a["down"], a["shared_down"], a["residual"], top_k=k, **q)
    want = moe.down_combine(*parts, a["logits"], a["down"], a["shared_down"], a["residual"], **q)
    if dt != mx.float32:
        assert mx.array_equal(y, want, equal_nan=True).item()
        return
    # float32 output keeps the last bits of each variant's FMA contractions (the H200: not bit-identical there)
    assert mx.array_equal(mx.isnan(y), mx.isnan(want)).item()
    live = ~mx.isnan(want)
    diff = mx.where(live, y - want, 0.0)
    err = (mx.linalg.norm(diff.flatten()) / mx.linalg.norm(mx.where(live, want, 0.0).flatten())).item()
    assert err < 1e-6, f"packed vs four-array down_combine: rel err {err:.2e}"


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_moe_packed_cuda(case):
    _gpu_packed("cuda", case)


@pytest.mark.metal
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_moe_packed_metal(case):
    _gpu_packed("metal", case)


# ---- moe_gate_up_routed: the router folded into gate/up ------------------------------------------------------------

# (case, router bits, router group): the nan-row case has no router (its logits are the case's own NaNs).
ROUTED = [(CASES[0], 8, 32), (CASES[1], 4, 32), (CASES[3], 8, 64), (CASES[6], 8, 64), (CASES[7], 4, 128)]


def _router(c, rbits, rgs, seed=1):
    """A quantized router [E + 1, H] (the shared-expert gate's row last) scaled so its logits spread over a few units."""
    M, k, E, H = c[:4]
    return (*_quant(np.random.default_rng(seed), (), E + 1, H, rgs, rbits), rbits, rgs)


def _check_routed(c, a, router, got):
    """The logits against the float64 oracle (x' times the dequantized router); then, routed by the kernel's own
    logits (a tie in T-rounded logits may go either way between two correct GEMVs), gate/up as _check_gate_up."""
    h, hs, ids, w, logits = got
    dt = c[8]
    assert logits.dtype == dt and logits.shape == (c[0], c[2] + 1)
    ref = _normed_x(a) @ _deq(router[:3], router[4], router[3]).T
    err = rel_errors(_f64(logits), ref)[0]
    assert err < (2e-5 if dt == mx.float32 and a["norm"] is None else 8e-3), f"{_id(c)}: router logits rel err {err}"
    return _check_gate_up(c, dict(a, logits=logits), (h, hs, ids, w))


def _routed_args(a, router):
    args = _gate_up_args(a)
    return args[:2] + list(router[:3]) + args[3:]


@pytest.mark.skipif(GXX is None, reason="g++ is not installed")
def test_routed_gate_up_emulated_matches_oracle(tmp_path):
    """moe_gate_up_routed's Metal source on the CPU emulator (outputs start as NaN bytes): 4- and 8-bit routers,
    groups 32-128, with and without the norm, at the planned launch and at the 35B-A3B gate/up plan; with packed
    weights too."""
    emu, checks = Emulator(tmp_path, packed_twins=True), []
    for (c, rbits, rgs), forced in [(r, None) for r in ROUTED] + [(ROUTED[2], {"rps": 2, "warps": 8})]:
        M, k, E, H, I, IS, gs, bits, dt = c[:9]
        a, router = _case(c), _router(c, rbits, rgs)
        p = moe.plan_gate_up(M, k, H, I, IS, bits, **(forced or {}))
        inst = moe.routed_instance(
            moe.gate_up_instance(dt, mx.bfloat16, M, k, E, H, I, IS, bits, gs, plan=p, normalize=a["normalize"],
                                 norm_dtype=None if a["norm"] is None else dt, eps=1e-6), rbits, rgs, mx.bfloat16)
        threads = 32 * p["WARPS"]
        emu.add(moe.ROUTED_SPEC, inst, _routed_args(a, router), (p["blocks"] * threads, 1, 1), (threads, 1, 1),
                [(M, k, I), (M, IS), (M, k), (M, k), (M, E + 1)])
        checks.append((c, a, router))
    for (c, a, router), got in zip(checks, emu.run()):
        _check_routed(c, a, router, got)


def test_router_fold_is_opt_in_and_falls_back(monkeypatch):
    """moe_router_fold is off by default; on, ops.moe_decode hands the router to it and feeds its logits to the down
    kernel; a declined fold runs the two-kernel path on the given logits."""
    c = CASES[2]
    a = _case(c)
    router = _router(c, 8, 64)
    seen = {}

    def fold(x, norm, r, *args, **kw):
        seen["router"] = r
        return None if seen.get("decline") else (*_gate_up_standin(a, c), a["logits"])

    def down(h, hs, inds, scores, logits, *args, **kw):
        seen["down_logits"] = logits
        return a["residual"]

    monkeypatch.setitem(ops._kernels, "moe_router_fold", fold)
    monkeypatch.setitem(ops._kernels, "moe_gate_up", lambda *args, **kw: _gate_up_standin(a, c))
    monkeypatch.setitem(ops._kernels, "moe_down_combine", down)
    monkeypatch.setattr(ops, "backend", lambda: "cuda")
    decode = lambda: _moe_decode(a, c, router=router)
    decode()
    assert "router" not in seen  # opt-in
    with ops.switched("moe_router_fold", True):
        assert mx.array_equal(decode(), a["residual"]).item() and seen["router"] is router
        assert seen["down_logits"] is a["logits"]
        seen["decline"], seen["down_logits"] = True, None
        decode()
        assert seen["down_logits"] is a["logits"]  # the fallback's logits: the ones given


def _gate_up_standin(a, c):
    M, k, E, H, I, IS = c[:6]
    return (mx.zeros((M, k, I)), mx.zeros((M, IS)), mx.zeros((M, k), dtype=mx.int32), mx.zeros((M, k)))


def _gpu_routed(backend, c, rbits, rgs):
    M, k, E, H, I, IS, gs, bits, dt = c[:9]
    a, router = _case(c), _router(c, rbits, rgs)
    got = moe.gate_up(a["x"], a["norm"], None, a["gate"], a["up"], a["shared_gate"], a["shared_up"], top_k=k,
                      normalize=a["normalize"], group_size=gs, bits=bits, backend=backend, init_value=NAN, router=router)
    _check_routed(c, a, router, got)


ROUTED_MODEL = [((M, 8, 256, 2048, 512, 512, 64, 4, dt, None, True), 8, 64) for M, dt in ((1, mx.bfloat16), (3, mx.float32))]


def routed_id(v) -> str:
    """pytest id of a (case, router bits, router group) parameter: the case's _id, the bits and group as they are."""
    return _id(v) if isinstance(v, tuple) else str(v)


@pytest.mark.cuda
@pytest.mark.parametrize("case,rbits,rgs", ROUTED + ROUTED_MODEL, ids=routed_id)
def test_routed_gate_up_cuda(case, rbits, rgs):
    _gpu_routed("cuda", case, rbits, rgs)


@pytest.mark.metal
@pytest.mark.parametrize("case,rbits,rgs", ROUTED + ROUTED_MODEL, ids=routed_id)
def test_routed_gate_up_metal(case, rbits, rgs):
    _gpu_routed("metal", case, rbits, rgs)


def _decode_with_router_fold(backend_marker: str) -> None:
    """The embedded 4-bit model in float32 (where a one-ulp logit rounding cannot flip a bf16 router tie), a prompt
    then 6 one-token steps with moe_router_fold on vs off, moe_chain (which takes the MoE block first; on by default
    on CUDA) off: the fold is taken, and the step logits agree."""
    err = decode_rel_err("moe_router_fold", dtype=mx.float32, superseded_by=("moe_chain",))
    assert err < 1e-4, f"{backend_marker}: decode logits with moe_router_fold: rel err {err:.2e}"


@pytest.mark.cuda
def test_decode_with_router_fold_cuda():
    _decode_with_router_fold("cuda")


@pytest.mark.metal
def test_decode_with_router_fold_metal():
    _decode_with_router_fold("metal")


def test_router_fold_declines_what_it_cannot_compute():
    """unsupported_router names the problem: the router's bits and group, its rows (the shared-expert gate's row
    must follow the E experts'), and the threadgroup memory its logits take beside the staged x'."""
    c = CASES[2]
    M, k, E, H = c[:4]
    a, router = _case(c), _router(c, 8, 64)
    x = a["x"]
    assert moe.unsupported_router(x, router, E) is None
    assert "bits=3" in moe.unsupported_router(x, (*router[:3], 3, 64), E)
    assert "rows" in moe.unsupported_router(x, tuple(r[:E] for r in router[:3]) + router[3:], E)  # no gate row
    wide = _quant(np.random.default_rng(2), (), moe.MAX_ROUTER_ROWS, 7168, 64, 8)
    assert "threadgroup memory" in moe.unsupported_router(mx.zeros((1, 7168)), (*wide, 8, 64), E)
    assert moe.gate_up(x, a["norm"], None, a["gate"], a["up"], a["shared_gate"], a["shared_up"], top_k=k, normalize=True,
                       group_size=c[6], bits=c[7], backend="cuda", router=(*router[:3], 3, 64)) is None
