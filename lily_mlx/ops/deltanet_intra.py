"""deltanet_intra: the parallel (intra-chunk) part of chunked Gated DeltaNet prefill in ONE launch.

reference.chunk_intra builds every chunk's u, w, q_dec, qk, k_dec and g_last from about 40 MLX primitives
(decay masks, k k^T, the unit-lower inverse by repeated squaring, three more products). The kernel
(kernels/deltanet_intra.inc, CUDA and Metal) runs one block per chunk of one value head: the cumulative decay,
k k^T and q k^T on the tensor cores in float32 tiles, the inverse by forward substitution in shared memory,
then u and w. Its outputs feed deltanet_chunk's scan. This module checks that it applies (else the
dispatcher runs reference.chunk_intra), picks the launch shape and registers switch "deltanet_intra".
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from . import kernels, metal_source, register_kernel

MAX_HEAD_DIM = 256
SHARED_BYTES = metal_source.THREADGROUP_BYTES
WARPS = 8
TILE = 16  # C comes in whole 16-row warp tiles
SPEC_PARAMS = ("T", "DK", "DV", "HK", "HV", "C", "WARPS")
FLOATS = (mx.float32, mx.bfloat16, mx.float16)


def shared_bytes(C: int) -> int:
    """A and T in one [C][C + 1] float buffer, plus G and beta."""
    return 4 * (C * (C + 1) + 2 * C)


def unsupported(q, k, v, log_g, beta, chunk_size: int) -> Optional[str]:
    """Why the kernel does not apply to these arguments (None when it does)."""
    if q.ndim != 4 or k.shape != q.shape or v.ndim != 4 or v.shape[:2] != q.shape[:2]:
        return f"shapes: q, k [B, T, Hk, Dk] and v [B, T, Hv, Dv] expected, got {q.shape}, {k.shape}, {v.shape}"
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    if log_g.shape != (B, T, Hv) or beta.shape != (B, T, Hv):
        return f"shapes: log_g, beta [B, T, Hv] = {(B, T, Hv)} expected, got {log_g.shape}, {beta.shape}"
    if q.dtype not in FLOATS or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes: q, k, v of one float dtype expected, got {q.dtype}, {k.dtype}, {v.dtype}"
    if log_g.dtype != mx.float32 or beta.dtype != mx.float32:
        return "dtypes: float32 log_g and beta expected"
    if T == 0 or Hv % Hk:
        return f"{T} tokens, {Hv} value heads over {Hk} key heads"
    if not (1 <= Dk <= MAX_HEAD_DIM and 1 <= Dv <= MAX_HEAD_DIM):
        return f"head dims Dk={Dk}, Dv={Dv} (at most {MAX_HEAD_DIM})"
    C = chunk_size
    if C % TILE or C > 32 * WARPS or shared_bytes(C) > SHARED_BYTES:
        return f"chunk size {C}: a multiple of {TILE} whose [C][C + 1] floats fit {SHARED_BYTES} bytes expected"
    N = -(-T // C)
    if B * Hv * N * C * max(Dk, Dv, C) >= 2**31 or B * T * max(Hk * Dk, Hv * Dv) >= 2**31:
        return "int32 indexing"
    return None


def instance(dtype, B: int, T: int, Hk: int, Hv: int, Dk: int, Dv: int, C: int) -> kernels.Instance:
    f32 = mx.float32
    template = (("T", dtype), ("DK", Dk), ("DV", Dv), ("HK", Hk), ("HV", Hv), ("C", C), ("WARPS", WARPS))
    inputs = ((dtype, (B, T, Hk, Dk)), (dtype, (B, T, Hk, Dk)), (dtype, (B, T, Hv, Dv)), (f32, (B, T, Hv)),
              (f32, (B, T, Hv)))
    return kernels.Instance(template, inputs, (f32,) * 6)


def grid(B: int, Hv: int, N: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, threadgroup) in threads: one block per (batch row, value head, chunk)."""
    return (B * Hv * N * 32 * WARPS, 1, 1), (32 * WARPS, 1, 1)


_LAUNCH: dict = {}  # argument signature -> (template, grid, threadgroup, output shapes) or None


def chunk_intra(q, k, v, log_g, beta, *, chunk_size: int, backend: str, init_value: Optional[float] = None):
    """reference.chunk_intra's (u, w, q_dec, qk, k_dec, g_last) for inputs whose padding tokens are already
    no-ops (log_g and beta 0), all float32, or None when the kernel does not apply."""
    args = (q, k, v, log_g, beta)
    key = (tuple((x.shape, x.dtype) for x in args), chunk_size)
    plan = _LAUNCH.get(key, False)
    if plan is False:
        plan = None
        if unsupported(*args, chunk_size) is None:
            B, T, Hk, Dk = q.shape
            Hv, Dv = v.shape[2:]
            C, N = chunk_size, -(-T // chunk_size)
            shapes = [(B, Hv, N, C, Dv), (B, Hv, N, C, Dk), (B, Hv, N, C, Dk), (B, Hv, N, C, C), (B, Hv, N, C, Dk),
                      (B, Hv, N)]
            plan = (list(instance(q.dtype, B, T, Hk, Hv, Dk, Dv, C).template), *grid(B, Hv, N), shapes)
        _LAUNCH[key] = plan
    if plan is None:
        return None
    template, grid_, group, shapes = plan
    return tuple(kernels.call("deltanet_intra", backend, list(args), template, grid_, group, shapes,
                              [mx.float32] * 6, init_value))


# (Hk, Hv, Dk, Dv) the project runs: Qwen3.5/3.6-35B-A3B, the embedded lily-tiny, tests/tiny.py.
MODEL_HEADS = ((16, 32, 128, 128), (2, 4, 32, 48), (2, 4, 16, 24))
# Shapes of the kernel tests: odd head dims, Dk not a multiple of 8, the largest.
TEST_HEADS = ((1, 3, 24, 40), (2, 2, 40, 24), (1, 1, 20, 36), (1, 2, 256, 256))


def _instances() -> list[kernels.Instance]:
    combos = [(dt, 1, 2048, *h, 64) for h in MODEL_HEADS for dt in (mx.bfloat16, mx.float32)]
    combos += [(mx.float32, 2, 50, *h, C) for h in TEST_HEADS for C in (16, 64)]
    insts = (instance(*c) for c in combos)
    return kernels.unique_instances(insts, key=lambda i: metal_source.metal_kernel_name("deltanet_intra", i.template,
                                                                                      i.inputs, i.output_dtypes))


SPEC = kernels.register_spec(kernels.KernelSpec(
    name="deltanet_intra", body="deltanet_intra.inc",
    input_names=("q", "k", "v", "log_g", "beta"),
    output_names=("u", "w", "q_dec", "qk", "k_dec", "g_last"), template_params=SPEC_PARAMS,
    description="Chunked Gated DeltaNet prefill: every chunk's intra-chunk part (decays, k k^T, the inverse, u, w) "
                "in one launch",
    instances=_instances,
))


def _dispatch(*args, **kwargs):
    from . import backend

    return chunk_intra(*args, backend=backend(), **kwargs)


# On: its cuda tests pass on the H200, where a whole prefill took 75.2 vs 78.5 ms at 512 tokens and 150.0 vs 154.0 ms
# at 2048 with it (2026-12-03, run 9, one process); 113.8 vs 126.9 ms at 2048 and 447.0 vs 509.2 at 8192 (2026-12-04,
# run 16, after float32 q, k beside a 16-bit v had made it decline in every prefill; off then took float32 v too).
register_kernel("deltanet_intra", SPEC.description, _dispatch)
