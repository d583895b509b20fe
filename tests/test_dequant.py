"""dequant (affine 4/8-bit weights to floats, one launch) against mx.dequantize and the float64 oracle.

CPU: the Metal source run by the shim's SIMT emulator on odd shapes (outputs start as NaN); the dispatcher
(off by default, never on CPU, declines what it cannot do). GPU (`cuda`/`metal`): the same through MLX, at
the 35B-A3B expert shape, and the dequantized prefill paths with the kernel on vs off.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from lily_mlx import ops
from lily_mlx.ops import dequant as dq
from lily_mlx.ops import reference
from emulator import GXX, Emulator

F32, BF16, F16 = mx.float32, mx.bfloat16, mx.float16
# (rows, K, group, bits, scales dtype, output dtype)
CASES = [(5, 384, 128, 4, F32, F32), (3, 96, 32, 8, F16, F16), (7, 192, 64, 4, BF16, F32), (9, 64, 32, 4, BF16, BF16),
         (1, 256, 64, 8, BF16, BF16)]


def _weights(rows, K, group, bits, sdt, seed=0):
    w = mx.random.normal((rows, K), key=mx.random.key(seed)) * 0.1
    q, s, b = mx.quantize(w, group_size=group, bits=bits)
    return q, s.astype(sdt), b.astype(sdt)


def _oracle(q, s, b, group, bits):
    return reference.dequantize(q, s.astype(F32), b.astype(F32), group, bits)


def _check(got, q, s, b, group, bits, odt):
    assert got.dtype == odt and not mx.isnan(got.astype(F32)).any().item(), "unwritten (NaN) outputs"
    want = np.asarray(_oracle(q, s, b, group, bits), dtype=np.float64)
    err = np.abs(np.asarray(got.astype(F32), dtype=np.float64) - want).max() / np.abs(want).max()
    assert err < (1e-6 if odt == F32 else 8e-3), f"max rel err {err:.2e}"  # bf16/f16: the output's rounding


@pytest.mark.skipif(GXX is None, reason="g++ is not installed")
def test_metal_emulated_matches_oracle(tmp_path):
    emu, inputs = Emulator(tmp_path), []
    for i, (rows, K, group, bits, sdt, odt) in enumerate(CASES):
        q, s, b = _weights(rows, K, group, bits, sdt, i)
        grid, tg = dq.grid(rows, K, bits)
        emu.add(dq.SPEC, dq.instance(rows, K, group, bits, sdt, odt), [q, s, b], grid, tg, [(rows, K)])
        inputs.append((q, s, b, group, bits, odt))
    for (q, s, b, group, bits, odt), (got,) in zip(inputs, emu.run()):
        _check(got, q, s, b, group, bits, odt)


def test_dispatcher_never_runs_on_cpu_and_obeys_its_switch(monkeypatch):
    q, s, b = _weights(4, 128, 64, 4, BF16)
    called = []
    monkeypatch.setitem(ops._kernels, "dequant", lambda *a, **k: called.append(1))
    want = mx.dequantize(q, s, b, group_size=64, bits=4)
    with ops.switched("dequant", True):
        got = ops.dequantize(q, s, b, group_size=64, bits=4, dtype=BF16)  # CPU: the kernel is not tried
    assert not called and mx.array_equal(got, want).item()
    monkeypatch.setattr(ops, "backend", lambda: "cuda")
    with ops.switched("dequant", False):
        ops.dequantize(q, s, b, group_size=64, bits=4, dtype=F32)
    assert not called
    ops.dequantize(q, s, b, group_size=64, bits=4, dtype=F32)  # on by default
    assert called == [1]


def test_unsupported_arguments_are_declined():
    q, s, b = _weights(4, 128, 64, 4, BF16)
    assert dq.unsupported(q, s, b, 64, 4, BF16) is None
    assert "bits" in dq.unsupported(q, s, b, 64, 3, BF16)
    assert "match" in dq.unsupported(q, s[:, :1], b[:, :1], 64, 4, BF16)
    assert "match" in dq.unsupported(q, s, None, 64, 4, BF16)
    assert "dtypes" in dq.unsupported(q, s, b, 64, 4, mx.int32)
    assert dq.dequantize(q, s, b, group_size=64, bits=3, backend="cuda") is None


def _gpu(backend):
    for i, (rows, K, group, bits, sdt, odt) in enumerate(CASES):
        q, s, b = _weights(rows, K, group, bits, sdt, i)
        got = dq.dequantize(q, s, b, group_size=group, bits=bits, dtype=odt, backend=backend, init_value=float("nan"))
        _check(got, q, s, b, group, bits, odt)
    # the 35B-A3B experts' gate projection: [256, 512, 2048], 4-bit, group 64, bf16
    q, s, b = _weights(256 * 512, 2048, 64, 4, BF16, 9)
    q, s, b = (a.reshape(256, 512, -1) for a in (q, s, b))
    got = dq.dequantize(q, s, b, group_size=64, bits=4, backend=backend, init_value=float("nan"))
    assert got.shape == (256, 512, 2048)
    want = mx.dequantize(q, s, b, group_size=64, bits=4)
    diff = mx.abs(got.astype(F32) - want.astype(F32)).max().item()
    assert diff <= 2 ** -7 * mx.abs(want.astype(F32)).max().item(), diff  # within a bf16 rounding of MLX's


@pytest.mark.cuda
def test_dequant_cuda():
    _gpu("cuda")


@pytest.mark.metal
def test_dequant_metal():
    _gpu("metal")


@pytest.mark.cuda
def test_prefill_dequantized_gemms_with_the_kernel_cuda():
    """The two prefill consumers, kernel on vs off: the routed experts' grouped GEMM and a dense projection."""
    E, N, K, rows = 64, 256, 1024, 8192
    q, s, b = _weights(E * N, K, 64, 4, BF16, 3)
    q, s, b = (a.reshape(E, N, -1) for a in (q, s, b))
    idx = mx.sort(mx.random.randint(0, E, (rows,), key=mx.random.key(4)))
    x = mx.random.normal((rows, 1, K), key=mx.random.key(5)).astype(BF16)
    kw = dict(scales=s, biases=b, group_size=64, bits=4)
    runs = {}
    for on in (True, False):
        with ops.switched("dequant", on):
            runs[on] = (ops.gather_matmul_dequantized(x, q, idx, **kw),
                        ops.quantized_matmul(x[:600, 0], q[0], s[0], b[0], group_size=64, bits=4))
    for a, c in zip(runs[True], runs[False]):
        af, cf = a.astype(F32), c.astype(F32)
        assert (mx.linalg.norm(af - cf) / mx.linalg.norm(cf)).item() < 1e-2
