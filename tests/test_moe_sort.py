"""moe_sort (a prefill's routed rows grouped by expert, one launch) against what MLX's argsorts give.

Within an expert the kernel's rows come in its atomics' order, so the checks are the invariants every consumer relies
on: the sorted experts equal a sort of the rows' experts, each flat row's sorted place holds its expert and token,
the places are a permutation, and the prefix sums of rows and of row tiles are exact. CPU: the Metal source run by
the shim's SIMT emulator (outputs poisoned with -1), and the dispatcher's MLX path. GPU (`cuda`/`metal`): the same
through MLX, and a whole-model prefill with the kernel on vs off.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from lily_mlx import ops
from lily_mlx.ops import moe_gemm as mg
from lily_mlx.ops import moe_sort as ms
from emulator import GXX, Emulator
from switch_ab import prefill_rel_err

# (tokens, top-k, experts, row tile, ids dtype, how the rows fall): more rows than the block's threads, experts
# left empty, every row on one expert, more experts than rows, one expert.
CASES = [(13, 3, 5, 16, mx.int32, "uniform"), (300, 8, 256, 32, mx.uint32, "uniform"),
         (200, 4, 64, 64, mx.uint32, "one"), (50, 2, 1000, 16, mx.uint32, "uniform"), (40, 1, 1, 64, mx.int32, "uniform")]


def _indices(tokens, k, E, dtype, split, seed):
    rng = np.random.default_rng(seed)
    if split == "one":
        ids = np.full((tokens, k), E // 2)
    else:  # k distinct experts a token, as top-k gives
        ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(tokens)])
    return mx.array(ids.astype(np.int32)).astype(dtype)


def _check(out, indices, E, bm):
    sorted_ids, x_rows, inv, row_starts, tile_starts = (np.array(a) for a in out)
    flat = np.array(indices).reshape(-1).astype(np.int64)
    k = indices.shape[-1]
    counts = np.bincount(flat, minlength=E)
    assert row_starts.tolist() == [0] + np.cumsum(counts).tolist()
    assert tile_starts.tolist() == [0] + np.cumsum(-(-counts // bm)).tolist()
    assert np.array_equal(np.sort(inv), np.arange(flat.size)), "inv_order is not a permutation of the sorted places"
    assert np.array_equal(sorted_ids, np.sort(flat))
    assert np.array_equal(sorted_ids[inv], flat) and np.array_equal(x_rows[inv], np.arange(flat.size) // k)


@pytest.mark.skipif(GXX is None, reason="g++ is not installed")
def test_metal_emulated_matches_argsort(tmp_path):
    emu, wants = Emulator(tmp_path), []
    for i, (tokens, k, E, bm, dt, split) in enumerate(CASES):
        indices = _indices(tokens, k, E, dt, split, i)
        emu.add(ms.SPEC, ms.instance(dt, tokens * k, E, k, bm), [indices.reshape(-1)], (ms.THREADS, 1, 1),
                (ms.THREADS, 1, 1), [(tokens * k,)] * 3 + [(E + 1,)] * 2)
        wants.append((indices, E, bm))
    for (indices, E, bm), out in zip(wants, emu.run()):
        _check(out, indices, E, bm)


def test_unsupported_arguments_are_declined():
    ids = mx.zeros((4, 2), mx.int32)
    assert ms.unsupported(ids, 8) is None
    assert "int32/uint32" in ms.unsupported(ids.astype(mx.float32), 8)
    assert "1 to 1024" in ms.unsupported(ids, 1025)
    assert ms.sort_rows(ids.astype(mx.int64), 8, 64, backend="cuda") is None


def test_sort_by_expert_mlx_path_and_the_kernels_plumbing(monkeypatch):
    """CPU: MLX's argsorts (stable). With moe_sort (faked by those argsorts) and moe_gemm on a GPU backend: the
    kernel's outputs are handed on, with moe_gemm's starts at the dispatcher's row tile."""
    indices = _indices(300, 8, 256, mx.uint32, "uniform", 5)
    idx, inv, x_rows, starts = ops.sort_by_expert(indices, 256)
    assert starts is None  # CPU: no moe_gemm
    _check((idx, x_rows, inv, *mg.expert_starts(idx, 256)[:2]), indices, 256, mg.BM)
    flat = indices.reshape(-1)
    assert mx.array_equal(idx, flat[mx.argsort(flat)]).item()  # stable: ties in row order
    seen = []

    def fake(ids, experts, bm):
        seen.append(bm)
        st = mg.expert_starts(idx, experts, bm)
        return ms.SortedRows(idx, x_rows, inv, st.rows, st.tiles)

    monkeypatch.setitem(ops._kernels, "moe_sort", fake)
    monkeypatch.setattr(ops, "backend", lambda: "cuda")
    with ops.switched("moe_gemm_direct", True):
        got = ops.sort_by_expert(indices, 256)  # 2400 rows, 9.4 an expert: row tile 16
    assert seen == [16] and got[3].bm == 16 and got[0] is idx and got[1] is inv and got[2] is x_rows
    assert got[3].rows.tolist() == mg.expert_starts(idx, 256).rows.tolist()
    monkeypatch.setattr(ops, "MOE_GEMM_MIN_ROWS", 10**6)
    assert ops.sort_by_expert(indices, 256)[3] is None  # moe_gemm will not run: no starts


def _gpu_cases(backend):
    for i, (tokens, k, E, bm, dt, split) in enumerate(CASES):
        indices = _indices(tokens, k, E, dt, split, i)
        _check(ms.sort_rows(indices, E, bm, backend=backend), indices, E, bm)


@pytest.mark.cuda
def test_moe_sort_cuda():
    _gpu_cases("cuda")


@pytest.mark.metal
def test_moe_sort_metal():
    _gpu_cases("metal")


def _model_prefill_on_vs_off():
    """The embedded 4-bit model prefilling 300 tokens, moe_sort on vs off: the rows' order within an expert changes,
    no row's value does, so the logits agree to rounding."""
    err = prefill_rel_err("moe_sort")
    assert err < 1e-6, f"prefill logits with moe_sort: rel err {err:.2e}"


@pytest.mark.cuda
def test_model_prefill_with_moe_sort_cuda():
    _model_prefill_on_vs_off()


@pytest.mark.metal
def test_model_prefill_with_moe_sort_metal():
    _model_prefill_on_vs_off()
