"""deltanet_chain (a DeltaNet decode token in one launch: input norm + fused projection, then the step) against the
references, phase by phase: the projection against the float32 oracle, the step (fed the kernel's own projection)
as tests/test_deltanet_step.py checks deltanet_step.

CPU: the kernel's Metal source on the shim's SIMT emulator, threadgroups in index order or last first, the counters
read back zero; the dispatcher rules. `cuda` / `metal`: the same through MLX, launches in one eval (tests/counters.py),
and the embedded model's decode steps with the switch on vs off.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from lily_mlx import ops
from lily_mlx.ops import deltanet_chain as dc
from lily_mlx.ops import deltanet_step as ds
from lily_mlx.ops import kernels, qmv, reference
from emulator import GXX, Emulator
from counters import assert_launches_agree
from switch_ab import assert_chain_decodes, decode_rel_err
from test_deltanet_step import BF16, F32, Case, _check_step, picked

NAN = float("nan")

# (Case, K, bits, group): Hk != Hv, Dk != Dv, B 1 and 3, float32 and bf16, a masked batch, 4- and 8-bit projections.
CASES = [
    (Case(1, 1, 3, 64, 32), 96, 4, 32),
    (Case(3, 2, 6, 48, 40, dtypes=(BF16, BF16, F32, BF16, BF16)), 256, 8, 64),
    (Case(3, 1, 3, 64, 32, dtypes=(BF16, BF16, F32, BF16, BF16), masks=[[True, False, True]]), 96, 4, 32),
    (Case(1, 1, 3, 64, 32, tokens=3), 96, 4, 32),  # a speculative verify's tokens
    (Case(2, 2, 6, 48, 40, dtypes=(BF16, BF16, F32, BF16, BF16), tokens=2), 256, 8, 64),
]
MODEL = [(Case(B, 16, 32, 128, 128, dtypes=(t, t, F32, t, t)), 2048, 4, 64) for B, t in ((1, BF16), (3, F32))]
# deltanet_chain_out: the cases whose Hv*Dv a group of 32 divides (the output projection's input).
OUT_CASES = [c for c in CASES if c[0].Hv * c[0].Dv % 32 == 0]
# KEEP (verify_keep): the states before the last of a verify's tokens too.
KEEP_CASE = (Case(2, 1, 3, 64, 32, dtypes=(BF16, BF16, F32, BF16, BF16), tokens=3, keep=True), 96, 4, 32)
KEEP_CASES = [KEEP_CASE, (Case(1, 16, 32, 128, 128, dtypes=(BF16, BF16, F32, BF16, BF16), tokens=2, keep=True), 2048,
                          4, 64)]  # and MTP's 2-token verify of the 35B layer
# ALT (mtp_resident): the states picked on the GPU from two pairs, each pick in turn.
ALT_CASE = (Case(2, 1, 3, 64, 32, dtypes=(BF16, BF16, F32, BF16, BF16), tokens=3, keep=True, alt=True), 96, 4, 32)
ALT_CASES = [ALT_CASE, (Case(1, 16, 32, 128, 128, dtypes=(BF16, BF16, F32, BF16, BF16), tokens=2, keep=True, alt=True),
                        2048, 4, 64)]


def _inputs(case, K, bits, gs, seed=0):
    """x [B, 1, K], the input norm (weight, eps), the quantized projection [PW, K] scaled so that proj is O(1), the
    step's parameters and state, and the mask."""
    T = case.dtypes[0]
    PW = case.C + case.Hv * case.Dv + 2 * case.Hv
    k = mx.random.split(mx.random.key(seed), 3)
    x = (mx.random.normal((case.B, case.tokens, K), key=k[0]) * 2).astype(T)
    norm = ((1 + 0.2 * mx.random.normal((K,), key=k[1])).astype(T), 1e-6)
    w, s, b = mx.quantize(mx.random.normal((PW, K), key=k[2]) * (1.5 / K ** 0.5), group_size=gs, bits=bits)
    conv_state, state = case.initial(seed)
    mask = None if case.masks is None else mx.array(case.masks[0]).reshape(case.B, case.tokens)
    return x, norm, (w, s.astype(BF16), b.astype(BF16), bits, gs), case.params(seed), conv_state, state, mask


def _out_proj(case, K, seed=0):
    """The output projection [K, Hv*Dv] (the residual stream is the layer's input x), group 32."""
    wo = mx.random.normal((K, case.Hv * case.Dv), key=mx.random.key(seed + 77)) * (1.0 / (case.Hv * case.Dv) ** 0.5)
    w, s, b = mx.quantize(wo, group_size=32, bits=4)
    return w, s.astype(BF16), b.astype(BF16), 4, 32


def _matmul_ref(x, q):
    w, s, b, bits, gs = q
    with mx.stream(mx.cpu):
        return reference.quantized_matmul_oracle(x, w, s.astype(F32), b.astype(F32), group_size=gs,
                                                 bits=bits).astype(F32)


def _close(case, what, got, ref):
    assert not mx.isnan(got.astype(F32)).any().item(), f"{case}: unwritten (NaN) {what}"
    err = (mx.linalg.norm((got.astype(F32) - ref).flatten()) / mx.linalg.norm(ref.flatten())).item()
    assert err < (1e-5 if case.dtypes[0] == F32 else 8e-3), f"{case}: {what} rel err {err:.2e}"


def _check(case, x, norm, in_proj, params, conv_state, state, mask, got, out_proj=None):
    """Phase by phase: the projection against the oracle, the step fed the kernel's projection (from the picked
    states: conv_state and state), then (out_proj) h against x + the output projection of the kernel's own step
    output."""
    out, conv_new, state_new, proj = got[:4]
    with mx.stream(mx.cpu):
        xn = reference.rms_norm(x, norm[0], norm[1])
    _close(case, "projection", proj, _matmul_ref(xn, in_proj))
    kept = tuple(got[-2:]) if case.keep else ()  # KEEP's states, after the launch's own outputs
    _check_step(case, 0, (out, conv_new, state_new, *kept), (proj, mask), params, conv_state, state)
    if out_proj is not None:
        assert got[4].dtype == x.dtype and got[4].shape == x.shape
        _close(case, "h", got[4], x.astype(F32) + _matmul_ref(out, out_proj))


@pytest.mark.skipif(GXX is None, reason="g++ is not installed")
def test_chain_emulated_matches_reference(tmp_path):
    """Both variants, every case, threadgroups in index order or last first; the counters come back zero; the cases
    whose weights pack also with packed weights, bit for bit the same."""
    emu, checks = Emulator(tmp_path, packed_twins=True), []
    # Every case, then two with chain_prefetch's L2 hints (none on Metal: the same values, through the same body), and
    # the 35B layer at B 1 planned for 132 SMs (6 rows a lane segment, one wave of 129 projection blocks).
    runs = [(c, False, False, None) for c in CASES] + [(c, True, False, None) for c in OUT_CASES]
    runs += [(CASES[0], False, True, None), (OUT_CASES[0], True, True, None), (MODEL[0], True, False, 132)]
    runs += [(c, with_out, False, None) for c in (KEEP_CASE, ALT_CASE) for with_out in (False, True)]
    for n, ((case, K, bits, gs), with_out, prefetch, sms) in enumerate(runs):
        x, norm, in_proj, params, conv_state, state, mask = _inputs(case, K, bits, gs, seed=n)
        alt = case.alt_inputs(n, n)
        out_proj = _out_proj(case, K, seed=n) if with_out else None
        conv_w, A_log, dt_bias, norm_w = params
        M = kernels.row_bucket(case.B * case.tokens)
        o = None if out_proj is None else (K, 4, 32, BF16)
        PW = in_proj[0].shape[0]
        p = dc.plan(M, K, PW, bits, case.Dk, case.Dv, None if o is None else (case.Hv * case.Dv, K, 4), sms)
        assert sms is None or (p["qmv"]["RPS"], p["proj_blocks"]) == (6, 129)
        inst = dc.instance(x.dtype, BF16, norm[0].dtype, M, K, bits, gs, (conv_w.dtype, A_log.dtype, dt_bias.dtype,
                           norm_w.dtype), case.Hk, case.Hv, case.Dk, case.Dv, case.W, mask is not None, case.eps, norm[1],
                           o, p, prefetch=prefetch, keep=case.keep, alt=case.alt)
        args = [x, *in_proj[:3], norm[0], conv_w, conv_state, A_log, dt_bias, norm_w, state,
                kernels.placeholder(mx.bool_) if mask is None else mask, *(alt or ())]
        shapes = [(case.B, case.tokens, case.Hv * case.Dv), ds.kept_shape(conv_state.shape, case.keep),
                  ds.kept_shape(state.shape, case.keep), (case.B, case.tokens, PW)]
        blocks = p["proj_blocks"] + case.B * case.Hv
        if out_proj is not None:
            args += [*out_proj[:3], x]
            shapes.append(x.shape)
            blocks += p["out"]["blocks"]
        args.append(mx.zeros((kernels.SYNC_SLOTS,), dtype=mx.int32))
        threads = 32 * p["WARPS"]
        spec = (dc.OUT_ALT_SPEC if case.alt else dc.OUT_SPEC) if with_out else (dc.ALT_SPEC if case.alt else dc.SPEC)
        emu.add(spec, inst, args, (blocks * threads, 1, 1), (threads, 1, 1), shapes,
                reversed_groups=n % 2 == 1, read_back=(len(args) - 1,))
        checks.append(((case, x, norm, in_proj, params, *picked(conv_state, state, alt), mask), out_proj))
    for (c, out_proj), (*got, sync) in zip(checks, emu.run()):
        _check(*c, ds.split_kept(got, 1, c[0].keep), out_proj)
        assert not np.array(sync).any(), f"{c[0]}: counters left at {np.array(sync)}"


def test_plan_runs_both_phases_in_the_steps_blocks():
    """At the 35B shape: 16-warp blocks (deltanet_step's), each lane with qmv's own 8 weight chunks in flight (4 rows
    of 2 chunks), so the 12,352 projection rows take 193 blocks of 64, with no persistent loop; the 32 heads after."""
    p = dc.plan(1, 2048, 12352, 4, 128, 128)
    assert p["WARPS"] == p["qmv"]["WARPS"] == 16
    assert (p["qmv"]["LANES"], p["qmv"]["RPS"], p["proj_blocks"]) == (32, 4, 193)
    assert qmv.plan(1, 2048, 12352, 4)["RPS"] == 4  # qmv's own plan: 8 warps, 386 blocks


def test_plan_fits_the_projection_in_one_wave_where_it_can():
    """Given the SMs (a 512-thread block each), the projection at one row of x takes the fewest rows a lane that fit
    one wave, at most 12 weight chunks in flight a lane; where none fits (or 193 blocks already do), the plan stays as
    it was. With more rows of x, a lane's chunks in flight times the rows stay within 12 (no spills at the verify's 2)."""
    wide = lambda sms: dc.plan(1, 2048, 12352, 4, 128, 128, (4096, 2048, 4), sms)  # noqa: E731
    assert (wide(132)["qmv"]["RPS"], wide(132)["proj_blocks"]) == (6, 129)
    assert wide(132)["out"] == wide(None)["out"]  # the output projection's 128 blocks already fit
    for sms in (None, 114, 193, 264):
        assert (wide(sms)["qmv"]["RPS"], wide(sms)["proj_blocks"]) == (4, 193), sms
    assert dc.plan(2, 2048, 12352, 4, 128, 128, None, 132)["qmv"]["RPS"] == 3  # 2 chunks a lane, 2 rows: 3 x 4 = 12
    assert dc.plan(4, 2048, 12352, 4, 128, 128, None, 132)["qmv"]["RPS"] == 3  # x's tile halves K: 1 chunk, 4 rows


def test_cuda_builds_of_four_rows_and_more_get_the_full_registers():
    """From M = 4 rows the chains' CUDA builds say one 512-thread block an SM is enough (ptxas, bounded by threads
    alone, chose 64 registers there: 1.6 KB spilled, 3.2x slower); at one and two rows the bound stays threads alone,
    as those builds were timed. Metal headers carry no bound."""
    for spec in (dc.SPEC, dc.OUT_SPEC, kernels.SPECS["deltanet_chain_out_pb"]):
        for M, bound in ((1, "(512)"), (2, "(512)"), (4, "(512, 1)"), (8, "(512, 1)")):
            cap = kernels.register_cap(spec, {"M": M})
            assert f"__launch_bounds__{bound}\n" in kernels.spec_header(spec, "cuda", "", cap), (spec.name, M)
            assert "__maxnreg__" not in kernels.spec_header(spec, "cuda", "", cap)  # NVRTC rejects it beside a bound
            assert "launch_bounds" not in kernels.spec_header(spec, "metal", "", cap)
    for spec in (dc.SPEC, dc.OUT_SPEC):
        inst = next(i for i in spec.instances() if dict(i.template)["M"] == 4)
        assert "__launch_bounds__(512, 1)" in kernels.full_source(spec, "cuda", inst)[1]


def test_unsupported_arguments_are_declined():
    case, K, bits, gs = CASES[0]
    x, norm, in_proj, params, conv_state, state, mask = _inputs(case, K, bits, gs)
    args = (params[0], conv_state, params[1], params[2], params[3], state, case.Hk, case.eps)
    assert dc.unsupported(x, norm, in_proj, *args) is None
    assert "input norm" in dc.unsupported(x, None, in_proj, *args)
    assert "bits=3" in dc.unsupported(x, norm, (*in_proj[:3], 3, gs), *args)
    assert "shapes" in dc.unsupported(x, norm, tuple(a[:-1] for a in in_proj[:3]) + in_proj[3:], *args)  # a row short
    assert dc.step(x, None, in_proj, *args[:6], num_key_heads=case.Hk, eps=case.eps, backend="cuda") is None


def test_chain_is_opt_in_and_falls_back(monkeypatch):
    """deltanet_chain is off by default; on, ops.deltanet_decode_step hands it the layer's input and does not build the
    projection; declined, or without a source, the projection is built and deltanet_step runs on it."""
    case, K, bits, gs = CASES[0]
    x, norm, in_proj, params, conv_state, state, mask = _inputs(case, K, bits, gs)
    result, built, seen = (mx.zeros((1,)),) * 3, [], []
    monkeypatch.setitem(ops._kernels, "deltanet_chain", lambda *a, **k: seen.append(a[:3]) or result)
    monkeypatch.setitem(ops._kernels, "deltanet_step", lambda proj, *a, **k: (proj,) * 3)
    monkeypatch.setattr(ops, "backend", lambda: "cuda")
    proj = lambda: built.append(1) or mx.ones((1,))

    def decode(source=(x, norm, in_proj)):
        return ops.deltanet_decode_step(proj, params[0], conv_state, params[1], params[2], params[3], state,
                                        num_key_heads=case.Hk, eps=case.eps, source=source)

    assert decode()[0].item() == 1 and built == [1] and not seen
    with ops.switched("deltanet_chain", True):
        assert decode() is result and built == [1] and seen[0][0] is x
        decode(None)
        assert built == [1, 1] and len(seen) == 1
        monkeypatch.setitem(ops._kernels, "deltanet_chain", lambda *a, **k: None)
        assert decode()[0].item() == 1 and built == [1, 1, 1]


def test_chain_out_is_on_for_cuda_and_needs_its_kernels(monkeypatch):
    """ops.deltanet_decode_add tries deltanet_chain_out only when it is on (by default on CUDA, opt-in on Metal) and
    deltanet_step and qmv are not switched off (ablation); otherwise, or declined, it returns None and the layer runs
    the step and its projection."""
    case, K, bits, gs = OUT_CASES[0]
    x, norm, in_proj, params, conv_state, state, mask = _inputs(case, K, bits, gs)
    result, seen = (mx.zeros((1,)),) * 3, []
    monkeypatch.setitem(ops._kernels, "deltanet_chain_out", lambda *a, **k: seen.append(k) or result)
    monkeypatch.setattr(ops, "backend", lambda: "cuda")
    out_proj = _out_proj(case, K)

    def decode():
        return ops.deltanet_decode_add(x, norm, in_proj, out_proj, x, params[0], conv_state, params[1], params[2],
                                       params[3], state, num_key_heads=case.Hk, eps=case.eps)

    with ops.switched("deltanet_chain_out", False):
        assert decode() is None and not seen
    assert decode() is result and seen[0]["out_proj"] is out_proj and seen[0]["residual"] is x
    for off in ("deltanet_step", "qmv"):
        with ops.switched(off, False):
            assert decode() is None
    assert len(seen) == 1
    monkeypatch.setattr(ops, "backend", lambda: "metal")
    assert decode() is None and len(seen) == 1
    with ops.switched("deltanet_chain_out", True):
        assert decode() is result and len(seen) == 2


def test_chains_take_one_row_unless_opted_in(monkeypatch):
    """On by default, a decode chain takes one row of one token or of MTP's two (what was measured) and declines
    more, which the unchained kernels then run; opted into by name it takes any rows."""
    case, K, bits, gs = MODEL[1]  # B 3
    x, norm, in_proj, params, conv_state, state, mask = _inputs(case, K, bits, gs)
    calls = []
    monkeypatch.setattr(dc, "step", lambda x, *a, **k: calls.append(x.shape) or (mx.zeros((1,)),) * 5)
    monkeypatch.setattr(ops, "backend", lambda: "cuda")
    run = lambda x: dc._dispatch_out(x, norm, in_proj, params[0], conv_state, params[1], params[2], params[3], state,
                                     num_key_heads=case.Hk, eps=case.eps)
    assert run(x) is None and run(x.swapaxes(0, 1)) is None and not calls  # [3, 1, K], [1, 3, K]: three rows
    assert run(x[:1]) is not None and calls == [(1, 1, K)]
    with ops.switched("deltanet_chain_out", True):
        assert run(x) is not None and calls[-1] == x.shape
    assert ops.chain_takes("moe_chain", x[0]) and not ops.chain_takes("moe_chain", x[:2, 0])
    two = mx.zeros((1, 2, K))
    assert ops.chain_takes("moe_chain", two) and not ops.chain_takes("moe_chain", two.swapaxes(0, 1))  # [2, 1, K]
    assert not ops.chain_takes("moe_chain", two[0]) and not ops.chain_takes("moe_chain", mx.zeros((1, 3, K)))
    import lily_mlx.server.engine  # noqa: F401  (registers the server's switches)

    assert set(ops.backend_defaults("cuda")) == {"moe_chain", "deltanet_chain_out", "attn_chain", "packed_weights",
                                                 "bundled_weights", "kv_scatter", "kv_write", "cuda_source_files",
                                                 "logprobs", "logprobs_argmax", "verify_keep", "mtp_resident",
                                                 "batched_prefill"}
    assert ops.backend_defaults("metal") == ()


def _gpu(backend, case, K, bits, gs, with_out=False, step=0):
    """Right, and assert_launches_agree: launches in one eval on counters of their own, equal, counters zero after.
    step: Case.alt_inputs' (ALT's pick)."""
    x, norm, in_proj, params, conv_state, state, mask = _inputs(case, K, bits, gs)
    out_proj = _out_proj(case, K) if with_out else None
    alt = case.alt_inputs(0, step)
    run = lambda: dc.step(x, norm, in_proj, params[0], conv_state, params[1], params[2], params[3], state,
                          num_key_heads=case.Hk, eps=case.eps, mask=mask, out_proj=out_proj,
                          residual=x if with_out else None, backend=backend, init_value=NAN, keep=case.keep, alt=alt)
    first = assert_launches_agree(run, str(case))
    _check(case, x, norm, in_proj, params, *picked(conv_state, state, alt), mask, first, out_proj)
    return first


def test_chain_prefetch_switch_reaches_the_template():
    """chain_prefetch (opt-in) builds both variants' launches with PF = 1, and only then."""
    case, K, bits, gs = MODEL[0]
    x, norm, in_proj, params, conv_state, state, mask = _inputs(case, K, bits, gs)
    args = (params[0], conv_state, params[1], params[2], params[3], state)
    for out_proj, res in ((None, None), (_out_proj(case, K), x)):
        launch = lambda: dict(dc._launch(x, norm, in_proj, args, case.Hk, case.eps, mask, out_proj, res)[0])["PF"]
        assert not ops.enabled("chain_prefetch") and launch() == 0
        with ops.switched("chain_prefetch", True):
            assert launch() == 1
        assert launch() == 0


@pytest.mark.cuda
@pytest.mark.parametrize("case,K,bits,gs", CASES + MODEL + KEEP_CASES, ids=repr)
def test_chain_cuda(case, K, bits, gs):
    _gpu("cuda", case, K, bits, gs)


@pytest.mark.metal
@pytest.mark.parametrize("case,K,bits,gs", CASES + MODEL, ids=repr)
def test_chain_metal(case, K, bits, gs):
    _gpu("metal", case, K, bits, gs)


@pytest.mark.cuda
@pytest.mark.parametrize("case,K,bits,gs", OUT_CASES + MODEL + KEEP_CASES, ids=repr)
def test_chain_out_cuda(case, K, bits, gs):
    _gpu("cuda", case, K, bits, gs, with_out=True)


@pytest.mark.cuda
@pytest.mark.parametrize("use_alt", [True, False])
@pytest.mark.parametrize("with_out", [False, True])
@pytest.mark.parametrize("case,K,bits,gs", ALT_CASES, ids=repr)
def test_chain_alt_cuda(case, K, bits, gs, with_out, use_alt):
    _gpu("cuda", case, K, bits, gs, with_out=with_out, step=0 if use_alt else 1)


@pytest.mark.metal
@pytest.mark.parametrize("case,K,bits,gs", OUT_CASES + MODEL, ids=repr)
def test_chain_out_metal(case, K, bits, gs):
    _gpu("metal", case, K, bits, gs, with_out=True)


@pytest.mark.cuda
@pytest.mark.parametrize("with_out", [False, True])
@pytest.mark.parametrize("case,K,bits,gs", OUT_CASES[:1] + MODEL, ids=repr)
def test_chain_prefetch_cuda(case, K, bits, gs, with_out):
    """With chain_prefetch's L2 hints every output is bit for bit the launch's without them (and right)."""
    plain = _gpu("cuda", case, K, bits, gs, with_out)
    with ops.switched("chain_prefetch", True):
        hinted = _gpu("cuda", case, K, bits, gs, with_out)
    for h, p in zip(hinted, plain):
        assert mx.array_equal(h, p, equal_nan=True).item(), f"{case}: the prefetch hints changed an output"


@pytest.mark.cuda
def test_decode_with_chain_prefetch_cuda():
    """The embedded model's decode steps with deltanet_chain_out, chain_prefetch on vs off: the same logits to the bit."""
    calls = []
    with ops.switched("deltanet_chain_out", True):
        err = decode_rel_err("chain_prefetch", dtype=F32, kernel="deltanet_chain_out", calls=calls)
    assert any(on for on, _ in calls) and any(not on for on, _ in calls)
    assert err == 0.0, f"decode logits with chain_prefetch: rel err {err:.2e}"


# deltanet_chain_out (on by default on CUDA) takes a DeltaNet layer before deltanet_chain does.
SUPERSEDED = {"deltanet_chain": ("deltanet_chain_out",), "deltanet_chain_out": ()}


@pytest.mark.cuda
@pytest.mark.parametrize("switch", ["deltanet_chain", "deltanet_chain_out"])
def test_decode_with_chain_cuda(switch):
    assert_chain_decodes(switch, "cuda", superseded_by=SUPERSEDED[switch])


@pytest.mark.metal
@pytest.mark.parametrize("switch", ["deltanet_chain", "deltanet_chain_out"])
def test_decode_with_chain_metal(switch):
    assert_chain_decodes(switch, "metal", superseded_by=SUPERSEDED[switch])
