"""moe_chain (a decode step's MoE block in one launch) against the float64 oracles of test_moe_kernels, phase by phase.

CPU: the kernel's Metal source on the shim's SIMT emulator (outputs start as NaN bytes), its threadgroups run in index
order or last first (the phases must follow the tickets, not the indices), and its counters read back: every launch
leaves them zero. The dispatcher rules. `cuda` / `metal`: the same cases through MLX, launches in one eval
(tests/counters.py), and the embedded model's decode steps with the switch on vs off.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import lily_mlx.ops as ops
from emulator import GXX, Emulator
from counters import assert_launches_agree
from switch_ab import assert_chain_decodes, decode_rel_err
from test_moe_kernels import (NAN, ROUTED, ROUTED_MODEL, _case, _check_down, _check_routed, _gate_up_standin, _id, _router,
                              routed_id)
from lily_mlx.ops import kernels, moe, moe_chain

# (case with the norm on: the chained block always stages the post-attention norm, router bits, router group).
CHAIN = [(c[:10] + (True,), rbits, rgs) for c, rbits, rgs in ROUTED]


def _args(a, router):
    return [a["x"], a["norm"][0], *router[:3], *a["gate"], *a["up"], *a["shared_gate"], *a["shared_up"], *a["down"],
            *a["shared_down"]]


def _unpack(packed, k, I, IS):
    """packed [M, k*I + Is + 2k] -> (h [M, k, I], hs [M, Is], ids [M, k] int32, weights [M, k])."""
    M = packed.shape[0]
    h = packed[:, :k * I].reshape(M, k, I)
    ids = packed[:, k * I + IS:k * I + IS + k].astype(mx.int32)
    return h, packed[:, k * I:k * I + IS], ids, packed[:, k * I + IS + k:]


def _check(c, a, router, y, logits, packed):
    """Each phase against its oracle, fed the kernel's own results of the phase before: the logits (x' times the
    router), gate/up routed by them, then down, combine and residual from the kernel's h, hs, ids and weights."""
    M, k, E, H, I, IS = c[:6]
    h, hs, ids, w = _unpack(packed, k, I, IS)
    _check_routed(c, a, router, (h, hs, ids, w, logits))
    return _check_down(c, dict(a, h=h, hs=hs, inds=ids, scores=w, logits=logits, residual=a["x"]), y)


@pytest.mark.skipif(GXX is None, reason="g++ is not installed")
def test_chain_emulated_matches_oracle(tmp_path):
    """Every case, at its plan and at the 35B-A3B block size (8 warps), half of them with the threadgroups run last
    first; the counters come back zero."""
    emu, checks = Emulator(tmp_path, packed_twins=True), []  # packed weights too, bit for bit the same
    # The last run with chain_prefetch's L2 hints (none on Metal: the same values, through the same body).
    runs = [(r, None, False) for r in CHAIN] + [(CHAIN[2], {"rps": 2, "warps": 8}, False), (CHAIN[0], None, True)]
    for n, ((c, rbits, rgs), forced, prefetch) in enumerate(runs):
        M, k, E, H, I, IS, gs, bits, dt = c[:9]
        a, router = _case(c), _router(c, rbits, rgs)
        p = moe_chain.plan(M, k, H, I, IS, E + 1, bits, rbits, **(forced or {}))
        inst = moe_chain.instance(dt, mx.bfloat16, M, k, E, H, I, IS, bits, gs, rbits, rgs, normalize=a["normalize"], p=p,
                                  prefetch=prefetch)
        args = _args(a, router) + [mx.zeros((kernels.SYNC_SLOTS,), dtype=mx.int32)]
        threads = 32 * p["WARPS"]
        emu.add(moe_chain.SPEC, inst, args, (p["blocks"] * threads, 1, 1), (threads, 1, 1),
                [(M, H), (M, E + 1), (M, moe.packed_width(k, I, IS))], reversed_groups=n % 2 == 1,
                read_back=(len(args) - 1,))
        checks.append((c, a, router))
    for (c, a, router), (y, logits, packed, sync) in zip(checks, emu.run()):
        _check(c, a, router, y, logits, packed)
        assert not np.array(sync).any(), f"{_id(c)}: counters left at {np.array(sync)}"


def test_plan_shares_one_block_size():
    """The three phases run in blocks of one size: down's rows are planned for gate/up's warps, and the router's
    rows per block are a warp's rows in flight (one 16-byte chunk of 8-bit codes a lane: 4 chunks at H = 2048)."""
    p = moe_chain.plan(1, 8, 2048, 512, 512, 257, 4, 8)  # 4-warp blocks, as moe_gate_up plans them
    assert p["WARPS"] == p["gate_up"]["WARPS"] == 4 and p["RROWS"] == 4
    assert p["down"]["RPS"] == 1 and p["down"]["inflight"] <= moe.MAX_INFLIGHT
    assert p["blocks"] == 65 + p["gate_up"]["blocks"] + p["down"]["blocks"]
    assert moe_chain.plan(3, 8, 2048, 512, 512, 257, 4, 4)["RROWS"] == 8  # 4-bit router: 2 chunks a lane, 2 rows


def test_unsupported_arguments_are_declined():
    """unsupported names the problem; chain() then returns None and launches nothing."""
    c, rbits, rgs = CHAIN[2]
    M, k, E, H, I, IS, gs, bits = c[:8]
    a, router = _case(c), _router(c, rbits, rgs)
    args = (a["x"], a["norm"], router, a["gate"], a["up"], a["down"], a["shared_gate"], a["shared_up"],
            a["shared_down"], k)
    assert moe_chain.unsupported(*args, gs, bits) is None
    assert "no norm" in moe_chain.unsupported(a["x"], None, *args[2:], gs, bits)
    assert "router bits=3" in moe_chain.unsupported(a["x"], a["norm"], (*router[:3], 3, rgs), *args[3:], gs, bits)
    many = mx.zeros((moe.MAX_M + 1, H), dtype=a["x"].dtype)
    assert "tokens" in moe_chain.unsupported(many, *args[1:], gs, bits)
    assert moe_chain.chain(many, *args[1:-1], top_k=k, normalize=True, group_size=gs, bits=bits, backend="cuda") is None


def test_each_launch_has_counters_of_its_own():
    """Two launches of one layer take distinct zero counters: MLX's CUDA graphs may run two launches that only read
    the same counters at once (two decodes of one model in one eval did, H100 run 40), and their tickets would mix."""
    args = _launch_args(*ROUTED_MODEL[0])
    with kernels.captured() as calls:
        for _ in range(2):
            moe_chain.chain(*args[:9], top_k=args[9], normalize=args[10], group_size=args[11], bits=args[12],
                            backend="cuda")
    counters = [inputs[moe_chain.SPEC.input_names.index("sync")] for _, inputs in calls]
    assert len(counters) == 2 and counters[0] is not counters[1]
    for s in counters:
        assert s.dtype == mx.int32 and s.shape == (kernels.SYNC_SLOTS,) and not np.array(s).any()


def test_chain_is_on_for_cuda_and_needs_both_moe_kernels(monkeypatch):
    """moe_chain is on by default on CUDA (opt-in on Metal); on, ops.moe_decode hands it the router and returns its
    result; off, or with moe_gate_up or moe_down_combine switched off (ablation), it is not tried; declined, the
    two-kernel path runs."""
    c, rbits, rgs = CHAIN[2]
    M, k, E, H, I, IS, gs, bits = c[:8]
    a, router = _case(c), _router(c, rbits, rgs)
    seen = []
    monkeypatch.setitem(ops._kernels, "moe_chain", lambda x, norm, r, *args, **kw: seen.append(r) or a["residual"])
    monkeypatch.setattr(ops, "backend", lambda: "cuda")

    def decode():
        return ops.moe_decode(a["x"], a["norm"][0], 1e-6, a["logits"], a["gate"], a["up"], a["down"], a["shared_gate"],
                              a["shared_up"], a["shared_down"], top_k=k, normalize=a["normalize"], group_size=gs,
                              bits=bits, router=router)

    monkeypatch.setitem(ops._kernels, "moe_gate_up", lambda *args, **kw: _gate_up_standin(a, c))
    monkeypatch.setitem(ops._kernels, "moe_down_combine", lambda *args, **kw: a["x"])
    monkeypatch.setitem(ops._kernels, "moe_route", lambda *args, **kw: None)  # the unfused path's router: MLX's
    with ops.switched("moe_chain", False):
        assert decode() is a["x"] and not seen
    assert decode() is a["residual"] and seen == [router]
    seen.clear()
    with ops.switched("moe_chain", True):
        assert decode() is a["residual"] and seen == [router]
        for off in ("moe_gate_up", "moe_down_combine"):
            with ops.switched(off, False):
                decode()
        assert len(seen) == 1
    monkeypatch.setitem(ops._kernels, "moe_chain", lambda *args, **kw: None)
    with ops.switched("moe_chain", True):
        assert decode() is a["x"]
    monkeypatch.setattr(ops, "backend", lambda: "metal")
    assert not ops.enabled("moe_chain")


def _gpu(backend, c, rbits, rgs):
    """Right, and assert_launches_agree: launches in one eval on counters of their own, equal, counters zero after."""
    M, k, E, H, I, IS, gs, bits = c[:8]
    a, router = _case(c), _router(c, rbits, rgs)
    args = (a["x"], a["norm"], router, a["gate"], a["up"], a["down"], a["shared_gate"], a["shared_up"], a["shared_down"])
    run = lambda: moe_chain.chain(*args, top_k=k, normalize=a["normalize"], group_size=gs, bits=bits, backend=backend,
                                  init_value=NAN)
    first = assert_launches_agree(run, _id(c))
    _check(c, a, router, *first)
    return first


@pytest.mark.cuda
@pytest.mark.parametrize("case,rbits,rgs", CHAIN + ROUTED_MODEL, ids=routed_id)
def test_chain_cuda(case, rbits, rgs):
    _gpu("cuda", case, rbits, rgs)


def _launch_args(c, rbits, rgs):
    a, router = _case(c), _router(c, rbits, rgs)
    return (a["x"], a["norm"], router, a["gate"], a["up"], a["down"], a["shared_gate"], a["shared_up"],
            a["shared_down"], c[1], a["normalize"], c[6], c[7])


def test_chain_prefetch_switch_reaches_the_template():
    """chain_prefetch (opt-in) builds the launch with PF = 1, and only then; each setting keeps its own plan."""
    args = _launch_args(*ROUTED_MODEL[0])
    assert not ops.enabled("chain_prefetch")
    assert dict(moe_chain._launch(*args)[0])["PF"] == 0
    with ops.switched("chain_prefetch", True):
        assert dict(moe_chain._launch(*args)[0])["PF"] == 1
    assert dict(moe_chain._launch(*args)[0])["PF"] == 0


@pytest.mark.cuda
@pytest.mark.parametrize("case,rbits,rgs", CHAIN[:2] + ROUTED_MODEL, ids=routed_id)
def test_chain_prefetch_cuda(case, rbits, rgs):
    """With chain_prefetch's L2 hints every output is bit for bit the launch's without them (and right)."""
    plain = _gpu("cuda", case, rbits, rgs)
    with ops.switched("chain_prefetch", True):
        hinted = _gpu("cuda", case, rbits, rgs)
    for h, p in zip(hinted, plain):
        assert mx.array_equal(h, p, equal_nan=True).item(), f"{_id(case)}: the prefetch hints changed an output"


@pytest.mark.metal
@pytest.mark.parametrize("case,rbits,rgs", CHAIN + ROUTED_MODEL, ids=routed_id)
def test_chain_metal(case, rbits, rgs):
    _gpu("metal", case, rbits, rgs)


@pytest.mark.cuda
def test_decode_with_chain_cuda():
    assert_chain_decodes("moe_chain", "cuda")


@pytest.mark.cuda
def test_decode_with_chain_prefetch_cuda():
    """The embedded model's decode steps with moe_chain, chain_prefetch on vs off: the prefetching launch runs in every
    layer and the logits are the same to the bit."""
    calls = []
    with ops.switched("moe_chain", True):
        err = decode_rel_err("chain_prefetch", dtype=mx.float32, kernel="moe_chain", calls=calls)
    assert any(on for on, _ in calls) and any(not on for on, _ in calls)
    assert err == 0.0, f"decode logits with chain_prefetch: rel err {err:.2e}"


def test_trace_build_keeps_the_default_registers(kernel_env):
    """Under LILY_CHAIN_TRACE moe_chain's CUDA build is capped at the registers the default build takes (96: 5
    blocks of 4 warps an SM), so the trace's waves are the default's (uncapped, its records took 128: 4 an SM);
    without the define, no cap."""
    inst = moe_chain.SPEC.instances()[0]
    for defines, cap in (("LILY_CHAIN_TRACE=64", moe_chain.TRACE_REGISTERS), (None, 0)):
        kernel_env(kernels.DEFINES_ENV, defines)
        assert kernels.register_cap(moe_chain.SPEC, inst.template) == cap
        assert ("__maxnreg__(96)" in kernels.full_source(moe_chain.SPEC, "cuda", inst)[1]) == bool(cap)


@pytest.mark.metal
def test_decode_with_chain_metal():
    assert_chain_decodes("moe_chain", "metal")
