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


# (table rows V, ids, K, group, bits, scales dtype, ids dtype): an embedding lookup (dequant_rows), ids repeating, in any
# order, a 2-D batch, rows whose words straddle warp tiles (K / codes-per-word not a multiple of 32)
ROW_CASES = [(300, [[5, 299, 0, 5]], 96, 32, 8, F32, mx.int32), (17, [3, 16, 3], 192, 64, 4, F16, mx.int32),
             (40, [[7], [39]], 2048, 64, 4, BF16, mx.uint32)]


@pytest.mark.skipif(GXX is None, reason="g++ is not installed")
def test_embedding_rows_emulated_match_quantized_embedding(tmp_path):
    emu, wants = Emulator(tmp_path, packed_twins=True), []  # packed tables too, bit for bit the same
    for i, (V, ids, K, group, bits, sdt, idt) in enumerate(ROW_CASES):
        q, s, b = _weights(V, K, group, bits, sdt, 10 + i)
        ids = mx.array(ids, dtype=idt)
        grid, tg = dq.grid(ids.size, K, bits)
        emu.add(dq.ROWS_SPEC, dq.rows_instance(V, ids.size, K, group, bits, sdt, idt), [q, s, b, ids], grid, tg,
                [(*ids.shape, K)])
        wants.append(ops.embedding_lookup(ids, q, s, b, group_size=group, bits=bits))  # on the CPU: MLX's gathers
    bad = mx.array([[2, -1, 300]], dtype=mx.int32)  # ids outside the table write NaN, not another row
    q, s, b = _weights(300, 96, 32, 8, F32, 10)
    emu.add(dq.ROWS_SPEC, dq.rows_instance(300, 3, 96, 32, 8, F32), [q, s, b, bad], *dq.grid(3, 96, 8), [(1, 3, 96)])
    outs = emu.run()
    def err(got, want):  # the kernel's fused multiply-add against MLX's: an ulp apart at most
        assert got.shape == want.shape and got.dtype == want.dtype and not mx.isnan(got).any().item()
        return (mx.abs(got.astype(F32) - want.astype(F32)).max() / mx.abs(want.astype(F32)).max()).item()

    for want, (got,) in zip(wants, outs):
        assert err(got, want) < (1e-6 if want.dtype == F32 else 8e-3), "the lookup differs from QuantizedEmbedding's"
    (got,) = outs[-1]
    row2 = ops.embedding_lookup(mx.array([2], dtype=mx.int32), q, s, b, group_size=32, bits=8)
    assert err(got[0, :1], row2) < 1e-6 and mx.isnan(got[0, 1:]).all().item()


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


def test_embedding_lookup_is_the_quantized_embedding_and_dispatches(monkeypatch):
    import mlx.nn as nn

    from lily_mlx.layers import embedded

    emb = nn.QuantizedEmbedding.from_embedding(nn.Embedding(50, 64), group_size=32, bits=4)
    ids = mx.array([[3, 49, 0]], dtype=mx.int32)
    assert mx.array_equal(embedded(emb, ids), emb(ids)).item()  # on the CPU: the same ops as mlx.nn's
    plain = nn.Embedding(50, 64)
    assert mx.array_equal(embedded(plain, ids), plain(ids)).item()
    called, id_dtypes = [], []
    monkeypatch.setitem(ops._kernels, "dequant_rows",
                        lambda *a, **k: called.append(k) or id_dtypes.append(a[0].dtype) or emb(a[0]))
    monkeypatch.setattr(ops, "backend", lambda: "cuda")
    with ops.switched("dequant_rows", False):
        embedded(emb, ids)
    assert not called
    embedded(emb, ids)  # on by default
    assert called == [{"group_size": 32, "bits": 4}]
    embedded(emb, ids.astype(mx.int64))  # numpy's int64 ids reach the kernel as int32
    assert len(called) == 2 and id_dtypes == [mx.int32, mx.int32]
    assert dq.embedding_rows(ids.astype(mx.int64), emb["weight"], emb["scales"], emb["biases"], group_size=32, bits=4,
                             backend="cuda") is None  # ids of another dtype: declined


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


def _gpu_rows(backend):
    """dequant_rows at the 35B-A3B embedding (248,320 x 2048, 4-bit, group 64, bf16) and the odd cases, against
    MLX's gathers and dequantize, outputs poisoned with NaN."""
    cases = ROW_CASES + [(248320, [[0, 248319, 17, 123456, 5, 5, 99999, 3]], 2048, 64, 4, BF16, mx.uint32)]
    for i, (V, ids, K, group, bits, sdt, idt) in enumerate(cases):
        q, s, b = _weights(V, K, group, bits, sdt, 20 + i)
        ids = mx.array(ids, dtype=idt)
        got = dq.embedding_rows(ids, q, s, b, group_size=group, bits=bits, backend=backend, init_value=float("nan"))
        with mx.stream(mx.cpu):
            want = mx.dequantize(q[ids], s[ids], b[ids], group_size=group, bits=bits)
        assert got.shape == want.shape and got.dtype == want.dtype and not mx.isnan(got).any().item()
        err = (mx.abs(got.astype(F32) - want.astype(F32)).max() / mx.abs(want.astype(F32)).max()).item()
        assert err < (1e-6 if sdt == F32 else 8e-3), (V, K, err)


@pytest.mark.cuda
def test_embedding_rows_cuda():
    _gpu_rows("cuda")


@pytest.mark.metal
def test_embedding_rows_metal():
    _gpu_rows("metal")


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
