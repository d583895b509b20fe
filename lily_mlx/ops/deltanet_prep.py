"""deltanet_prep: the prefill Gated DeltaNet mixer up to the delta rule in ONE launch.

From the fused input projection: the causal depthwise conv + SiLU (padding tokens zeroed), the q/k L2 norms (q
scaled by Dk^-1/2), the gates log g and beta (zero at padding tokens, which makes them no-ops on the state) and
the next conv state. The body is kernels/deltanet_prep.inc (CUDA and Metal); ops.deltanet_mix feeds its float32
q, k, v and gates straight to the chunked delta rule. Where it does not apply (right-padded rows, other shapes),
the dispatcher runs the composition. Switch "deltanet_prep": its cuda tests pass (H200 run 25), and whole prefills on
vs off in one process took 60.8 vs 60.8 ms at 512 tokens, 91.8 vs 95.7 at 2048 and 379.8 vs 395.4 at 8192, the peak
over the weights 1.01 vs 2.12 GB at 2048 (no float32 copy of the conv output and its casts).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from . import kernels, register_kernel
from .deltanet_step import ACT_DTYPES, MAX_CONV_WIDTH, MAX_HEAD_DIM, split_heads

WARPS = 8
SPEC_PARAMS = ("T", "TW", "TA", "TD", "HK", "HV", "DK", "DV", "W", "WARPS", "MASKED")


def unsupported(proj, conv_weight, conv_state, A_log, dt_bias, Dv: int, num_key_heads: int, mask=None) -> Optional[str]:
    """Why the kernel does not apply to these arguments (None when it does)."""
    heads = None if proj.ndim != 3 else split_heads(proj, conv_weight, A_log, Dv, num_key_heads)
    if heads is None or proj.shape[1] < 1:
        return f"shapes: proj [B, T, C + Hv*Dv + 2*Hv] with {num_key_heads} key heads expected, got {proj.shape}"
    B, L, P = proj.shape
    Hk, Hv, Dk, _, C = heads
    if not (1 <= Dk <= MAX_HEAD_DIM and 1 <= Dv <= MAX_HEAD_DIM):
        return f"head dims Dk={Dk}, Dv={Dv} beyond {MAX_HEAD_DIM}"
    if conv_weight.ndim != 3 or conv_weight.shape[2] != 1 or not 2 <= conv_weight.shape[1] <= MAX_CONV_WIDTH:
        return f"conv weight shape {conv_weight.shape}: [C, W, 1] with W in 2..{MAX_CONV_WIDTH} expected"
    if conv_state.shape != (B, conv_weight.shape[1] - 1, C) or dt_bias.shape != (Hv,):
        return f"conv state {conv_state.shape} / dt_bias {dt_bias.shape}"
    if mask is not None and (mask.shape != (B, L) or mask.dtype != mx.bool_):
        return f"mask: bool [B, T] = {(B, L)} expected, got {mask.dtype} {mask.shape}"
    if proj.dtype not in ACT_DTYPES or conv_state.dtype != proj.dtype:
        return f"dtypes: proj {proj.dtype} and the conv state {conv_state.dtype} must share one float dtype"
    if any(x.dtype not in ACT_DTYPES for x in (conv_weight, A_log, dt_bias)):
        return "parameter dtypes"
    if B * L * P >= 2**31 or B * L * Hv * max(Dk, Dv) >= 2**31:
        return "int32 indexing"
    return None


def instance(dtype, weight_dtype, alog_dtype, dt_bias_dtype, B: int, L: int, Hk: int, Hv: int, Dk: int, Dv: int,
             W: int, masked: bool) -> kernels.Instance:
    C = 2 * Hk * Dk + Hv * Dv
    template = (("T", dtype), ("TW", weight_dtype), ("TA", alog_dtype), ("TD", dt_bias_dtype), ("HK", Hk),
                ("HV", Hv), ("DK", Dk), ("DV", Dv), ("W", W), ("WARPS", WARPS), ("MASKED", bool(masked)))
    inputs = ((dtype, (B, L, C + Hv * Dv + 2 * Hv)), (weight_dtype, (C, W, 1)), (dtype, (B, W - 1, C)),
              (alog_dtype, (Hv,)), (dt_bias_dtype, (Hv,)), (mx.bool_, (B, L) if masked else (1,)))
    return kernels.Instance(template, inputs, (mx.float32,) * 5 + (dtype,))


_LAUNCH: dict = {}  # argument signature -> (template, (Hk, Hv, Dk, C)) or None (not applicable)


def deltanet_prep(proj, conv_weight, conv_state, A_log, dt_bias, *, value_head_dim: int, num_key_heads: int,
                  mask=None, backend: str, init_value: Optional[float] = None):
    """proj [B, T, qkv | z | b | a] -> (q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], log_g, beta [B, T, Hv], all float32,
    and the next conv state [B, W-1, C] in proj's dtype), or None when the kernel does not apply. mask [B, T] bool
    marks real tokens: a padding token's conv input is zero and its gates make it a no-op on the state."""
    args = (proj, conv_weight, conv_state, A_log, dt_bias)
    key = (tuple((x.shape, x.dtype) for x in args), value_head_dim, num_key_heads,
           None if mask is None else (mask.shape, mask.dtype))
    plan = _LAUNCH.get(key, False)
    if plan is False:
        plan = None
        if unsupported(*args, value_head_dim, num_key_heads, mask) is None:
            heads = split_heads(proj, conv_weight, A_log, value_head_dim, num_key_heads)
            inst = instance(proj.dtype, conv_weight.dtype, A_log.dtype, dt_bias.dtype, *proj.shape[:2], *heads[:4],
                            conv_weight.shape[1], mask is not None)
            plan = (list(inst.template), heads)
        _LAUNCH[key] = plan
    if plan is None:
        return None
    template, (Hk, Hv, Dk, _, _) = plan
    B, L, _ = proj.shape
    f32 = mx.float32
    shapes = [(B, L, Hk, Dk), (B, L, Hk, Dk), (B, L, Hv, value_head_dim), (B, L, Hv), (B, L, Hv), conv_state.shape]
    inputs = [proj, conv_weight, conv_state, A_log, dt_bias, kernels.placeholder(mx.bool_) if mask is None else mask]
    return tuple(kernels.call("deltanet_prep", backend, inputs, template, (B * L * 32 * WARPS, 1, 1),
                              (32 * WARPS, 1, 1), shapes, [f32] * 5 + [proj.dtype], init_value))


# (Hk, Hv, Dk, Dv): Qwen3.5/3.6-35B-A3B, the embedded lily-tiny, tests/tiny.py, then the tests' odd shapes.
MODEL_HEADS = ((16, 32, 128, 128), (2, 4, 32, 48), (2, 4, 16, 24))
TEST_HEADS = ((1, 3, 64, 32), (2, 6, 48, 40), (2, 4, 256, 32), (1, 1, 32, 256))


def _instances() -> list[kernels.Instance]:
    f32, bf16, f16 = mx.float32, mx.bfloat16, mx.float16
    combos = []
    for heads in MODEL_HEADS:
        for masked in (False, True):
            combos += [(f32, f32, f32, f32, 1, 64, *heads, 4, masked),
                       (bf16, bf16, f32, bf16, 1, 64, *heads, 4, masked),
                       (f16, f16, f32, f16, 1, 64, *heads, 4, masked)]
    for heads in TEST_HEADS:
        combos += [(f32, f32, f32, f32, 3, 65, *heads, 4, False), (bf16, f32, bf16, f32, 3, 65, *heads, 3, True)]
    return kernels.unique_instances((instance(*c) for c in combos), key=kernels.source_key)


SPEC = kernels.register_spec(kernels.KernelSpec(
    name="deltanet_prep", body="deltanet_prep.inc",
    input_names=("proj", "conv_weight", "conv_state", "A_log", "dt_bias", "mask"),
    output_names=("q", "k", "v", "log_g", "beta", "conv_state_out"), template_params=SPEC_PARAMS,
    description="prefill DeltaNet mixer before the delta rule (conv, SiLU, q/k norms, gates, mask) in one launch",
    instances=_instances,
))


def _dispatch(*args, **kwargs):
    from . import backend

    return deltanet_prep(*args, backend=backend(), **kwargs)


register_kernel("deltanet_prep", SPEC.description, _dispatch)
