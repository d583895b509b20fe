"""deltanet_chunk: the inter-chunk scan of chunked Gated DeltaNet prefill in ONE launch.

reference.gated_delta_chunked computes every chunk's u, w, q_dec, qk, k_dec, g_last at once
(reference.chunk_intra), then carries the float32 state through the chunks; chunk by chunk that is
about 8 small primitives per 64 tokens, each costing a launch. The kernel (kernels/deltanet_chunk.inc,
CUDA and Metal) carries the state through all chunks in one launch. This module checks that it
applies (else the dispatcher runs reference.chunk_scan_reference), picks the launch shape and
registers switch "deltanet_chunk" (on: its cuda tests pass on the H200, where it takes the 35B mixer from 7.5 to
4.9 ms per layer at 2048 tokens).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from . import kernels, metal_source, register_kernel

MAX_HEAD_DIM = 256  # Dk: a lane holds Dk/32 state columns per row in the update
SHARED_BYTES = 32768  # Metal's threadgroup memory
SPEC_PARAMS = ("DK", "DV", "C", "ROWS", "WARPS")


def plan(Dv: int) -> dict:
    """ROWS state rows per block (16, or the power of two covering a narrower Dv), 8 warps."""
    return {"ROWS": min(16, 1 << (Dv - 1).bit_length()), "WARPS": 8}


def shared_bytes(Dk: int, C: int, rows: int) -> int:
    """The block's rows of S (padded stride Dk + 1) and of the chunk's v, float32."""
    return 4 * rows * (Dk + 1 + C)


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
    if shared_bytes(Dk, C, (launch or plan(Dv))["ROWS"]) > SHARED_BYTES:
        return f"chunk size {C} with Dk={Dk} exceeds {SHARED_BYTES} bytes of shared memory"
    if B * Hv * N * C * max(Dk, Dv, C) >= 2**31 or B * Hv * Dv * Dk >= 2**31:
        return "int32 indexing"
    return None


def instance(B: int, Hv: int, N: int, Dk: int, Dv: int, C: int, launch: Optional[dict] = None) -> kernels.Instance:
    p = launch or plan(Dv)
    f32 = mx.float32
    template = (("DK", Dk), ("DV", Dv), ("C", C), ("ROWS", p["ROWS"]), ("WARPS", p["WARPS"]))
    inputs = ((f32, (B, Hv, N, C, Dv)), (f32, (B, Hv, N, C, Dk)), (f32, (B, Hv, N, C, Dk)), (f32, (B, Hv, N, C, C)),
              (f32, (B, Hv, N, C, Dk)), (f32, (B, Hv, N)), (f32, (B, Hv, Dv, Dk)))
    return kernels.Instance(template, inputs, (f32, f32))


def grid(B: int, Hv: int, Dv: int, launch: dict) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, threadgroup) in threads: one block per (batch row, value head, ROWS state rows)."""
    threads = 32 * launch["WARPS"]
    return (B * Hv * -(-Dv // launch["ROWS"]) * threads, 1, 1), (threads, 1, 1)


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
        p = launch or plan(Dv)
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
    combos.append((1, 3, 2, 24, 40, 64, {"ROWS": 8, "WARPS": 2}))  # several rows per warp in the update
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
