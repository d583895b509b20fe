"""qmv (fused affine dequant GEMV) against the float32 oracle; dispatcher fallback on CPU and when off."""

from __future__ import annotations

import itertools

import mlx.core as mx
import pytest

import lily_mlx.ops as ops
from lily_mlx.ops import qmv, reference

# (M, K as a multiple of the group or 2048, N): N=1 (shared-expert gate), odd N, N just past 8192.
SHAPES = [(1, "4g", 1), (3, 2048, 33), (8, 2048, 7), (1, 2048, 8200), (3, "4g", 8200)]
CASES = [
    (bits, gs, dt, M, (4 * gs if K == "4g" else K), N)
    for (bits, gs, dt), (M, K, N) in itertools.product(
        itertools.product((4, 8), (32, 64, 128), (mx.float32, mx.bfloat16)), SHAPES)
]
TOL = {mx.float32: 2e-5, mx.bfloat16: 8e-3, mx.float16: 2e-3}


def _inputs(M, K, N, bits, gs, dt, seed, lead=()):
    key = mx.random.key(seed)
    k1, k2 = mx.random.split(key)
    w, scales, biases = mx.quantize(mx.random.normal((N, K), key=k1) * 0.05, group_size=gs, bits=bits)
    x = mx.random.normal((*lead, M, K), key=k2).astype(dt)
    return x, w, scales, biases


def _oracle(x, w, scales, biases, gs, bits):
    # On the CPU in float32 (no TF32), with the scales upcast exactly: the kernel keeps w = s*q + b in float32.
    with mx.stream(mx.cpu):
        y = reference.quantized_matmul_oracle(x.astype(mx.float32), w, scales.astype(mx.float32),
                                              biases.astype(mx.float32), group_size=gs, bits=bits)
        return mx.array(y)


def _check(backend, bits, gs, dt, M, K, N, seed=0, lead=()):
    x, w, scales, biases = _inputs(M, K, N, bits, gs, dt, seed, lead)
    y = qmv.qmv(x, w, scales, biases, group_size=gs, bits=bits, backend=backend, init_value=float("nan"))
    assert y is not None, f"qmv declined bits={bits} group={gs} M={M} K={K} N={N}"
    assert y.shape == (*lead, M, N) and y.dtype == dt
    ref = _oracle(x, w, scales, biases, gs, bits)
    yf = y.astype(mx.float32)
    assert not mx.isnan(yf).any().item(), "unwritten (NaN) outputs"
    err = (mx.linalg.norm(yf - ref) / mx.linalg.norm(ref)).item()
    assert err < TOL[dt], f"relative error {err:.2e} >= {TOL[dt]} (bits={bits} group={gs} {dt} M={M} K={K} N={N})"


def _id(c):
    bits, gs, dt, M, K, N = c
    return f"b{bits}-g{gs}-{str(dt).split('.')[-1]}-M{M}-K{K}-N{N}"


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_qmv_cuda(case):
    _check("cuda", *case)


@pytest.mark.cuda
def test_qmv_cuda_model_shapes_and_dispatch():
    _check("cuda", 4, 64, mx.bfloat16, 1, 2048, 248320)  # lm_head
    _check("cuda", 4, 64, mx.float16, 2, 4096, 2048)
    _check("cuda", 4, 64, mx.bfloat16, 1, 512, 2048, lead=(2,))  # [2, 1, K] input
    x, w, s, b = _inputs(1, 2048, 16384, 4, 64, mx.bfloat16, 3)  # 16 MiB of codes: above the dispatch threshold
    via_ops = ops.quantized_matmul(x, w, s, b, group_size=64, bits=4)
    direct = qmv.qmv(x, w, s, b, group_size=64, bits=4, backend="cuda")
    assert mx.array_equal(via_ops, direct).item(), "ops.quantized_matmul did not take the qmv kernel"


@pytest.mark.cuda
def test_qmv_cuda_source_files_and_inline_agree():
    """The #included-source build (opt-in on CUDA) and the inline one are the same kernel: equal bits."""
    x, w, s, b = _inputs(3, 2048, 1000, 4, 64, mx.bfloat16, 4)
    with ops.switched("cuda_source_files", True):
        files = qmv.qmv(x, w, s, b, group_size=64, bits=4, backend="cuda")
    with ops.switched("cuda_source_files", False):
        inline = qmv.qmv(x, w, s, b, group_size=64, bits=4, backend="cuda")
    assert mx.array_equal(files, inline).item()


@pytest.mark.cuda
@pytest.mark.parametrize("dt", [mx.float32, mx.bfloat16])
def test_many_rows_dense_dequant_gemm_cuda(dt):
    """dense_dequant_gemm at prefill rows: dequantize + dense GEMM against the float32 oracle and MLX's
    quantized matmul, norm and residual variants included."""
    N = -(-ops.DENSE_DEQUANT_MIN_WEIGHTS // 2048) + 5  # just past the weight-size threshold, odd
    x, w, s, b = _inputs(ops.DENSE_DEQUANT_MIN_ROWS + 3, 2048, N, 4, 64, dt, 5)
    res = mx.random.normal((x.shape[0], N), key=mx.random.key(6)).astype(dt)
    nw = (1 + 0.2 * mx.random.normal((2048,), key=mx.random.key(7))).astype(dt)
    kw = dict(group_size=64, bits=4)
    runs = {}
    for on in (True, False):
        with ops.switched("dense_dequant_gemm", on):
            runs[on] = [ops.quantized_matmul(x, w, s, b, **kw), ops.quantized_matmul_add(x, w, s, b, res, **kw),
                        ops.norm_quantized_matmul(x, nw, 1e-6, w, s, b, **kw)]
    with mx.stream(mx.cpu):
        ref = _oracle(x, w, s, b, 64, 4)
    tol = 3e-3 if dt == mx.float32 else 1e-2  # float32 GEMMs run in TF32 on CUDA by default
    yf = runs[True][0].astype(mx.float32)
    assert (mx.linalg.norm(yf - ref) / mx.linalg.norm(ref)).item() < tol
    for a, c in zip(runs[True], runs[False]):
        af, cf = a.astype(mx.float32), c.astype(mx.float32)
        assert not mx.isnan(af).any().item() and (mx.linalg.norm(af - cf) / mx.linalg.norm(cf)).item() < tol


# (bits, group, x dtype, M, K, N, fusion): the input norm over one and several K tiles, the residual add.
FUSED = [(4, 64, mx.bfloat16, 1, 2048, 8192 + 4096 + 64, "norm"), (8, 64, mx.bfloat16, 2, 2048, 257, "norm"),
         (4, 32, mx.float32, 8, 1024, 19, "norm"), (4, 64, mx.bfloat16, 1, 4096, 2048, "residual"),
         (4, 128, mx.float32, 3, 256, 70, "residual"), (4, 64, mx.float16, 2, 2048, 248320, "norm")]


def _check_fused(backend, bits, gs, dt, M, K, N, fusion, seed=0):
    x, w, scales, biases = _inputs(M, K, N, bits, gs, dt, seed)
    x = x * 3  # the norm must matter
    key = mx.random.key(seed + 1)
    norm = ((1 + 0.3 * mx.random.normal((K,), key=key)).astype(dt), 1e-6) if fusion == "norm" else None
    res = mx.random.normal((M, N), key=key).astype(dt) if fusion == "residual" else None
    y = qmv.qmv(x, w, scales, biases, group_size=gs, bits=bits, backend=backend, norm=norm, residual=res,
                init_value=float("nan"))
    assert y is not None and y.shape == (M, N) and y.dtype == dt
    with mx.stream(mx.cpu):
        xin = reference.rms_norm(x, *norm) if norm else x
        ref = _oracle(xin, w, scales, biases, gs, bits) + (res.astype(mx.float32) if res is not None else 0)
    yf = y.astype(mx.float32)
    assert not mx.isnan(yf).any().item(), "unwritten (NaN) outputs"
    err = (mx.linalg.norm(yf - ref) / mx.linalg.norm(ref)).item()
    assert err < TOL[dt], f"{fusion}: relative error {err:.2e} >= {TOL[dt]} (bits={bits} M={M} K={K} N={N})"


@pytest.mark.cuda
@pytest.mark.parametrize("case", FUSED, ids=str)
def test_qmv_fused_cuda(case):
    _check_fused("cuda", *case)


@pytest.mark.metal
@pytest.mark.parametrize("case", FUSED, ids=str)
def test_qmv_fused_metal(case):
    _check_fused("metal", *case)


@pytest.mark.metal
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_qmv_metal(case):
    _check("metal", *case)


@pytest.mark.metal
def test_qmv_metal_model_shapes():
    _check("metal", 4, 64, mx.bfloat16, 1, 2048, 248320)
    _check("metal", 4, 64, mx.float16, 2, 4096, 2048)


def _raising_kernel(*args, **kwargs):
    raise AssertionError("the qmv kernel ran where the reference should")


def test_dispatcher_falls_back_on_cpu(monkeypatch):
    monkeypatch.setitem(ops._kernels, "qmv", _raising_kernel)
    with mx.stream(mx.cpu):
        x, w, s, b = _inputs(1, 256, 9, 4, 64, mx.float32, 1)
        y = ops.quantized_matmul(x, w, s, b, group_size=64, bits=4)
        ref = reference.quantized_matmul(x, w, s, b, group_size=64, bits=4)
        assert mx.allclose(y, ref).item()


def test_dispatcher_skips_switched_off_kernel(monkeypatch):
    monkeypatch.setitem(ops._kernels, "qmv", _raising_kernel)
    monkeypatch.setattr(ops, "backend", lambda: "cuda")
    x, w, s, b = _inputs(1, 256, 9, 4, 64, mx.float32, 1)
    with ops.disabled("qmv"):
        y = ops.quantized_matmul(x, w, s, b, group_size=64, bits=4)
    assert mx.allclose(y, reference.quantized_matmul(x, w, s, b, group_size=64, bits=4)).item()
    assert ops.enabled("qmv")
    with pytest.raises(AssertionError, match="kernel ran"):
        ops.quantized_matmul(x, w, s, b, group_size=64, bits=4)


def test_dispatch_leaves_small_weights_to_the_reference(monkeypatch):
    monkeypatch.setattr(ops, "backend", lambda: "cuda")
    monkeypatch.setattr(qmv, "qmv", _raising_kernel)
    x, w, s, b = _inputs(1, 2048, 512, 4, 64, mx.float32, 1)
    assert w.nbytes < qmv.DISPATCH_MIN_WEIGHT_BYTES
    assert qmv._dispatch(x, w, s, b, group_size=64, bits=4) is None
    # Fused with a norm or a residual, the kernel replaces several primitives: taken at any size.
    with pytest.raises(AssertionError, match="kernel ran"):
        qmv._dispatch(x, w, s, b, group_size=64, bits=4, norm=(mx.ones((2048,)), 1e-6))
    with pytest.raises(AssertionError, match="kernel ran"):
        qmv._dispatch(x, w, s, b, group_size=64, bits=4, residual=mx.zeros((1, 512)))


def test_fused_entries_fall_back_to_the_composition(monkeypatch):
    monkeypatch.setitem(ops._kernels, "qmv", _raising_kernel)
    x, w, s, b = _inputs(2, 256, 9, 4, 64, mx.float32, 1)
    nw, r = mx.random.uniform(0.5, 1.5, (256,)), mx.random.normal((2, 9))
    y = ops.norm_quantized_matmul(x, nw, 1e-5, w, s, b, group_size=64, bits=4)
    assert mx.array_equal(y, reference.quantized_matmul(mx.fast.rms_norm(x, nw, 1e-5), w, s, b, group_size=64, bits=4)).item()
    y = ops.quantized_matmul_add(x, w, s, b, r, group_size=64, bits=4)
    assert mx.array_equal(y, r + reference.quantized_matmul(x, w, s, b, group_size=64, bits=4)).item()


def test_unsupported_arguments_are_declined():
    x, w, s, b = _inputs(1, 256, 9, 4, 64, mx.float32, 1)
    assert qmv.unsupported(x, w, s, b, 64, 4) is None
    assert "bits" in qmv.unsupported(x, w, s, b, 64, 2)
    assert "group_size" in qmv.unsupported(x, w, s, b, 16, 4)
    assert "rows" in qmv.unsupported(mx.zeros((9, 256)), w, s, b, 64, 4)
    assert qmv.unsupported(x, w, s, None, 64, 4) is not None
    assert qmv.unsupported(mx.zeros((1, 128)), w, s, b, 64, 4) == "shapes"
    assert qmv.qmv(mx.zeros((9, 256)), w, s, b, group_size=64, bits=4, backend="cuda") is None
    assert "norm" in qmv.unsupported(x, w, s, b, 64, 4, norm=(mx.ones((128,)), 1e-6))
    assert "norm" in qmv.unsupported(x, w, s, b, 64, 4, norm=(mx.ones((256,)), 0.0))
    assert "residual" in qmv.unsupported(x, w, s, b, 64, 4, residual=mx.zeros((1, 8)))
    assert "residual" in qmv.unsupported(x, w, s, b, 64, 4, residual=mx.zeros((1, 9), dtype=mx.bfloat16))


@pytest.mark.parametrize("M", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("K,N,bits", [(512, 2048, 4), (2048, 8192, 4), (2048, 1, 8), (4096, 2048, 4), (768, 33, 8)])
def test_plan_respects_kernel_limits(M, K, N, bits):
    p = qmv.plan(M, K, N, bits)
    cpc = 128 // bits
    assert (K // cpc) % p["LANES"] == 0 and 32 % p["LANES"] == 0
    assert M * p["LANES"] * cpc <= qmv.XBUDGET
    rows_block = p["WARPS"] * (32 // p["LANES"]) * p["RPS"]
    assert 1 <= p["blocks"] <= min(qmv.MAX_BLOCKS, -(-N // rows_block))
