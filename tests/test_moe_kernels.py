"""The fused MoE decode kernels (moe_gate_up, moe_down_combine) against a float64 oracle.

CPU: both kernels' Metal sources run by the shim's SIMT emulator (tests/metal_shim), the model's
logits through the op entries (their unfused fallback) bit-identical to the plain block, and the
dispatcher rules. `cuda` / `metal`: the same cases through MLX on the GPU.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

import lily_mlx
import lily_mlx.ops as ops
from lily_mlx import model as model_mod
from lily_mlx.ops import kernels, moe, reference
from emulator import ATTRIBUTE, GXX, SHIM_DIR, metal_unit
from emulator import MAIN as EMULATOR_MAIN, case_source as _emulator_call, run as _run, to_numpy as _to_numpy

NAN = float("nan")

# (M, k, E, H, I, Is, group, bits, x dtype, experts of the tokens or None for random).
# Planned lanes per row: gate/up 2, 1, 4, 32, 2, 4, 4; down 1, 1, 2, 2, 16, 2, 2. Two tokens share
# expert 3 in the second case; an id outside [0, E) (5, 7) must turn its slot (gate/up) or its token
# (down) into NaN.
CASES = [
    (1, 2, 5, 64, 32, 96, 32, 4, mx.float32, None),
    (3, 2, 7, 96, 64, 32, 32, 4, mx.bfloat16, [[3, 1], [6, 3], [0, 2]]),
    (3, 2, 5, 128, 64, 192, 64, 4, mx.bfloat16, None),
    (1, 2, 7, 2048, 64, 128, 64, 4, mx.bfloat16, None),
    (2, 2, 5, 64, 512, 512, 64, 4, mx.bfloat16, None),
    (2, 2, 5, 64, 32, 64, 32, 8, mx.float32, [[4, 5], [0, 1]]),
    (3, 2, 7, 128, 64, 128, 64, 4, mx.float32, [[1, 2], [7, 0], [2, 1]]),
]

# The emulated runs: every case at its planned launch, and two at forced rows per lane segment and
# warps (the 35B-A3B gate/up plan is RPS 2, WARPS 8; the small shapes plan RPS 1, WARPS 4).
EMULATED = [(c, None, None) for c in CASES] + [(CASES[3], 2, 8), (CASES[2], 4, 8)]


def _id(c):
    M, k, E, H, I, IS, gs, bits, dt, _ = c
    return f"M{M}-k{k}-E{E}-H{H}-I{I}-Is{IS}-g{gs}-b{bits}-{str(dt).split('.')[-1]}"


def _quant(rng, lead, rows, cols, gs, bits):
    """Random MLX affine codes [*lead, rows, cols*bits/32] with bf16 scales and biases centring them."""
    w = mx.array(rng.integers(0, 1 << 32, (*lead, rows, cols * bits // 32), dtype=np.uint32))
    s = rng.uniform(0.5, 1.5, (*lead, rows, cols // gs)) * (0.1 / (1 << bits))
    b = -s * ((1 << bits) / 2) + 0.01 * rng.standard_normal(s.shape)
    return w, mx.array(s.astype(np.float32)).astype(mx.bfloat16), mx.array(b.astype(np.float32)).astype(mx.bfloat16)


def _normal(rng, shape, dtype=mx.float32):
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def _case(c, seed=0):
    M, k, E, H, I, IS, gs, bits, dt, experts = c
    rng = np.random.default_rng(seed)
    if experts is None:
        experts = np.argsort(rng.uniform(size=(M, E)), axis=-1)[:, :k]
    scores = rng.uniform(0.1, 1.0, (M, k))
    return {
        "x": _normal(rng, (M, H), dt),
        "inds": mx.array(np.asarray(experts, dtype=np.int32)),
        "gate": _quant(rng, (E,), I, H, gs, bits), "up": _quant(rng, (E,), I, H, gs, bits),
        "shared_gate": _quant(rng, (), IS, H, gs, bits), "shared_up": _quant(rng, (), IS, H, gs, bits),
        "down": _quant(rng, (E,), H, I, gs, bits), "shared_down": _quant(rng, (), H, IS, gs, bits),
        "scores": mx.array((scores / scores.sum(-1, keepdims=True)).astype(np.float32)),
        "logit": _normal(rng, (M, 1), dt),
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


def oracle_gate_up(a, gs, bits):
    """(h [M, k, I], hs [M, Is]) in float64; a slot with an id outside [0, E) is NaN."""
    x, inds = _f64(a["x"]), np.array(a["inds"])
    wg, wu = _deq(a["gate"], gs, bits), _deq(a["up"], gs, bits)
    E = wg.shape[0]
    ok = (inds >= 0) & (inds < E)
    sel = np.where(ok, inds, 0)
    g = np.einsum("mh,mkih->mki", x, wg[sel])
    u = np.einsum("mh,mkih->mki", x, wu[sel])
    h = np.where(ok[..., None], _silu(g) * u, np.nan)
    hs = _silu(x @ _deq(a["shared_gate"], gs, bits).T) * (x @ _deq(a["shared_up"], gs, bits).T)
    return h, hs


def oracle_down(a, gs, bits):
    """y [M, H] in float64 from a["h"], a["hs"]; a token with an id outside [0, E) is NaN."""
    inds = np.array(a["inds"])
    wd = _deq(a["down"], gs, bits)
    valid = (inds >= 0) & (inds < wd.shape[0])
    ok = valid.all(axis=-1)
    yd = np.einsum("mki,mkhi->mkh", _f64(a["h"]), wd[np.where(valid, inds, 0)])
    y = (yd * _f64(a["scores"])[..., None]).sum(axis=1)
    gate = 1.0 / (1.0 + np.exp(-_f64(a["logit"])))
    y = y + gate * (_f64(a["hs"]) @ _deq(a["shared_down"], gs, bits).T) + _f64(a["residual"])
    return np.where(ok[:, None], y, np.nan)


def rel_errors(got: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(norm-wise relative error, max |error| / max |ref|) over the rows the oracle defines."""
    keep = ~np.isnan(ref)
    assert np.array_equal(np.isnan(got), ~keep), "NaN where the oracle has a value (unwritten output?) or vice versa"
    d, r = got[keep] - ref[keep], ref[keep]
    return float(np.linalg.norm(d) / np.linalg.norm(r)), float(np.abs(d).max() / np.abs(r).max())


TOL_F32 = 2e-5  # the kernels accumulate in float32; gate/up writes float32 whatever x's dtype
TOL_OUT = {mx.float32: 2e-5, mx.bfloat16: 8e-3, mx.float16: 2e-3}  # down: one rounding to x's dtype


def _gate_up_args(a):
    return [a["x"], a["inds"], *a["gate"], *a["up"], *a["shared_gate"], *a["shared_up"]]


def _down_args(a):
    return [a["h"], a["hs"], a["inds"], a["scores"], a["logit"], *a["down"], *a["shared_down"], a["residual"]]


def _emulated_case(n, spec, inst, arrays, plan, out_shapes, tmp_path):
    for i, arr in enumerate(arrays):
        _to_numpy(arr).tofile(tmp_path / f"{n}_in{i}.bin")
    kname, src = kernels.full_source(spec, "metal", inst)
    threads = 32 * plan["WARPS"]
    call = _emulator_call(n, spec, inst, kname, arrays, (plan["blocks"] * threads, 1, 1), (threads, 1, 1), out_shapes)
    return kname, ATTRIBUTE.sub("", src), call


def _read(path, shape, dtype) -> np.ndarray:
    if dtype == mx.float32:
        return np.fromfile(path, dtype=np.float32).reshape(shape).astype(np.float64)
    raw = mx.array(np.fromfile(path, dtype=np.uint16)).view(dtype)
    return np.array(raw.astype(mx.float32)).reshape(shape).astype(np.float64)


@pytest.mark.skipif(GXX is None, reason="g++ is not installed")
def test_metal_emulated_matches_oracle(tmp_path):
    """Both kernels' Metal sources on the CPU emulator (outputs start as NaN bytes), every case, one build."""
    srcs, calls, checks = {}, [], []
    for c, rps, warps in EMULATED:
        M, k, E, H, I, IS, gs, bits, dt, _ = c
        a = _case(c)
        n = len(calls)
        plan = moe.plan_gate_up(M, k, H, I, IS, bits, rps, warps)
        inst = moe.gate_up_instance(dt, mx.bfloat16, M, k, E, H, I, IS, bits, gs, plan=plan)
        kname, src, call = _emulated_case(n, moe.GATE_UP_SPEC, inst, _gate_up_args(a), plan,
                                          [(M, k, I), (M, IS)], tmp_path)
        srcs[kname], calls = src, calls + [call]
        h_ref, hs_ref = oracle_gate_up(a, gs, bits)
        checks.append((n, c, "gate_up", [((M, k, I), mx.float32, h_ref), ((M, IS), mx.float32, hs_ref)], TOL_F32))
        n = len(calls)
        plan = moe.plan_down(M, k, H, I, IS, bits, rps, warps)
        inst = moe.down_instance(dt, mx.bfloat16, M, k, E, H, I, IS, bits, gs, plan=plan)
        kname, src, call = _emulated_case(n, moe.DOWN_SPEC, inst, _down_args(a), plan, [(M, H)], tmp_path)
        srcs[kname], calls = src, calls + [call]
        checks.append((n, c, "down", [((M, H), dt, oracle_down(a, gs, bits))], TOL_OUT[dt]))
    unit = tmp_path / "emulate.cpp"
    unit.write_text("#define METAL_SHIM_SIM 1\n" + metal_unit(moe.GATE_UP_SPEC, []) + "\n".join(srcs.values())
                    + EMULATOR_MAIN.replace("CASES", "\n".join(calls)))
    exe = tmp_path / "emulate"
    rc, log = _run([GXX, "-std=c++20", "-O1", "-pthread", "-Wno-attributes", f"-I{SHIM_DIR}", str(unit), "-o", str(exe)])
    assert rc == 0, f"emulator build failed:\n{log}"
    worst = {}
    for n, c, which, outs, tol in checks:
        rc, log = _run([str(exe), str(n), str(tmp_path)], timeout=300)
        assert rc == 0, f"emulated {which} {_id(c)} failed:\n{log}"
        for o, (shape, dtype, ref) in enumerate(outs):
            got = _read(tmp_path / f"{n}_out{o}.bin", shape, dtype)
            err, max_err = rel_errors(got, ref)
            assert err < tol, f"{which} {_id(c)} output {o}: relative error {err:.2e} >= {tol}"
            worst[which, str(dtype)] = max(worst.get((which, str(dtype)), 0.0), max_err)
    print("emulated max |err| / max |ref|:", {f"{w} {d}": f"{e:.1e}" for (w, d), e in sorted(worst.items())})


def test_oracle_rejects_a_wrong_kernel_answer():
    """The checks above can fail: a dropped shared expert or a swapped expert is far outside tolerance."""
    c = CASES[2]
    a = _case(c)
    y = oracle_down(a, c[6], c[7])
    b = dict(a, hs=mx.zeros_like(a["hs"]))
    assert rel_errors(oracle_down(b, c[6], c[7]), y)[0] > 1e-2
    b = dict(a, inds=a["inds"][:, ::-1])
    h, _ = oracle_gate_up(a, c[6], c[7])
    assert rel_errors(oracle_gate_up(b, c[6], c[7])[0], h)[0] > 1e-2
    with pytest.raises(AssertionError, match="NaN"):
        rel_errors(np.where(np.arange(y.size).reshape(y.shape) == 3, np.nan, y), y)


# ---- the model and the dispatcher (CPU) -------------------------------------------------------------

def _plain_decoder_layer(self, x, mask=None, cache=None):
    # DecoderLayer.__call__ before the fused path: the MoE block without the residual, added after.
    mixer = self.linear_attn if self.is_linear else self.self_attn
    h = x + mixer(self.input_layernorm(x), mask, cache)
    return h + self.mlp(self.post_attention_layernorm(h))


def test_model_logits_unchanged_through_the_op_entries(tiny_checkpoints, monkeypatch):
    """Prefill and a decode step of the 4-bit tiny model: through ops.moe_gate_up / moe_down_combine
    (on CPU their unfused fallback) the logits are bit-identical to the plain block's."""
    model, _ = lily_mlx.load_model(tiny_checkpoints[0]["mlx_q4"])
    calls = []
    real = ops.moe_gate_up
    monkeypatch.setattr(ops, "moe_gate_up", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompt, step = mx.array([[5, 9, 33, 7, 101]]), mx.array([[42]])

    def run():
        cache = model.make_cache()
        first = model(prompt, cache=cache)
        return first, model(step, cache=cache)

    fused = run()
    assert len(calls) == 2 * len(model.layers), "the op entries were not taken at prefill and decode"
    with monkeypatch.context() as m:
        m.setattr(model_mod.DecoderLayer, "__call__", _plain_decoder_layer)
        plain = run()
    assert len(calls) == 2 * len(model.layers)
    for f, p in zip(fused, plain):
        assert f.dtype == p.dtype and mx.array_equal(f, p).item()
    layer = model.layers[0].mlp
    x = mx.zeros((1, 1, 64))
    inds, _ = ops.moe_route(layer.gate(x), layer.top_k, layer.norm_topk_prob)
    sw, se = layer.switch_mlp, layer.shared_expert
    q = lambda l: (l["weight"], l["scales"], l["biases"])  # noqa: E731
    assert moe.unsupported_gate_up(x, inds, q(sw.gate_proj), q(sw.up_proj), q(se.gate_proj), q(se.up_proj), 32, 4) is None


def _raising_kernel(*args, **kwargs):
    raise AssertionError("a moe kernel ran where the unfused ops should")


@pytest.mark.parametrize("name", ["moe_gate_up", "moe_down_combine"])
def test_dispatch_switch_and_never_on_cpu(name, monkeypatch):
    c = CASES[0]
    a = _case(c)
    entry = {"moe_gate_up": lambda: ops.moe_gate_up(a["x"], a["inds"], a["gate"], a["up"], a["shared_gate"],
                                                    a["shared_up"], group_size=c[6], bits=c[7]),
             "moe_down_combine": lambda: ops.moe_down_combine(a["h"], a["hs"], a["inds"], a["scores"], a["logit"],
                                                              a["down"], a["shared_down"], a["residual"],
                                                              group_size=c[6], bits=c[7])}[name]
    monkeypatch.setitem(ops._kernels, name, _raising_kernel)
    monkeypatch.setattr(ops, "_disabled", {name})
    monkeypatch.setattr(ops, "backend", lambda: "cuda")
    assert not ops.enabled(name)
    out = entry()  # switched off: the unfused ops
    monkeypatch.setattr(ops, "_disabled", set())
    with pytest.raises(AssertionError, match="kernel ran"):
        entry()
    monkeypatch.setattr(ops, "backend", lambda: "cpu")
    again = entry()
    for o, p in zip(out if isinstance(out, tuple) else (out,), again if isinstance(again, tuple) else (again,)):
        assert mx.array_equal(o, p).item()


def test_unfused_ops_match_the_oracle():
    c = (3, 2, 5, 128, 64, 192, 64, 4, mx.float32, None)
    a = _case(c)
    gs, bits = c[6], c[7]
    h, hs = moe.gate_up_unfused(a["x"], a["inds"], a["gate"], a["up"], a["shared_gate"], a["shared_up"],
                                group_size=gs, bits=bits)
    h_ref, hs_ref = oracle_gate_up(a, gs, bits)
    assert h.shape == h_ref.shape and hs.shape == hs_ref.shape
    assert rel_errors(_f64(h), h_ref)[0] < 1e-5 and rel_errors(_f64(hs), hs_ref)[0] < 1e-5
    y = moe.down_combine_unfused(a["h"], a["hs"], a["inds"], a["scores"], a["logit"], a["down"], a["shared_down"],
                                 a["residual"], group_size=gs, bits=bits)
    assert y.shape == a["residual"].shape and y.dtype == a["residual"].dtype
    assert rel_errors(_f64(y), oracle_down(a, gs, bits))[0] < 1e-5


def test_unsupported_arguments_are_declined():
    a = _case(CASES[0])
    gu = (a["x"], a["inds"], a["gate"], a["up"], a["shared_gate"], a["shared_up"])
    assert moe.unsupported_gate_up(*gu, 32, 4) is None
    assert "bits" in moe.unsupported_gate_up(*gu, 32, 2)
    assert "group_size" in moe.unsupported_gate_up(*gu, 16, 4)
    assert "tokens" in moe.unsupported_gate_up(mx.zeros((9, 64)), mx.zeros((9, 2), mx.int32), *gu[2:], 32, 4)
    assert moe.unsupported_gate_up(a["x"], a["inds"].astype(mx.float32), *gu[2:], 32, 4) == "dtypes"
    mixed = (a["shared_gate"][0], a["shared_gate"][1].astype(mx.float32), a["shared_gate"][2])
    assert "pointer type" in moe.unsupported_gate_up(*gu[:4], mixed, a["shared_up"], 32, 4)
    assert moe.unsupported_gate_up(*gu, 64, 4) == "shapes"  # scales are per 32 columns
    dn = (a["h"], a["hs"], a["inds"], a["scores"], a["logit"], a["down"], a["shared_down"], a["residual"])
    assert moe.unsupported_down(*dn, 32, 4) is None
    assert moe.unsupported_down(a["h"][:, :1], *dn[1:], 32, 4) == "shapes"
    assert moe.unsupported_down(*dn[:4], a["logit"][:, :0], *dn[5:], 32, 4) == "shapes"
    big = (mx.zeros((1, 2, 4096)), mx.zeros((1, 4096)), a["inds"][:1], a["scores"][:1], a["logit"][:1],
           _quant(np.random.default_rng(0), (5,), 64, 4096, 32, 4), _quant(np.random.default_rng(1), (), 64, 4096, 32, 4),
           a["residual"][:1])
    assert "staged" in moe.unsupported_down(*big, 32, 4)
    assert moe.gate_up(mx.zeros((9, 64)), mx.zeros((9, 2), mx.int32), *gu[2:], group_size=32, bits=4,
                       backend="cuda") is None


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
    M, k, E, H, I, IS, gs, bits, dt, _ = c
    a = _case(c)
    h, hs = moe.gate_up(a["x"], a["inds"], a["gate"], a["up"], a["shared_gate"], a["shared_up"], group_size=gs,
                        bits=bits, backend=backend, init_value=NAN)
    h_ref, hs_ref = oracle_gate_up(a, gs, bits)
    assert h.dtype == mx.float32 and rel_errors(_f64(h), h_ref)[0] < TOL_F32
    assert rel_errors(_f64(hs), hs_ref)[0] < TOL_F32
    y = moe.down_combine(*_down_args(a)[:5], a["down"], a["shared_down"], a["residual"], group_size=gs, bits=bits,
                         backend=backend, init_value=NAN)
    assert y.dtype == dt and rel_errors(_f64(y), oracle_down(a, gs, bits))[0] < TOL_OUT[dt]


def _gpu_chain_at_model_shape(backend, M, dt):
    """35B-A3B's MoE (E 256, H 2048, I = Is = 512, top-8, group 64): gate/up kernel -> down kernel,
    with moe_route's uint32 ids, against the oracle; also through the ops entries once opted in."""
    c = (M, 8, 256, 2048, 512, 512, 64, 4, dt, None)
    a = _case(c, seed=M)
    a["inds"] = a["inds"].astype(mx.uint32)
    h, hs = moe.gate_up(a["x"], a["inds"], a["gate"], a["up"], a["shared_gate"], a["shared_up"], group_size=64,
                        bits=4, backend=backend, init_value=NAN)
    h_ref, hs_ref = oracle_gate_up(a, 64, 4)
    assert rel_errors(_f64(h), h_ref)[0] < TOL_F32 and rel_errors(_f64(hs), hs_ref)[0] < TOL_F32
    a["h"], a["hs"] = h, hs
    y = moe.down_combine(*_down_args(a)[:5], a["down"], a["shared_down"], a["residual"], group_size=64, bits=4,
                         backend=backend, init_value=NAN)
    assert rel_errors(_f64(y), oracle_down(a, 64, 4))[0] < TOL_OUT[dt]
    for name in ("moe_gate_up", "moe_down_combine"):
        ops.set_enabled(name, True)
    try:
        h2, hs2 = ops.moe_gate_up(a["x"], a["inds"], a["gate"], a["up"], a["shared_gate"], a["shared_up"],
                                  group_size=64, bits=4)
        y2 = ops.moe_down_combine(h2, hs2, *_down_args(a)[2:5], a["down"], a["shared_down"], a["residual"],
                                  group_size=64, bits=4)
    finally:
        for name in ("moe_gate_up", "moe_down_combine"):
            ops._opted_in.discard(name)
    assert mx.array_equal(h2, h).item() and mx.array_equal(y2, y).item(), "the ops entries did not take the kernels"


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
