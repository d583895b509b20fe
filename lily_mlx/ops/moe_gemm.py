"""moe_gemm: the prefill's expert GEMM with the 4/8-bit weights dequantized inside the tile (kernels/moe_gemm.inc,
CUDA mma.sync and Metal simdgroup matrices behind one body).

Rows arrive sorted by expert (SwitchGLU sorts them, moe_sort where it runs). `expert_starts` turns the sorted
expert ids into the two prefix sums the kernel's blocks search: where each expert's rows and its row tiles begin
(64 rows; 16 or 32 for the opt-in moe_gemm_direct, which kernels/moe_gemm_direct.inc holds). Until this kernel,
the prefill dequantized every expert of a layer to bf16 (1.6 GB written, then re-read by MLX's grouped GEMM,
`moe_dequant_gemm`); here each block dequantizes one 128 x 64 slice of one expert's codes into shared memory.
The tensor cores take 16-bit operands, so float32 activations keep the other paths. H200, 2026-12-04 (first
version, bench/profile_prefill.py): a 2048-token prefill 308.5 -> 214.3 ms, 512 tokens 205.2 -> 105.4 ms, peak
memory 9 GB lower; one layer's routed experts on 16,384 rows 4.56 -> 1.98 ms.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import mlx.core as mx

from . import kernels, metal_source, register_kernel, register_switch

BM, BN, BK, LD = 64, 128, 64, 72  # the body's tile: rows, output columns, reduction slice, padded row
THREADS = 256
ACTIVATIONS = (mx.bfloat16, mx.float16)
SPEC_PARAMS = ("T", "TS", "BITS", "GROUP", "K", "N", "E", "GATHER")
# moe_gemm_staged (opt-in): shared-memory stages a block cycles through, STAGES - 1 slices of loads in flight. Its
# gate projection at 2048 tokens, H200: 416.5 us at 2 stages, 497.1 at 3, 544.3 at 4 (run 12), against 486-489 us
# for the default body in runs 11 and 13; whole prefills in one process no faster (run 14: 75.3 vs 71.6 ms at 512
# tokens, 113.1 vs 112.2 at 2048). Metal's 32 KB hold one stage.
STAGES = {"cuda": 2, "metal": 1}
# moe_gemm_direct (kernels/moe_gemm_direct.inc, opt-in): 4 warps of 32 columns each, no shared memory; the row
# tile by the average rows an expert, (at most, BM) in order, else the shared-memory body's 64. H200, 512 tokens
# (16 rows an expert): at BM 32, 2989 vs 3117 us of kernel time (ncu, run 20) but the whole prefill 76.8 vs 63.0 ms
# (run 19, one process, cause not found); the wall-time cases (run 19) favoured BM 16, hence the tile here.
DIRECT_THREADS = 128
DIRECT_BN = 128
DIRECT_TILES = ((24, 16),)
DIRECT_BMS = (16, 32)  # the row tiles its instances and tests cover
METAL_SHARED_LIMIT = metal_source.THREADGROUP_BYTES


def shared_bytes(stages: int, bits: int, group_size: int, scale_dtype) -> int:
    """The staged body's shared memory: `stages` x (x slice, raw codes, scale and bias runs) + the dequantized tile."""
    run = max(4, max(1, BK // group_size) * scale_dtype.size)  # the aligned scale run covering a slice
    stage = BM * LD * 2 + BN * BK * bits // 8 + 2 * BN * run
    return stages * stage + BN * LD * 2


class ExpertStarts(NamedTuple):
    """Where each expert's rows and its row tiles begin in the sorted rows ([E + 1] int32 prefix sums each), for
    tiles of `bm` rows (the kernel's row tiles never straddle two experts)."""
    rows: mx.array
    tiles: mx.array
    bm: int


def tile_rows(rows: int, experts: int) -> int:
    """The row tile for `rows` sorted rows over `experts`: moe_gemm_direct's for few rows an expert on average."""
    from . import enabled

    if enabled("moe_gemm_direct"):
        for most, bm in DIRECT_TILES:
            if rows <= most * experts:
                return bm
    return BM


def expert_starts(indices: mx.array, experts: int, bm: int = BM) -> ExpertStarts:
    """Sorted expert ids [R] -> their ExpertStarts for tiles of bm rows."""
    counts = mx.zeros((experts,), mx.int32).at[indices.astype(mx.int32)].add(1)  # [E]
    zero = mx.zeros((1,), mx.int32)
    row_starts = mx.concatenate([zero, mx.cumsum(counts)])
    tile_starts = mx.concatenate([zero, mx.cumsum((counts + bm - 1) // bm)])
    return ExpertStarts(row_starts, tile_starts, bm)


def unsupported(x, w, indices, scales, biases, group_size: int, bits: int, stages_on: Optional[str] = None,
                x_rows: Optional[mx.array] = None) -> Optional[str]:
    """Why the kernel does not apply (None when it does); stages_on: the backend of the staged variant."""
    if x.dtype not in ACTIVATIONS:
        return f"activations {x.dtype}: the tensor-core GEMM takes bfloat16 or float16"
    if bits not in (4, 8) or group_size % 32 or w.dtype != mx.uint32 or w.ndim != 3:
        return f"bits={bits}, group_size={group_size}, w {w.dtype} {w.shape}: [E, N, K*bits/32] uint32, groups of 32k"
    E, N, K = w.shape[0], w.shape[1], w.shape[2] * 32 // bits
    if K % BK or x.shape[-1] != K:
        return f"K={K} (x {x.shape}): the reduction must be a multiple of {BK} and match x"
    if biases is None or scales.shape != (E, N, K // group_size) or biases.shape != scales.shape \
            or biases.dtype != scales.dtype or scales.dtype not in (mx.float32, mx.bfloat16, mx.float16):
        return f"scales/biases {scales.shape} do not match w {w.shape} at group {group_size}"
    rows = x.size // K if x_rows is None else x_rows.size
    if indices.size != rows or indices.dtype not in (mx.int32, mx.uint32):
        return f"indices {indices.dtype} {indices.shape}: one int32/uint32 expert id per row ({rows})"
    if x_rows is not None and (x_rows.dtype not in (mx.int32, mx.uint32) or x_rows.ndim != 1):
        return f"x_rows {x_rows.dtype} {x_rows.shape}: one int32/uint32 row of x per sorted row expected"
    if max(rows, x.size // K) * max(K, N) >= 2**31:
        return "int32 indexing: rows x width over 2^31"
    if stages_on == "metal" and shared_bytes(STAGES["metal"], bits, group_size, scales.dtype) > METAL_SHARED_LIMIT:
        return (f"bits={bits}, group_size={group_size}, scales {scales.dtype}: the staged tile needs more than Metal's "
                f"{METAL_SHARED_LIMIT} bytes of threadgroup memory")
    return None


def instance(x_dtype, scale_dtype, rows: int, K: int, N: int, E: int, bits: int, group_size: int,
             stages: Optional[int] = None, gather: bool = False, bm: int = BM) -> kernels.Instance:
    """One call's instance: of the staged variant with `stages`, of moe_gemm_direct for a row tile `bm` under 64;
    `gather`: rows read through x_rows."""
    template = (("T", x_dtype), ("TS", scale_dtype), ("BITS", bits), ("GROUP", group_size), ("K", K), ("N", N),
                ("E", E), ("GATHER", int(gather))) + ((("STAGES", stages),) if stages else ()) \
        + ((("BM", bm),) if bm != BM else ())
    inputs = ((x_dtype, (rows, K)), (mx.int32, (E + 1,)), (mx.int32, (E + 1,)), (mx.uint32, (E, N, K * bits // 32)),
              (scale_dtype, (E, N, K // group_size)), (scale_dtype, (E, N, K // group_size)),
              (mx.int32, (rows if gather else E + 1,)))
    return kernels.Instance(template, inputs, (x_dtype,))


def launch(rows: int, N: int, E: int, bm: int = BM) -> tuple[int, int]:
    """(blocks, threads a block) of the body for row tile bm: blocks an upper bound, as every expert adds at most
    one partial row tile."""
    bn, threads = (BN, THREADS) if bm == BM else (DIRECT_BN, DIRECT_THREADS)
    return (-(-rows // bm) + min(E, rows)) * -(-N // bn), threads


def gather_matmul(x, w, indices, *, scales, biases, group_size: int, bits: int, backend: str,
                  starts: Optional[ExpertStarts] = None, init_value: Optional[float] = None,
                  stages: Optional[int] = None, x_rows: Optional[mx.array] = None):
    """x [..., 1, K] rows sorted by expert, w [E, N, K*bits/32], indices [...] (sorted) -> [..., 1, N] in x's
    dtype, or None when the kernel does not apply. `starts`: expert_starts(indices, E, bm) if already computed
    (its bm picks the body: 64, the shared-memory one, else moe_gemm_direct); `stages`: the staged variant with
    that many stages where the body is the shared-memory one; `x_rows` [R]: sorted row r is x row x_rows[r]
    (x [T, 1, K] unsorted, the result [R, 1, N]), read in place of a gather."""
    starts_bm = starts.bm if starts is not None else BM
    stages = stages if starts_bm == BM else None
    if unsupported(x, w, indices, scales, biases, group_size, bits, backend if stages else None, x_rows) is not None:
        return None
    E, N, K = w.shape[0], w.shape[1], x.shape[-1]
    rows = x.size // K if x_rows is None else x_rows.size
    starts = starts if starts is not None else expert_starts(indices.reshape(-1), E)
    inst = instance(x.dtype, scales.dtype, rows, K, N, E, bits, group_size, stages, x_rows is not None, starts.bm)
    name = STAGED_SPEC.name if stages else SPEC.name if starts.bm == BM else DIRECT_SPEC.name
    from . import enabled

    if name == SPEC.name and enabled("moe_gemm_bounded"):
        name = BOUNDED_SPEC.name
    smem = shared_bytes(stages, bits, group_size, scales.dtype) if stages else 0
    x_rows_in = starts.rows  # unread without GATHER
    if x_rows is not None:  # SwitchGLU's are int32 already: one cast a layer, not one a projection
        x_rows_in = x_rows if x_rows.dtype == mx.int32 else x_rows.astype(mx.int32)
    blocks, threads = launch(rows, N, E, starts.bm)
    y = kernels.call(name, backend, [x.reshape(-1, K), starts.tiles, starts.rows, w, scales, biases, x_rows_in],
                     list(inst.template), (blocks * threads, 1, 1), (threads, 1, 1), [(rows, N)], [x.dtype],
                     init_value, smem)[0]
    return y.reshape(*x.shape[:-1], N) if x_rows is None else y.reshape(rows, *x.shape[1:-1], N)


# The 35B-A3B experts (gate/up 2048 -> 512, down 512 -> 2048, 256 experts, 4-bit, group 64) and the odd test shapes;
# the staged variant's at each backend's stage count, the odd ones at 2, 4 and 1 stages; moe_gemm_direct's at each
# of its row tiles, the odd ones at 16 and 32 in turn.
def _instances(staged: bool = False, direct: bool = False) -> list[kernels.Instance]:
    bf16, f16 = mx.bfloat16, mx.float16
    model_stages = sorted(set(STAGES.values())) if staged else [None]
    # gate and up read the tokens through x_rows (SwitchGLU), down its sorted rows; bench.kernels gate without.
    tiles = list(DIRECT_BMS) if direct else [BM]
    insts = [instance(t, bf16, 16384, K, N, 256, 4, 64, s, gather, bm) for t in ACTIVATIONS
             for K, N, gather in ((2048, 512, True), (2048, 512, False), (512, 2048, False)) for s in model_stages
             for bm in tiles]
    odd = ((bf16, bf16, 70, 192, 160, 5, 4, 64, 2), (f16, mx.float32, 37, 128, 96, 3, 8, 32, 4),
           (bf16, f16, 9, 256, 136, 4, 4, 128, 1))
    insts += [instance(*o[:-1], o[-1] if staged else None, gather, tiles[i % len(tiles)])
              for i, o in enumerate(odd) for gather in (False, True)]
    name = "moe_gemm_staged" if staged else "moe_gemm_direct" if direct else "moe_gemm"
    return kernels.unique_instances(insts, key=lambda i: metal_source.metal_kernel_name(name, i.template, i.inputs,
                                                                                      i.output_dtypes))


SPEC = kernels.register_spec(kernels.KernelSpec(
    name="moe_gemm", body="moe_gemm.inc",
    input_names=("x", "tile_starts", "row_starts", "w", "scales", "biases", "x_rows"), output_names=("y",),
    template_params=SPEC_PARAMS,
    description="prefill experts: a grouped GEMM on rows sorted by expert, 4/8-bit weights dequantized in the tile, "
                "tensor cores",
    instances=lambda: _instances(staged=False),
))


# The default body at 3 resident blocks an SM: ptxas gave the down projection's build 91 registers (2 blocks of 256
# threads an SM; ncu, run 21: 92, 24% of warps active), the gate/up one 80. A 512-token prefill streams each
# expert's codes for 16 rows at ~0.65 TB/s, bound by bytes in flight an SM: a third block brings 50% more.
BOUNDED_SPEC = kernels.register_spec(kernels.KernelSpec(
    name="moe_gemm_bounded", body="moe_gemm.inc", input_names=SPEC.input_names, output_names=SPEC.output_names,
    template_params=SPEC_PARAMS, description="moe_gemm built for 3 resident blocks an SM (CUDA launch bounds)",
    instances=lambda: _instances(staged=False), cuda_launch_bounds=(THREADS, 3),
))


STAGED_SPEC = kernels.register_spec(kernels.KernelSpec(
    name="moe_gemm_staged", body="moe_gemm.inc", input_names=SPEC.input_names, output_names=SPEC.output_names,
    template_params=SPEC_PARAMS + ("STAGES",),
    description="moe_gemm with each slice copied into shared-memory stages ahead of use (cp.async on CUDA)",
    instances=lambda: _instances(staged=True), defines=("LILY_MOE_STAGED",),
))


DIRECT_SPEC = kernels.register_spec(kernels.KernelSpec(
    name="moe_gemm_direct", body="moe_gemm_direct.inc", input_names=SPEC.input_names,
    output_names=SPEC.output_names, template_params=SPEC_PARAMS + ("BM",),
    description="moe_gemm for few rows an expert: warps load their fragments straight from global memory (k permuted "
                "within a slice), no shared memory",
    instances=lambda: _instances(direct=True),
))


def _dispatch(x, w, indices, *, starts: Optional[ExpertStarts] = None, **kwargs):
    from . import backend, enabled

    b = backend()
    if starts is None:
        starts = expert_starts(indices.reshape(-1), w.shape[0], tile_rows(indices.size, w.shape[0]))
    return gather_matmul(x, w, indices, backend=b, stages=STAGES[b] if enabled("moe_gemm_staged") else None,
                         starts=starts, **kwargs)


register_kernel("moe_gemm", SPEC.description, _dispatch)
register_switch("moe_gemm_staged", STAGED_SPEC.description, default_on=False)
register_switch("moe_gemm_direct", DIRECT_SPEC.description, default_on=False)
register_switch("moe_gemm_bounded", BOUNDED_SPEC.description, default_on=False)
# H200 run 18, one process, on vs off: whole prefills 64.7 vs 80.1 ms at 512 tokens, 101.6 vs 107.9 at 2048, 412.3
# vs 446.7 at 8192.
register_switch("moe_gemm_gather", "moe_gemm reads the gate and up projections' rows through the sort order "
                "(no gathered copy of x)")
