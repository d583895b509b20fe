"""deltanet_prep (the prefill DeltaNet mixer up to the delta rule, one launch) against the composition it replaces.

CPU: the kernel's Metal source run by the shim's SIMT emulator (outputs poisoned with NaN) on odd shapes, left-padded
rows and prompts shorter than the conv window; the mixer's launch count with it. GPU (`cuda`/`metal`): the same
checks through MLX at the model's shape and T in 1, 63, 64, 65, 300, the mixer on vs off, and a whole-model prefill.
"""

from __future__ import annotations

import collections
import re

import mlx.core as mx
import pytest

from lily_mlx import ops
from lily_mlx.ops import deltanet_prep as dp
from lily_mlx.ops import kernels, reference
from emulator import GXX, Emulator
from switch_ab import prefill_rel_err

F32, BF16, F16 = mx.float32, mx.bfloat16, mx.float16
# Relative L2 error against the composition in the same dtype: float32 rounding; one 16-bit rounding step of the
# conv output or the SiLU landing the other way.
TOL = {F32: 1e-5, BF16: 1e-2, F16: 2e-3}
TOL_GATES = 1e-5


class Case:
    """Shapes (B, T, Hk, Hv, Dk, Dv, conv width W), dtypes (activations, conv weight, A_log, dt_bias), left padding
    per batch row (None: no mask)."""

    def __init__(self, B, T, Hk, Hv, Dk, Dv, W=4, dtypes=(F32,) * 4, pad=None):
        self.B, self.T, self.Hk, self.Hv, self.Dk, self.Dv, self.W = B, T, Hk, Hv, Dk, Dv, W
        self.dtypes, self.pad = dtypes, pad
        self.C = 2 * Hk * Dk + Hv * Dv

    def __repr__(self):
        names = "-".join(str(d).split(".")[-1] for d in self.dtypes[:2])
        return (f"B{self.B}-T{self.T}-Hk{self.Hk}-Hv{self.Hv}-Dk{self.Dk}-Dv{self.Dv}-W{self.W}-{names}"
                f"{'-padded' if self.pad else ''}")

    def arrays(self, seed=0):
        """(proj, conv_weight, conv_state, A_log, dt_bias, mask)"""
        T_, TW, TA, TD = self.dtypes
        k = mx.random.split(mx.random.key(seed), 5)
        proj = mx.random.normal((self.B, self.T, self.C + self.Hv * self.Dv + 2 * self.Hv), key=k[0]).astype(T_)
        conv_w = (mx.random.normal((self.C, self.W, 1), key=k[1]) * 0.5).astype(TW)
        conv_state = mx.random.normal((self.B, self.W - 1, self.C), key=k[2]).astype(T_)
        A_log = mx.random.uniform(-1.0, 1.0, (self.Hv,), key=k[3]).astype(TA)
        dt_bias = mx.random.normal((self.Hv,), key=k[4]).astype(TD)
        mask = None if self.pad is None else mx.arange(self.T)[None, :] >= mx.array(self.pad)[:, None]
        return proj, conv_w, conv_state, A_log, dt_bias, mask

    def out_shapes(self):
        B, T = self.B, self.T
        return [(B, T, self.Hk, self.Dk)] * 2 + [(B, T, self.Hv, self.Dv), (B, T, self.Hv), (B, T, self.Hv),
                                                 (B, self.W - 1, self.C)]


def _composition(case, proj, conv_w, conv_state, A_log, dt_bias, mask):
    """What ops.deltanet_mix computes before the delta rule without the kernel, on the CPU, as float32 q, k, v."""
    C, key_dim = case.C, case.Hk * case.Dk
    with mx.stream(mx.cpu):
        qkv = proj[..., :C]
        b = proj[..., C + case.Hv * case.Dv:C + case.Hv * case.Dv + case.Hv]
        a = proj[..., C + case.Hv * case.Dv + case.Hv:]
        if mask is not None:
            qkv = mx.where(mask[..., None], qkv, 0)
        conv_out, new_state = reference.causal_conv1d(qkv, conv_w, conv_state)
        q, k, v = mx.split(conv_out, [key_dim, 2 * key_dim], axis=-1)
        shape = (case.B, case.T, case.Hk, case.Dk)
        q, k, log_g, beta = ops._deltanet_qk_gates(q.reshape(shape), k.reshape(shape), a, b, A_log, dt_bias,
                                                   case.Dk**-0.5)
        log_g, beta = reference.masked_gates(log_g, beta, mask)
        out = (q, k, v.reshape(case.B, case.T, case.Hv, case.Dv).astype(F32), log_g, beta, new_state)
        mx.eval(out)
    return out


def _rel(x, ref):
    x, ref = x.astype(F32), ref.astype(F32)
    return (mx.linalg.norm((x - ref).flatten()) / mx.linalg.norm(ref.flatten())).item()


def _check(case, got, arrays):
    want = _composition(case, *arrays)
    names = ("q", "k", "v", "log_g", "beta", "conv state")
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{case} {name}: {g.dtype} {g.shape} != {w.dtype} {w.shape}"
        assert not mx.isnan(g.astype(F32)).any().item(), f"{case}: unwritten (NaN) {name}"
    assert mx.array_equal(got[5], want[5]).item(), f"{case}: the conv state differs from the composition's"
    errs = {n: _rel(g, w) for n, g, w in zip(names[:5], got[:5], want[:5])}
    tol = TOL[case.dtypes[0]]
    assert max(errs["q"], errs["k"], errs["v"]) < tol, f"{case}: rel err {errs}"
    assert max(errs["log_g"], errs["beta"]) < TOL_GATES, f"{case}: rel err {errs}"
    mask = arrays[-1]
    if mask is not None:  # a padding token is an exact no-op on the state
        pad = mx.logical_not(mask)[..., None]
        assert not mx.any(pad & ((got[3] != 0) | (got[4] != 0))).item(), f"{case}: a padding token has gates"
    return errs


# ---- the Metal source on the CPU (shim emulator) -------------------------------------------------

# Hk != Hv, Dk != Dv (Dk < 32, neither a multiple of 32), B 1 and 2, fp32/bf16/f16, a conv weight of another dtype,
# left-padded rows (one wholly padding), T = 1 and T shorter than the conv window (the state carries old rows).
EMULATED = [
    Case(1, 3, 2, 4, 32, 48),
    Case(2, 5, 1, 3, 64, 32, dtypes=(BF16, BF16, F32, BF16), pad=[0, 2]),
    Case(2, 2, 2, 6, 24, 40, dtypes=(BF16, F32, BF16, F32), pad=[2, 1]),
    Case(1, 1, 2, 4, 16, 24, W=3, dtypes=(F16, F16, F32, F16)),
]


@pytest.mark.skipif(GXX is None, reason="g++ is not installed")
def test_deltanet_prep_metal_emulated_matches_composition(tmp_path):
    emu, inputs = Emulator(tmp_path), []
    for c, case in enumerate(EMULATED):
        arrays = case.arrays(seed=c)
        inst = dp.instance(*case.dtypes, case.B, case.T, case.Hk, case.Hv, case.Dk, case.Dv, case.W,
                           case.pad is not None)
        launch_inputs = list(arrays[:5]) + [mx.array([True]) if arrays[5] is None else arrays[5]]
        emu.add(dp.SPEC, inst, launch_inputs, (case.B * case.T * 32 * dp.WARPS, 1, 1), (32 * dp.WARPS, 1, 1),
                case.out_shapes())
        inputs.append(arrays)
    worst = {repr(case): _check(case, tuple(got), arrays) for case, got, arrays in zip(EMULATED, emu.run(), inputs)}
    print("rel err against the composition:", worst)


def test_unsupported_arguments_are_declined():
    case = Case(1, 3, 2, 4, 32, 48)
    proj, conv_w, conv_state, A_log, dt_bias, _ = case.arrays()
    assert dp.unsupported(proj, conv_w, conv_state, A_log, dt_bias, 48, 2) is None
    assert "shapes" in dp.unsupported(proj, conv_w, conv_state, A_log, dt_bias, 48, 3)
    assert "mask" in dp.unsupported(proj, conv_w, conv_state, A_log, dt_bias, 48, 2, mx.ones((1, 2), dtype=mx.bool_))
    assert "dtypes" in dp.unsupported(proj, conv_w, conv_state.astype(BF16), A_log, dt_bias, 48, 2)
    assert "conv state" in dp.unsupported(proj, conv_w, conv_state[:, :2], A_log, dt_bias, 48, 2)


def test_mixer_launches_with_prep(monkeypatch, tmp_path):
    """The point of deltanet_prep: the prefill mixer's graph at the 35B head shapes (its kernels stood in, as in
    tests/test_decode_budget.py) holds 22 primitives that launch besides its 2 kernels, 8 besides its 3 with
    deltanet_prep (CPU's graph: its rms_norm decomposes, one launch on CUDA)."""
    views = {"Broadcast", "Reshape", "Squeeze", "Slice", "Split", "Transpose", "ExpandDims", "Depends"}
    launched = collections.Counter()

    def standin(name, backend, inputs, template, grid, group, output_shapes, output_dtypes, *rest):
        launched[name] += 1
        outs = [mx.broadcast_to(mx.array(0, dtype=d), s) for s, d in zip(output_shapes, output_dtypes)]
        return mx.depends(outs, list(inputs))

    monkeypatch.setattr(kernels, "call", standin)
    monkeypatch.setattr(ops, "backend", lambda: "cuda")
    case = Case(1, 512, 16, 32, 128, 128, dtypes=(BF16, BF16, F32, BF16))
    proj, conv_w, conv_state, A_log, dt_bias, _ = case.arrays()
    norm_w = mx.ones((case.Dv,), dtype=BF16)
    mx.eval(proj, conv_w, conv_state, A_log, dt_bias, norm_w)
    counts = []
    for on in (False, True):
        launched.clear()
        with ops.switched("deltanet_prep", on):
            outs = ops.deltanet_mix(proj, conv_w, conv_state, A_log, dt_bias, norm_w, None, num_key_heads=16, eps=1e-6)
        mx.export_to_dot(str(tmp_path / "g.dot"), *outs)
        nodes = re.findall(r'\[label ="([^"]+)", shape=rectangle\]', (tmp_path / "g.dot").read_text())
        counts.append(sum(n not in views for n in nodes))
        assert ("deltanet_prep" in launched) == on
    assert counts == [22, 8], counts


# ---- GPU: the kernel through MLX ------------------------------------------------------------------

MODEL_35B = (16, 32, 128, 128)
GPU_CASES = EMULATED + [
    Case(1, 1, *MODEL_35B, dtypes=(BF16, BF16, F32, BF16)),
    Case(1, 63, *MODEL_35B, dtypes=(BF16, BF16, F32, BF16)),
    Case(2, 64, *MODEL_35B, dtypes=(BF16, BF16, F32, BF16), pad=[0, 17]),
    Case(1, 65, *MODEL_35B),
    Case(3, 300, *MODEL_35B, dtypes=(F32,) * 4, pad=[0, 299, 5]),
    Case(2, 70, 2, 4, 256, 32, dtypes=(F16, F16, F32, F16)),
    Case(1, 33, 1, 1, 32, 256, W=2, dtypes=(BF16, F32, BF16, F32), pad=[3]),
]


def _gpu_cases(backend):
    for c, case in enumerate(GPU_CASES):
        proj, conv_w, conv_state, A_log, dt_bias, mask = arrays = case.arrays(seed=c)
        got = dp.deltanet_prep(proj, conv_w, conv_state, A_log, dt_bias, value_head_dim=case.Dv,
                               num_key_heads=case.Hk, mask=mask, backend=backend, init_value=float("nan"))
        assert got is not None, f"deltanet_prep declined {case}"
        mx.eval(got)
        _check(case, got, arrays)


@pytest.mark.cuda
def test_deltanet_prep_cuda():
    _gpu_cases("cuda")


@pytest.mark.metal
def test_deltanet_prep_metal():
    _gpu_cases("metal")


# The whole mixer with the kernel on vs off: the delta rule and the output norm see the same inputs up to rounding.
TOL_MIX = {F32: (2e-5, 2e-5), BF16: (2e-2, 1e-2)}


def _mix_on_vs_off(T, dtype):
    case = Case(2, T, *MODEL_35B, dtypes=(dtype, dtype, F32, dtype), pad=[0, T // 3])
    proj, conv_w, conv_state, A_log, dt_bias, mask = case.arrays(seed=T)
    norm_w = (1.0 + 0.2 * mx.random.normal((case.Dv,), key=mx.random.key(1))).astype(dtype)
    state = 0.1 * mx.random.normal((case.B, case.Hv, case.Dv, case.Dk), key=mx.random.key(2))
    runs = []
    for on in (False, True):
        with ops.switched("deltanet_prep", on):
            before = ops.declined.get("deltanet_prep", 0)
            out = ops.deltanet_mix(proj, conv_w, conv_state, A_log, dt_bias, norm_w, state, num_key_heads=case.Hk,
                                   eps=1e-6, mask=mask)
            mx.eval(out)
            assert ops.declined.get("deltanet_prep", 0) == before, "deltanet_prep declined the mixer's call"
            runs.append(out)
    (o_off, c_off, s_off), (o_on, c_on, s_on) = runs
    assert mx.array_equal(c_on, c_off).item(), "conv state differs with the kernel"
    real = mask[..., None]  # the padding tokens' outputs are never read
    errs = _rel(mx.where(real, o_on, 0), mx.where(real, o_off, 0)), _rel(s_on, s_off)
    tol = TOL_MIX[dtype]
    assert errs[0] < tol[0] and errs[1] < tol[1], f"T={T} {dtype}: rel err out, state {errs}"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 64, 300])
def test_mixer_with_prep_cuda(T, dtype):
    _mix_on_vs_off(T, dtype)


@pytest.mark.metal
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 64, 300])
def test_mixer_with_prep_metal(T, dtype):
    _mix_on_vs_off(T, dtype)


def _model_prefill_on_vs_off():
    err = prefill_rel_err("deltanet_prep")
    assert err < 2e-2, f"prefill logits with deltanet_prep: rel err {err:.2e}"


@pytest.mark.cuda
def test_model_prefill_with_prep_cuda():
    _model_prefill_on_vs_off()


@pytest.mark.metal
def test_model_prefill_with_prep_metal():
    _model_prefill_on_vs_off()
