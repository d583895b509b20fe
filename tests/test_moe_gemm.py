"""moe_gemm (the prefill's expert GEMM, weights dequantized in the tile, tensor cores) against the float32 oracle.

CPU: the Metal source run by the shim's SIMT emulator on odd shapes (rows per expert none, 1, 64 + 1, all on
one expert; N not a multiple of the tile; outputs start as NaN), the expert prefix sums, the dispatcher (off by
default, never on CPU, declines float32). GPU (`cuda`/`metal`): the same through MLX, the 35B-A3B expert shapes
on 16,384 sorted rows against MLX's quantized gather, and a whole-model prefill with the kernel on vs off.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from lily_mlx import ops
from lily_mlx.ops import kernels
from lily_mlx.ops import moe_gemm as mg
from lily_mlx.ops import reference
from emulator import GXX, Emulator
from switch_ab import prefill_rel_err

F32, BF16, F16 = mx.float32, mx.bfloat16, mx.float16
# (rows per expert, K, N, bits, group, x dtype, scales dtype)
# K 192: three slices of K, an odd number of scale groups a row; group 32 at 4 bits: two groups a slice.
CASES = [((0, 65, 1, 4, 0), 128, 160, 4, 64, BF16, BF16), ((37, 0, 0), 128, 96, 8, 32, F16, F32),
         ((2, 3, 0, 4), 256, 136, 4, 128, BF16, F16), ((5, 70), 192, 96, 4, 64, BF16, BF16),
         ((64, 3), 256, 72, 4, 32, F16, BF16)]


def _case(counts, K, N, bits, group, xdt, sdt, seed):
    E, rows = len(counts), sum(counts)
    k = mx.random.split(mx.random.key(seed), 2)
    q, s, b = mx.quantize(mx.random.normal((E, N, K), key=k[0]) * 0.1, group_size=group, bits=bits)
    idx = mx.array(np.repeat(np.arange(E), counts).astype(np.int32))
    x = mx.random.normal((rows, 1, K), key=k[1]).astype(xdt)
    return x, q, s.astype(sdt), b.astype(sdt), idx


def _tokens(x, seed):
    """(tokens, x_rows): x's rows as the gather variant reads them, from fewer unsorted tokens, several rows a token."""
    T = x.shape[0] // 2 + 1
    x_rows = mx.array(np.random.default_rng(seed).integers(0, T, x.shape[0]).astype(np.int32))
    tokens = mx.random.normal((T, 1, x.shape[-1]), key=mx.random.key(seed)).astype(x.dtype)
    return tokens, x_rows


def _oracle(x, q, s, b, idx, group, bits):
    with mx.stream(mx.cpu):
        return reference.gather_matmul_oracle(x.astype(F32), q, idx, scales=s.astype(F32), biases=b.astype(F32),
                                              group_size=group, bits=bits)


def _check(got, want, xdt):
    g, w = got.astype(F32), want.astype(F32)
    assert got.shape == want.shape and got.dtype == xdt
    assert not mx.isnan(g).any().item(), "unwritten (NaN) outputs"
    err = (mx.linalg.norm(g - w) / mx.linalg.norm(w)).item()
    assert err < 1e-2, f"relative error {err:.2e}"  # the 16-bit operands' rounding; a wrong tile is O(1)


def test_expert_starts_are_prefix_sums():
    counts = [0, 65, 1, 128, 0, 3]
    idx = mx.array(np.repeat(np.arange(6), counts).astype(np.uint32))
    rows, tiles, bm = mg.expert_starts(idx, 6)
    assert rows.tolist() == [0, 0, 65, 66, 194, 194, 197] and bm == mg.BM
    assert tiles.tolist() == [0, 0, 2, 3, 5, 5, 6]
    assert mg.launch(197, 160, 6)[0] >= tiles[-1].item() * 2  # the launch covers every tile of both column tiles
    assert mg.expert_starts(idx, 6, 16).tiles.tolist() == [0, 0, 5, 6, 14, 14, 15]
    assert mg.launch(197, 160, 6, 16)[0] >= 15 * 2  # moe_gemm_direct's 128-column tiles


@pytest.mark.skipif(GXX is None, reason="g++ is not installed")
def test_metal_emulated_matches_oracle(tmp_path):
    """The default body; the staged variant at Metal's one stage and at the rings CUDA can run (2 and 4 stages: the
    copies' slots and wait counts); moe_gemm_direct at row tiles 16 and 32; each also reading its rows from unsorted
    tokens through x_rows (gather)."""
    emu, wants = Emulator(tmp_path), []
    variants = [(mg.SPEC, None, mg.BM)] * len(CASES) + [(mg.STAGED_SPEC, (1, 2, 4)[i % 3], mg.BM)
                                                        for i in range(len(CASES))]
    variants += [(mg.DIRECT_SPEC, None, bm) for bm in (16, 32) for _ in CASES]
    for i, ((spec, stages, bm), gather) in enumerate((v, g) for v in variants for g in (False, True)):
        counts, K, N, bits, group, xdt, sdt = CASES[(i // 2) % len(CASES)]
        x, q, s, b, idx = _case(counts, K, N, bits, group, xdt, sdt, (i // 2) % len(CASES))
        E, rows = len(counts), sum(counts)
        starts = mg.expert_starts(idx, E, bm)
        x_in, x_rows = (x, starts.rows) if not gather else _tokens(x, i)
        if gather:
            x = x_in[x_rows]
        blocks, threads = mg.launch(rows, N, E, bm)
        emu.add(spec, mg.instance(xdt, sdt, rows, K, N, E, bits, group, stages, gather, bm),
                [x_in.reshape(-1, K), starts.tiles, starts.rows, q, s, b, x_rows],
                (blocks * threads, 1, 1), (threads, 1, 1), [(rows, N)])
        wants.append((_oracle(x, q, s, b, idx, group, bits).reshape(rows, N), xdt))
    for (want, xdt), (got,) in zip(wants, emu.run()):
        _check(got, want, xdt)


def test_dispatch_from_its_row_threshold_on_gpus_only(monkeypatch):
    x, q, s, b, idx = _case((3, 0, 5), 64, 32, 4, 32, BF16, BF16, 7)
    kw = dict(scales=s, biases=b, group_size=32, bits=4, sorted_indices=True)
    calls = []
    monkeypatch.setitem(ops._kernels, "moe_gemm", lambda *a, **k: calls.append(k) or reference.gather_matmul(*a[:3], **{
        n: k[n] for n in ("scales", "biases", "group_size", "bits")}))
    want = reference.gather_matmul(x, q, idx, **kw)
    assert mx.array_equal(ops.gather_matmul(x, q, idx, **kw), want).item()  # CPU: MLX's gather
    assert ops.sorted_expert_starts(idx, 3) is None
    monkeypatch.setattr(ops, "backend", lambda: "cuda")
    ops.gather_matmul(x, q, idx, **kw)
    assert not calls and ops.sorted_expert_starts(idx, 3) is None  # 8 rows: below the threshold
    monkeypatch.setattr(ops, "MOE_GEMM_MIN_ROWS", 8)
    starts = ops.sorted_expert_starts(idx, 3)
    ops.gather_matmul(x, q, idx, expert_starts=starts, **kw)
    ops.gather_matmul(x, q, idx, **{**kw, "sorted_indices": False})  # unsorted rows: never
    with ops.disabled("moe_gemm"):
        ops.gather_matmul(x, q, idx, **kw)
        assert ops.sorted_expert_starts(idx, 3) is None
    monkeypatch.setattr(ops, "backend", lambda: "cpu")
    ops.gather_matmul(x, q, idx, **kw)
    assert len(calls) == 1 and calls[0]["starts"] is starts
    assert [a.tolist() for a in starts[:2]] == [[0, 3, 3, 8], [0, 1, 1, 2]] and starts.bm == mg.BM


def test_gather_switch_hands_moe_gemm_the_sort_order(monkeypatch):
    """SwitchGLU with moe_gemm_gather: gate and up get the unsorted tokens and x_rows (down its sorted rows), and the
    logits equal the gathered path's; off, every call gets gathered rows. moe_gemm faked by MLX's gather on CPU."""
    import lily_mlx
    from lily_mlx.embedded import EMBEDDED_4BIT_MODEL

    def fake(x, w, indices, *, x_rows=None, starts=None, **q):
        seen.append(x_rows is not None)
        return reference.gather_matmul(x if x_rows is None else x[x_rows], w, indices, sorted_indices=True, **q)

    monkeypatch.setattr(ops, "_kernels", {"moe_gemm": fake})  # no other kernel: their MLX paths run on CPU
    monkeypatch.setattr(ops, "backend", lambda: "cuda")
    model, _ = lily_mlx.load_model(EMBEDDED_4BIT_MODEL)
    toks = mx.array(np.random.default_rng(0).integers(0, 2048, (1, 300)))  # 600 sorted rows: moe_gemm's
    logits, calls = {}, {}
    for on in (False, True):
        seen = []
        with ops.switched("moe_gemm_gather", on):
            logits[on] = model(toks, cache=model.make_cache())
        calls[on] = seen
    n = len(model.language_model.model.layers)
    assert calls[False] == [False] * 3 * n and calls[True] == [True, True, False] * n
    assert mx.allclose(logits[True], logits[False], rtol=1e-5, atol=1e-5).item()


def test_row_tile_by_rows_an_expert():
    assert mg.tile_rows(4096, 256) == mg.BM  # moe_gemm_direct off
    with ops.switched("moe_gemm_direct", True):
        assert [mg.tile_rows(r, 256) for r in (4096, 6144, 6145)] == [16, 16, mg.BM]
        idx = mx.array(np.repeat(np.arange(4), 300).astype(np.int32))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ops, "backend", lambda: "cuda")
            assert ops.sorted_expert_starts(idx, 4).bm == mg.BM  # 300 rows an expert
            assert ops.sorted_expert_starts(idx, 64).bm == 16  # 18.75
        picked = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(mg, "gather_matmul", lambda *a, **k: picked.append(k["starts"].bm))
            mp.setattr(ops, "backend", lambda: "cuda")
            mg._dispatch(mx.zeros((1200, 1, 64), BF16), mx.zeros((64, 8, 8), mx.uint32), idx, scales=None)
        assert picked == [16]  # no starts handed over: the dispatcher's own, at the switch's tile


def test_staged_variant_is_opt_in(monkeypatch):
    x, q, s, b, idx = _case((40, 30), 64, 32, 4, 64, BF16, BF16, 9)
    picked = []
    monkeypatch.setattr(mg, "gather_matmul", lambda *a, **k: picked.append((k["backend"], k["stages"])))
    monkeypatch.setattr(ops, "backend", lambda: "cuda")
    kw = dict(scales=s, biases=b, group_size=64, bits=4)
    mg._dispatch(x, q, idx, **kw)
    with ops.switched("moe_gemm_staged", True):
        mg._dispatch(x, q, idx, **kw)
    assert picked == [("cuda", None), ("cuda", mg.STAGES["cuda"])]


def test_unsupported_arguments_are_declined():
    x, q, s, b, idx = _case((3, 2), 128, 40, 4, 64, BF16, BF16, 8)
    why = lambda **over: mg.unsupported(*[over.get(n, v) for n, v in
                                          (("x", x), ("w", q), ("indices", idx), ("scales", s), ("biases", b))],
                                        over.get("group_size", 64), over.get("bits", 4))
    assert why() is None
    assert "bfloat16 or float16" in why(x=x.astype(F32))
    assert "bits" in why(bits=3) and "groups of 32" in why(group_size=16)
    assert "multiple of 64" in why(x=x[..., :96], w=q[..., :12], scales=s[..., :1], biases=b[..., :1])
    assert "do not match" in why(biases=None)
    assert "one int32/uint32 expert id per row" in why(indices=idx[:4])
    tokens, x_rows = _tokens(x, 1)
    assert mg.unsupported(tokens, q, idx, s, b, 64, 4, x_rows=x_rows) is None
    assert "one int32/uint32 expert id per row" in mg.unsupported(tokens, q, idx, s, b, 64, 4, x_rows=x_rows[:3])
    assert "x_rows" in mg.unsupported(tokens, q, idx, s, b, 64, 4, x_rows=x_rows.astype(F32))
    x8, q8, s8, b8, idx8 = _case((3, 0, 5), 64, 32, 8, 64, BF16, BF16, 7)
    assert "32768 bytes of threadgroup memory" in mg.unsupported(x8, q8, idx8, s8, b8, 64, 8, "metal")
    assert mg.unsupported(x8, q8, idx8, s8, b8, 64, 8, "cuda") is None and mg.unsupported(x8, q8, idx8, s8, b8, 64, 8) is None
    assert mg.unsupported(x, q, idx, s, b, 64, 4, "metal") is None  # 4-bit, group 64, 16-bit scales: exactly 32 KB
    assert mg.gather_matmul(x.astype(F32), q, idx, scales=s, biases=b, group_size=64, bits=4, backend="cuda") is None


def _gpu_case(backend, i):
    """CASES[i] at every stage count, then read from unsorted tokens through x_rows (default body, backend's stages)."""
    counts, K, N, bits, group, xdt, sdt = CASES[i]
    x, q, s, b, idx = _case(counts, K, N, bits, group, xdt, sdt, i)
    for stages in (None, 1, 2, 3, 4) if backend == "cuda" else (None, mg.STAGES[backend]):
        got = mg.gather_matmul(x, q, idx, scales=s, biases=b, group_size=group, bits=bits, backend=backend,
                               init_value=float("nan"), stages=stages)
        if mg.unsupported(x, q, idx, s, b, group, bits, backend if stages else None) is not None:
            assert got is None  # the staged tile past Metal's 32 KB: 8-bit, group 32 with float32 scales
            continue
        _check(got, _oracle(x, q, s, b, idx, group, bits), xdt)
    tokens, x_rows = _tokens(x, i)
    for stages in (None, mg.STAGES[backend]):
        if mg.unsupported(x, q, idx, s, b, group, bits, backend if stages else None) is None:
            got = mg.gather_matmul(tokens, q, idx, scales=s, biases=b, group_size=group, bits=bits, backend=backend,
                                   init_value=float("nan"), stages=stages, x_rows=x_rows)
            _check(got, _oracle(tokens[x_rows], q, s, b, idx, group, bits), xdt)
    for bm in (16, 32):  # moe_gemm_direct
        starts = mg.expert_starts(idx, len(counts), bm)
        for xin, rows_in, want_x in ((x, None, x), (tokens, x_rows, tokens[x_rows])):
            got = mg.gather_matmul(xin, q, idx, scales=s, biases=b, group_size=group, bits=bits, backend=backend,
                                   init_value=float("nan"), starts=starts, x_rows=rows_in)
            _check(got, _oracle(want_x, q, s, b, idx, group, bits), xdt)


def _gpu_model_shapes(backend, rows=16384, tiles=(mg.BM,)):
    # The 35B-A3B experts on a 2048-token prefill's 16,384 sorted rows (or a 512-token one's 4,096): gate/up
    # 2048 -> 512, down 512 -> 2048, a skewed split (one expert holds 1,000 rows, or 100, the last three none)
    # against MLX's quantized gather; gate/up also read from the tokens through x_rows, as SwitchGLU hands them.
    # `tiles`: the row tiles to run (64: the shared-memory body, else moe_gemm_direct's).
    E = 256
    rng = np.random.default_rng(3)
    big = rows // 16
    idx = mx.array(np.sort(np.concatenate([np.full(big, 7), rng.integers(0, E - 3, rows - big)])).astype(np.uint32))
    for K, N in ((2048, 512), (512, 2048)):
        q, s, b = mx.quantize(mx.random.normal((E, N, K), key=mx.random.key(K)) * 0.05, group_size=64, bits=4)
        s, b = s.astype(BF16), b.astype(BF16)
        x = mx.random.normal((rows, 1, K), key=mx.random.key(N)).astype(BF16)
        want = reference.gather_matmul(x, q, idx, scales=s, biases=b, group_size=64, bits=4, sorted_indices=True)
        x_rows = mx.array(rng.integers(0, rows // 8, rows).astype(np.int32))
        tokens = x[: rows // 8]
        if K == 2048:
            want_gathered = reference.gather_matmul(tokens[x_rows], q, idx, scales=s, biases=b, group_size=64,
                                                    bits=4, sorted_indices=True)
        for bm in tiles:
            kw = dict(scales=s, biases=b, group_size=64, bits=4, backend=backend, init_value=float("nan"),
                      starts=mg.expert_starts(idx, E, bm))
            _check(mg.gather_matmul(x, q, idx, **kw), want, BF16)
            if K == 2048:
                _check(mg.gather_matmul(tokens, q, idx, x_rows=x_rows, **kw), want_gathered, BF16)


@pytest.mark.cuda
@pytest.mark.parametrize("i", range(len(CASES)))
def test_moe_gemm_cuda(i):
    _gpu_case("cuda", i)


@pytest.mark.metal
@pytest.mark.parametrize("i", range(len(CASES)))
def test_moe_gemm_metal(i):
    _gpu_case("metal", i)


@pytest.mark.cuda
def test_moe_gemm_model_shapes_cuda():
    _gpu_model_shapes("cuda")


@pytest.mark.metal
def test_moe_gemm_model_shapes_metal():
    _gpu_model_shapes("metal")


@pytest.mark.cuda
def test_moe_gemm_direct_model_shapes_cuda():
    _gpu_model_shapes("cuda", rows=4096, tiles=(16, 32))


@pytest.mark.metal
def test_moe_gemm_direct_model_shapes_metal():
    _gpu_model_shapes("metal", rows=4096, tiles=(16, 32))


def _model_prefill_direct_on_vs_off(monkeypatch):
    """The embedded 4-bit model's prefill with moe_gemm_direct on vs off (its row tile forced: 8 experts hold too
    many rows for the default choice): every projection through the direct body when on, none when off."""
    monkeypatch.setattr(mg, "DIRECT_TILES", ((10**6, 32),))
    calls = []
    err = prefill_rel_err("moe_gemm_direct", kernel="moe_gemm", calls=calls)
    assert {(on, k["starts"].bm) for on, k in calls} == {(False, mg.BM), (True, 32)}
    assert err < 2e-2, f"prefill logits with moe_gemm_direct: rel err {err:.2e}"


@pytest.mark.cuda
def test_model_prefill_with_moe_gemm_direct_cuda(monkeypatch):
    _model_prefill_direct_on_vs_off(monkeypatch)


@pytest.mark.metal
def test_model_prefill_with_moe_gemm_direct_metal(monkeypatch):
    _model_prefill_direct_on_vs_off(monkeypatch)


def _model_prefill_gather_on_vs_off():
    """The embedded 4-bit model's prefill with moe_gemm_gather on vs off: the same rows read in place of gathered, so
    the same logits, and moe_gemm given x_rows only when on."""
    calls = []
    err = prefill_rel_err("moe_gemm_gather", kernel="moe_gemm", calls=calls)
    seen = {(on, k.get("x_rows") is not None) for on, k in calls}
    assert {(False, False), (True, True), (True, False)} == seen  # gate/up gathered in place, down not
    assert err < 1e-6, f"prefill logits with moe_gemm_gather: rel err {err:.2e}"


@pytest.mark.cuda
def test_model_prefill_with_moe_gemm_gather_cuda():
    _model_prefill_gather_on_vs_off()


@pytest.mark.metal
def test_model_prefill_with_moe_gemm_gather_metal():
    _model_prefill_gather_on_vs_off()


def _model_prefill_on_vs_off():
    """The embedded 4-bit model prefilling 300 tokens (600 sorted expert rows), moe_gemm on vs off."""
    err = prefill_rel_err("moe_gemm")
    assert err < 2e-2, f"prefill logits with moe_gemm: rel err {err:.2e}"


@pytest.mark.cuda
def test_model_prefill_with_moe_gemm_cuda():
    _model_prefill_on_vs_off()


@pytest.mark.metal
def test_model_prefill_with_moe_gemm_metal():
    _model_prefill_on_vs_off()


def test_bounded_variant_carries_launch_bounds():
    """moe_gemm_bounded is the default body built for 3 resident blocks an SM: its CUDA source differs from the
    default's by the __global__ line's launch bounds only (a Metal build has none)."""
    inst = mg.SPEC.instances()[0]
    default = kernels.full_source(mg.SPEC, "cuda", inst)[1]
    bounded = kernels.full_source(mg.BOUNDED_SPEC, "cuda", inst)[1]
    bounds = "#undef __global__\n#define __global__ __location__(global) __launch_bounds__(256, 3)\n"
    assert bounds not in default and bounded.replace(bounds, "").replace("moe_gemm_bounded", "moe_gemm") == default
    assert "launch_bounds" not in kernels.full_source(mg.BOUNDED_SPEC, "metal", inst)[1]


def _model_prefill_bounded_on_vs_off(monkeypatch):
    """The same body under launch bounds: the same arithmetic, so the same logits, and the bounded build launched
    only when on."""
    launched, real = [], kernels.call
    monkeypatch.setattr(kernels, "call", lambda name, *a, **k: launched.append(name) or real(name, *a, **k))
    err = prefill_rel_err("moe_gemm_bounded", kernel="moe_gemm")
    assert "moe_gemm_bounded" in launched and "moe_gemm" in launched
    assert err < 1e-6, f"prefill logits with moe_gemm_bounded: rel err {err:.2e}"


@pytest.mark.cuda
def test_model_prefill_with_moe_gemm_bounded_cuda(monkeypatch):
    _model_prefill_bounded_on_vs_off(monkeypatch)


@pytest.mark.metal
def test_model_prefill_with_moe_gemm_bounded_metal(monkeypatch):
    _model_prefill_bounded_on_vs_off(monkeypatch)
