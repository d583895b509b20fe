"""flash_attn: prefill attention with the online softmax, for head dims MLX has no fused attention for on CUDA.

MLX's CUDA backend runs head_dim 256 attention unfused: every score reaches memory (reference.attention, or
reference.attention_query_blocked in blocks of queries), 16 GB per layer at 16k tokens. The kernel
(kernels/flash_attn.inc, CUDA and Metal) keeps a 64-query tile's scores in registers and streams the keys once,
with GQA, causal masks aligned bottom-right (the queries as the last L of S positions: a prefix already in the
KV cache) and 16-bit q, k, v. This module checks that it applies (else the dispatcher runs the reference),
picks the launch and registers switch "flash_attn".
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from . import kernels, metal_source, register_kernel

BQ, WARPS = 64, 4  # the body's query tile and warps (16 query rows each)
MAX_HEAD_DIM = 256  # a warp's [16, D] output stays in registers
SHARED_BYTES = {"cuda": 48 * 1024, "metal": metal_source.THREADGROUP_BYTES}  # static shared memory / Metal's threadgroup memory
SPEC_PARAMS = ("T", "D", "HQ", "HKV", "BK", "CAUSAL", "SCALE_BITS")
ACTIVATIONS = (mx.bfloat16, mx.float16)


def shared_bytes(D: int, BK: int) -> int:
    """K and V tiles [BK][D + 8] in 16-bit."""
    return 2 * BK * (D + 8) * 2


def keys_per_step(D: int, backend: str) -> int:
    """BK: 32 keys per step where K and V tiles of 32 fit the shared memory, else 16 (Metal at head_dim 256)."""
    return 32 if shared_bytes(D, 32) <= SHARED_BYTES.get(backend, SHARED_BYTES["metal"]) else 16


def unsupported(q, k, v, mask) -> Optional[str]:
    """Why the kernel does not apply (None when it does)."""
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        return f"shapes: q [B, Hq, L, D], k and v [B, Hkv, S, D] expected, got {q.shape}, {k.shape}, {v.shape}"
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if q.dtype not in ACTIVATIONS or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype}: 16-bit q, k, v of one dtype (the tensor cores' operands)"
    if mask is not None and not (isinstance(mask, str) and mask == "causal"):
        return "mask: None or 'causal' (array masks take MLX's attention)"
    if Hq % Hkv or D % 16 or not 16 <= D <= MAX_HEAD_DIM:
        return f"{Hq} query heads over {Hkv} kv heads, head_dim {D} (a multiple of 16 up to {MAX_HEAD_DIM})"
    if L == 0 or S < L:
        return f"{L} queries over {S} keys: the queries are the last L of S >= L positions"
    if B * max(Hq * L, Hkv * S) * D >= 2**31:
        return "int32 indexing"
    return None


def instance(dtype, B: int, Hq: int, Hkv: int, L: int, S: int, D: int, causal: bool, scale: float,
             BK: int = 32) -> kernels.Instance:
    template = (("T", dtype), ("D", D), ("HQ", Hq), ("HKV", Hkv), ("BK", BK), ("CAUSAL", bool(causal)),
                ("SCALE_BITS", kernels.float_bits(scale)))
    return kernels.Instance(template, ((dtype, (B, Hq, L, D)), (dtype, (B, Hkv, S, D)), (dtype, (B, Hkv, S, D))),
                            (dtype,))


def grid(B: int, Hq: int, L: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, threadgroup) in threads: one block of 4 warps per (batch row, query head, 64 queries)."""
    return (B * Hq * -(-L // BQ) * 32 * WARPS, 1, 1), (32 * WARPS, 1, 1)


def attention(q, k, v, *, scale: float, mask=None, backend: str, init_value: Optional[float] = None):
    """softmax(q k^T scale) v [B, Hq, L, D] in q's dtype, or None when the kernel does not apply."""
    if unsupported(q, k, v, mask) is not None:
        return None
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    inst = instance(q.dtype, B, Hq, Hkv, L, S, D, mask is not None, scale, keys_per_step(D, backend))
    return kernels.call("flash_attn", backend, [q, k, v], list(inst.template), *grid(B, Hq, L), [q.shape], [q.dtype],
                        init_value)[0]


# (Hq, Hkv, D) the project runs: Qwen3.5/3.6-35B-A3B (16:2 at 256), the embedded lily-tiny, tests/tiny.py.
MODEL_HEADS = ((16, 2, 256), (4, 2, 64), (4, 2, 32))


def _instances() -> list[kernels.Instance]:
    insts = [instance(dt, 1, Hq, Hkv, 2048, 2048, D, True, D**-0.5, BK)
             for Hq, Hkv, D in MODEL_HEADS for dt in ACTIVATIONS for BK in (16, 32)]
    insts += [instance(mx.bfloat16, 2, 6, 2, 70, 100, 48, False, 0.3), instance(mx.float16, 1, 3, 3, 33, 33, 80, True, 0.2)]
    return kernels.unique_instances(insts, key=lambda i: metal_source.metal_kernel_name("flash_attn", i.template,
                                                                                      i.inputs, i.output_dtypes))


SPEC = kernels.register_spec(kernels.KernelSpec(
    name="flash_attn", body="flash_attn.inc", input_names=("q", "k", "v"), output_names=("o",),
    template_params=SPEC_PARAMS, instances=_instances,
    description="prefill attention with the online softmax (GQA, causal bottom-right, 16-bit, head_dim <= 256)",
))


def _dispatch(q, k, v, **kwargs):
    from . import backend

    return attention(q, k, v, backend=backend(), **kwargs)


# On (from ops.FLASH_MIN_SCORES scores): its cuda tests pass on the H200, where a 16,384-token prefill took 1433 vs
# 1635 ms with it (2026-12-03, run 9, one process); the rule's threshold is argued at FLASH_MIN_SCORES.
register_kernel("flash_attn", SPEC.description, _dispatch)
