"""deltanet_chunk: the inter-chunk scan of chunked Gated DeltaNet prefill in ONE launch, on the tensor cores.

reference.gated_delta_chunked computes every chunk's u, w, q_dec, qk, k_dec, g_last at once
(reference.chunk_intra), then carries the float32 state through the chunks; chunk by chunk that is
about 8 small primitives per 64 tokens, each costing a launch. The kernel (kernels/deltanet_chunk.inc,
CUDA and Metal) carries the state through all chunks in one launch, its three products per chunk in
float32 tensor-core tiles (CUDA: TF32 split high + low, three MMAs a product; Metal: simdgroup float).
This module checks that it applies (else the dispatcher runs reference.chunk_scan_reference), picks the
launch shape and registers switch "deltanet_chunk". The first, SIMT version is kernels/scratch/deltanet_chunk_v1.inc.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from . import kernels, metal_source, register_kernel

MAX_HEAD_DIM = 256  # Dk: the update's S tiles, (Dk / 32) * (R / 16) of them, stay in the warps' registers
SHARED_BYTES = metal_source.THREADGROUP_BYTES
SPEC_PARAMS = ("DK", "DV", "C", "R", "WARPS")
TILE = 16  # C and R come in whole 16-row warp tiles


def shared_bytes(Dk: int, C: int, rows: int) -> int:
    """The block's rows of S and the chunk's v^T, float32, row strides padded to 4 mod 32 (the kernel's SK, VC)."""
    return 4 * rows * (-(-Dk // 32) * 32 + 4 + C + 4)


def plan(Dk: int, Dv: int, C: int = 64) -> dict:
    """R state rows per block: 32 (16 where Dv or the shared memory calls for it); 8 warps."""
    rows = 32 if Dv > TILE and shared_bytes(Dk, C, 32) <= SHARED_BYTES else TILE
    return {"R": rows, "WARPS": 8}


def unsupported(u, w, q_dec, qk, k_dec, g_last, state, launch: Optional[dict] = None) -> Optional[str]:
    """Why the kernel does not apply to these arguments (None when it does)."""
    if u.ndim != 5 or w.ndim != 5:
        return f"shapes: u [B, Hv, N, C, Dv], w [B, Hv, N, C, Dk] expected, got {u.shape}, {w.shape}"
    B, Hv, N, C, Dv = u.shape
    Dk = w.shape[-1]
    if w.shape != (B, Hv, N, C, Dk) or q_dec.shape != w.shape or k_dec.shape != w.shape \
            or qk.shape != (B, Hv, N, C, C) or g_last.shape != (B, Hv, N) or state.shape != (B, Hv, Dv, Dk):
        return "shapes: q_dec, k_dec as w; qk [B, Hv, N, C, C]; g_last [B, Hv, N]; state [B, Hv, Dv, Dk]"
    if any(x.dtype != mx.float32 for x in (u, w, q_dec, qk, k_dec, g_last, state)):
        return "dtypes: float32 inputs expected"
    if N == 0:
        return "no chunks"
    if not (1 <= Dk <= MAX_HEAD_DIM and Dv >= 1):
        return f"head dims Dk={Dk} (at most {MAX_HEAD_DIM}), Dv={Dv}"
    rows = (launch or plan(Dk, Dv, C))["R"]
    if C % TILE or rows % TILE:
        return f"chunk size {C} and rows per block {rows}: multiples of {TILE} expected"
    if shared_bytes(Dk, C, rows) > SHARED_BYTES:
        return f"chunk size {C} with Dk={Dk} exceeds {SHARED_BYTES} bytes of shared memory"
    if B * Hv * N * C * max(Dk, Dv, C) >= 2**31 or B * Hv * Dv * Dk >= 2**31:
        return "int32 indexing"
    return None


def instance(B: int, Hv: int, N: int, Dk: int, Dv: int, C: int, launch: Optional[dict] = None) -> kernels.Instance:
    p = launch or plan(Dk, Dv, C)
    f32 = mx.float32
    template = (("DK", Dk), ("DV", Dv), ("C", C), ("R", p["R"]), ("WARPS", p["WARPS"]))
    inputs = ((f32, (B, Hv, N, C, Dv)), (f32, (B, Hv, N, C, Dk)), (f32, (B, Hv, N, C, Dk)), (f32, (B, Hv, N, C, C)),
              (f32, (B, Hv, N, C, Dk)), (f32, (B, Hv, N)), (f32, (B, Hv, Dv, Dk)))
    return kernels.Instance(template, inputs, (f32, f32))


def grid(B: int, Hv: int, Dv: int, launch: dict) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, threadgroup) in threads: one block per (batch row, value head, R state rows)."""
    threads = 32 * launch["WARPS"]
    return (B * Hv * -(-Dv // launch["R"]) * threads, 1, 1), (threads, 1, 1)


_LAUNCH: dict = {}  # argument signature -> (template, grid, threadgroup) or None (not applicable)


def _launch(args, launch):
    key = (tuple((x.shape, x.dtype) for x in args), None if launch is None else tuple(sorted(launch.items())))
    hit = _LAUNCH.get(key, False)
    if hit is not False:
        return hit
    out = None
    if unsupported(*args, launch) is None:
        B, Hv, N, C, Dv = args[0].shape
        Dk = args[1].shape[-1]
        p = launch or plan(Dk, Dv, C)
        out = (list(instance(B, Hv, N, Dk, Dv, C, p).template), *grid(B, Hv, Dv, p))
    _LAUNCH[key] = out
    return out


def chunk_scan(u, w, q_dec, qk, k_dec, g_last, state, *, backend: str, init_value: Optional[float] = None,
               launch: Optional[dict] = None):
    """reference.chunk_scan_reference in one launch: (y [B, Hv, N, C, Dv], new state [B, Hv, Dv, Dk]),
    both float32, or None when the kernel does not apply."""
    args = (u, w, q_dec, qk, k_dec, g_last, state)
    plan_ = _launch(args, launch)
    if plan_ is None:
        return None
    template, grid_, group = plan_
    return tuple(kernels.call("deltanet_chunk", backend, list(args), template, grid_, group, [u.shape, state.shape],
                              [mx.float32, mx.float32], init_value))


# (Hv, Dk, Dv) the project runs: Qwen3.5/3.6-35B-A3B, the embedded lily-tiny, tests/tiny.py.
MODEL_HEADS = ((32, 128, 128), (4, 32, 48), (4, 16, 24))
# Shapes of the kernel tests: odd Dk/Dv, the largest head dims.
TEST_HEADS = ((3, 24, 40), (2, 40, 24), (2, 256, 256), (1, 256, 32), (1, 32, 256))


def _instances() -> list[kernels.Instance]:
    combos = [(1, Hv, 32, Dk, Dv, 64, None) for Hv, Dk, Dv in MODEL_HEADS]
    for Hv, Dk, Dv in TEST_HEADS:
        combos += [(1, Hv, 3, Dk, Dv, 64, None), (2, Hv, 1, Dk, Dv, 16, None)]
    combos.append((1, 3, 2, 24, 40, 64, {"R": 16, "WARPS": 2}))  # several tiles per warp
    insts = (instance(*c) for c in combos)
    return kernels.unique_instances(insts, key=lambda i: metal_source.metal_kernel_name("deltanet_chunk", i.template,
                                                                                      i.inputs, i.output_dtypes))


SPEC = kernels.register_spec(kernels.KernelSpec(
    name="deltanet_chunk", body="deltanet_chunk.inc",
    input_names=("u", "w", "q_dec", "qk", "k_dec", "g_last", "state"),
    output_names=("y", "state_out"), template_params=SPEC_PARAMS,
    description="Chunked Gated DeltaNet prefill: the scan over chunks (float32 state carried) in one launch",
    instances=_instances,
))


def _dispatch(*args, **kwargs):
    from . import backend

    return chunk_scan(*args, backend=backend(), **kwargs)


register_kernel("deltanet_chunk", SPEC.description, _dispatch)
