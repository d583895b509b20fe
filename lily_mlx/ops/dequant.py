"""dequant: affine-quantized weights to floats in ONE launch (kernels/dequant.inc, CUDA and Metal).

The prefill paths that run quantized weights as dense GEMMs (every expert before the grouped GEMM,
`moe_dequant_gemm`; the dense projections, `dense_dequant_gemm`) first write the weights out in the
activations' dtype; MLX's `mx.dequantize` moved about 0.75 TB/s doing that on the H200 (2.7 ms for a
layer's 805M expert weights). This module checks that the kernel applies (else ops.dequantize runs
mx.dequantize), picks the launch and registers switch "dequant". The first version (kernels/scratch/dequant_v1.inc)
was slower than mx.dequantize; this one (each warp store covering 32 consecutive outputs) moved 2.56 TB/s on the
H200 (every expert's gate projection: 269 us vs 1014 us) and took a 2048-token prefill from 333 to 314 ms.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from . import kernels, metal_source, register_kernel

FLOAT_DTYPES = (mx.float32, mx.bfloat16, mx.float16)
THREADS = 256
SPEC_PARAMS = ("TS", "TO", "BITS", "GROUP", "K", "THREADS")


def unsupported(w, scales, biases, group_size: int, bits: int, dtype) -> Optional[str]:
    """Why the kernel does not apply (None when it does)."""
    if bits not in (4, 8) or group_size % (32 // bits) or w.dtype != mx.uint32 or w.ndim < 2:
        return f"bits={bits}, group_size={group_size}, w {w.dtype} {w.shape}: 4/8-bit uint32 codes expected"
    K = w.shape[-1] * 32 // bits
    if K % group_size or scales.shape != (*w.shape[:-1], K // group_size) or biases is None \
            or biases.shape != scales.shape or biases.dtype != scales.dtype:
        return f"scales/biases {scales.shape} do not match w {w.shape} at group {group_size}"
    if scales.dtype not in FLOAT_DTYPES or dtype not in FLOAT_DTYPES:
        return f"dtypes: scales {scales.dtype}, output {dtype}"
    if w.size * (32 // bits) >= 2**31:
        return "int32 indexing: more than 2^31 weights"
    return None


def instance(rows: int, K: int, group_size: int, bits: int, scale_dtype, dtype) -> kernels.Instance:
    template = (("TS", scale_dtype), ("TO", dtype), ("BITS", bits), ("GROUP", group_size), ("K", K),
                ("THREADS", THREADS))
    inputs = ((mx.uint32, (rows, K * bits // 32)), (scale_dtype, (rows, K // group_size)),
              (scale_dtype, (rows, K // group_size)))
    return kernels.Instance(template, inputs, (dtype,))


def grid(rows: int, K: int, bits: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    words = rows * K * bits // 32
    return (-(-words // THREADS) * THREADS, 1, 1), (THREADS, 1, 1)


def dequantize(w, scales, biases, *, group_size: int, bits: int, dtype=None, backend: str,
               init_value: Optional[float] = None) -> Optional[mx.array]:
    """w [..., K*bits/32] -> [..., K] in `dtype` (default: the scales' dtype), or None when the kernel does not apply."""
    dtype = dtype or scales.dtype
    if unsupported(w, scales, biases, group_size, bits, dtype) is not None:
        return None
    K = w.shape[-1] * 32 // bits
    rows = w.size // w.shape[-1]
    flat = [a.reshape(rows, a.shape[-1]) for a in (w, scales, biases)]
    inst = instance(rows, K, group_size, bits, scales.dtype, dtype)
    grid_, group = grid(rows, K, bits)
    out = kernels.call("dequant", backend, flat, list(inst.template), grid_, group, [(rows, K)], [dtype], init_value)[0]
    return out.reshape(*w.shape[:-1], K)


# (K, group, bits) the project dequantizes: the 35B-A3B experts (gate/up K=2048, down K=512), its projections,
# the tiny checkpoints; plus odd test widths.
MODEL_WIDTHS = ((2048, 64, 4), (512, 64, 4), (4096, 64, 4), (2048, 64, 8), (64, 32, 4), (96, 32, 4))


def _instances() -> list[kernels.Instance]:
    insts = [instance(8, K, g, b, mx.bfloat16, mx.bfloat16) for K, g, b in MODEL_WIDTHS]
    insts += [instance(5, 384, 128, 4, mx.float32, mx.float32), instance(3, 96, 32, 8, mx.float16, mx.float16),
              instance(7, 192, 64, 4, mx.bfloat16, mx.float32)]
    return kernels.unique_instances(insts, key=lambda i: metal_source.metal_kernel_name("dequant", i.template,
                                                                                      i.inputs, i.output_dtypes))


SPEC = kernels.register_spec(kernels.KernelSpec(
    name="dequant", body="dequant.inc", input_names=("w", "scales", "biases"), output_names=("out",),
    template_params=SPEC_PARAMS,
    description="Affine 4/8-bit weights to floats (the operand of the prefill's dequantized GEMMs)",
    instances=_instances,
))


def rows_instance(V: int, R: int, K: int, group_size: int, bits: int, scale_dtype, ids_dtype=mx.int32) -> kernels.Instance:
    template = (("TS", scale_dtype), ("TO", scale_dtype), ("BITS", bits), ("GROUP", group_size), ("K", K),
                ("THREADS", THREADS))
    inputs = ((mx.uint32, (V, K * bits // 32)), (scale_dtype, (V, K // group_size)), (scale_dtype, (V, K // group_size)),
              (ids_dtype, (R,)))
    return kernels.Instance(template, inputs, (scale_dtype,))


def embedding_rows(ids, w, scales, biases, *, group_size: int, bits: int, backend: str,
                   init_value: Optional[float] = None) -> Optional[mx.array]:
    """The rows ids [...] (int32, or uint32 as argmax gives them) of the quantized table w [V, K*bits/32]
    dequantized, [..., K] in the scales' dtype (as mlx.nn.QuantizedEmbedding), in one launch; None when the
    kernel does not apply."""
    if ids.dtype not in (mx.int32, mx.uint32) or ids.size == 0 or w.shape[0] >= 2**31 or w.ndim != 2 or unsupported(w, scales, biases, group_size, bits,
                                                                           scales.dtype) is not None:
        return None
    K = w.shape[-1] * 32 // bits
    inst = rows_instance(w.shape[0], ids.size, K, group_size, bits, scales.dtype, ids.dtype)
    grid_, group = grid(ids.size, K, bits)
    return kernels.call("dequant_rows", backend, [w, scales, biases, ids], list(inst.template), grid_, group,
                        [(*ids.shape, K)], [scales.dtype], init_value)[0]


def _rows_instances() -> list[kernels.Instance]:
    insts = [rows_instance(248320, 8, 2048, 64, 4, mx.bfloat16, t) for t in (mx.int32, mx.uint32)]
    insts += [rows_instance(300, 5, 96, 32, 8, mx.float32), rows_instance(17, 3, 192, 64, 4, mx.float16)]
    return kernels.unique_instances(insts, key=lambda i: metal_source.metal_kernel_name("dequant_rows", i.template,
                                                                                      i.inputs, i.output_dtypes))


ROWS_SPEC = kernels.register_spec(kernels.KernelSpec(
    name="dequant_rows", body="dequant.inc", input_names=("w", "scales", "biases", "ids"), output_names=("out",),
    template_params=SPEC_PARAMS, description="an embedding lookup: quantized table rows picked by id and dequantized",
    instances=_rows_instances, defines=("LILY_DEQUANT_ROWS",), weights=(("w", "scales", "biases"),),
))


def _dispatch_rows(ids, w, scales, biases, **kwargs):
    from . import backend

    return embedding_rows(ids, w, scales, biases, backend=backend(), **kwargs)


# On with qmv_attn (see there): its cuda tests pass on the H200 (run 9).
register_kernel("dequant_rows", ROWS_SPEC.description + " (one launch for three gathers and a dequantize)",
                _dispatch_rows)


def _dispatch(w, scales, biases, **kwargs):
    from . import backend

    return dequantize(w, scales, biases, backend=backend(), **kwargs)


register_kernel("dequant", SPEC.description, _dispatch)
