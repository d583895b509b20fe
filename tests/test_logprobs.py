"""logprobs / logprobs_argmax (a sampling step's log-softmax and greedy token in one launch) against the reference:
logits - mx.logsumexp(logits), then mx.argmax.

CPU: the Metal source on the shim's SIMT emulator (outputs start as NaN bytes), threadgroups in index order or last
first (the phases follow the tickets), counters read back zero; rows with ties across chunks, -inf entries, a row of
-inf, a maximum in a partial last chunk. The dispatcher's CPU path is the reference. `cuda` / `metal`: the same
cases and the 35B vocabulary through MLX, outputs pre-filled with NaN.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import lily_mlx.ops as ops
from emulator import GXX, Emulator
from lily_mlx.ops import kernels
from lily_mlx.ops import logprobs as lpk
from lily_mlx.ops import reference

F32, BF16, F16 = mx.float32, mx.bfloat16, mx.float16
# (rows, vocabulary, dtype, what the rows hold)
CASES = [
    (1, 5000, BF16, "normal"),            # 3 chunks, the last partial
    (3, 1000, F32, "normal"),             # one partial chunk a row
    (2, 4097, F16, "ties"),               # the maximum repeated in several chunks: the first wins
    (2, 2 * lpk.CHUNK + 7, F32, "tail"),  # each row's maximum in its 7-element last chunk
    (3, 3000, BF16, "inf"),               # -inf entries; the last row all -inf
]
GPU_CASES = CASES + [(1, 248320, BF16, "normal"), (2, 248320, BF16, "ties"), (8, 248320, BF16, "normal"),
                     (1, 248320, F32, "normal")]


def _logits(R, V, dtype, kind, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((R, V)) * 4).astype(np.float32)
    if kind == "ties":
        for r in range(R):
            x[r, [7 + r, V // 2, V - 1]] = 30.0  # exact in every dtype
    elif kind == "tail":
        x[:, -1 - np.arange(R)] = 40.0
    elif kind == "inf":
        x[0, ::3] = -np.inf
        x[1, :V - 5] = -np.inf
        x[-1] = -np.inf
    return mx.array(x).astype(dtype)


def _check(case, lp, token, argmax_only=None):
    R, V, dtype, kind = case
    x = _logits(*case)
    ref = reference.logprobs(x)
    want = np.array(mx.argmax(ref, axis=-1))
    got_lp = np.array(lp.astype(F32))
    ref_lp = np.array(ref.astype(F32))
    finite = np.isfinite(ref_lp)
    assert np.array_equal(np.isnan(got_lp), np.isnan(ref_lp)), f"{case}: NaN where the reference has none (or not)"
    assert np.array_equal(got_lp[~finite & ~np.isnan(ref_lp)], ref_lp[~finite & ~np.isnan(ref_lp)]), f"{case}: infinities"
    # logsumexp in float32 by another order may round to the neighbouring T: every logprob then moves by one step.
    ulp = {F32: 1e-6, F16: 2e-3, BF16: 1.6e-2}[dtype] * np.maximum(1.0, np.abs(ref_lp[finite]))
    assert np.all(np.abs(got_lp[finite] - ref_lp[finite]) <= ulp), f"{case}: logprobs off by {np.abs(got_lp - ref_lp)[finite].max()}"
    assert token.dtype == mx.uint32 and np.array_equal(np.array(token), want), f"{case}: token {token} != {want}"
    if argmax_only is not None:
        assert argmax_only.dtype == mx.uint32
        assert np.array_equal(np.array(argmax_only), np.array(mx.argmax(x, axis=-1))), f"{case}: argmax alone"


@pytest.mark.skipif(GXX is None, reason="g++ is not installed")
def test_metal_emulated_matches_reference(tmp_path):
    emu, runs = Emulator(tmp_path), []
    zero = mx.zeros((kernels.SYNC_SLOTS,), dtype=mx.int32)
    for n, case in enumerate(CASES):
        R, V, dtype, _ = case
        x, NB = _logits(*case), -(-V // lpk.CHUNK)
        inst = lpk.instance(dtype, R, V)
        group = (lpk.THREADS, 1, 1)
        full = emu.add(lpk.SPEC, inst, [x, zero], (2 * R * NB * lpk.THREADS, 1, 1), group, [(R, V), (R,), (R, NB, 4)],
                       reversed_groups=n % 2 == 1, read_back=(1,))
        alone = emu.add(lpk.ARGMAX_SPEC, inst, [x, zero], (R * NB * lpk.THREADS, 1, 1), group, [(1,), (R,), (R, NB, 4)],
                        reversed_groups=n % 2 == 0, read_back=(1,))
        runs.append((case, full, alone))
    out = emu.run()
    for case, full, alone in runs:
        lp, token, _, sync = out[full]
        _check(case, lp, token, out[alone][1])
        for o in (full, alone):
            assert not np.array(out[o][3]).any(), f"{case}: counters left at {np.array(out[o][3])}"


def test_dispatcher_cpu_is_the_reference():
    x = _logits(2, 300, BF16, "ties")
    lp, token = ops.to_logprobs(x, greedy=True)
    assert mx.array_equal(lp, reference.logprobs(x)) and np.array_equal(np.array(token), [7, 8])
    assert ops.to_logprobs(x)[1] is None
    assert np.array_equal(np.array(ops.argmax(x)), [7, 8])


def test_unsupported():
    assert lpk.unsupported(mx.zeros((2, 5), dtype=mx.int32)) is not None
    assert lpk.unsupported(mx.zeros((2, 0))) is not None
    assert lpk.unsupported(mx.zeros((1, lpk.MAX_V))) is not None
    assert lpk.unsupported(mx.zeros((1, 3, 7))) is None
    assert lpk.unsupported(mx.broadcast_to(mx.zeros((1, 1 << 20)), (1 << 11, 1 << 20))) is not None  # int32 indexing


def _gpu(backend, case):
    x = _logits(*case)
    lp, token = lpk.logprobs(x, greedy=True, backend=backend, init_value=float("nan"))
    alone = lpk.argmax(x, backend=backend, init_value=float("nan"))
    _check(case, lp, token, alone)
    lp3, token3 = lpk.logprobs(x[:, None], greedy=True, backend=backend)  # [R, 1, V]: leading dims kept
    assert lp3.shape == (case[0], 1, case[1]) and token3.shape == (case[0], 1)


@pytest.mark.cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_logprobs_cuda(case):
    _gpu("cuda", case)


@pytest.mark.metal
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_logprobs_metal(case):
    _gpu("metal", case)


def _greedy_on_vs_off(mtp: bool):
    """The embedded 4-bit model's greedy tokens and logprobs through generate_step (mtp: the speculative loop, whose
    draft takes logprobs_argmax) with both switches on vs off."""
    import lily_mlx
    from lily_mlx.embedded import EMBEDDED_4BIT_MODEL
    from lily_mlx.generation import generate_step

    model = lily_mlx.load_model(EMBEDDED_4BIT_MODEL)[0]
    prompt = mx.array(np.random.default_rng(1).integers(0, 2048, 8))
    runs, names, calls = {}, ("logprobs", "logprobs_argmax"), []
    real = {n: ops._kernels[n] for n in names}
    for on in (False, True):
        with ops.switched("logprobs", on), ops.switched("logprobs_argmax", on):
            before = [ops.declined.get(n, 0) for n in names]
            for n in names:
                ops._kernels[n] = lambda *a, _n=n, **k: calls.append((on, _n)) or real[_n](*a, **k)
            try:
                runs[on] = list(generate_step(prompt, model, max_tokens=24, mtp=mtp))
            finally:
                ops._kernels.update(real)
            assert [ops.declined.get(n, 0) for n in names] == before, "the kernels declined"
    if ops.backend() != "cpu":  # the kernels ran, only when on (the draft's argmax only with mtp)
        assert all(on for on, _ in calls) and {n for _, n in calls} == set(names[:1 + mtp])
    assert [t for t, _ in runs[True]] == [t for t, _ in runs[False]], "greedy tokens with the kernel differ"
    for (_, on), (_, off) in zip(runs[True], runs[False]):
        assert on.dtype == off.dtype and mx.allclose(on.astype(F32), off.astype(F32), atol=2e-2).item()


def _model_checks():
    _greedy_on_vs_off(False)
    _greedy_on_vs_off(True)


@pytest.mark.cuda
def test_generate_with_kernel_cuda():
    _model_checks()


@pytest.mark.metal
def test_generate_with_kernel_metal():
    _model_checks()
