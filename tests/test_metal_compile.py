"""Compile checks for every registered kernel where no GPU exists (CI), plus an emulated Metal run.

Metal: the full source MLX would build (lily_mlx.ops.metal_source) for each instantiation the
project uses, against tests/metal_shim/metal_shim.h with `g++ -std=c++17 -fsyntax-only`, the
[[...]] attributes stripped. CUDA: the same with MLX's CUDA signature through `nvcc -arch=sm_90a`
when nvcc is installed (device code only, as NVRTC compiles it). Emulated: qmv's Metal source run on the CPU by
the shim's SIMT emulator (tests/emulator.py) and compared with the reference, and the emulator's own scheduling
and bounds checks on small probes.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

import script_tool
from emulator import GXX, SANITIZER_ENV, SHIM_DIR, Emulator, metal_unit, run, sanitizer_flags
from lily_mlx import ops
from lily_mlx.ops import kernels, metal_source, qmv, reference

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


def test_variant_blocks_are_selected_per_spec():
    """A body's #ifdef LILY_* blocks are resolved per kernel variant (each variant's source holds only its own
    lines); other conditionals reach the compiler; an unclosed block is an error."""
    text = "a\n#ifdef LILY_A\nb\n#ifdef __CUDACC__\nc\n#else\nd\n#endif\n#else\ne\n#endif\n#ifndef LILY_A\nf\n#endif\ng"
    assert kernels.select_blocks(text, ["LILY_A"]).split() == ["a", "b", "#ifdef", "__CUDACC__", "c", "#else", "d",
                                                               "#endif", "g"]
    assert kernels.select_blocks(text, []).split() == ["a", "e", "f", "g"]
    with pytest.raises(ValueError, match="not closed"):
        kernels.select_blocks("#ifdef LILY_A\nb", [])
    plain, attn = (kernels.body(kernels.SPECS[n], "cuda") for n in ("qmv", "qmv_attn"))
    assert "part_acc" in attn and "part_acc" not in plain and "x_shape" in plain and "x_shape" not in attn


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
    assert name == ("custom_kernel_qmv__bfloat16_t_bfloat16_t_4_64_1_2048_32_4_8_0_0_0_bfloat16_t_uint32_t_bfloat16_t_bfloat16_t"
                    "_bfloat16_tc_bfloat16_tc_bfloat16_t")  # the unread 1-element nw and res are constant
    assert ("template <typename T, typename TN, int BITS, int GS, int M, int K, int LANES, int RPS, int WARPS, bool NORM, "
            "bool RES, int EPS_BITS>\n[[kernel]] void ") in src
    # The body reads its row count from x_shape and x_ndim, and N from w_shape.
    assert ("  const device bfloat16_t* x [[buffer(0)]],\n  const constant int* x_shape [[buffer(1)]],\n"
            "  const constant int& x_ndim [[buffer(2)]],\n  const device uint32_t* w [[buffer(3)]],\n"
            "  const constant int* w_shape [[buffer(4)]],\n") in src
    assert "  const constant bfloat16_t* nw [[buffer(7)]],\n" in src
    assert "  device bfloat16_t* y [[buffer(9)]],\n" in src
    assert "  uint thread_index_in_simdgroup [[thread_index_in_simdgroup]],\n" in src
    assert "thread_position_in_grid [[" not in src  # attributes appear only when the body names them
    targs = "bfloat16_t, bfloat16_t, 4, 64, 1, 2048, 32, 4, 8, 0, 0, 0"
    assert src.rstrip().endswith(f"decltype({name}<{targs}>) {name}<{targs}>;")


def test_kernels_carry_only_the_helpers_they_call():
    """Each launch hashes its full source, so headers hold only the common helpers a body reaches."""
    assert kernels.common_header("x = 1;") == ""
    hdr = kernels.common_header("lily_norm_rope<T, 64, 16>(src, nw, eps, pos, lb, dst, lane);")
    assert "lily_normed(" in hdr and "lily_norm_rope(" in hdr and "lily_topk" not in hdr
    assert hdr.index("lily_normed(") < hdr.index("lily_norm_rope(")  # file order: used before use
    names = {n for names, _ in kernels._common_helpers() for n in names}
    assert {"lily_qdot16", "lily_topk", "lily_row_rsqrt_ms", "lily_sigmoid", "lily_neg_inf"} <= names
    hdr = kernels.common_header("lily_router_rows<T, 64, 32, 8, 64, 9, 4>(wr, sr, br, xs4, 0, 9, out, w, l);")
    assert hdr.index("struct lily_router_regs") < hdr.index("lily_router_load(") < hdr.index("lily_router_rows(")
    everything = len(kernels.header("metal", " ".join(sorted(names) + ["lily_mma", "lily_df_"])))
    for name in SPEC_NAMES:
        spec = kernels.SPECS[name]
        body = kernels.body(spec, "metal")
        assert len(kernels.header("metal", body)) < everything
    assert "LILY_DF_STEPS" not in kernels.header("metal", "lily_mma(c, a, b);")  # tile helpers without the direct ones


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
    rc, log = run([GXX, "-std=c++17", "-fsyntax-only", "-Wall", "-Wno-attributes", "-Wno-unknown-pragmas",
                    "-Wno-unused-variable", "-Wno-unused-but-set-variable", "-Werror", f"-I{SHIM_DIR}", str(unit)])
    assert rc == 0, f"Metal source of {name} does not compile against the shim:\n{log}"


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed: the CUDA compile check needs the CUDA toolkit")
def test_cuda_kernels_compile(tmp_path):
    """Every instance of every kernel, packed variants included, in one unit, device code only (-ptx), as NVRTC
    compiles it: nvcc's host pass and second device pass took 6x as long. The specs with launch bounds go last, as
    each redefines __global__ for what follows. A kernel whose header lacks a helper another kernel's header brings
    would pass here: the Metal check above compiles each spec alone, through the same helper selection."""
    names = sorted(SPEC_NAMES, key=lambda n: bool(kernels.SPECS[n].cuda_launch_bounds))
    rc, log = _cuda_ptx(tmp_path, [kernels.full_source(kernels.SPECS[n], "cuda", i)[1] for n in names
                                   for i in kernels.SPECS[n].instances()])
    assert rc == 0, f"the CUDA sources do not compile:\n{log}"


def _cuda_ptx(tmp_path: Path, sources: list[str]) -> tuple[int, str]:
    """nvcc over the sources as one unit, device code only, against the stand-in for MLX's utils.cuh."""
    inc = tmp_path / "include" / "mlx" / "backend" / "cuda" / "device"
    inc.mkdir(parents=True)
    (inc / "utils.cuh").write_text(CUDA_UTILS_STANDIN)
    unit = tmp_path / "kernels.cu"
    unit.write_text("\n".join(sources))
    # 177: a variable declared and not used, as the shared entry prelude leaves in kernels that need few indices.
    return run([NVCC, "-std=c++17", "-arch=sm_90a", f"-I{tmp_path / 'include'}", "-x", "cu", "-fdevice-syntax-only",
                "-diag-suppress", "177", "-ptx", str(unit), "-o", str(tmp_path / "kernels.ptx")])


@pytest.mark.parametrize("device", [True, False], ids=["device_scalars", "host_data"])
def test_int32_scalar_holds_its_value(device):
    with ops.switched("device_scalars", device):
        got = [kernels.int32_scalar(v) for v in (0, 7, 4095, -3)]
    assert all(a.shape == (1,) and a.dtype == mx.int32 for a in got)
    assert [a.item() for a in got] == [0, 7, 4095, -3]


@pytest.mark.parametrize("device", [True, False], ids=["device_counters", "host_data"])
def test_sync_counters_are_each_launch_s_own_zeros(device):
    """Every call gives zeros no other call got, past one pool's worth too, with device_counters on or off."""
    with ops.switched("device_counters", device):
        made = [kernels.sync_counters() for _ in range(kernels.COUNTER_POOL + 3)]
    assert len({id(a) for a in made}) == len(made)
    assert all(a.shape == (kernels.SYNC_SLOTS,) and a.dtype == mx.int32 for a in made)
    assert not mx.concatenate(made).any().item()


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed: the CUDA compile check needs the CUDA toolkit")
def test_cuda_chains_compile_with_their_trace(tmp_path, kernel_env):
    """The chained kernels with bench/chain_trace.py's experiment define (LILY_CHAIN_TRACE) compile; their counters
    then have room for the records."""
    chains = [n for n, spec in kernels.SPECS.items()
              if kernels.records_trace(n) and not (spec.packed_from or spec.bundled_from)]
    assert {"moe_chain", "deltanet_chain", "deltanet_chain_out", "attn_chain", "attn_chain_long"} <= set(chains)
    kernel_env(kernels.DEFINES_ENV, "LILY_CHAIN_TRACE=64")
    assert kernels.sync_counters().shape == (kernels.SYNC_SLOTS + kernels.TRACE_FIELDS * 64,)
    names = sorted(chains, key=lambda n: bool(kernels.SPECS[n].cuda_launch_bounds))
    sources = [kernels.full_source(kernels.SPECS[n], "cuda", kernels.SPECS[n].instances()[0])[1] for n in names]
    assert all("lily_trace_record(sync, vb, phase" in src for src in sources)
    header = (kernels.kernel_dir() / "sync_cuda.h").read_text()
    assert f"#define LILY_SYNC_SLOTS {kernels.SYNC_SLOTS} " in header
    assert f"#define LILY_TRACE_FIELDS {kernels.TRACE_FIELDS} " in header
    rc, log = _cuda_ptx(tmp_path, sources)
    assert rc == 0, f"the traced chains do not compile:\n{log}"


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed: the CUDA compile check needs the CUDA toolkit")
def test_cuda_code_lop3_experiment_compiles(tmp_path, kernel_env):
    """lily_qdot16's code-to-float as one lop3 (LILY_CODE_LOP3, 1 by the header's #ifndef) and as plain C++
    (LILY_CODE_LOP3=0, an experiment define) both compile in the kernels that decode codes."""
    names = ("qmv", "moe_gate_up_pw", "moe_down_combine", "moe_chain_pb")
    plain = [kernels.full_source(kernels.SPECS[n], "cuda", kernels.SPECS[n].instances()[0])[1] for n in names]
    assert all("#define LILY_CODE_LOP3 1\n" in src and "#define LILY_CODE_LOP3 0" not in src for src in plain)
    kernel_env(kernels.DEFINES_ENV, "LILY_CODE_LOP3=0")
    sources = [kernels.full_source(kernels.SPECS[n], "cuda", kernels.SPECS[n].instances()[0])[1] for n in names]
    assert all("#define LILY_CODE_LOP3 0\n#" in src for src in sources) and sources != plain
    rc, log = _cuda_ptx(tmp_path, sources)
    assert rc == 0, f"the LILY_CODE_LOP3=0 kernels do not compile:\n{log}"


def test_experiment_defines_reach_every_header(kernel_env):
    """$LILY_MLX_KERNEL_DEFINES puts its #defines before a kernel's header (before the #ifndef defaults), on both
    backends; anything but LILY_* NAME=one-token VALUE is refused with the variable named."""
    spec = kernels.SPECS["moe_chain"]
    kernel_env(kernels.DEFINES_ENV, "LILY_SYNC_SLEEP_NS=512, LILY_X=-1")
    for backend in ("cuda", "metal"):
        hdr = kernels.spec_header(spec, backend, kernels.body(spec, backend))
        assert hdr.startswith("#define LILY_SYNC_SLEEP_NS 512\n#define LILY_X -1\n")
    assert "__nanosleep(LILY_SYNC_SLEEP_NS)" in kernels.full_source(spec, "cuda", spec.instances()[0])[1]
    for bad in ("LILY_SYNC_SLEEP_NS", "SLEEP=5", "LILY_A=1;2", "LILY_A=a b"):
        kernel_env(kernels.DEFINES_ENV, bad)
        with pytest.raises(ValueError, match=kernels.DEFINES_ENV):
            kernels.experiment_values()
    kernel_env(kernels.DEFINES_ENV, None)
    assert kernels.experiment_defines() == ""


def test_plan_overrides_reach_the_planners_they_name(kernel_env):
    """$LILY_MLX_PLAN sets a standalone kernel's rows a lane segment and warps a block where its planner chooses
    them (moe_chain's block following moe_gate_up's); a chained phase's fixed block is kept; anything else is
    refused with the variable named."""
    from lily_mlx.ops import moe, moe_chain, qmv

    shape = (1, 8, 2048, 512, 512, 4)  # the 35B-A3B experts: M, K, H, I, IS, bits
    default = moe.plan_gate_up(*shape)
    assert (default["RPS"], default["WARPS"], default["blocks"]) == (2, 4, 576)
    assert qmv.plan(1, 2048, 9216, 4)["RPS"] == 4
    attn = qmv.plan(1, 4096, 2048, 4, qmv.ATTN_MIN_BLOCKS, kernel="qmv_attn")
    chained = qmv.plan(1, 2048, 9216, 4, warps=16)
    kernel_env(kernels.PLAN_ENV, "moe_gate_up.WARPS=8, qmv.RPS=2, moe_down_combine.WARPS=8")
    p = moe.plan_gate_up(*shape)
    assert (p["RPS"], p["WARPS"], p["blocks"]) == (2, 8, 288)
    assert moe.plan_gate_up(*shape, rps=1, warps=4)["WARPS"] == 4  # given: kept
    chain = moe_chain.plan(*shape[:5], 257, 4, 8)
    assert chain["WARPS"] == 8 and chain["down"]["WARPS"] == 8  # the chain's down phase keeps the chain's block
    assert moe.plan_down(*shape)["WARPS"] == 8 and moe.plan_down(*shape, warps=4)["WARPS"] == 4
    assert qmv.plan(1, 2048, 9216, 4)["RPS"] == 2 and qmv.plan(1, 2048, 9216, 4)["blocks"] == min(576, qmv.MAX_BLOCKS)
    assert qmv.plan(1, 2048, 9216, 4, warps=16) == chained  # a chained phase's plan: its own
    assert qmv.plan(1, 4096, 2048, 4, qmv.ATTN_MIN_BLOCKS, kernel="qmv_attn") == attn  # not named: its own
    from lily_mlx.ops import deltanet_chain

    dn = lambda: deltanet_chain.plan(2, 2048, 12352, 4, 128, 128, (4096, 2048, 4), 132)  # noqa: E731  the 35B verify
    assert (dn()["qmv"]["RPS"], dn()["proj_blocks"], dn()["out"]["RPS"]) == (3, 258, 1)
    kernel_env(kernels.PLAN_ENV, "deltanet_chain.IN_RPS=5,deltanet_chain.OUT_RPS=2")  # counts, not powers of two only
    assert (dn()["qmv"]["RPS"], dn()["proj_blocks"], dn()["out"]["RPS"], dn()["out"]["blocks"]) == (5, 155, 2, 64)
    from lily_mlx.ops import attn_chain

    qkv = lambda: attn_chain.plan(2, 2048, 16, 2, 256, 4, 2048, 4, True, 132)["qkv"]  # noqa: E731  the 35B verify
    assert (qkv()["RPS"], qkv()["blocks"]) == (3, 384)
    kernel_env(kernels.PLAN_ENV, "attn_chain.IN_RPS=5")
    assert (qkv()["RPS"], qkv()["blocks"]) == (5, 231)
    inst = qmv._instances()[0]
    assert "__maxnreg__" not in kernels.full_source(qmv.SPEC, "cuda", inst)[1]
    kernel_env(kernels.PLAN_ENV, "qmv.MAXREG=168")  # a register cap in qmv's builds, any count: not in its plan
    assert "__maxnreg__(168)" in kernels.full_source(qmv.SPEC, "cuda", inst)[1] and qmv.plan(8, 2048, 12352, 4)["RPS"] == 2
    assert "__maxnreg__" not in kernels.full_source(qmv.ATTN_SPEC, "cuda", qmv._attn_instances()[0])[1]
    for bad in ("moe_gate_up.WARPS", "moe_gate_up.LANES=4", "attn_chain.WARPS=4", "qmv.RPS=3", "qmv.WARPS=64",
                "qmv.RPS=0", "WARPS=4", "deltanet_chain.IN_RPS=9", "deltanet_chain.RPS=2", "qmv.MAXREG=256",
                "qmv_attn.MAXREG=128"):
        kernel_env(kernels.PLAN_ENV, bad)
        with pytest.raises(ValueError, match=kernels.PLAN_ENV):
            moe.plan_gate_up(*shape)
    kernel_env(kernels.PLAN_ENV, None)
    assert moe.plan_gate_up(*shape) == default


# ---- emulated Metal run -------------------------------------------------------------------------

# (M, K, N, bits, group, x dtype, fusion): LANES 32/16/8/4, several K tiles (M=8), partial last
# blocks, N=1; the input RMSNorm (one K tile and several) and the residual add.
EMULATED = [
    (1, 2048, 37, 4, 64, mx.bfloat16, None),
    (3, 256, 45, 4, 32, mx.float32, None),
    (8, 1024, 19, 4, 128, mx.float32, None),
    (2, 128, 70, 8, 32, mx.bfloat16, None),
    (1, 512, 1, 8, 64, mx.float16, None),
    (5, 768, 9, 8, 128, mx.float32, None),
    (1, 2048, 37, 4, 64, mx.bfloat16, "norm"),
    (8, 1024, 19, 4, 128, mx.float32, "norm"),
    (3, 256, 70, 8, 32, mx.bfloat16, "residual"),
    (3, 1024, 19, 4, 128, mx.float32, "norm"),  # rows past M in the bucket's build: no read, no write
    (7, 256, 33, 4, 64, mx.bfloat16, "residual"),
]


def _qmv_case(M, K, N, bits, gs, dt, fusion, key):
    k = mx.random.split(key, 4)
    w, scales, biases = mx.quantize(mx.random.normal((N, K), key=k[0]) * 0.05, group_size=gs, bits=bits)
    x = (mx.random.normal((M, K), key=k[1]) * 3).astype(dt)
    norm = (1 + 0.3 * mx.random.normal((K,), key=k[2])).astype(dt) if fusion == "norm" else None
    res = mx.random.normal((M, N), key=k[3]).astype(dt) if fusion == "residual" else None
    with mx.stream(mx.cpu):
        xin = reference.rms_norm(x, norm, 1e-6) if norm is not None else x
        y = reference.quantized_matmul_oracle(xin, w, scales.astype(mx.float32), biases.astype(mx.float32),
                                              group_size=gs, bits=bits)
        ref = (y + res if res is not None else y).astype(mx.float32)
    return x, w, scales, biases, norm, res, ref


def _build_probe(tmp_path: Path, source: str, *flags: str) -> str:
    """A small emulator program built against the shim; returns its path."""
    (tmp_path / "probe.cpp").write_text(source)
    rc, log = run([GXX, "-std=c++20", *flags, f"-I{SHIM_DIR}", str(tmp_path / "probe.cpp"), "-o", str(tmp_path / "probe")])
    assert rc == 0, log
    return str(tmp_path / "probe")


BOUNDS_PROBE = """#define METAL_SHIM_SIM 1
#include "metal_shim.h"
#include <cstdio>
#include <vector>
int main(int argc, char** argv) {
  const int past = argv[1][0] - '0';  // how far past its own element each thread reads
  std::vector<char> buffer(64 * sizeof(float), 0);  // as the emulator loads an input: exactly its bytes
  const device float* x = reinterpret_cast<const float*>(buffer.data());
  float total = 0;
  metal_sim::launch(uint3(64, 1, 1), uint3(64, 1, 1), [&](const metal_sim::Ids& ids) {
    total += x[ids.thread_position_in_grid.x + past];
  });
  std::printf("%g", total);
}
"""


@pytest.mark.skipif(not sanitizer_flags(), reason="g++ cannot build with AddressSanitizer here")
def test_emulator_catches_a_read_past_a_buffer(tmp_path):
    """The emulator's builds are bounds-checked: a kernel thread reading one element past its input fails the run."""
    probe = _build_probe(tmp_path, BOUNDS_PROBE, "-O0", *sanitizer_flags())
    assert run([probe, "0"], env=SANITIZER_ENV) == (0, "0")
    rc, log = run([probe, "1"], env=SANITIZER_ENV)
    assert rc != 0 and "heap-buffer-overflow" in log, log


SCHEDULER_PROBE = """#define METAL_SHIM_SIM 1
#include "metal_shim.h"
#include <cstdio>
int main(int argc, char** argv) {
  const char mode = argv[1][0];  // s: spin, e: a thread leaves early, f/r: no barrier, threads in order / reversed
  static atomic_int flag;
  int sum = 0;
  metal_sim::launch(uint3(64, 1, 1), uint3(64, 1, 1), [&](const metal_sim::Ids& ids) {
    const uint t = ids.thread_index_in_threadgroup;
    if (mode == 'f' || mode == 'r') {  // each thread reads its neighbour's slot with no barrier after the writes
      threadgroup int slot[64];
      slot[t] = int(t);
      sum += slot[(t + 1) % 64];
      return;
    }
    if (mode == 'e' && t == 5) return;  // never reaches the barrier the others wait at
    if (t == 63) atomic_store_explicit(&flag, 1, memory_order_relaxed);
    if (t == 0) while (atomic_load_explicit(&flag, memory_order_relaxed) == 0) {}  // thread 63 runs after it
    threadgroup_barrier(mem_flags::mem_threadgroup);
    sum += simd_sum(int(t));
  }, mode == 'r');
  std::printf("%d", sum);
}
"""


@pytest.mark.skipif(GXX is None, reason="g++ is not installed")
@pytest.mark.parametrize("switch", ["native", "ucontext"])
@pytest.mark.parametrize("opt", ["-O0", "-O2"])
def test_emulator_scheduler_spins_orders_and_reports_a_deadlock(tmp_path, switch, opt):
    """The emulator's fibers, with its own context switch (x86-64) and with ucontext's (elsewhere): a thread
    spinning on an atomic lets the thread that sets it run; a barrier that a returned thread never reaches ends the
    run with a message instead of a hang; a missing barrier shows as a different result in the two thread orders."""
    probe = _build_probe(tmp_path, SCHEDULER_PROBE, opt, *(["-DMETAL_SIM_UCONTEXT"] if switch == "ucontext" else []))
    assert run([probe, "s"], timeout=60) == (0, str(32 * (sum(range(32)) + sum(range(32, 64)))))
    rc, out = run([probe, "e"], timeout=60)
    assert rc != 0 and "threadgroup (0, 0, 0) deadlocked: 63 of 64 threads wait" in out, out
    # In order, threads 0-62 read slots not yet written (0, the static's initial value); reversed, every slot but
    # thread 63's read (slot 0) is written before it is read.
    assert run([probe, "f"], timeout=60) == (0, "0")
    assert run([probe, "r"], timeout=60) == (0, str(sum(range(64))))


@pytest.mark.skipif(GXX is None, reason="g++ is not installed")
def test_qmv_metal_emulated_matches_reference(tmp_path):
    """Every case against its reference; each whose weight packs also through qmv_pw, bit for bit the same."""
    emu, expected = Emulator(tmp_path, packed_twins=True), []
    for c, (M, K, N, bits, gs, dt, fusion) in enumerate(EMULATED):
        x, w, scales, biases, norm, res, ref = _qmv_case(M, K, N, bits, gs, dt, fusion, mx.random.key(c))
        # Built for M's bucket, as the dispatcher builds it: the kernel reads the M actual rows from x_shape.
        Mb = kernels.row_bucket(M)
        inst = qmv.instance(dt, scales.dtype, Mb, K, N, bits, gs, None if norm is None else norm.dtype,
                            res is not None, 1e-6)
        p = qmv.plan(Mb, K, N, bits)
        threads = 32 * p["WARPS"]
        arrays = [x, w, scales, biases, kernels.placeholder(dt) if norm is None else norm,
                  kernels.placeholder(dt) if res is None else res]
        emu.add(qmv.SPEC, inst, arrays, (p["blocks"] * threads, 1, 1), (threads, 1, 1), [(M, N)])
        expected.append((ref, 1e-5 if dt == mx.float32 else 8e-3))
    results = emu.run()
    assert len(emu.twins) >= len(EMULATED) // 2, "too few cases packed"
    for c, ((y,), (ref, tol)) in enumerate(zip(results, expected)):
        y = y.astype(mx.float32)
        assert not mx.isnan(y).any().item(), f"case {EMULATED[c]}: unwritten (NaN) outputs"
        err = (mx.linalg.norm(y - ref) / mx.linalg.norm(ref)).item()
        assert err < tol, f"case {EMULATED[c]}: relative error {err:.2e} >= {tol}"


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_cuda_source_files_expand_to_the_inline_source(name, tmp_path):
    """The #include form MLX gets on CUDA (kernels.included) is the inline source once NVRTC expands it,
    names every shape/strides/ndim array the body reads (MLX passes only those), and moves when it changes."""
    spec = kernels.SPECS[name]
    src = kernels.body(spec, "cuda")
    hdr = kernels.header("cuda", src)
    stub, hstub = kernels.included(spec, src, hdr, tmp_path)
    expand = lambda text: re.sub(r'#include "([^"]+)"\n', lambda m: Path(m.group(1)).read_text(), text)
    assert len(stub) + len(hstub) < 400 < len(src)
    assert expand(hstub) == hdr and expand(stub).startswith(src)
    assert metal_source.shape_infos(stub, spec.input_names) == metal_source.shape_infos(src, spec.input_names)
    again, _ = kernels.included(spec, src + "\n", hdr, tmp_path)
    assert again.splitlines()[0] != stub.splitlines()[0]


def test_kernel_source_dir_falls_back_to_inline(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("LILY_MLX_KERNEL_CACHE", str(blocker / "kernels"))  # cannot be created
    assert kernels.source_dir() is None
    monkeypatch.setenv("LILY_MLX_KERNEL_CACHE", str(tmp_path / "k"))
    assert kernels.source_dir() == (tmp_path / "k").resolve()


def _register_tool():
    return script_tool.load("cuda_registers")


def test_register_check_knows_every_kernels_block():
    """scripts/cuda_registers.py (launchability through ptxas) knows the block each kernel is launched with."""
    tool = _register_tool()
    for name in SPEC_NAMES:
        spec = kernels.SPECS[name]
        for inst in spec.instances()[:3]:
            threads = tool.block_threads(spec, dict(inst.template))
            assert 32 <= threads <= 1024 and threads % 32 == 0, (name, threads)
            assert not spec.cuda_launch_bounds or threads <= spec.cuda_launch_bounds[0], (name, threads)


def test_occupancy_follows_the_sm90_limits():
    """scripts/cuda_registers.py --decode-step: blocks an SM holds by registers (a warp's in units of 256), shared
    memory (1 KB more a block), threads and the 32-block cap, as CUDA's occupancy calculator counts them; waves."""
    tool = _register_tool()
    assert tool.blocks_per_sm(89, 256, 8464) == (2, "registers")  # 96 a lane: 21 warps an SM, two 8-warp blocks
    assert tool.blocks_per_sm(89, 128, 8464) == (5, "registers")
    assert tool.blocks_per_sm(80, 256, 8464) == (3, "registers")
    assert tool.blocks_per_sm(64, 512, 2048) == (2, "registers")
    assert tool.blocks_per_sm(32, 256, 100 * 1024) == (2, "shared memory")
    assert tool.blocks_per_sm(16, 1024, 0) == (2, "threads")
    assert tool.blocks_per_sm(16, 32, 0) == (32, "blocks")
    assert tool.waves(288, 2, 132) == (2, 24 / 264)
    assert tool.waves(528, 2, 132) == (2, 1.0)


def test_decode_step_launches_are_traced_with_their_grids():
    """--decode-step's trace (narrow widths here): every kernel of an unchained, unpacked decode step, in order, each
    with the blocks and threads its dispatcher launches and a complete CUDA source; the default step launches the
    chains, and the server's 8-slot step (--rows 8) none of them."""
    tool = _register_tool()
    from bench.step_dispatch import NARROW, SWITCHES

    launched = tool.decode_step_launches(tuple("-" + n for n in SWITCHES), 64, NARROW)
    names = [n for n, *_ in launched]
    assert {"qmv", "deltanet_step", "moe_gate_up", "moe_down_combine", "attn_decode"} <= set(names)
    assert names.count("moe_gate_up") == 4 and names.count("deltanet_step") == 3
    for name, blocks, threads, smem, source in launched:
        assert blocks >= 1 and threads % 32 == 0 and 32 <= threads <= 1024 and smem >= 0, name
        assert f"void custom_kernel_{name}" in source, name
    chained = [n for n, *_ in tool.decode_step_launches((), 64, NARROW)]
    assert chained.count("moe_chain_pb") == 4 and chained.count("deltanet_chain_out_pb") == 3
    assert "attn_chain_long_pb" in chained
    slots = tool.decode_step_launches((), 64, NARROW, rows=8)  # the server's step of 8 slots: no chain takes 8 rows
    names = [n for n, *_ in slots]
    assert names.count("moe_gate_up_pw") == 4 and not any("chain" in n for n in names)
    assert all("constexpr int M = 8;" in src for n, *_, src in slots if n == "qmv_pw") and "qmv_pw" in names


def test_chain_hooks_reach_the_bodies_they_include():
    """A chain's hook (a LILY_ macro with a body, such as LILY_GATE_UP_AFTER_LOADS) is kept in the expanded source
    and counts as defined for the #ifdef that calls it in the included body: before, kernels.expand dropped those
    blocks, so chain_prefetch's L2 hints and chain_trace's marks never ran."""
    for name, calls in (("moe_chain", 1), ("deltanet_chain_out", 2), ("attn_chain", 3)):
        body = kernels.body(kernels.SPECS[name], "cuda")
        assert body.count("lily_prefetch_") >= calls and body.count("_AFTER_LOADS") == 3, name
    plain = kernels.body(kernels.SPECS["qmv"], "cuda")
    assert "AFTER_LOADS" not in plain and "lily_prefetch" not in plain
