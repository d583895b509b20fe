"""deltanet_chunk (the scan over chunks of the chunked gated delta rule) against chunk_scan_reference.

CPU: the kernel's Metal source run by the shim's SIMT emulator on odd shapes, from a given and a zero
state, outputs poisoned with NaN; the dispatcher's fallbacks and declines. GPU (`cuda`/`metal`): the
kernel through MLX at odd shapes and the model's, ops.gated_delta and ops.deltanet_mix with the kernel
on vs off (float32 and bfloat16 inputs), and whole-model prefill logits with the kernel on vs off.
"""

from __future__ import annotations

import re

import mlx.core as mx
import pytest

import lily_mlx
from lily_mlx import ops
from lily_mlx.embedded import EMBEDDED_MODEL
from lily_mlx.ops import deltanet_chunk as dc
from lily_mlx.ops import kernels
from lily_mlx.ops import reference
from emulator import GXX, Emulator

F32, BF16 = mx.float32, mx.bfloat16
TOL = 1e-5  # relative L2 against the float32 reference scan: summation order only


class Case:
    """One scan: B, key/value heads, head dims, chunk size C, T tokens (N = ceil(T / C) chunks)."""

    def __init__(self, B, Hk, Hv, Dk, Dv, C, T, zero_state=False, launch=None):
        self.B, self.Hk, self.Hv, self.Dk, self.Dv, self.C, self.T = B, Hk, Hv, Dk, Dv, C, T
        self.zero_state, self.launch = zero_state, launch
        self.N = -(-T // C)

    def __repr__(self):
        launch = "" if self.launch is None else "-" + "-".join(f"{k}{v}" for k, v in sorted(self.launch.items()))
        return (f"B{self.B}-Hk{self.Hk}-Hv{self.Hv}-Dk{self.Dk}-Dv{self.Dv}-C{self.C}-T{self.T}"
                f"{'-zero' if self.zero_state else ''}{launch}")

    def inputs(self, seed=0, dtype=F32):
        """q, k, v, log_g, beta, state as the model produces them (normalised q, k; gates in range)."""
        k = mx.random.split(mx.random.key(seed), 7)
        B, T, Hk, Hv = self.B, self.T, self.Hk, self.Hv
        q = (reference.l2_normalize(mx.random.normal((B, T, Hk, self.Dk), key=k[0])) * self.Dk**-0.5).astype(dtype)
        kk = reference.l2_normalize(mx.random.normal((B, T, Hk, self.Dk), key=k[1])).astype(dtype)
        v = mx.random.normal((B, T, Hv, self.Dv), key=k[2]).astype(dtype)
        A_log = mx.log(mx.random.uniform(0.5, 4.0, (Hv,), key=k[3]))
        log_g, beta = reference.deltanet_gates(mx.random.normal((B, T, Hv), key=k[4]),
                                               mx.random.normal((B, T, Hv), key=k[5]), A_log, mx.zeros((Hv,)))
        state = None if self.zero_state else 0.1 * mx.random.normal((B, Hv, self.Dv, self.Dk), key=k[6])
        return q, kk, v, log_g, beta, state

    def parts(self, seed=0):
        """chunk_intra's (u, w, q_dec, qk, k_dec, g_last, state), evaluated on the CPU."""
        with mx.stream(mx.cpu):
            parts = reference.chunk_intra(*self.inputs(seed), chunk_size=self.C)
            mx.eval(parts)
        return parts


def _rel(x, ref):
    x, ref = x.astype(F32), ref.astype(F32)
    return (mx.linalg.norm((x - ref).flatten()) / mx.linalg.norm(ref.flatten())).item()


def _check_scan(case, got, parts, tol=TOL):
    y, state = got
    assert y.shape == (case.B, case.Hv, case.N, case.C, case.Dv) and y.dtype == F32
    assert state.shape == (case.B, case.Hv, case.Dv, case.Dk) and state.dtype == F32
    for name, x in (("y", y), ("state", state)):
        assert not mx.isnan(x).any().item(), f"{case}: unwritten (NaN) {name}"
    with mx.stream(mx.cpu):
        y_ref, s_ref = reference.chunk_scan_reference(*parts)
        mx.eval(y_ref, s_ref)
    errs = _rel(y, y_ref), _rel(state, s_ref)
    assert max(errs) < tol, f"{case}: rel err y {errs[0]:.2e}, state {errs[1]:.2e}"
    return errs


# ---- the Metal source on the CPU (shim emulator) -------------------------------------------------

# Dk != Dv, neither a multiple of 32 (Dk < 32 and Dk > 32) and Dk = 20 not even of the MMA's 8, Dv not a
# multiple of the block's rows (a partial last block), C 16 and 64, N 1 and 3 (a padded tail), B 1 and 2,
# a given and a zero state, a launch with 2 warps over 16 rows (several tiles per warp), and one head of
# the model's dims over 8 chunks.
EMULATED = [
    Case(1, 1, 2, 24, 40, 16, 40),
    Case(2, 1, 2, 40, 24, 64, 50, zero_state=True),
    Case(1, 1, 1, 20, 36, 16, 33),
    Case(1, 1, 3, 24, 40, 64, 150, launch={"R": 16, "WARPS": 2}),
    Case(1, 1, 1, 128, 128, 64, 512),
]


@pytest.mark.skipif(GXX is None, reason="g++ is not installed")
def test_deltanet_chunk_metal_emulated_matches_reference(tmp_path):
    emu, expected = Emulator(tmp_path), []
    for c, case in enumerate(EMULATED):
        parts = case.parts(seed=c)
        p = case.launch or dc.plan(case.Dk, case.Dv, case.C)
        grid, group = dc.grid(case.B, case.Hv, case.Dv, p)
        inst = dc.instance(case.B, case.Hv, case.N, case.Dk, case.Dv, case.C, p)
        emu.add(dc.SPEC, inst, list(parts), grid, group, [parts[0].shape, parts[-1].shape])
        expected.append(parts)
    errs = {repr(case): _check_scan(case, got, parts) for case, got, parts in zip(EMULATED, emu.run(), expected)}
    print("rel err (y, state) vs the reference scan:", errs)


# ---- GPU: the kernel through MLX ------------------------------------------------------------------

MODEL = (1, 16, 32, 128, 128, 64)  # Qwen3.5/3.6-35B-A3B: B, Hk, Hv, Dk, Dv, C
GPU_CASES = EMULATED + [
    Case(2, 2, 6, 24, 40, 16, 100),
    Case(3, 1, 3, 40, 24, 64, 129, zero_state=True),
    Case(1, 2, 4, 32, 48, 64, 150),  # the embedded lily-tiny
    Case(2, 1, 2, 256, 256, 64, 200),
    Case(1, 1, 1, 256, 32, 64, 64),
    Case(1, 1, 1, 32, 256, 16, 40, zero_state=True),
] + [Case(*MODEL, T) for T in (1, 63, 64, 65, 2048)] + [Case(*MODEL, 200, zero_state=True)]


def _gpu_scan(backend, case):
    parts = case.parts()
    got = dc.chunk_scan(*parts, backend=backend, init_value=float("nan"), launch=case.launch)
    assert got is not None, f"deltanet_chunk declined {case}"
    mx.eval(got)
    _check_scan(case, got, parts)


@pytest.mark.cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=repr)
def test_deltanet_chunk_cuda(case):
    _gpu_scan("cuda", case)


@pytest.mark.metal
@pytest.mark.parametrize("case", GPU_CASES, ids=repr)
def test_deltanet_chunk_metal(case):
    _gpu_scan("metal", case)


def _switch(on: bool):
    """deltanet_chunk forced on or off, the switches as they were afterwards."""
    return ops.switched("deltanet_chunk", on)


def _counting(monkeypatch):
    """Counts the kernel's dispatches (a run with the switch on must have reached the kernel)."""
    calls = []
    inner = ops._kernels["deltanet_chunk"]

    def counted(*args, **kwargs):
        out = inner(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setitem(ops._kernels, "deltanet_chunk", counted)
    return calls


# (y, state) tolerances, kernel on vs off: float32 summation order; bf16 y rounds after both.
TOL_ON_OFF = {F32: (2e-5, 2e-5), BF16: (8e-3, 2e-5)}


def _gated_delta_on_vs_off(monkeypatch, T, dtype):
    B = 2 if T > 100 else 1
    q, k, v, log_g, beta, state = Case(B, *MODEL[1:], T).inputs(seed=T, dtype=dtype)
    mask = mx.arange(T)[None, :] >= mx.array([[0], [37]]) if B == 2 else None  # row 1 left-padded
    calls = _counting(monkeypatch)
    runs = []
    for on in (False, True):
        with _switch(on):
            out = ops.gated_delta(q, k, v, log_g, beta, state, mask)
            mx.eval(out)
            runs.append(out)
    assert calls == [True], f"T={T}: the kernel path was not taken ({calls})"
    (y_off, s_off), (y_on, s_on) = runs
    assert y_on.dtype == dtype and not mx.isnan(y_on.astype(F32)).any().item()
    errs = _rel(y_on, y_off), _rel(s_on, s_off)
    tol = TOL_ON_OFF[dtype]
    assert errs[0] < tol[0] and errs[1] < tol[1], f"T={T} {dtype}: rel err y {errs[0]:.2e}, state {errs[1]:.2e}"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [16, 63, 64, 65, 2048])
def test_gated_delta_kernel_on_vs_off_cuda(monkeypatch, T, dtype):
    _gated_delta_on_vs_off(monkeypatch, T, dtype)


@pytest.mark.metal
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [16, 63, 64, 65, 2048])
def test_gated_delta_kernel_on_vs_off_metal(monkeypatch, T, dtype):
    _gated_delta_on_vs_off(monkeypatch, T, dtype)


def _mix_args(B, T, Hk, Hv, Dk, Dv, dtype, seed=0):
    """A fused projection [qkv | z | b | a] and the mixer's parameters, random."""
    C, W = 2 * Hk * Dk + Hv * Dv, 4
    k = mx.random.split(mx.random.key(seed), 7)
    proj = mx.random.normal((B, T, C + Hv * Dv + 2 * Hv), key=k[0]).astype(dtype)
    conv_w = (mx.random.normal((C, W, 1), key=k[1]) * 0.5).astype(dtype)
    conv_state = mx.random.normal((B, W - 1, C), key=k[2]).astype(dtype)
    A_log = mx.random.uniform(-1.0, 1.0, (Hv,), key=k[3])
    dt_bias = mx.random.normal((Hv,), key=k[4]).astype(dtype)
    norm_w = (1.0 + 0.2 * mx.random.normal((Dv,), key=k[5])).astype(dtype)
    state = 0.1 * mx.random.normal((B, Hv, Dv, Dk), key=k[6])
    return proj, conv_w, conv_state, A_log, dt_bias, norm_w, state


def _mix_on_vs_off(monkeypatch, heads, T, dtype):
    Hk, Hv, Dk, Dv = heads
    args = _mix_args(2, T, Hk, Hv, Dk, Dv, dtype)
    mask = mx.arange(T)[None, :] >= mx.array([[0], [T // 3]])  # row 1 left-padded
    calls = _counting(monkeypatch)
    runs = []
    for on in (False, True):
        with _switch(on):
            out = ops.deltanet_mix(*args, num_key_heads=Hk, eps=1e-6, mask=mask)
            mx.eval(out)
            runs.append(out)
    assert calls == [True], f"the kernel path was not taken ({calls})"
    (o_off, c_off, s_off), (o_on, c_on, s_on) = runs
    assert mx.array_equal(c_on, c_off).item()
    errs = _rel(o_on, o_off), _rel(s_on, s_off)
    tol = TOL_ON_OFF[dtype]
    assert errs[0] < tol[0] and errs[1] < tol[1], f"{heads} T={T} {dtype}: rel err out, state {errs}"


MIX_CASES = [((2, 6, 24, 40), 100), ((16, 32, 128, 128), 300)]


def _compiled_vs_plain(monkeypatch, dtype, exact: bool):
    """compiled_mixer fuses the mixer's elementwise ops (mx.compile, shapeless): the same outputs (CPU: bit for bit;
    a GPU's fused kernels may round differently) at two lengths through one trace, a left-padded row included; the
    compiled graphs run only when it is on."""
    calls = []
    for name in ("_deltanet_qk_gates_compiled", "_gated_rms_norm_compiled"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    for T in (70, 33):
        args = _mix_args(2, T, 2, 6, 24, 40, dtype, seed=T)
        mask = mx.arange(T)[None, :] >= mx.array([[0], [T // 3]])
        runs = []
        for on in (False, True):
            with ops.disabled("deltanet_prep"), ops.switched("compiled_mixer", on):  # prep replaces the qk gates
                runs.append(ops.deltanet_mix(*args, num_key_heads=2, eps=1e-6, mask=mask))
        for a, b in zip(*runs):
            if exact:
                assert mx.array_equal(a, b).item(), f"T={T}"
            else:
                assert _rel(b, a) < (1e-5 if dtype == F32 else 1e-2), f"T={T}: rel err {_rel(b, a):.2e}"
    assert calls == ["_deltanet_qk_gates_compiled", "_gated_rms_norm_compiled"] * 2


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_compiled_mixer_is_the_mixer(monkeypatch, dtype):
    with mx.stream(mx.cpu):
        _compiled_vs_plain(monkeypatch, dtype, exact=True)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_compiled_mixer_is_the_mixer_cuda(monkeypatch, dtype):
    _compiled_vs_plain(monkeypatch, dtype, exact=False)


@pytest.mark.metal
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_compiled_mixer_is_the_mixer_metal(monkeypatch, dtype):
    _compiled_vs_plain(monkeypatch, dtype, exact=False)


def test_compiled_mixer_takes_launches_out(monkeypatch, tmp_path):
    """The point of compiled_mixer: the prefill mixer's graph at the 35B head shapes, its two kernels stood in (as
    tests/test_decode_budget.py does), holds 42 primitives that launch, 22 with it on (CPU's graph: its rms_norm
    decomposes, one launch on CUDA)."""
    views = {"Broadcast", "Reshape", "Squeeze", "Slice", "Split", "Transpose", "ExpandDims", "Depends"}

    def standin(name, backend, inputs, template, grid, group, output_shapes, output_dtypes, *rest):
        outs = [mx.broadcast_to(mx.array(0, dtype=d), s) for s, d in zip(output_shapes, output_dtypes)]
        return mx.depends(outs, list(inputs))

    monkeypatch.setattr(kernels, "call", standin)
    monkeypatch.setattr(ops, "backend", lambda: "cuda")
    args = _mix_args(1, 512, 16, 32, 128, 128, BF16)[:-1] + (None,)
    mx.eval(args[:-1])
    counts = []
    for on in (False, True):
        with ops.disabled("deltanet_prep"), ops.switched("compiled_mixer", on):
            mx.export_to_dot(str(tmp_path / "g.dot"), *ops.deltanet_mix(*args, num_key_heads=16, eps=1e-6))
        nodes = re.findall(r'\[label ="([^"]+)", shape=rectangle\]', (tmp_path / "g.dot").read_text())
        counts.append(sum(n not in views for n in nodes))
    assert counts == [42, 22]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,T", MIX_CASES)
def test_deltanet_mix_kernel_on_vs_off_cuda(monkeypatch, heads, T, dtype):
    _mix_on_vs_off(monkeypatch, heads, T, dtype)


@pytest.mark.metal
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,T", MIX_CASES)
def test_deltanet_mix_kernel_on_vs_off_metal(monkeypatch, heads, T, dtype):
    _mix_on_vs_off(monkeypatch, heads, T, dtype)


def _model_prefill_on_vs_off(monkeypatch):
    # float32: the bounds are float rounding, as in test_deltanet_step's model test
    model, _ = lily_mlx.load_model(EMBEDDED_MODEL, dtype=mx.float32)
    prompt = mx.random.randint(0, 256, (2, 150), key=mx.random.key(3))  # 3 chunks, the last partial
    calls = _counting(monkeypatch)
    runs = []
    for on in (False, True):
        with _switch(on):
            cache = model.make_cache()
            logits = model(prompt, cache=cache)  # [B, T, V]
            tok = mx.argmax(logits[:, -1, :], axis=-1)[:, None]
            toks = []
            for _ in range(16):  # decode continues from the prefill's state
                tok = mx.argmax(model(tok, cache=cache)[:, -1, :], axis=-1)[:, None]
                toks.append(tok)
            runs.append((logits.astype(F32), mx.concatenate(toks, axis=1)))
    assert calls and all(calls), "the kernel path was not taken"
    (l_off, t_off), (l_on, t_on) = runs
    assert _rel(l_on, l_off) < 1e-4, f"prefill logits with the kernel: rel err {_rel(l_on, l_off):.2e}"
    assert mx.array_equal(t_on, t_off).item(), "16 greedy tokens after the prefill differ with the kernel on"


@pytest.mark.cuda
def test_model_prefill_with_kernel_cuda(monkeypatch):
    _model_prefill_on_vs_off(monkeypatch)


@pytest.mark.metal
def test_model_prefill_with_kernel_metal(monkeypatch):
    _model_prefill_on_vs_off(monkeypatch)


# ---- CPU: dispatch, declines, launch plan ---------------------------------------------------------

def _sentinel(*args, **kwargs):
    raise AssertionError("the deltanet_chunk kernel was dispatched")


def test_dispatch_cpu_fallback_and_switch(monkeypatch):
    monkeypatch.setitem(ops._kernels, "deltanet_chunk", _sentinel)
    monkeypatch.setitem(ops._kernels, "deltanet_intra", lambda *a, **kw: None)  # declines: the reference intra part
    q, k, v, log_g, beta, state = Case(1, 1, 2, 24, 40, 16, 40).inputs()
    want = reference.gated_delta_chunked(q, k, v, log_g, beta, state)
    with _switch(True):
        y, s = ops.gated_delta(q, k, v, log_g, beta, state)  # CPU: the reference scan, bit for bit
        assert mx.array_equal(y, want[0]).item() and mx.array_equal(s, want[1]).item()
        monkeypatch.setattr(ops, "backend", lambda: "cuda")
        ops.gated_delta(q[:, :8], k[:, :8], v[:, :8], log_g[:, :8], beta[:, :8], state)  # short: sequential
        with pytest.raises(AssertionError, match="dispatched"):
            ops.gated_delta(q, k, v, log_g, beta, state)
    with _switch(False):
        ops.gated_delta(q, k, v, log_g, beta, state)  # switched off: reference


def test_declined_arguments_take_the_reference(monkeypatch):
    monkeypatch.setattr(ops, "backend", lambda: "cuda")
    case = Case(1, 1, 2, 288, 40, 16, 40)  # Dk past MAX_HEAD_DIM: declined before any launch
    parts = case.parts()
    with _switch(True):
        y, s = ops.chunk_scan(*parts)
    y_ref, s_ref = reference.chunk_scan_reference(*parts)
    assert mx.array_equal(y, y_ref).item() and mx.array_equal(s, s_ref).item()


def test_unsupported_arguments_are_declined():
    parts = Case(1, 1, 2, 24, 40, 16, 40).parts()
    u, w, q_dec, qk, k_dec, g_last, state = parts
    assert dc.unsupported(*parts) is None
    assert "shapes" in dc.unsupported(u[0], *parts[1:])
    assert "shapes" in dc.unsupported(*parts[:3], qk[..., :-1], *parts[4:])
    assert "shapes" in dc.unsupported(*parts[:5], g_last[..., :1], state)
    assert "shapes" in dc.unsupported(*parts[:6], state[..., :-1])
    assert "dtypes" in dc.unsupported(*parts[:6], state.astype(BF16))
    assert "dtypes" in dc.unsupported(u.astype(BF16), *parts[1:])
    assert "no chunks" in dc.unsupported(*(x[:, :, :0] for x in parts[:6]), state)
    big = Case(1, 1, 1, 288, 32, 16, 16).parts()
    assert "head dim" in dc.unsupported(*big)
    assert dc.chunk_scan(*big, backend="cuda") is None
    long = Case(1, 1, 1, 128, 32, 512, 512).parts()
    assert "shared memory" in dc.unsupported(*long)
    odd = Case(1, 1, 1, 32, 32, 24, 48).parts()
    assert "multiples of 16" in dc.unsupported(*odd)
    assert "multiples of 16" in dc.unsupported(*parts, launch={"R": 24, "WARPS": 8})


@pytest.mark.parametrize("Dk,Dv,C", [(16, 24, 64), (24, 40, 16), (32, 48, 64), (128, 128, 64), (256, 256, 64),
                                     (256, 32, 128), (32, 256, 16), (40, 8, 64), (16, 3, 16)])
def test_plan_fits(Dk, Dv, C):
    p = dc.plan(Dk, Dv, C)
    assert 32 * p["WARPS"] <= 1024 and p["R"] in (16, 32)  # Metal: <= 1024 threads; whole 16-row tiles
    assert p["R"] == 32 or Dv <= 16 or dc.shared_bytes(Dk, C, 32) > dc.SHARED_BYTES  # 16 only where it must
    assert dc.shared_bytes(Dk, C, p["R"]) <= dc.SHARED_BYTES
