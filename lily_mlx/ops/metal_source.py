"""The full kernel sources MLX generates around a custom-kernel body, written out here.

`mx.fast.metal_kernel` and `mx.fast.cuda_kernel` take only a body and a header; MLX writes the
signature (from the input/output names and the call's dtypes), the template arguments and, on Metal,
the thread attributes whose names appear in the body. These functions reproduce that text (MLX
0.32: mlx/backend/common/metal_kernel.cpp, mlx/backend/cuda/custom_kernel.cpp) so kernels can be
compile-checked where no GPU exists: Metal against tests/metal_shim, CUDA with nvcc.
"""

from __future__ import annotations

from typing import Sequence, Union

import mlx.core as mx

TemplateArg = Union[int, bool, mx.Dtype]

# MLX passes an input in the constant address space when it has fewer elements than this.
MAX_CONSTANT_ARRAY_SIZE = 8
# Threadgroup memory one Metal threadgroup may use: every kernel's shared-memory check holds its plan to this.
THREADGROUP_BYTES = 32768

# (attribute, type) in MLX's order; one is added to the signature when its name occurs in the body.
METAL_ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

_TYPE_STRINGS = {  # MLX's get_type_string (Metal and kernel-name spelling)
    mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t", mx.float64: "double",
    mx.complex64: "complex64_t", mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t",
    mx.int32: "int32_t", mx.int64: "int64_t", mx.uint8: "uint8_t", mx.uint16: "uint16_t",
    mx.uint32: "uint32_t", mx.uint64: "uint64_t",
}
_CUDA_TYPES = {  # MLX's dtype_to_cuda_type
    mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
    mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
    mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float", mx.float64: "double",
    mx.complex64: "mlx::core::cu::complex64_t",
}

# What MLX's cuda_kernel puts before the user header.
CUDA_DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'


def type_string(dtype: mx.Dtype) -> str:
    if dtype not in _TYPE_STRINGS:
        raise ValueError(f"dtype {dtype} has no kernel type string")
    return _TYPE_STRINGS[dtype]


def cuda_type(dtype: mx.Dtype) -> str:
    if dtype not in _CUDA_TYPES:
        raise ValueError(f"dtype {dtype} has no CUDA type")
    return _CUDA_TYPES[dtype]


def shape_infos(source: str, input_names: Sequence[str]) -> list[tuple[bool, bool, bool]]:
    """Which of `<name>_shape`, `_strides`, `_ndim` the body mentions, per input."""
    return [(f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source) for n in input_names]


def metal_attributes(source: str) -> list[str]:
    return [f"  {t} {a} [[{a}]]" for a, t in METAL_ATTRIBUTES if a in source]


def _template_value(v: TemplateArg, spell) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int):
        return str(v)
    return spell(v)


def metal_kernel_name(name: str, template: Sequence[tuple[str, TemplateArg]], inputs, output_dtypes) -> str:
    """inputs: (dtype, shape) per input, as the call passes them."""
    kname = "custom_kernel_" + name
    if template:
        # MLX appends "_" and then the template list with "<", ">" and ", " turned into "_",
        # its last character dropped: <float, 4> gives "__float_4".
        kname += "__" + ", ".join(_template_value(v, type_string) for _, v in template).replace(", ", "_")
    for dtype, shape in inputs:
        kname += "_" + type_string(dtype)
        size = 1
        for d in shape:
            size *= d
        if len(shape) == 0:
            kname += "s"
        elif size < MAX_CONSTANT_ARRAY_SIZE:
            kname += "c"
    for dtype in output_dtypes:
        kname += "_" + type_string(dtype)
    return kname


def metal_source(name, input_names, output_names, source, header, inputs, output_dtypes, template=()):
    """(kernel name, full source) as mx.fast.metal_kernel compiles it, minus MLX's own utils header
    (metal_stdlib, bfloat16_t, float16_t), which comes first in the library MLX builds."""
    kname = metal_kernel_name(name, template, inputs, output_dtypes)
    infos = shape_infos(source, input_names)
    attrs = metal_attributes(source)
    out = header
    if template:
        kinds = ["bool" if isinstance(v, bool) else "int" if isinstance(v, int) else "typename" for _, v in template]
        out += "template <" + ", ".join(f"{k} {n}" for k, (n, _) in zip(kinds, template)) + ">\n"
    out += f"[[kernel]] void {kname}(\n"
    index = 0
    for (n, (dtype, shape), info) in zip(input_names, inputs, infos):
        size = 1
        for d in shape:
            size *= d
        location = "constant" if size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if len(shape) == 0 else "*"
        out += f"  const {location} {type_string(dtype)}{ref} {n} [[buffer({index})]],\n"
        index += 1
        if len(shape) > 0:
            if info[0]:
                out += f"  const constant int* {n}_shape [[buffer({index})]],\n"
                index += 1
            if info[1]:
                out += f"  const constant int64_t* {n}_strides [[buffer({index})]],\n"
                index += 1
            if info[2]:
                out += f"  const constant int& {n}_ndim [[buffer({index})]],\n"
                index += 1
    for n, dtype in zip(output_names, output_dtypes):
        out += f"  device {type_string(dtype)}* {n} [[buffer({index})]]"
        # MLX's own test, buffer index included (a body using `_shape` with no attributes breaks it).
        out += ",\n" if index < len(inputs) + len(output_names) - 1 or attrs else ") {\n"
        index += 1
    for i, a in enumerate(attrs):
        out += a + (",\n" if i < len(attrs) - 1 else ") {\n")
    out += source + "\n}\n"
    if template:
        tdef = kname + "<" + ", ".join(_template_value(v, type_string) for _, v in template) + ">"
        out += f'\ntemplate [[host_name("{kname}")]] [[kernel]] decltype({tdef}) {tdef};\n'
    return kname, out


def cuda_kernel_name(name: str, template: Sequence[tuple[str, TemplateArg]]) -> str:
    h = ""
    for _, v in template:
        if isinstance(v, bool):
            h += "_t" if v else "_f"
        elif isinstance(v, int):
            h += f"_{v}"
        else:
            h += "_" + type_string(v)
    return "custom_kernel_" + name + h


def cuda_source(name, input_names, output_names, source, header, inputs, output_dtypes, template=()):
    """(kernel name, full source) as mx.fast.cuda_kernel hands it to NVRTC."""
    kname = cuda_kernel_name(name, template)
    infos = shape_infos(source, input_names)
    out = CUDA_DEFAULT_HEADER + header
    out += "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    out += f"__global__ void {kname}(\n"
    for (n, (dtype, shape), info) in zip(input_names, inputs, infos):
        out += f"    const {cuda_type(dtype)}* {n},\n"
        if len(shape) > 0:
            if info[0]:
                out += f"    const __grid_constant__ Shape {n}_shape,\n"
            if info[1]:
                out += f"    const __grid_constant__ Strides {n}_strides,\n"
            if info[2]:
                out += f"    const __grid_constant__ int {n}_ndim,\n"
    for i, (n, dtype) in enumerate(zip(output_names, output_dtypes)):
        out += f"    {cuda_type(dtype)}* {n}" + (",\n" if i < len(output_names) - 1 else ") {\n")
    if template:
        for n, v in template:
            if isinstance(v, bool):
                out += f"  constexpr bool {n} = {'true' if v else 'false'};\n"
            elif isinstance(v, int):
                out += f"  constexpr int {n} = {v};\n"
            else:
                out += f"  using {n} = {cuda_type(v)};\n"
        out += "\n"
    out += source + "\n}\n\n} // namespace mlx::core::cu\n"
    return kname, out
