"""deltanet_step: Gated DeltaNet decode tokens in ONE launch (one token a step; a few in a speculative verify).

Conv1d state shift + depthwise conv + SiLU over the head's q/k/v channels, q/k L2 norms, the gates
g and beta, the delta-rule update of the float32 state and the gated RMSNorm: the body is
kernels/deltanet_step.inc (CUDA and Metal). This module checks that the kernel applies (else the
dispatcher runs the reference composition), picks the launch shape and registers switch
"deltanet_step" (its cuda tests passed on the H200, 2026-12-02).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import mlx.core as mx

from . import kernels, register_kernel

ACT_DTYPES = (mx.float32, mx.bfloat16, mx.float16)
MAX_HEAD_DIM = 256  # Dk, Dv: the state rows a warp holds in registers are sized for this
MAX_CONV_WIDTH = 8
MAX_TOKENS = 8  # tokens a row: each block runs them in turn (model.DECODE_TOKENS_MAX)
STATE_REGS = 64  # floats of state one lane holds per pass over its rows
# The block's warps at most. The CUDA launch bound is 2 such blocks an SM (64 registers, what the 35B instance used
# unbounded): unbounded, Dk 32 x Dv 256 in float32 took 158 and failed at launch (H200 run 32).
MAX_WARPS = 16

SPEC_PARAMS = ("T", "TW", "TA", "TD", "TN", "HK", "HV", "DK", "DV", "W", "WARPS", "RB", "MASKED", "EPS_BITS", "KEEP")


def plan(Dk: int, Dv: int) -> dict:
    """WARPS warps per block over the Dv state rows (about 8 rows each), RB rows per warp per pass."""
    warps = min(MAX_WARPS, -(-Dv // 8))
    rows = -(-Dv // warps)
    rb = max(1, min(rows, STATE_REGS // -(-Dk // 32)))
    return {"WARPS": warps, "RB": rb}


def split_heads(proj, conv_weight, A_log, Dv: int, num_key_heads: int) -> Optional[tuple[int, int, int, int, int]]:
    """(Hk, Hv, Dk, Dv, C) implied by the fused projection [qkv (C) | z (Hv*Dv) | b (Hv) | a (Hv)], or None."""
    Hk, Hv, C = num_key_heads, A_log.shape[0], conv_weight.shape[0]
    if Hk <= 0 or Hv % Hk or (C - Hv * Dv) % (2 * Hk) or C <= Hv * Dv or proj.shape[-1] != C + Hv * Dv + 2 * Hv:
        return None
    return Hk, Hv, (C - Hv * Dv) // (2 * Hk), Dv, C


def unsupported(proj, conv_weight, conv_state, A_log, dt_bias, norm_weight, state, num_key_heads, eps,
                mask=None, alt=None) -> Optional[str]:
    """Why the kernel does not apply to these arguments (None when it does)."""
    heads = split_heads(proj, conv_weight, A_log, norm_weight.shape[0], num_key_heads)
    if proj.ndim != 3 or not 1 <= proj.shape[1] <= MAX_TOKENS or heads is None:
        return f"shapes: proj [B, T <= {MAX_TOKENS}, C + Hv*Dv + 2*Hv] expected, got {proj.shape}"
    B, T = proj.shape[:2]
    Hk, Hv, Dk, Dv, Cc = heads
    if not (1 <= Dk <= MAX_HEAD_DIM and 1 <= Dv <= MAX_HEAD_DIM):
        return f"head dims Dk={Dk}, Dv={Dv} beyond {MAX_HEAD_DIM}"
    if conv_weight.ndim != 3 or conv_weight.shape[2] != 1:
        return f"conv weight shape {conv_weight.shape}"
    W = conv_weight.shape[1]
    if not 2 <= W <= MAX_CONV_WIDTH or conv_state.shape != (B, W - 1, Cc):
        return f"conv width {W} / conv state shape {conv_state.shape}"
    if dt_bias.shape != (Hv,):
        return "gate shapes"
    if state is not None and (state.shape != (B, Hv, Dv, Dk) or state.dtype != mx.float32):
        return "state: float32 [B, Hv, Dv, Dk] expected"
    if mask is not None and (mask.shape != (B, T) or mask.dtype != mx.bool_):
        return f"mask: bool [B, {T}] expected"
    if proj.dtype not in ACT_DTYPES or conv_state.dtype != proj.dtype:
        return "dtypes: proj and the conv state must share one float dtype"
    if any(x.dtype not in ACT_DTYPES for x in (conv_weight, A_log, dt_bias, norm_weight)):
        return "parameter dtypes"
    if not eps > 0.0:
        return f"eps {eps}"
    if B * Hv * Dv * Dk >= 2**31 or B * W * proj.shape[-1] >= 2**31:
        return "int32 indexing"
    if alt is not None:
        conv_alt, state_alt, use_alt = alt
        if state is None or (conv_alt.shape, conv_alt.dtype, state_alt.shape, state_alt.dtype) != (
                conv_state.shape, conv_state.dtype, state.shape, state.dtype):
            return "alt: the alternative conv state and state must match conv_state's and state's shapes and dtypes"
        if use_alt.size != 1 or use_alt.dtype != mx.bool_:
            return "alt: use_alt must be one bool"
    return None


def instance(dtype, weight_dtype, alog_dtype, dt_bias_dtype, norm_dtype, B: int, Hk: int, Hv: int, Dk: int, Dv: int,
             W: int, masked: bool, eps: float, launch: Optional[dict] = None, keep: bool = False,
             alt: bool = False) -> kernels.Instance:
    """keep: the states after all but the last token too (KEEP; conv_state_out and state_out get a leading 2); alt:
    an instance of the _alt variant (ALT_SPEC), its states picked on the GPU from two pairs."""
    p = launch or plan(Dk, Dv)
    C = 2 * Hk * Dk + Hv * Dv
    template = (("T", dtype), ("TW", weight_dtype), ("TA", alog_dtype), ("TD", dt_bias_dtype), ("TN", norm_dtype),
                ("HK", Hk), ("HV", Hv), ("DK", Dk), ("DV", Dv), ("W", W), ("WARPS", p["WARPS"]), ("RB", p["RB"]),
                ("MASKED", bool(masked)), ("EPS_BITS", kernels.float_bits(eps)), ("KEEP", bool(keep)))
    conv_shape, state_shape = (B, W - 1, C), (B, Hv, Dv, Dk)
    inputs = ((dtype, (B, 1, C + Hv * Dv + 2 * Hv)), (weight_dtype, (C, W, 1)), (dtype, conv_shape),
              (alog_dtype, (Hv,)), (dt_bias_dtype, (Hv,)), (norm_dtype, (Dv,)), (mx.float32, state_shape),
              (mx.bool_, (B, 1) if masked else (1,)))
    if alt:
        inputs += ((dtype, conv_shape), (mx.float32, state_shape), (mx.bool_, (1,)))
    return kernels.Instance(template, inputs, (dtype, dtype, mx.float32))


_LAUNCH: dict = {}  # argument signature -> (template, grid, threadgroup) or None (not applicable)


def _launch(args, num_key_heads, eps, mask, launch, keep, alt):
    key = (tuple((x.shape, x.dtype) for x in args if x is not None), args[-1] is None, num_key_heads, eps,
           None if mask is None else mask.shape, None if launch is None else tuple(sorted(launch.items())), keep,
           None if alt is None else tuple((x.shape, x.dtype) for x in alt))
    hit = _LAUNCH.get(key, False)
    if hit is not False:
        return hit
    out = None
    if unsupported(*args, num_key_heads, eps, mask, alt) is None:
        proj, conv_weight, conv_state, A_log, dt_bias, norm_weight, _ = args
        Hk, Hv, Dk, Dv, _ = split_heads(proj, conv_weight, A_log, norm_weight.shape[0], num_key_heads)
        p = launch or plan(Dk, Dv)
        inst = instance(proj.dtype, conv_weight.dtype, A_log.dtype, dt_bias.dtype, norm_weight.dtype, proj.shape[0],
                        Hk, Hv, Dk, Dv, conv_weight.shape[1], mask is not None, eps, p, keep)
        threads = 32 * p["WARPS"]
        out = (list(inst.template), (proj.shape[0] * Hv * threads, 1, 1), (threads, 1, 1), (Hv, Dv, Dk))
    _LAUNCH[key] = out
    return out


def deltanet_step(proj, conv_weight, conv_state, A_log, dt_bias, norm_weight, state, *, num_key_heads: int,
                  eps: float, mask=None, backend: str, init_value: Optional[float] = None, launch: Optional[dict] = None,
                  keep: bool = False, alt: Optional[tuple] = None):
    """T <= MAX_TOKENS decode tokens from the fused projection proj [B, T, qkv | z | b | a]: (out [B, T, Hv*Dv] in
    proj's dtype, new conv state [B, W-1, C], new state [B, Hv, Dv, Dk] float32), or None when the kernel
    does not apply. state None means zeros; mask [B, T] bool marks real tokens (a masked token leaves the
    state unchanged). keep (T >= 2): the conv state and state after all but the last token follow. alt =
    (conv state, state, use_alt [1] bool): the tokens start from that pair instead where use_alt, read in place
    (deltanet_step_alt)."""
    args = (proj, conv_weight, conv_state, A_log, dt_bias, norm_weight, state)
    plan_ = _launch(args, num_key_heads, eps, mask, launch, keep, alt)
    if plan_ is None:
        return None
    template, grid, group, (Hv, Dv, Dk) = plan_
    B = proj.shape[0]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    inputs = [proj, conv_weight, conv_state, A_log, dt_bias, norm_weight, state,
              kernels.placeholder(mx.bool_) if mask is None else mask, *(alt or ())]
    shapes = [(B, proj.shape[1], Hv * Dv), kept_shape(conv_state.shape, keep), kept_shape((B, Hv, Dv, Dk), keep)]
    out = kernels.call(variant("deltanet_step", alt), backend, inputs, template, grid, group, shapes,
                       [proj.dtype, proj.dtype, mx.float32], init_value)
    return split_kept(out, 1, keep)


def variant(name: str, alt: Optional[tuple]) -> str:
    """The kernel a launch takes: `name`, or with alt its _alt variant (alt_spec)."""
    return name + ALT if alt is not None else name


def kept_shape(shape: tuple, keep: bool) -> tuple:
    """A state output's shape, with KEEP's leading 2 (the final state, then the one before the last token)."""
    return (2, *shape) if keep else tuple(shape)


def split_kept(outputs, first: int, keep: bool) -> tuple:
    """A launch's outputs with the conv state and state at outputs[first], [first + 1]: as they are, or with KEEP the
    final two in their places and the two kept states appended."""
    outputs = list(outputs)
    if not keep:
        return tuple(outputs)
    # Slices, not x[0]: MLX indexes an integer by a gather, a copy of the 2 MB state a layer (H100 run 84: 60
    # launches, 1.85 ms of a 2-token verify's 4.2).
    (conv, conv_kept), (state, state_kept) = (mx.split(outputs[first + i], 2) for i in (0, 1))
    outputs[first], outputs[first + 1] = conv.squeeze(0), state.squeeze(0)
    return (*outputs, conv_kept.squeeze(0), state_kept.squeeze(0))


# (Hk, Hv, Dk, Dv) the project runs: Qwen3.5/3.6-35B-A3B, the embedded lily-tiny, tests/tiny.py.
MODEL_HEADS = ((16, 32, 128, 128), (2, 4, 32, 48), (2, 4, 16, 24))
# Shapes of the kernel tests (odd Dk/Dv, Hk != Hv) and the largest head dims.
TEST_HEADS = ((1, 3, 64, 32), (2, 6, 48, 40), (1, 2, 256, 256), (2, 4, 256, 32), (1, 1, 32, 256))


def _instances() -> list[kernels.Instance]:
    f32, bf16, f16 = mx.float32, mx.bfloat16, mx.float16
    eps = 1e-6
    combos = []
    for heads in MODEL_HEADS:
        for masked in (False, True):
            combos += [(f32, f32, f32, f32, f32, 1, *heads, 4, masked, eps),
                       (bf16, bf16, f32, bf16, bf16, 1, *heads, 4, masked, eps),
                       (f16, f16, f32, f16, f16, 1, *heads, 4, masked, eps)]
    for heads in TEST_HEADS:
        combos += [(f32, f32, f32, f32, f32, 3, *heads, 4, False, eps), (bf16, f32, bf16, f32, bf16, 3, *heads, 4, True, 1e-5)]
    combos.append((bf16, bf16, bf16, bf16, bf16, 3, 1, 3, 64, 32, 2, True, eps))  # conv width 2
    insts = [instance(*c) for c in combos]
    # KEEP (a verify's states before its last token): the models' heads, and the emulated tests' heads
    insts += [instance(bf16, bf16, f32, bf16, bf16, 1, *heads, 4, False, eps, keep=True) for heads in MODEL_HEADS]
    insts += [instance(f32, f32, f32, f32, f32, 1, 2, 4, 32, 48, 4, False, eps, keep=True),
              instance(bf16, bf16, f32, bf16, bf16, 3, 1, 3, 64, 32, 4, True, eps, keep=True),
              instance(f32, bf16, f32, f32, f32, 2, 2, 4, 16, 24, 2, False, eps, {"WARPS": 2, "RB": 3}, keep=True)]
    return kernels.unique_instances(insts, key=kernels.source_key)


def _alt_instances() -> list[kernels.Instance]:
    """The _alt variant's: the resident loop's verify (KEEP too) at the models' heads, and the emulated tests' cases."""
    f32, bf16, eps = mx.float32, mx.bfloat16, 1e-6
    insts = [instance(bf16, bf16, f32, bf16, bf16, 1, *heads, 4, False, eps, keep=True, alt=True) for heads in MODEL_HEADS]
    insts += [instance(f32, f32, f32, f32, f32, 1, 2, 4, 32, 48, 4, False, eps, keep=True, alt=True),
              instance(bf16, bf16, f32, bf16, bf16, 3, 1, 3, 64, 32, 4, True, eps, alt=True),
              instance(f32, bf16, f32, f32, f32, 2, 2, 4, 16, 24, 2, False, eps, {"WARPS": 2, "RB": 3}, keep=True,
                       alt=True)]
    return kernels.unique_instances(insts, key=kernels.source_key)


SPEC = kernels.register_spec(kernels.KernelSpec(
    name="deltanet_step", body="deltanet_step.inc",
    input_names=("proj", "conv_weight", "conv_state", "A_log", "dt_bias", "norm_weight", "state", "mask"),
    output_names=("out", "conv_state_out", "state_out"), template_params=SPEC_PARAMS,
    description="Gated DeltaNet decode step (conv, norms, gates, state update, gated RMSNorm) in one launch",
    instances=_instances, cuda_launch_bounds=(32 * MAX_WARPS, 2),
))
ALT = "_alt"  # the variant's suffix
ALT_INPUTS = ("conv_state_alt", "state_alt", "use_alt")


def alt_spec(spec: kernels.KernelSpec, instances) -> kernels.KernelSpec:
    """spec's variant whose states are picked on the GPU (LILY_ALT): the alternative pair and use_alt after its mask.
    A variant of its own, so the plain launch (every decode step) takes no placeholders for them."""
    at = spec.input_names.index("mask") + 1
    return kernels.register_spec(dataclasses.replace(
        spec, name=spec.name + ALT, input_names=spec.input_names[:at] + ALT_INPUTS + spec.input_names[at:],
        defines=spec.defines + ("LILY_ALT",), instances=instances,
        description=spec.description + "; its states picked on the GPU from two pairs"))


ALT_SPEC = alt_spec(SPEC, _alt_instances)


def _dispatch(*args, **kwargs):
    from . import backend

    return deltanet_step(*args, backend=backend(), **kwargs)


register_kernel("deltanet_step", SPEC.description, _dispatch)
