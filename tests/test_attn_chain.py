"""attn_chain / attn_chain_long (a gated-attention layer's decode half in one launch: input norm + fused q|k|v
projection, split attention, the splits' merge inside o_proj or through attn_combine, the residual add) against the
references, phase by phase: the projection against the float32 oracle GEMV, the attention (fed the kernel's own
projection) as tests/test_attn_decode.py checks attn_decode, h against the residual plus the oracle GEMV of the
reference attention.

CPU: the kernels' Metal sources on the shim's SIMT emulator, threadgroups in index order or last first, outputs
poisoned with NaN, the counters read back zero; the dispatcher rules. `cuda` / `metal`: the same through MLX, two
launches in one eval (tests/counters.py), and the embedded models' decode steps with the switch on vs off.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from lily_mlx import ops
from lily_mlx.ops import attn_chain as ac
from lily_mlx.ops import attn_decode as ad
from lily_mlx.ops import kernels, reference
from emulator import GXX, Emulator
from counters import assert_launches_agree
from switch_ab import assert_chain_decodes, decode_rel_err
from test_attn_decode import BF16, F16, F32, TOL, Case, _check, _rel

NAN = float("nan")

# (Case, K, bits, group of the input projection, H, bits of the output one). Query groups 2, 3, 1 and 8; D 32..96;
# B 1 to 3; an empty cache, a full one, empty splits, stacked planes, a left-padded batch; float32, bf16 and float16.
CASES = [
    (Case(1, 4, 2, 32, 8, 16, 5, nsplit=2), 96, 4, 32, 70, 4),
    (Case(2, 6, 2, 64, 16, 40, 37, BF16, nsplit=3), 256, 8, 64, 37, 8),
    (Case(3, 8, 1, 32, 32, 7, 0, nsplit=1), 64, 4, 32, 45, 4),
    (Case(1, 3, 3, 96, 32, 70, 64, F16, nsplit=4), 128, 8, 32, 33, 4),
    (Case(2, 4, 2, 32, 8, 9, 3, F32, nsplit=5), 96, 4, 32, 64, 4),  # 4 positions over 5 splits: one split is empty
    (Case(2, 6, 2, 64, 16, 40, 37, BF16, nsplit=3, planes=3, plane=2), 256, 4, 64, 40, 4),
    (Case(3, 6, 2, 64, 16, 40, 37, BF16, nsplit=3, starts=[0, 20, 36]), 128, 4, 32, 37, 8),
    # A speculative verify's tokens.
    (Case(1, 4, 2, 32, 8, 16, 5, nsplit=2, tokens=3), 96, 4, 32, 70, 4),
    (Case(2, 6, 2, 64, 16, 40, 30, BF16, nsplit=3, tokens=2, starts=[0, 12]), 256, 8, 64, 37, 8),
]
MODEL = [(Case(B, 16, 2, 256, 64, cap, off, dt, theta=1e7), 2048, 4, 64, 2048, 4)
         for B, cap, off, dt in ((1, 256, 200, BF16), (1, 4096, 3001, BF16), (2, 512, 300, F32))]


def _inputs(case, K, bits, gs, H, obits, seed=0):
    """x [B, 1, K], the input norm (weight, eps), the quantized projections (q|k|v [PW, K] scaled so that proj is
    O(1); o_proj [H, Hq*D]), the cache arrays (keys, values, offset) of the attention case and the residual
    [B, 1, H] (H is not K here, so a kernel mixing up the two fails)."""
    T, PW = case.dtype, case.Hq * 2 * case.D + 2 * case.Hkv * case.D
    k = mx.random.split(mx.random.key(seed), 5)
    x = (mx.random.normal((case.B, case.tokens, K), key=k[0]) * 2).astype(T)
    norm = ((1 + 0.2 * mx.random.normal((K,), key=k[1])).astype(T), 1e-6)
    w, s, b = mx.quantize(mx.random.normal((PW, K), key=k[2]) * (2.0 / K ** 0.5), group_size=gs, bits=bits)
    ow, os_, ob = mx.quantize(mx.random.normal((H, case.Hq * case.D), key=k[3]) * 0.05, group_size=32, bits=obits)
    _, qn, kn, keys, values, offset = case.arrays(seed)
    res = mx.random.normal((case.B, case.tokens, H), key=k[4]).astype(T)
    return (x, norm, (w, s.astype(BF16), b.astype(BF16), bits, gs), qn, kn, keys, values, offset,
            (ow, os_.astype(BF16), ob.astype(BF16), obits, 32), res)


def _oracle(x, q):
    w, s, b, bits, gs = q
    with mx.stream(mx.cpu):
        return reference.quantized_matmul_oracle(x, w, s.astype(F32), b.astype(F32), group_size=gs, bits=bits).astype(F32)


def _check_chain(case, inputs, got, fold):
    """Phase by phase: proj against the oracle; k_new, v_new and the attention (attn_combine's out in the long variant)
    from the kernel's proj against the reference; h against x + the oracle GEMV of that reference attention."""
    x, norm, qkv, qn, kn, keys, values, offset, o_proj, res = inputs
    k_new, v_new, part_acc, part_ml, proj = got[:5]
    with mx.stream(mx.cpu):
        xn = reference.rms_norm(x, norm[0], norm[1])
    err = _rel(proj, _oracle(xn, qkv))
    assert err < (1e-5 if case.dtype == F32 else 8e-3), f"{case}: projection rel err {err:.2e}"
    ref = case.reference((proj, qn, kn, keys, values, offset))
    attn = ref[0] if fold else got[5]
    _check(case, (attn, k_new, v_new), ref)
    h = got[-1]
    assert h.shape == res.shape and h.dtype == case.dtype
    err = _rel(h, res.astype(F32) + _oracle(ref[0], o_proj))
    assert err < TOL[case.dtype], f"{case}: h rel err {err:.2e}"


def _emulated_launch(case, inputs, fold, prefetch=False, sms=None, kv_write=False, stage=False):
    x, norm, qkv, qn, kn, keys, values, offset, o_proj, res = inputs
    B, L, Hq, Hkv, D, K = case.B, case.tokens, case.Hq, case.Hkv, case.D, x.shape[-1]
    H, obits = o_proj[0].shape[0], o_proj[3]
    p = ac.plan(kernels.row_bucket(B * L), K, Hq, Hkv, D, qkv[3], H, obits, fold, sms)
    inst = ac.instance(case.dtype, case.dtype, qn.dtype, norm[0].dtype, BF16, BF16, B, K, qkv[3], qkv[4], Hq, Hkv, D,
                       case.rope, case.theta, 1e-6, norm[1], D**-0.5, H, obits, 32, fold, bool(case.starts), p=p,
                       tokens=L, prefetch=prefetch, kv_write=kv_write, stage=stage)
    zero = mx.array([0], dtype=mx.int32)
    rows = [r for r in case.rows() if r is not None] or [zero, zero]
    args = [x, *qkv[:3], norm[0], qn, kn, keys, values, offset, mx.array([case.plane], dtype=mx.int32), *rows,
            *o_proj[:3], res, mx.zeros((kernels.SYNC_SLOTS,), dtype=mx.int32)]
    ns, PW = case.nsplit, qkv[0].shape[0]
    shapes = [(B, Hkv, L, D), (B, Hkv, L, D), (B * L, Hq, ns, D), (B * L, Hq, ns, 2), (B, L, PW)] + \
        ([] if fold else [(B, L, Hq * D)]) + [res.shape]
    threads = 32 * p["WARPS"]
    grid = (ac.blocks(p, B * L, Hq, Hkv, ns, fold) * threads, 1, 1)
    return ac.SPEC if fold else ac.LONG_SPEC, inst, args, grid, (threads, 1, 1), shapes


@pytest.mark.skipif(GXX is None, reason="g++ is not installed")
@pytest.mark.parametrize("stage", [False, True], ids=["rows", "staged"])
def test_chain_emulated_matches_reference(tmp_path, stage):
    """Both variants, every case, threadgroups in index order or last first; the counters come back zero; the cases
    whose weights pack also with packed weights, bit for bit the same. Both with the split's cached rows read by each
    warp and staged in shared memory (STAGE, which the planner takes for long splits only)."""
    emu, checks = Emulator(tmp_path, packed_twins=True), []
    # Then two with chain_prefetch's L2 hints (none on Metal: the same values, through the same body), and one planned
    # for a GPU of 2 SMs (the projection's 288 one-warp blocks fitted to one wave: 9 rows a lane segment, not 1).
    runs = [(c, True, False, None) for c in CASES] + [(c, False, False, None) for c in CASES]
    runs += [(CASES[0], f, True, None) for f in (1, 0)] + [(CASES[3], True, False, 2)]
    for n, (c, fold, prefetch, sms) in enumerate(runs):
        case, K, bits, gs, H, obits = c
        inputs = _inputs(case, K, bits, gs, H, obits, seed=n)
        spec, inst, args, grid, group, shapes = _emulated_launch(case, inputs, fold, prefetch, sms, stage=stage)
        assert sms is None or dict(inst.template)["RPS"] == 9
        emu.add(spec, inst, args, grid, group, shapes, reversed_groups=n % 2 == 1, read_back=(len(args) - 1,))
        checks.append((case, inputs, fold))
    for (case, inputs, fold), (*got, sync) in zip(checks, emu.run()):
        _check_chain(case, inputs, got, fold)
        assert not np.array(sync).any(), f"{case}: counters left at {np.array(sync)}"


@pytest.mark.skipif(GXX is None, reason="g++ is not installed")
def test_chain_kv_write_emulated(tmp_path):
    """KVW (switch kv_write): the outputs as without it, and keys and values, read back after the launch, hold k_new and
    v_new at columns offset .. offset + T - 1 of the layer's plane and everything else as before (one token, several
    tokens, stacked planes, a left-padded batch; both variants, threadgroups in index order or last first)."""
    emu, checks = Emulator(tmp_path), []
    for n, (c, fold) in enumerate([(CASES[0], True), (CASES[5], False), (CASES[6], True), (CASES[7], False),
                                   (CASES[8], True)]):
        case, K, bits, gs, H, obits = c
        inputs = _inputs(case, K, bits, gs, H, obits, seed=n)
        spec, inst, args, grid, group, shapes = _emulated_launch(case, inputs, fold, kv_write=True)
        assert dict(inst.template)["KVW"]
        keys_at, values_at = spec.input_names.index("keys"), spec.input_names.index("values")
        emu.add(spec, inst, args, grid, group, shapes, reversed_groups=n % 2 == 1,
                read_back=(len(args) - 1, keys_at, values_at))
        checks.append((case, inputs, fold))
    for (case, inputs, fold), (*got, sync, keys, values) in zip(checks, emu.run()):
        _check_chain(case, inputs, got, fold)
        assert not np.array(sync).any(), f"{case}: counters left at {np.array(sync)}"
        before = inputs[5:7]
        off, B, L = int(inputs[7][0]), case.B, case.tokens
        planes = slice(case.plane * B, (case.plane + 1) * B)
        for new, after, old in zip(got[:2], (keys, values), before):
            want = np.array(old.astype(F32))  # exact: every dtype here widens to float32 exactly
            want[planes, :, off:off + L, :] = np.array(new.astype(F32))
            assert np.array_equal(np.array(after.astype(F32)), want), f"{case}: the cache after the launch"


def test_plan_at_the_35b_shape():
    """8-warp blocks (attn_decode's: a warp per query head of a kv head): the 9,216 q|k|v rows in 288 blocks of 32,
    o_proj's 2,048 rows in qmv_attn's 128 blocks (folded) or qmv's 256 (long); only an unsplit cache folds: a
    256-position cache's 17 splits, like a 4,096-position one's 256, go through attn_combine's 16 blocks."""
    fold, long = (ac.plan(1, 2048, 16, 2, 256, 4, 2048, 4, f) for f in (True, False))
    assert fold["WARPS"] == 8 and (fold["qkv"]["LANES"], fold["qkv"]["RPS"], fold["qkv"]["blocks"]) == (32, 4, 288)
    # On 132 SMs of two blocks each (MAX_REGISTERS): 40 rows a block fit the projection in one wave, o_proj unchanged.
    fitted = ac.plan(1, 2048, 16, 2, 256, 4, 2048, 4, True, 132)
    assert (fitted["qkv"]["RPS"], fitted["qkv"]["blocks"], fitted["out"]) == (5, 231, fold["out"])
    assert ac.plan(2, 2048, 16, 2, 256, 4, 2048, 4, True, 132) == ac.plan(2, 2048, 16, 2, 256, 4, 2048, 4, True)
    assert fold["out"]["blocks"] == 128 and long["out"]["blocks"] == 256
    assert ad.splits(1, 2, 32) == ac.FOLD_MAX_SPLITS < ad.splits(1, 2, 256) == 17 <= ad.FOLD_MAX_SPLITS
    assert ac.blocks(fold, 1, 16, 2, 17, True) == 288 + 34 + 128
    assert ac.blocks(long, 1, 16, 2, 256, False) == 288 + 512 + 16 + 256
    for f in (True, False):  # under Metal's threadgroup memory at every decode batch
        assert all(ac.shared_bytes(M, 2048, 16, 2, 256, 4, 4, f) <= 32768 for M in (1, 2, 4, 8))


def test_unsupported_arguments_are_declined():
    case, K, bits, gs, H, obits = CASES[0]
    x, norm, qkv, qn, kn, keys, values, offset, o_proj, res = _inputs(case, K, bits, gs, H, obits)

    def why(x=x, norm=norm, qkv=qkv, keys=keys, o_proj=o_proj, residual=res, **kw):
        k = dict(case.kw(), **kw)
        return ac.unsupported(x, norm, qkv, qn, kn, 1e-6, keys, values, offset, o_proj, residual, k["n_heads"],
                              k["n_kv_heads"], k["rope_dims"], k["scale"], k["plane"])

    assert why() is None
    assert "input norm" in why(norm=None) and "input norm" in why(residual=None)
    assert "bits=3" in why(qkv=(*qkv[:3], 3, gs))
    assert "proj" in why(qkv=tuple(a[:-1] for a in qkv[:3]) + qkv[3:])  # a row short of [q | gate, k, v]
    assert "heads" in why(n_heads=5)
    assert "output projection" in why(o_proj=(*o_proj[:3], 3, 32))
    assert "output projection" in why(residual=res[..., :-1])  # o_proj's rows are not the residual's width
    assert "[B, T <= 8, K]" in why(x=x.reshape(1, 1, 1, -1))
    assert ac.decode_add(x, None, qkv, qn, kn, 1e-6, keys, values, offset, o_proj, res, backend="cuda",
                         **{k: v for k, v in case.kw().items() if k not in ("row_start", "row_pos")}) is None


def test_blocks_fit_the_register_cap():
    """attn_chain's CUDA lanes at one row (M 1) are capped at MAX_REGISTERS (__maxnreg__ in the instance's header),
    so a block of more than 16 warps (query heads a kv head) could not launch: declined, 16 taken."""
    for spec in (ac.SPEC, ac.LONG_SPEC):
        for M, cap in ((1, ac.MAX_REGISTERS), (2, 0)):
            assert kernels.register_cap(spec, (("M", M),)) == cap
            cap_of = kernels.register_cap(spec, {"M": M})
            headers = {b: kernels.spec_header(spec, b, "", cap_of) for b in ("cuda", "metal")}
            assert (f"__maxnreg__({cap})" in headers["cuda"]) == (cap > 0) and "__maxnreg__" not in headers["metal"]
        inst = next(i for i in spec.instances() if dict(i.template)["M"] == 1)
        assert f"__maxnreg__({ac.MAX_REGISTERS})" in kernels.full_source(spec, "cuda", inst)[1]
    for Hq, declined in ((16, False), (17, True), (20, True)):
        case = Case(1, Hq, 1, 32, 8, 16, 5, nsplit=2)
        x, norm, qkv, qn, kn, keys, values, offset, o_proj, res = _inputs(case, 96, 4, 32, 70, 4)
        k = case.kw()
        why = ac.unsupported(x, norm, qkv, qn, kn, 1e-6, keys, values, offset, o_proj, res, k["n_heads"],
                             k["n_kv_heads"], k["rope_dims"], k["scale"], k["plane"])
        assert (why is not None and "registers" in why) == declined, (Hq, why)


def test_dispatch_picks_the_variant_by_the_splits(monkeypatch):
    """ops.attention_decode_add: attn_chain is on by default on CUDA, needs a source and attn_decode and qmv on, folds
    the merge into o_proj for an unsplit cache with qmv_attn on and takes attn_chain_long for a split one or with
    qmv_attn off; the projection is then never built. Declined, the unchained path runs on the built projection."""
    launched, built = [], []

    def standin(name, backend, inputs, template, grid, group, output_shapes, output_dtypes, init_value=None):
        launched.append(name)
        return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

    monkeypatch.setattr(kernels, "call", standin)
    monkeypatch.setattr(ops, "backend", lambda: "cuda")

    def run(cap, source=True):
        case = Case(1, 16, 2, 256, 64, cap, cap - 1, BF16, theta=1e7)
        x, norm, qkv, qn, kn, keys, values, offset, o_proj, res = _inputs(case, 2048, 4, 64, 96, 4)
        proj = lambda: built.append(1) or mx.zeros((1, 1, qkv[0].shape[0]), BF16)
        launched.clear()
        built.clear()
        h, k_new, v_new = ops.attention_decode_add(
            proj, qn, kn, 1e-6, keys, values, offset, o_proj[:3], res, group_size=32, bits=4,
            source=(x, norm, qkv) if source else None, **case.kw())
        assert h.shape == (1, 1, 96) and k_new.shape == v_new.shape == (1, 2, 1, 256)
        return list(launched), len(built)

    with ops.switched("attn_chain", False):
        assert run(256) == (["attn_decode", "qmv_attn"], 1)
    assert run(256) == (["attn_chain_long"], 0)  # on by default
    with ops.switched("attn_chain", True):
        assert run(32) == (["attn_chain"], 0)
        assert run(256) == (["attn_chain_long"], 0)  # unchained, this cache's 17 splits would fold (qmv_attn)
        assert run(4096) == (["attn_chain_long"], 0)
        assert run(256, source=False) == (["attn_decode", "qmv_attn"], 1)
        with ops.disabled("qmv_attn"):
            assert run(32) == (["attn_chain_long"], 0)
        for off in ("attn_decode", "qmv"):
            with ops.disabled(off):
                assert "attn_chain" not in run(256)[0][0]


def test_plan_override_sets_the_attention_phases_blocks(monkeypatch, kernel_env):
    """A long cache's attention phase splits into about ac.TARGET_BLOCKS blocks, or n under LILY_MLX_PLAN=
    attn_chain.BLOCKS=n (the grid and the partials follow); a short cache stays whole."""
    seen = []

    def standin(name, backend, inputs, template, grid, group, output_shapes, output_dtypes, init_value=None):
        seen.append((output_shapes[2][2], grid[0] // group[0]))
        return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

    monkeypatch.setattr(kernels, "call", standin)

    def splits(cap):
        case = Case(1, 16, 2, 256, 64, cap, cap - 1, BF16, theta=1e7)
        x, norm, qkv, qn, kn, keys, values, offset, o_proj, res = _inputs(case, 2048, 4, 64, 96, 4)
        seen.clear()
        ac.decode_add(x, norm, qkv, qn, kn, 1e-6, keys, values, offset, o_proj, res, backend="cuda", **case.kw())
        return seen[0]

    default = splits(4096)
    assert default[0] == ac.TARGET_BLOCKS // 2 == ad.splits(1, 2, 4096, ac.TARGET_BLOCKS) == 128
    kernel_env(kernels.PLAN_ENV, "attn_chain.BLOCKS=128")
    ns, blocks = splits(4096)
    assert ns == 64 and blocks == default[1] - 2 * (default[0] - 64)  # two kv heads, 64 splits each
    assert splits(32)[0] == 1
    kernel_env(kernels.PLAN_ENV, None)
    assert splits(4096) == default


def _gpu(backend, case, K, bits, gs, H, obits, fold):
    """Right, and assert_launches_agree: launches in one eval on counters of their own, equal, counters zero after."""
    inputs = _inputs(case, K, bits, gs, H, obits)
    x, norm, qkv, qn, kn, keys, values, offset, o_proj, res = inputs
    row_start, row_pos = case.rows()
    kw = dict(case.kw(), row_start=row_start, row_pos=row_pos)
    run = lambda: ac.decode_add(x, norm, qkv, qn, kn, 1e-6, keys, values, offset, o_proj, res, fold=fold,
                                backend=backend, init_value=NAN, **kw)
    assert run() is not None, f"attn_chain declined {case}"
    first = assert_launches_agree(run, str(case))
    _check_chain(case, inputs, first, fold and ad.splits(case.B * case.tokens, case.Hkv, case.cap) <= ac.FOLD_MAX_SPLITS)
    return first


def test_chain_prefetch_switch_reaches_the_template():
    """chain_prefetch (opt-in) builds the launch with PF = 1, and only then."""
    case, K, bits, gs, H, obits = MODEL[0]
    x, norm, qkv, qn, kn, keys, values, offset, o_proj, res = _inputs(case, K, bits, gs, H, obits)
    kw = {k: v for k, v in case.kw().items() if k not in ("row_start", "row_pos")}  # as decode_add passes them
    rows = None if case.rows()[0] is None else case.rows()
    launch = lambda: dict(ac._launch(x, norm, qkv, qn, kn, 1e-6, keys, values, offset, o_proj, res, kw, rows,
                                     True)[1])["PF"]
    assert not ops.enabled("chain_prefetch") and launch() == 0
    with ops.switched("chain_prefetch", True):
        assert launch() == 1
    assert launch() == 0


GPU_CASES = CASES + MODEL  # the cache split as planned (the emulated cases force theirs)


@pytest.mark.cuda
@pytest.mark.parametrize("fold", [True, False], ids=["fold", "long"])
@pytest.mark.parametrize("case,K,bits,gs,H,obits", GPU_CASES, ids=repr)
def test_chain_cuda(case, K, bits, gs, H, obits, fold):
    _gpu("cuda", case, K, bits, gs, H, obits, fold)


@pytest.mark.metal
@pytest.mark.parametrize("fold", [True, False], ids=["fold", "long"])
@pytest.mark.parametrize("case,K,bits,gs,H,obits", GPU_CASES, ids=repr)
def test_chain_metal(case, K, bits, gs, H, obits, fold):
    _gpu("metal", case, K, bits, gs, H, obits, fold)


@pytest.mark.cuda
@pytest.mark.parametrize("case,K,bits,gs,H,obits", MODEL, ids=repr)
def test_chain_wide_cuda(case, K, bits, gs, H, obits):
    with ops.switched("attn_decode_wide", True):
        _gpu("cuda", case, K, bits, gs, H, obits, True)


@pytest.mark.metal
@pytest.mark.parametrize("case,K,bits,gs,H,obits", MODEL, ids=repr)
def test_chain_wide_metal(case, K, bits, gs, H, obits):
    with ops.switched("attn_decode_wide", True):
        _gpu("metal", case, K, bits, gs, H, obits, True)


@pytest.mark.cuda
@pytest.mark.parametrize("fold", [True, False], ids=["fold", "long"])
@pytest.mark.parametrize("case,K,bits,gs,H,obits", CASES[:1] + MODEL, ids=repr)
def test_chain_prefetch_cuda(case, K, bits, gs, H, obits, fold):
    """With chain_prefetch's L2 hints (the cached K/V rows, the output projection) every output is bit for bit the
    launch's without them (and right)."""
    plain = _gpu("cuda", case, K, bits, gs, H, obits, fold)
    with ops.switched("chain_prefetch", True):
        hinted = _gpu("cuda", case, K, bits, gs, H, obits, fold)
    for h, p in zip(hinted, plain):
        assert mx.array_equal(h, p, equal_nan=True).item(), f"{case}: the prefetch hints changed an output"


@pytest.mark.cuda
@pytest.mark.parametrize("fold", [True, False], ids=["fold", "long"])
@pytest.mark.parametrize("case,K,bits,gs,H,obits", GPU_CASES, ids=repr)
def test_chain_staged_cuda(kernel_env, case, K, bits, gs, H, obits, fold):
    """Every split cache's rows through shared memory (attn_decode.STAGE_ROWS=1: the test caches are short of the
    planner's STAGE_MIN_ROWS a split), right as the unstaged launch is."""
    kernel_env(kernels.PLAN_ENV, "attn_decode.STAGE_ROWS=1")
    _gpu("cuda", case, K, bits, gs, H, obits, fold)


def test_stage_follows_the_split_length(kernel_env):
    """STAGE is built for splits of at least STAGE_MIN_ROWS cached positions (or $LILY_MLX_PLAN's), never for one
    unsplit block."""
    assert not ad.staged(4096, 1) and not ad.staged(272, 18) and ad.staged(4352, 128) and ad.staged(16640, 128)
    kernel_env(kernels.PLAN_ENV, "attn_decode.STAGE_ROWS=8")
    assert ad.staged(272, 18) and not ad.staged(100, 18)


@pytest.mark.cuda
def test_decode_with_chain_cuda():
    assert_chain_decodes("attn_chain", "cuda")


@pytest.mark.cuda
def test_decode_with_chain_prefetch_cuda():
    """The embedded model's decode steps with attn_chain, chain_prefetch on vs off: the same logits to the bit."""
    calls = []
    with ops.switched("attn_chain", True):
        err = decode_rel_err("chain_prefetch", dtype=mx.float32, kernel="attn_chain", calls=calls)
    assert any(on for on, _ in calls) and any(not on for on, _ in calls)
    assert err == 0.0, f"decode logits with chain_prefetch: rel err {err:.2e}"


@pytest.mark.metal
def test_decode_with_chain_metal():
    assert_chain_decodes("attn_chain", "metal")
