"""Compile checks for every registered kernel where no GPU exists (CI), plus an emulated Metal run.

Metal: the full source MLX would build (lily_mlx.ops.metal_source) for each instantiation the
project uses, against tests/metal_shim/metal_shim.h with `g++ -std=c++17 -fsyntax-only`, the
[[...]] attributes stripped. CUDA: the same with MLX's CUDA signature through `nvcc -arch=sm_90a`
when nvcc is installed. Emulated: qmv's Metal source run on the CPU by the shim's SIMT emulator
(a thread per GPU thread, simdgroups of 32) and compared with the reference.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from lily_mlx.ops import kernels, metal_source, qmv, reference

SHIM_DIR = Path(__file__).parent / "metal_shim"
ATTRIBUTE = re.compile(r"\[\[[^\[\]]*\]\]")
GXX = shutil.which("g++")
NVCC = shutil.which("nvcc")
SPEC_NAMES = sorted(kernels.SPECS)

# Stands in for MLX's mlx/backend/cuda/device/utils.cuh, which ships inside libmlx only.
CUDA_UTILS_STANDIN = """#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 10>;
using Strides = cuda::std::array<int64_t, 10>;
}
"""


def metal_unit(spec, instances) -> str:
    parts = ['#include "metal_shim.h"\n']
    for inst in instances:
        _, src = kernels.full_source(spec, "metal", inst)
        parts.append(ATTRIBUTE.sub("", src))
    return "\n".join(parts)


def _run(cmd, cwd=None, timeout=900):
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    return r.returncode, (r.stdout + r.stderr)[-8000:]


def test_instances_are_distinct_and_named():
    for name in SPEC_NAMES:
        spec = kernels.SPECS[name]
        insts = spec.instances()
        assert insts, f"kernel {name} lists no instantiations"
        for inst in insts:
            assert tuple(n for n, _ in inst.template) == spec.template_params
        names = {kernels.full_source(spec, "metal", i)[0] for i in insts}
        assert len(names) == len(insts), f"kernel {name}: two instantiations share a Metal kernel name"


def test_metal_signature_matches_mlx_format():
    inst = qmv.instance(mx.bfloat16, mx.bfloat16, 1, 2048, 8192, 4, 64)
    name, src = kernels.full_source(qmv.SPEC, "metal", inst)
    assert name == "custom_kernel_qmv__bfloat16_t_4_64_1_2048_32_4_8_bfloat16_t_uint32_t_bfloat16_t_bfloat16_t_bfloat16_t"
    assert "template <typename T, int BITS, int GS, int M, int K, int LANES, int RPS, int WARPS>\n[[kernel]] void " in src
    assert "  const device bfloat16_t* x [[buffer(0)]],\n  const device uint32_t* w [[buffer(1)]],\n" in src
    assert "  const constant int* w_shape [[buffer(2)]],\n" in src  # the body reads N from w_shape
    assert "  device bfloat16_t* y [[buffer(5)]],\n" in src
    assert "  uint thread_index_in_simdgroup [[thread_index_in_simdgroup]],\n" in src
    assert "thread_position_in_grid [[" not in src  # attributes appear only when the body names them
    assert src.rstrip().endswith(f"decltype({name}<bfloat16_t, 4, 64, 1, 2048, 32, 4, 8>) {name}<bfloat16_t, 4, 64, 1, 2048, 32, 4, 8>;")


def test_metal_small_and_scalar_inputs_use_constant_space():
    _, src = metal_source.metal_source("k", ["a", "s"], ["o"], "o[0] = a[0] + s;", "",
                                       [(mx.float32, (4,)), (mx.float32, ())], [mx.float32])
    assert "  const constant float* a [[buffer(0)]],\n  const constant float& s [[buffer(1)]],\n" in src
    assert "custom_kernel_k_floatc_floats_float(" in src


@pytest.mark.skipif(GXX is None, reason="g++ is not installed")
@pytest.mark.parametrize("name", SPEC_NAMES)
def test_metal_kernels_compile(name, tmp_path):
    spec = kernels.SPECS[name]
    unit = tmp_path / f"{name}_metal.cpp"
    unit.write_text(metal_unit(spec, spec.instances()))
    rc, log = _run([GXX, "-std=c++17", "-fsyntax-only", "-Wall", "-Wno-attributes", "-Wno-unknown-pragmas",
                    "-Wno-unused-variable", "-Wno-unused-but-set-variable", "-Werror", f"-I{SHIM_DIR}", str(unit)])
    assert rc == 0, f"Metal source of {name} does not compile against the shim:\n{log}"


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed: the CUDA compile check needs the CUDA toolkit")
@pytest.mark.parametrize("name", SPEC_NAMES)
def test_cuda_kernels_compile(name, tmp_path):
    spec = kernels.SPECS[name]
    inc = tmp_path / "include" / "mlx" / "backend" / "cuda" / "device"
    inc.mkdir(parents=True)
    (inc / "utils.cuh").write_text(CUDA_UTILS_STANDIN)
    unit = tmp_path / f"{name}.cu"
    unit.write_text("\n".join(kernels.full_source(spec, "cuda", i)[1] for i in spec.instances()))
    rc, log = _run([NVCC, "-std=c++17", "-arch=sm_90a", f"-I{tmp_path / 'include'}", "-x", "cu",
                    "-fdevice-syntax-only", "-c", str(unit), "-o", str(tmp_path / "out.o")])
    assert rc == 0, f"CUDA source of {name} does not compile:\n{log}"


# ---- emulated Metal run -------------------------------------------------------------------------

def _to_numpy(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16)) if a.dtype in (mx.bfloat16, mx.float16) else np.array(a)


def _emulator_call(case: int, spec, inst, kname, arrays, grid, group, out_shapes) -> str:
    """The C++ for one case of main(): load inputs, poison outputs with NaN bytes, launch, save."""
    src = kernels.body(spec, "metal")
    infos = [(f"{n}_shape" in src, f"{n}_strides" in src, f"{n}_ndim" in src) for n in spec.input_names]
    attrs = [a for a, _ in metal_source.METAL_ATTRIBUTES if a in src]
    lines, args = [f"  case {case}: {{"], []
    for i, (a, n, info) in enumerate(zip(arrays, spec.input_names, infos)):
        t = metal_source.type_string(a.dtype)
        lines.append(f'    auto in{i} = load(dir + "/{case}_in{i}.bin");')
        args.append(f"*reinterpret_cast<const {t}*>(in{i}.data())" if a.ndim == 0 else f"reinterpret_cast<const {t}*>(in{i}.data())")
        if a.ndim:
            if info[0]:
                lines.append(f"    static const int {n}_shape[] = {{{', '.join(map(str, a.shape))}}};")
                args.append(f"{n}_shape")
            if info[1]:
                strides = [math.prod(a.shape[j + 1:]) for j in range(a.ndim)]
                lines.append(f"    static const int64_t {n}_strides[] = {{{', '.join(map(str, strides))}}};")
                args.append(f"{n}_strides")
            if info[2]:
                lines.append(f"    static const int {n}_ndim = {a.ndim};")
                args.append(f"{n}_ndim")
    for o, (shape, dtype) in enumerate(zip(out_shapes, inst.output_dtypes)):
        t = metal_source.type_string(dtype)
        lines.append(f"    std::vector<char> out{o}({math.prod(shape)} * sizeof({t}), char(0xff));")
        args.append(f"reinterpret_cast<{t}*>(out{o}.data())")
    args += [f"ids.{a}" for a in attrs]
    targs = ", ".join(metal_source.type_string(v) if isinstance(v, mx.Dtype) else str(int(v)) for _, v in inst.template)
    lines.append(f"    metal_sim::launch(uint3({grid[0]}u, {grid[1]}u, {grid[2]}u), uint3({group[0]}u, {group[1]}u, {group[2]}u),")
    lines.append(f"        [&](const metal_sim::Ids& ids) {{ {kname}<{targs}>({', '.join(args)}); }});")
    lines += [f'    save(dir + "/{case}_out{o}.bin", out{o});' for o in range(len(out_shapes))]
    lines.append("  } break;")
    return "\n".join(lines)


EMULATOR_MAIN = """
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
static std::vector<char> load(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) { std::perror(path.c_str()); std::exit(2); }
  std::fseek(f, 0, SEEK_END); long n = std::ftell(f); std::fseek(f, 0, SEEK_SET);
  std::vector<char> buf(n);
  if (std::fread(buf.data(), 1, n, f) != size_t(n)) std::exit(3);
  std::fclose(f);
  return buf;
}
static void save(const std::string& path, const std::vector<char>& buf) {
  FILE* f = std::fopen(path.c_str(), "wb");
  std::fwrite(buf.data(), 1, buf.size(), f);
  std::fclose(f);
}
int main(int argc, char** argv) {
  const int which = std::atoi(argv[1]);
  const std::string dir = argv[2];
  switch (which) {
CASES
  default: return 1;
  }
  return 0;
}
"""

# (M, K, N, bits, group, x dtype): LANES 32/16/8/4, several K tiles (M=8), partial last blocks, N=1.
EMULATED = [
    (1, 2048, 37, 4, 64, mx.bfloat16),
    (3, 256, 45, 4, 32, mx.float32),
    (8, 1024, 19, 4, 128, mx.float32),
    (2, 128, 70, 8, 32, mx.bfloat16),
    (1, 512, 1, 8, 64, mx.float16),
    (5, 768, 9, 8, 128, mx.float32),
]


@pytest.mark.skipif(GXX is None, reason="g++ is not installed")
def test_qmv_metal_emulated_matches_reference(tmp_path):
    mx.random.seed(7)
    cases, expected, tols = [], [], []
    srcs, seen = [], set()
    for c, (M, K, N, bits, gs, dt) in enumerate(EMULATED):
        w_f = mx.random.normal((N, K)) * 0.05
        w, scales, biases = mx.quantize(w_f, group_size=gs, bits=bits)
        x = mx.random.normal((M, K)).astype(dt)
        arrays = [x, w, scales, biases]
        for i, a in enumerate(arrays):
            _to_numpy(a).tofile(tmp_path / f"{c}_in{i}.bin")
        inst = qmv.instance(dt, scales.dtype, M, K, N, bits, gs)
        kname, src = kernels.full_source(qmv.SPEC, "metal", inst)
        if kname not in seen:
            seen.add(kname)
            srcs.append(ATTRIBUTE.sub("", src))
        p = qmv.plan(M, K, N, bits)
        threads = 32 * p["WARPS"]
        cases.append(_emulator_call(c, qmv.SPEC, inst, kname, arrays, (p["blocks"] * threads, 1, 1), (threads, 1, 1), [(M, N)]))
        expected.append(reference.quantized_matmul_oracle(x, w, scales.astype(mx.float32), biases.astype(mx.float32),
                                                          group_size=gs, bits=bits).astype(mx.float32))
        tols.append(1e-5 if dt == mx.float32 else 8e-3)
    unit = tmp_path / "emulate.cpp"
    unit.write_text("#define METAL_SHIM_SIM 1\n" + metal_unit(qmv.SPEC, [])
                    + "\n".join(srcs) + EMULATOR_MAIN.replace("CASES", "\n".join(cases)))
    exe = tmp_path / "emulate"
    rc, log = _run([GXX, "-std=c++20", "-O1", "-pthread", "-Wno-attributes", f"-I{SHIM_DIR}", str(unit), "-o", str(exe)])
    assert rc == 0, f"emulator build failed:\n{log}"
    for c, (M, K, N, bits, gs, dt) in enumerate(EMULATED):
        rc, log = _run([str(exe), str(c), str(tmp_path)], timeout=300)
        assert rc == 0, f"emulated case {c} failed:\n{log}"
        raw = np.fromfile(tmp_path / f"{c}_out0.bin", dtype=np.uint16 if dt != mx.float32 else np.float32)
        y = mx.array(raw).view(dt).reshape(M, N).astype(mx.float32) if dt != mx.float32 else mx.array(raw).reshape(M, N)
        assert not mx.isnan(y).any().item(), f"case {EMULATED[c]}: unwritten (NaN) outputs"
        err = (mx.linalg.norm(y - expected[c]) / mx.linalg.norm(expected[c])).item()
        assert err < tols[c], f"case {EMULATED[c]}: relative error {err:.2e} >= {tols[c]}"
