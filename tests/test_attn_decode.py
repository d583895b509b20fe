"""attn_decode / attn_combine (the fused decode attention) against the reference op, and the reference
against the model's unfused attention (cache update, q/k norm, RoPE, mx.fast SDPA, output gate).

CPU: both kernels' Metal sources on the emulator (tests/emulator.py), split and unsplit, outputs
poisoned with NaN. `cuda` / `metal`: the same through MLX, at the 35B-A3B shape, and whole-model
greedy decoding with the kernel on vs off.
"""

from __future__ import annotations

import math

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

import lily_mlx
from emulator import GXX, Emulator
from lily_mlx import ops
from lily_mlx.embedded import EMBEDDED_4BIT_MODEL, EMBEDDED_MODEL
from lily_mlx.ops import attn_decode as ad
from lily_mlx.ops import kernels, qmv, reference

F32, BF16, F16 = mx.float32, mx.bfloat16, mx.float16
TOL = {F32: 2e-5, BF16: 1.5e-2, F16: 3e-3}  # the output's rounding; bf16 also the rounded q/k feeding the scores


class Case:
    """B, Hq, Hkv, D, rope dims, cache capacity, offset (tokens already cached), dtype, splits (None: planned),
    the stacked cache's planes (the compiled decoder's stacked_kv layout) with the plane read, and a left-padded
    batch's first column per row (`starts`: row b holds columns [starts[b], offset), rotating at offset - start)."""

    def __init__(self, B, Hq, Hkv, D, rope, cap, offset, dtype=F32, nsplit=None, theta=1e4, planes=1, plane=0,
                 starts=None, tokens=1):
        self.B, self.Hq, self.Hkv, self.D, self.rope, self.cap, self.offset = B, Hq, Hkv, D, rope, cap, offset
        self.dtype, self.theta, self.planes, self.plane, self.starts = dtype, theta, planes, plane, starts
        self.tokens = tokens  # new tokens a row (a speculative verify's several)
        self.nsplit = nsplit or ad.splits(B * tokens, Hkv, cap)

    def __repr__(self):
        return (f"B{self.B}-Hq{self.Hq}-Hkv{self.Hkv}-D{self.D}-rope{self.rope}-cap{self.cap}-off{self.offset}-"
                f"{str(self.dtype).split('.')[-1]}-split{self.nsplit}"
                + (f"-plane{self.plane}of{self.planes}" if self.planes > 1 else "")
                + (f"-starts{'_'.join(map(str, self.starts))}" if self.starts else "")
                + (f"-T{self.tokens}" if self.tokens > 1 else ""))

    def arrays(self, seed=0):
        k = mx.random.split(mx.random.key(seed), 5)
        B, Hq, Hkv, D = self.B, self.Hq, self.Hkv, self.D
        proj = (mx.random.normal((B, self.tokens, Hq * 2 * D + 2 * Hkv * D), key=k[0]) * 2).astype(self.dtype)
        qn = (1 + 0.3 * mx.random.normal((D,), key=k[1])).astype(self.dtype)
        kn = (1 + 0.3 * mx.random.normal((D,), key=k[2])).astype(self.dtype)
        keys = mx.random.normal((self.planes * B, Hkv, self.cap, D), key=k[3]).astype(self.dtype)
        values = mx.random.normal((self.planes * B, Hkv, self.cap, D), key=k[4]).astype(self.dtype)
        return proj, qn, kn, keys, values, mx.array([self.offset], dtype=mx.int32)

    def rows(self):
        """(row_start, row_pos) [B] int32 of a left-padded batch, or (None, None)."""
        if not self.starts:
            return None, None
        start = mx.array(self.starts, dtype=mx.int32)
        return start, self.offset - start

    def kw(self):
        row_start, row_pos = self.rows()
        return dict(n_heads=self.Hq, n_kv_heads=self.Hkv, rope_dims=self.rope, rope_theta=self.theta,
                    scale=self.D**-0.5, plane=self.plane, row_start=row_start, row_pos=row_pos)

    def reference(self, args):
        # The oracle reads the plane's rows as a separate cache, so a kernel reading another plane fails it; a
        # left-padded row is its own cache of columns [start, offset), so a kernel reading the padding fails it.
        B, p = self.B, self.plane
        proj, qn, kn, keys, values, offset = args
        keys, values = keys[p * B:(p + 1) * B], values[p * B:(p + 1) * B]
        kw = dict(self.kw(), plane=0, row_start=None, row_pos=None)
        with mx.stream(mx.cpu):
            if not self.starts:
                out = reference.attention_decode(proj, qn, kn, 1e-6, keys, values, offset, **kw)
            else:
                rows = [reference.attention_decode(proj[b:b + 1], qn, kn, 1e-6, keys[b:b + 1, :, s:], values[b:b + 1, :, s:],
                                                   mx.array([self.offset - s], dtype=mx.int32), **kw)
                        for b, s in enumerate(self.starts)]
                out = tuple(mx.concatenate(parts) for parts in zip(*rows))
            mx.eval(out)
        return out


def _rel(x, ref):
    x, ref = x.astype(F32), ref.astype(F32)
    assert not mx.isnan(x).any().item(), "unwritten (NaN) outputs"
    return (mx.linalg.norm(x.flatten() - ref.flatten()) / mx.linalg.norm(ref.flatten())).item()


def _check(case, got, ref):
    out, k_new, v_new = got
    assert out.shape == (case.B, case.tokens, case.Hq * case.D) and out.dtype == case.dtype
    assert k_new.shape == (case.B, case.Hkv, case.tokens, case.D) == v_new.shape
    assert mx.array_equal(v_new, ref[2]).item(), f"{case}: v_new differs"
    errs = _rel(out, ref[0]), _rel(k_new, ref[1])
    assert errs[0] < TOL[case.dtype] and errs[1] < TOL[case.dtype] / 4, f"{case}: out, k_new rel errors {errs}"
    return errs


# Odd shapes: Hq/Hkv groups 2, 3, 1 and 8, D 32..96, partial and full rope, an empty cache
# (offset 0), a full one (offset == capacity), splits 1..5 with uneven chunks and empty splits.
EMULATED = [
    Case(1, 4, 2, 32, 8, 16, 5),
    Case(2, 6, 2, 64, 16, 40, 37, BF16, nsplit=3),
    Case(3, 8, 1, 32, 32, 7, 0),
    Case(1, 3, 3, 96, 32, 70, 64, F16, nsplit=4),
    Case(1, 4, 2, 64, 16, 80, 64, F32, nsplit=17),  # context 64's 17 splits of 4: the last holds the new token alone
    Case(1, 8, 1, 64, 16, 24, 24, BF16),
    Case(2, 4, 2, 32, 8, 9, 3, F32, nsplit=5),  # 4 positions over 5 splits: one split is empty
    Case(2, 6, 2, 64, 16, 40, 37, BF16, nsplit=3, planes=3, plane=2),  # stacked planes, the last read
    Case(1, 4, 2, 32, 8, 16, 5, F32, planes=4, plane=1),
    Case(3, 6, 2, 64, 16, 40, 37, BF16, nsplit=3, starts=[0, 20, 36]),  # left padding: whole splits skipped
    Case(2, 4, 2, 32, 8, 16, 9, F32, starts=[4, 0]),  # one block per kv head
    # 37 splits: attn_combine's warps merge several groups of CS, the last one partial; the cache read in whole TP
    # rows, then a boundary iteration. 8 rows of left padding empty the first split.
    Case(1, 4, 2, 32, 8, 300, 290, BF16, nsplit=37, starts=[8]),
    # A speculative verify's tokens: each sees the cache and the new tokens up to itself.
    Case(1, 4, 2, 32, 8, 16, 5, tokens=3),
    Case(2, 6, 2, 64, 16, 40, 30, BF16, nsplit=3, tokens=2),
    Case(1, 3, 3, 96, 32, 70, 0, F16, nsplit=4, tokens=5),  # an empty cache: only the new tokens
    Case(3, 6, 2, 64, 16, 40, 33, BF16, nsplit=3, starts=[0, 20, 32], tokens=4),
    Case(2, 6, 2, 64, 16, 40, 30, F32, nsplit=2, planes=3, plane=1, tokens=2),
    # Lanes' dims as whole 16-byte loads with attn_decode_wide: 8 bf16 (the 35B head), 8 float32 (two loads), 4.
    Case(1, 4, 2, 256, 64, 60, 50, BF16, nsplit=3, theta=1e7),
    Case(1, 2, 1, 256, 64, 40, 37, F32, nsplit=2, tokens=2),
    Case(1, 4, 1, 128, 32, 40, 33, F32),
]


@pytest.mark.skipif(GXX is None, reason="g++ is not installed")
@pytest.mark.parametrize("wide", [False, True], ids=["strided-lanes", "wide"])
@pytest.mark.parametrize("stage", [False, True], ids=["rows", "staged"])
def test_metal_emulated_matches_reference(tmp_path, wide, stage):
    emu, splits = Emulator(tmp_path / "a"), []
    (tmp_path / "a").mkdir()
    for c, case in enumerate(EMULATED):
        args = case.arrays(c)
        split = case.nsplit > 1
        inst = ad.instance(case.dtype, case.dtype, case.dtype, case.B, case.Hq, case.Hkv, case.D, case.rope, case.theta,
                           1e-6, case.D**-0.5, split, rows=bool(case.starts), tokens=case.tokens, wide=wide,
                           stage=stage)
        threads = 32 * (case.Hq // case.Hkv)
        B, L, Hq, ns, D = case.B, case.tokens, case.Hq, case.nsplit, case.D
        shapes = [(B, L, Hq * D) if not split else (1,), (B, case.Hkv, L, D), (B, case.Hkv, L, D),
                  (B * L, Hq, ns, D) if split else (1,), (B * L, Hq, ns, 2) if split else (1,)]
        plane, zero = mx.array([case.plane], dtype=mx.int32), mx.array([0], dtype=mx.int32)
        rows = [r for r in case.rows() if r is not None] or [zero, zero]
        emu.add(ad.SPEC, inst, [*args, plane, *rows], (B * L * case.Hkv * ns * threads, 1, 1), (threads, 1, 1), shapes)
    first = emu.run()
    second = Emulator(tmp_path / "b", packed_twins=True)  # each split case's partials merged by attn_combine and
    # by qmv_attn (o_proj's weight also packed where it packs: bit for bit the same)
    (tmp_path / "b").mkdir()
    for c, case in enumerate(EMULATED):
        if case.nsplit > 1:
            proj = case.arrays(c)[0]
            inst = ad.combine_instance(case.dtype, case.B, case.Hq, case.Hkv, case.D, case.nsplit)
            threads = 32 * ad.COMBINE_WARPS
            rows_ = case.B * case.tokens
            n = second.add(ad.COMBINE_SPEC, inst, [first[c][3], first[c][4], proj], (rows_ * case.Hq * threads, 1, 1),
                           (threads, 1, 1), [(case.B, case.tokens, case.Hq * case.D)])
            o_proj, res = _o_proj(case, c)
            inst, grid, group = _qmv_attn_launch(case, o_proj)
            m = second.add(qmv.ATTN_SPEC, inst, [first[c][3], first[c][4], proj, *o_proj[:3], res], grid, group,
                           [res.shape])
            splits.append((c, n, m))
    outs = second.run() if splits else []
    merged = {c: (outs[n][0], outs[m][0]) for c, n, m in splits}
    for c, case in enumerate(EMULATED):
        ref = case.reference(case.arrays(c))
        out = merged[c][0] if case.nsplit > 1 else first[c][0]
        _check(case, (out, first[c][1], first[c][2]), ref)
        if case.nsplit > 1:
            o_proj, res = _o_proj(case, c)
            _check_projected(case, merged[c][1], ref[0], o_proj, res)


def _o_proj(case, seed):
    """An odd-sized quantized output projection [N, Hq*D] (4-bit, or 8-bit for even seeds) and its residual."""
    k = mx.random.split(mx.random.key(100 + seed), 2)
    N, K = 37 + 2 * seed, case.Hq * case.D
    w, scales, biases = mx.quantize(mx.random.normal((N, K), key=k[0]) * 0.05, group_size=32, bits=8 if seed % 2 == 0 else 4)
    res = mx.random.normal((case.B, case.tokens, N), key=k[1]).astype(case.dtype)
    return (w, scales, biases, 8 if seed % 2 == 0 else 4), res


def _qmv_attn_launch(case, o_proj):
    w, scales, biases, bits = o_proj
    M, K, N = kernels.row_bucket(case.B * case.tokens), case.Hq * case.D, w.shape[0]
    inst = qmv.attn_instance(case.dtype, scales.dtype, M, case.Hq, case.Hkv, case.D, N, bits, 32, case.nsplit)
    p = qmv.plan(M, K, N, bits, qmv.ATTN_MIN_BLOCKS)
    return inst, (p["blocks"] * 32 * p["WARPS"], 1, 1), (32 * p["WARPS"], 1, 1)


def _check_projected(case, got, attn_ref, o_proj, res):
    """qmv_attn's output against residual + the reference attention's output through the float32 oracle GEMV."""
    w, scales, biases, bits = o_proj
    with mx.stream(mx.cpu):
        want = res.astype(F32) + reference.quantized_matmul_oracle(
            attn_ref, w, scales.astype(F32), biases.astype(F32), group_size=32, bits=bits)
    assert got.shape == res.shape and got.dtype == case.dtype
    err = _rel(got, want)
    assert err < TOL[case.dtype], f"{case}: qmv_attn relative error {err:.2e}"


@pytest.mark.parametrize("tokens", [1, 3])
def test_reference_matches_the_unfused_attention(tokens):
    """The reference op equals the model's plain path: norms, RoPE, KVCache update, mx.fast SDPA (causal over the new
    tokens), gate."""
    case = Case(2, 6, 2, 64, 16, 300, 37, tokens=tokens)
    proj, qn, kn, keys, values, offset = case.arrays(3)
    D, Hq, Hkv, B, L = case.D, case.Hq, case.Hkv, case.B, tokens
    out, k_new, v_new = reference.attention_decode(proj, qn, kn, 1e-6, keys, values, offset, **case.kw())
    cache = KVCache()
    cache.update_and_fetch(keys[:, :, :37], values[:, :, :37])
    q, k, v = mx.split(proj, [Hq * 2 * D, Hq * 2 * D + Hkv * D], axis=-1)
    q, gate = mx.split(q.reshape(B, L, Hq, 2 * D), 2, axis=-1)
    q = mx.fast.rope(mx.fast.rms_norm(q, qn, 1e-6).transpose(0, 2, 1, 3), 16, traditional=False, base=1e4, scale=1.0,
                     offset=37)
    k = mx.fast.rope(mx.fast.rms_norm(k.reshape(B, L, Hkv, D), kn, 1e-6).transpose(0, 2, 1, 3), 16, traditional=False,
                     base=1e4, scale=1.0, offset=37)
    kk, vv = cache.update_and_fetch(k, v.reshape(B, L, Hkv, D).transpose(0, 2, 1, 3))
    plain = mx.fast.scaled_dot_product_attention(q, kk, vv, scale=D**-0.5, mask="causal" if L > 1 else None)
    plain = plain.transpose(0, 2, 1, 3).reshape(B, L, -1) * mx.sigmoid(gate.reshape(B, L, -1))
    assert _rel(out, plain) < 1e-5 and mx.array_equal(k_new, k).item()


def test_model_decode_matches_the_generic_path(monkeypatch):
    """Greedy decoding of the embedded model through the fused-attention op (on CPU its reference)
    against the model with that branch off (the generic cache path)."""
    from lily_mlx import model as model_mod

    model, _ = lily_mlx.load_model(EMBEDDED_MODEL, dtype=mx.float32)  # float32: the bounds are float rounding

    def run():
        cache = model.make_cache()
        logits = [model(mx.array([[5, 9, 33, 7, 101, 2]]), cache=cache)[:, -1]]
        for t in range(6):
            logits.append(model(mx.argmax(logits[-1], -1)[:, None], cache=cache)[:, -1])
        return mx.stack(logits)

    calls = []
    real = ops.attention_decode
    monkeypatch.setattr(ops, "attention_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    fused = run()
    assert len(calls) == 6, "the decode steps did not take ops.attention_decode"
    monkeypatch.setattr(model_mod, "_decode_kv", lambda cache, mask: None)
    assert _rel(fused, run()) < 1e-5


def test_splits_and_unsupported():
    assert ad.splits(1, 2, 20) == 1 and ad.splits(1, 2, ad.SINGLE_MAX) == 1
    assert ad.splits(1, 2, 4096) == ad.TARGET_BLOCKS // 2 and ad.splits(1, 2, 1000) == math.ceil(1001 / ad.MIN_CHUNK)
    assert ad.splits(1, 2, 300) == math.ceil(301 / ad.MIN_CHUNK) and ad.splits(256, 2, 4096) == 2
    case = Case(1, 4, 2, 32, 8, 16, 5)
    args = list(case.arrays())

    def why(i=None, value=None, **kw):
        a = list(args)
        if i is not None:
            a[i] = value
        k = dict(case.kw(), **kw)
        return ad.unsupported(a[0], a[1], a[2], 1e-6, a[3], a[4], a[5], k["n_heads"], k["n_kv_heads"], k["rope_dims"],
                              k["scale"], k["plane"])

    assert why() is None
    assert "plane" in why(plane=1) and "plane" in why(plane=-1)  # one plane of one row
    stacked = [mx.concatenate([args[i]] * 3) for i in (3, 4)]  # three planes of one row

    def why_stacked(plane, proj=args[0]):
        return ad.unsupported(proj, args[1], args[2], 1e-6, *stacked, args[5], 4, 2, 8, 0.1, plane)

    assert why_stacked(2) is None and "plane 3" in why_stacked(3)
    assert "not planes" in why_stacked(0, mx.concatenate([args[0]] * 2))  # 3 rows are not planes of 2
    assert "heads" in why(n_heads=5)
    assert "head_dim" in why(rope_dims=7)
    assert "proj" in why(0, args[0][..., 1:])
    assert "offset" in why(5, mx.array(5))
    assert "dtypes" in why(4, args[4].astype(BF16))
    assert "shared memory" in ad.unsupported(mx.zeros((1, 1, 32 * 2 * 512 + 2 * 512)), mx.ones(512), mx.ones(512), 1e-6,
                                             mx.zeros((1, 1, 4, 512)), mx.zeros((1, 1, 4, 512)), args[5], 32, 1, 64, 0.1)
    assert ad.attention_decode(*args[:3], 1e-6, *args[3:5], mx.array(5), backend="cuda", **case.kw()) is None


def test_attention_decode_add_folds_the_merge_only_for_short_caches(monkeypatch):
    """ops.attention_decode_add with qmv_attn on: a split short cache merges inside o_proj (attn_decode, qmv_attn),
    a long one through attn_combine and qmv; off, or on the CPU, the unfused path."""
    launched = []

    def standin(name, backend, inputs, template, grid, group, output_shapes, output_dtypes, init_value=None):
        launched.append(name)
        return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

    def run(cap, on):
        case = Case(1, 16, 2, 256, 64, cap, cap - 1, BF16, theta=1e7)
        args = case.arrays(1)
        w, scales, biases = mx.quantize(mx.random.normal((96, 16 * 256)) * 0.05, group_size=64, bits=4)
        res = mx.zeros((1, 1, 96), BF16)
        launched.clear()
        with ops.switched("qmv_attn", on):
            h, k_new, v_new = ops.attention_decode_add(*args[:3], 1e-6, *args[3:], (w, scales, biases), res,
                                                       group_size=64, bits=4, **case.kw())
        assert h.shape == (1, 1, 96) and k_new.shape == (1, 2, 1, 256)
        return list(launched)

    monkeypatch.setattr(kernels, "call", standin)
    monkeypatch.setattr(ops, "backend", lambda: "cuda")
    assert run(256, True) == ["attn_decode", "qmv_attn"]
    assert run(4096, True) == ["attn_decode", "attn_combine", "qmv"]  # 256 splits: past ad.FOLD_MAX_SPLITS
    assert run(256, False) == ["attn_decode", "attn_combine", "qmv"]
    monkeypatch.setattr(ops, "backend", lambda: "cpu")
    assert run(256, True) == []


# ---- on the GPU ----------------------------------------------------------------------------------

GPU_CASES = EMULATED + [
    Case(1, 16, 2, 256, 64, 30, 20, BF16, theta=1e7),  # 35B-A3B, a few cached tokens: one launch
    Case(1, 16, 2, 256, 64, 300, 200, BF16, theta=1e7),
    Case(1, 16, 2, 256, 64, 4096, 3001, BF16, theta=1e7),  # split over 256 blocks per kv head
    Case(2, 16, 2, 256, 64, 1024, 1024, F32, theta=1e7),
    Case(1, 16, 2, 256, 64, 4096, 3001, BF16, theta=1e7, planes=10, plane=7),  # the stacked 35B layout
    Case(8, 16, 2, 256, 64, 512, 300, BF16, theta=1e7, starts=[0, 3, 17, 100, 150, 200, 250, 299]),  # server batch
]


def _gpu(backend, case):
    args = case.arrays(7)
    got = ad.attention_decode(*args[:3], 1e-6, *args[3:], backend=backend, init_value=float("nan"), **case.kw())
    assert got is not None, f"attn_decode declined {case}"
    _check(case, got, case.reference(args))


# attn_decode_wide on: the cases whose lanes take whole 16-byte loads (D/32 dims of 8 bf16 or 4+ float32).
WIDE_CASES = [c for c in GPU_CASES if (c.D // 32) * (2 if c.dtype != F32 else 4) % 16 == 0]


@pytest.mark.cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=repr)
def test_attn_decode_cuda(case):
    with ops.switched("attn_decode_wide", False):
        _gpu("cuda", case)


@pytest.mark.metal
@pytest.mark.parametrize("case", GPU_CASES, ids=repr)
def test_attn_decode_metal(case):
    with ops.switched("attn_decode_wide", False):
        _gpu("metal", case)


@pytest.mark.cuda
@pytest.mark.parametrize("case", WIDE_CASES, ids=repr)
def test_attn_decode_wide_cuda(case):
    with ops.switched("attn_decode_wide", True):
        _gpu("cuda", case)


@pytest.mark.metal
@pytest.mark.parametrize("case", WIDE_CASES, ids=repr)
def test_attn_decode_wide_metal(case):
    with ops.switched("attn_decode_wide", True):
        _gpu("metal", case)


def _gpu_projected(backend, case):
    """attn_decode's split partials merged inside o_proj (qmv_attn) against the reference attention through the
    float32 oracle GEMV, outputs poisoned with NaN."""
    args = case.arrays(7)
    got = ad.attention_decode(*args[:3], 1e-6, *args[3:], backend=backend, init_value=float("nan"), merge=False,
                              **case.kw())
    assert got is not None and isinstance(got[0], tuple), f"attn_decode did not split {case}"
    o_proj, res = _o_proj(case, 3)
    y = qmv.qmv_attn(*got[0], args[0], *o_proj[:3], res, n_kv_heads=case.Hkv, group_size=32, bits=o_proj[3],
                     backend=backend, init_value=float("nan"))
    if case.B * case.tokens > qmv.MAX_M:  # past qmv's rows the model merges with attn_combine and MLX's matmul
        assert y is None, f"qmv_attn took {case.B * case.tokens} rows"
        return
    assert y is not None, f"qmv_attn declined {case}"
    _check_projected(case, y, case.reference(args)[0], o_proj, res)


# The GPU splits as planned (a case's forced nsplit is the emulator's): the cases whose cache the plan splits.
SPLIT_GPU_CASES = [c for c in GPU_CASES if ad.splits(c.B, c.Hkv, c.cap) > 1]


@pytest.mark.cuda
@pytest.mark.parametrize("case", SPLIT_GPU_CASES, ids=repr)
def test_qmv_attn_cuda(case):
    _gpu_projected("cuda", case)


@pytest.mark.metal
@pytest.mark.parametrize("case", SPLIT_GPU_CASES, ids=repr)
def test_qmv_attn_metal(case):
    _gpu_projected("metal", case)


def _model_on_vs_off(path):
    """64 greedy tokens with attn_decode and qmv_attn on vs off; the 4-bit model's o_proj takes qmv_attn (its
    256-position cache splits in 17)."""
    model, _ = lily_mlx.load_model(path, dtype=mx.float32)  # float32: the bounds are float rounding
    runs = []
    for on in (True, False):
        with ops.disabled(*([] if on else ["attn_decode"])), ops.switched("qmv_attn", on):
            cache = model.make_cache()
            logits = model(mx.array([[5, 9, 33, 7, 101, 2, 64, 12]]), cache=cache)[:, -1]
            toks = []
            for _ in range(64):
                tok = mx.argmax(logits, -1)[:, None]
                toks.append(tok)
                logits = model(tok, cache=cache)[:, -1]
            runs.append((mx.concatenate(toks, 1), logits))
    assert mx.array_equal(runs[0][0], runs[1][0]).item(), "64 greedy tokens differ with attn_decode and qmv_attn on"
    assert _rel(runs[0][1], runs[1][1]) < 1e-4


MODELS = pytest.mark.parametrize("path", [EMBEDDED_MODEL, EMBEDDED_4BIT_MODEL], ids=["bf16", "4bit"])


@pytest.mark.cuda
@MODELS
def test_model_greedy_with_kernel_cuda(path):
    _model_on_vs_off(path)


@pytest.mark.metal
@MODELS
def test_model_greedy_with_kernel_metal(path):
    _model_on_vs_off(path)
