"""deltanet_intra (the intra-chunk part of the chunked gated delta rule) against reference.chunk_intra.

CPU: the kernel's Metal source run by the shim's SIMT emulator on odd shapes, outputs poisoned with NaN; the
dispatcher's fallback and declines. GPU (`cuda`/`metal`): the kernel through MLX at odd shapes and the model's,
float32 and bfloat16 inputs; ops.gated_delta with both DeltaNet prefill kernels on vs off.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from lily_mlx import ops
from lily_mlx.ops import deltanet_intra as di
from lily_mlx.ops import reference
from emulator import GXX, Emulator
from test_deltanet_chunk import Case, _rel

F32, BF16 = mx.float32, mx.bfloat16
NAMES = ("u", "w", "q_dec", "qk", "k_dec", "g_last")
TOL = 2e-5  # relative L2 against the float32 reference: summation order, and the inverse by substitution
            # where the reference squares


def _inputs(case, seed, dtype, mask=None):
    q, k, v, log_g, beta, _ = case.inputs(seed, dtype)
    return q, k, v, *reference.masked_gates(log_g, beta, mask)


def _expected(case, args):
    with mx.stream(mx.cpu):
        parts = reference.chunk_intra(*args, chunk_size=case.C)[:6]
        mx.eval(parts)
    return parts


def _check(case, got, want, tol=TOL):
    assert len(got) == 6
    for name, x, ref in zip(NAMES, got, want):
        assert x.shape == ref.shape and x.dtype == F32, f"{case} {name}: {x.shape} {x.dtype}"
        assert not mx.isnan(x).any().item(), f"{case}: unwritten (NaN) {name}"
        # g_last = e^(G_C) can underflow: the H200 returns the denormal 1.4e-45 where the CPU returns 0
        err = (mx.linalg.norm((x - ref).flatten()) / max(mx.linalg.norm(ref.flatten()).item(), 1e-30)).item()
        assert err < tol, f"{case} {name}: rel err {err:.2e}"


# ---- the Metal source on the CPU (shim emulator) -------------------------------------------------

# Hk < Hv (two value heads per key head), Dk != Dv, Dk 20 not a multiple of the MMA's 8, Dv past one 32-wide
# tile, C 16 and 64, a padded tail (T not a multiple of C), B 2 with a left-padded row (masked gates), bf16 inputs.
EMULATED = [
    (Case(1, 1, 2, 24, 40, 16, 40), F32),
    (Case(2, 1, 1, 40, 24, 64, 70), F32),
    (Case(1, 1, 1, 20, 36, 16, 33), BF16),
    (Case(1, 1, 1, 128, 128, 64, 128), BF16),
]


@pytest.mark.skipif(GXX is None, reason="g++ is not installed")
def test_deltanet_intra_metal_emulated_matches_reference(tmp_path):
    emu, expected = Emulator(tmp_path), []
    for c, (case, dtype) in enumerate(EMULATED):
        mask = (mx.arange(case.T)[None, :] >= mx.array([[0], [5]])) if case.B == 2 else None
        args = _inputs(case, c, dtype, mask)
        inst = di.instance(dtype, case.B, case.T, case.Hk, case.Hv, case.Dk, case.Dv, case.C)
        N = case.N
        shapes = [(case.B, case.Hv, N, case.C, case.Dv), *[(case.B, case.Hv, N, case.C, case.Dk)] * 2,
                  (case.B, case.Hv, N, case.C, case.C), (case.B, case.Hv, N, case.C, case.Dk), (case.B, case.Hv, N)]
        emu.add(di.SPEC, inst, list(args), *di.grid(case.B, case.Hv, N), shapes)
        expected.append(_expected(case, args))
    for (case, _), got, want in zip(EMULATED, emu.run(), expected):
        _check(case, got, want)


# ---- GPU: the kernel through MLX ------------------------------------------------------------------

MODEL = (1, 16, 32, 128, 128, 64)
GPU_CASES = [c for c, _ in EMULATED] + [
    Case(2, 2, 6, 24, 40, 16, 100),
    Case(1, 2, 4, 32, 48, 64, 150),  # the embedded lily-tiny
    Case(2, 1, 2, 256, 256, 64, 200),
] + [Case(*MODEL, T) for T in (16, 63, 64, 65, 2048)]


def _gpu_intra(backend, case, dtype):
    args = _inputs(case, 0, dtype)
    got = di.chunk_intra(*args, chunk_size=case.C, backend=backend, init_value=float("nan"))
    assert got is not None, f"deltanet_intra declined {case}"
    mx.eval(got)
    _check(case, got, _expected(case, args))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=repr)
def test_deltanet_intra_cuda(case, dtype):
    _gpu_intra("cuda", case, dtype)


@pytest.mark.metal
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=repr)
def test_deltanet_intra_metal(case, dtype):
    _gpu_intra("metal", case, dtype)


def _both_kernels_on_vs_off(T, dtype):
    """ops.gated_delta at the model's heads, both prefill kernels on vs both off (a left-padded row at B = 2)."""
    B = 2 if T > 100 else 1
    q, k, v, log_g, beta, state = Case(B, *MODEL[1:], T).inputs(seed=T, dtype=dtype)
    mask = mx.arange(T)[None, :] >= mx.array([[0], [37]]) if B == 2 else None
    runs = []
    for on in (False, True):
        with ops.disabled():
            for name in ("deltanet_intra", "deltanet_chunk"):
                ops.set_enabled(name, on)
            runs.append(ops.gated_delta(q, k, v, log_g, beta, state, mask))
            mx.eval(runs[-1])
    (y_off, s_off), (y_on, s_on) = runs
    errs = _rel(y_on, y_off), _rel(s_on, s_off)
    tol = (2e-5, 2e-5) if dtype == F32 else (8e-3, 2e-5)  # bf16 y rounds after both
    assert errs[0] < tol[0] and errs[1] < tol[1], f"T={T} {dtype}: rel err y {errs[0]:.2e}, state {errs[1]:.2e}"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [16, 65, 2048, 4096])
def test_gated_delta_both_kernels_cuda(T, dtype):
    _both_kernels_on_vs_off(T, dtype)


@pytest.mark.metal
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [16, 65, 2048, 4096])
def test_gated_delta_both_kernels_metal(T, dtype):
    _both_kernels_on_vs_off(T, dtype)


# ---- CPU: dispatch and declines -------------------------------------------------------------------

def test_dispatch_runs_the_kernel_only_when_switched_on(monkeypatch):
    calls = []
    monkeypatch.setitem(ops._kernels, "deltanet_intra", lambda *a, **kw: calls.append(kw) or None)
    case = Case(1, 1, 2, 24, 40, 16, 40)
    q, k, v, log_g, beta, state = case.inputs()
    want = reference.chunk_intra(q, k, v, log_g, beta, state, chunk_size=16)
    monkeypatch.setattr(ops, "backend", lambda: "cuda")
    with ops.switched("deltanet_intra", False):
        ops.chunk_intra(q, k, v, log_g, beta, state, chunk_size=16)
    assert calls == []
    before = ops.declined.get("deltanet_intra", 0)
    with ops.switched("deltanet_intra", True):
        got = ops.chunk_intra(q, k, v, log_g, beta, state, chunk_size=16)  # the kernel declines: the reference
    assert calls == [{"chunk_size": 16}] and ops.declined["deltanet_intra"] == before + 1  # and the decline counted
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))


def test_the_mixer_hands_the_kernel_arguments_it_takes(monkeypatch):
    """ops.deltanet_mix makes float32 q, k (l2-normalised) and a 16-bit v: they reach deltanet_intra in one dtype.
    Until 2026-12-04 the mismatch made the kernel decline in every real prefill, silently (MLX ops instead: 3x the
    time, 1 GB of temporaries a layer at 2048 tokens)."""
    verdicts, real_try = [], ops._try

    def spy(name, *args, **kwargs):
        if name == "deltanet_intra":
            verdicts.append(di.unsupported(*args, kwargs["chunk_size"]))
        return real_try(name, *args, **kwargs)

    monkeypatch.setattr(ops, "_try", spy)
    Hk, Hv, Dk, Dv, T, W = 2, 4, 16, 24, 70, 4
    C = 2 * Hk * Dk + Hv * Dv
    keys = mx.random.split(mx.random.key(3), 3)
    proj = mx.random.normal((1, T, C + Hv * Dv + 2 * Hv), key=keys[0]).astype(BF16)
    conv_w = (mx.random.normal((C, W, 1), key=keys[1]) * 0.3).astype(BF16)
    A_log, dt_bias = mx.zeros((Hv,)), mx.random.normal((Hv,), key=keys[2])
    ops.deltanet_mix(proj, conv_w, mx.zeros((1, W - 1, C), BF16), A_log, dt_bias, mx.ones((Dv,), BF16), None,
                     num_key_heads=Hk, eps=1e-6)
    assert verdicts == [None]


def test_unsupported_arguments_are_declined():
    q, k, v, log_g, beta, _ = Case(1, 1, 2, 24, 40, 16, 40).inputs()
    assert di.unsupported(q, k, v, log_g, beta, 64) is None
    assert "shapes" in di.unsupported(q[0], k, v, log_g, beta, 64)
    assert "shapes" in di.unsupported(q, k, v, log_g[..., :1], beta, 64)
    assert "dtypes" in di.unsupported(q.astype(BF16), k, v, log_g, beta, 64)
    assert "dtypes" in di.unsupported(q, k, v, log_g.astype(BF16), beta, 64)
    assert "chunk size" in di.unsupported(q, k, v, log_g, beta, 24)
    assert "chunk size" in di.unsupported(q, k, v, log_g, beta, 128)  # [C][C + 1] floats past 32 KB
    wide = Case(1, 1, 1, 288, 32, 16, 16).inputs()
    assert "head dims" in di.unsupported(*wide[:5], 64)
    assert di.chunk_intra(*wide[:5], chunk_size=64, backend="cuda") is None
    three = Case(1, 2, 3, 24, 40, 16, 20).inputs()
    assert "value heads" in di.unsupported(*three[:5], 64)


def _drift_over_4096_tokens():
    """Both prefill kernels in bf16 over 4096 tokens (64 chunks) against the float64 sequential recurrence: the
    float32 state must not drift on the tensor cores (CUDA: TF32 high + low)."""
    from test_reference_ops import _delta_f64, _delta_inputs, rel

    q, k, v, log_g, beta, state = _delta_inputs(1, 4096, 1, 2, 128, 96, seed=11, dtype=BF16)
    with ops.disabled():
        for name in ("deltanet_intra", "deltanet_chunk"):
            ops.set_enabled(name, True)
        y, S = ops.gated_delta(q, k, v, log_g, beta, state)
        mx.eval(y, S)
    y0, S0 = _delta_f64(q, k, v, log_g, beta, state)
    assert rel(S, S0) < 1e-4
    assert rel(y.astype(F32), y0) < 1e-2


@pytest.mark.cuda
def test_bf16_drift_over_4096_tokens_cuda():
    _drift_over_4096_tokens()


@pytest.mark.metal
def test_bf16_drift_over_4096_tokens_metal():
    _drift_over_4096_tokens()
