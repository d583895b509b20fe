"""moe_route (a prefill's softmax, top-k and renormalisation in one launch) against reference.moe_route.

The reference's argpartition leaves the k chosen in no set order, so the checks compare each token's chosen experts
as a set, their weights expert by expert, and the kernel's own order (descending logit). CPU: the Metal source run by
the shim's SIMT emulator (outputs poisoned with NaN); GPU (`cuda`/`metal`): the same through MLX, and a whole-model
prefill with the kernel on vs off.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from lily_mlx import ops
from lily_mlx.ops import moe_router as mr
from lily_mlx.ops import reference
from emulator import GXX, Emulator
from switch_ab import prefill_rel_err

F32, BF16, F16 = mx.float32, mx.bfloat16, mx.float16
# (tokens, experts, logit columns, top-k, renormalise, dtype): the 35B router (256 of 257 columns, the shared-expert
# gate last), fewer tokens than a block's warps, E not a multiple of 32, no renormalisation, k = 32.
CASES = [(37, 256, 257, 8, True, BF16), (3, 100, 100, 3, False, F32), (70, 40, 41, 32, False, F16),
         (9, 16, 17, 4, True, F32)]


def _logits(tokens, columns, dtype, seed):
    # distinct values a row (a permutation scaled), so no top-k tie depends on who breaks it
    rng = np.random.default_rng(seed)
    rows = np.stack([rng.permutation(columns) for _ in range(tokens)]).astype(np.float32) * (4.0 / columns)
    return mx.array(rows).astype(dtype)


def _check(got, logits, top_k, normalize, experts):
    ids, weights = got
    assert ids.dtype == mx.uint32 and weights.dtype == F32
    assert not mx.isnan(weights).any().item(), "unwritten (NaN) weights"
    r_ids, r_w = reference.moe_route(logits[..., :experts], top_k, normalize)
    ids, weights, r_ids, r_w = (np.array(a) for a in (ids, weights, r_ids, r_w))
    for t in range(ids.shape[0]):
        assert sorted(ids[t]) == sorted(r_ids[t]), f"token {t}: experts {ids[t]} != {r_ids[t]}"
        want = dict(zip(r_ids[t], r_w[t]))
        np.testing.assert_allclose(weights[t], [want[i] for i in ids[t]], rtol=1e-5, atol=1e-7)
        row = np.array(logits[t].astype(F32))
        assert np.all(np.diff(row[ids[t]]) < 0), f"token {t}: not in descending logit order"


def _emulate(emu, logits, E, k, norm):
    """Adds moe_route's launch over logits [tokens, columns] (a warp a token) to the emulator's run."""
    tokens, columns = logits.shape
    blocks = -(-tokens // mr.WARPS)
    return emu.add(mr.SPEC, mr.instance(logits.dtype, tokens, E, k, columns, norm), [logits],
                   (blocks * 32 * mr.WARPS, 1, 1), (32 * mr.WARPS, 1, 1), [(tokens, k)] * 2)


@pytest.mark.skipif(GXX is None, reason="g++ is not installed")
def test_moe_route_metal_emulated_matches_reference(tmp_path):
    emu, wants = Emulator(tmp_path), []
    for i, (tokens, E, columns, k, norm, dtype) in enumerate(CASES):
        logits = _logits(tokens, columns, dtype, i)
        _emulate(emu, logits, E, k, norm)
        wants.append((logits, k, norm, E))
    for (logits, k, norm, E), got in zip(wants, emu.run()):
        _check(got, logits, k, norm, E)


def test_unsupported_arguments_are_declined():
    logits = mx.zeros((4, 257))
    assert mr.unsupported(logits, 8, 256) is None
    assert "top-k" in mr.unsupported(logits, 33, 256)
    assert "experts" in mr.unsupported(logits, 8, 258)
    assert "float" in mr.unsupported(logits.astype(mx.int32), 8, 256)


def _gpu_cases(backend):
    for i, (tokens, E, columns, k, norm, dtype) in enumerate(CASES):
        logits = _logits(tokens, columns, dtype, i)
        got = mr.route(logits, k, norm, E, backend=backend, init_value=float("nan"))
        assert got is not None
        _check(got, logits, k, norm, E)
    logits = _logits(2 * 300, 257, BF16, 7).reshape(2, 300, 257)  # [B, T, E + 1] as the model passes them
    ids, weights = mr.route(logits, 8, True, 256, backend=backend)
    assert ids.shape == weights.shape == (2, 300, 8)
    _check((ids.reshape(-1, 8), weights.reshape(-1, 8)), logits.reshape(-1, 257), 8, True, 256)


@pytest.mark.cuda
def test_moe_route_cuda():
    _gpu_cases("cuda")


@pytest.mark.metal
def test_moe_route_metal():
    _gpu_cases("metal")


def _model_prefill_on_vs_off():
    """The same experts and weights up to float rounding: the logits agree to rounding. float32 activations: bf16
    router logits tie often, and which of two tied experts is chosen is the reference's argpartition's choice (the
    bf16 model measured 1.5e-3 on the H200, run 25)."""
    err = prefill_rel_err("moe_route", dtype=mx.float32)
    assert err < 1e-4, f"prefill logits with moe_route: rel err {err:.2e}"


@pytest.mark.cuda
def test_model_prefill_with_moe_route_cuda():
    _model_prefill_on_vs_off()


@pytest.mark.metal
def test_model_prefill_with_moe_route_metal():
    _model_prefill_on_vs_off()


def _topk_oracle(row: np.ndarray, k: int, experts: int) -> list[int]:
    """lily_topk's rule: descending logit, ties (-0 with +0 too) to the lower id, NaN and -inf never chosen, id E
    for each missing pick."""
    valid = [i for i in range(experts) if row[i] > -np.inf]
    return (sorted(valid, key=lambda i: (-row[i], i)) + [experts] * k)[:k]


@pytest.mark.skipif(GXX is None, reason="g++ is not installed")
@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_topk_ties_signed_zeros_and_nonfinite_emulated(tmp_path, dtype):
    """The picks where they are easy to get wrong: 16-bit logits take packed keys (value bits | 8191 - id) and one
    warp max a pick, float32 ones (value, id) comparisons; both must give the oracle's ids, in its order."""
    E, columns, k = 40, 41, 8
    rows = np.full((6, columns), -1.0, dtype=np.float32)
    rows[0] = 0.5                                   # every logit tied
    rows[1, [3, 7, 20, 33, 39]] = [-0.0, 0.0, -0.0, 0.0, -0.0]  # the top five tie at zero, signs mixed
    rows[2, ::3] = np.nan
    rows[2, 1::3] = -np.inf
    rows[2, [2, 35, 38]] = [2.0, 3.0, 2.0]          # NaN and -inf never picked
    rows[3] = -np.inf
    rows[3, [5, 36]] = [-7.5, -7.5]                 # two to pick: the other six are id E
    rows[4] = -np.arange(columns, dtype=np.float32) // 3  # negative, tied in threes
    rows[5] = np.linspace(-3.0, 3.0, columns)[::-1]  # distinct, descending by id
    logits = mx.array(rows).astype(dtype)
    emu = Emulator(tmp_path)
    _emulate(emu, logits, E, k, True)
    ids, weights = (np.array(a) for a in emu.run()[0])
    cast = np.array(logits.astype(F32))
    for t in range(rows.shape[0]):
        want = _topk_oracle(cast[t], k, E)
        assert ids[t].tolist() == want, f"row {t}: {ids[t].tolist()} != {want}"
        chosen = [cast[t, i] if i < E else -np.inf for i in want]
        w = np.exp(np.array(chosen, dtype=np.float64) - chosen[0])
        np.testing.assert_allclose(weights[t], w / w.sum(), rtol=1e-6, atol=1e-7)
