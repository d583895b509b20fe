"""deltanet_chain: a Gated DeltaNet layer's decode token in one launch (kernels/deltanet_chain.inc, CUDA and Metal):
qmv's body (input RMSNorm + the fused projection [qkv | z | b | a]) and deltanet_step's body as two phases of one
grid, ordered through the layer's counters (`kernels.sync_counters`) as moe_chain orders its three. One launch fewer
in each of the 30 DeltaNet layers of a decode step, the GPU's work unchanged.

Switch "deltanet_chain", opt-in: its ordering has run on the CPU emulator only, not yet on a GPU.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from . import deltanet_step as ds
from . import kernels, qmv, register_kernel

SPEC_PARAMS = ds.SPEC_PARAMS + ("QTN", "BITS", "GS", "M", "K", "LANES", "RPS", "QEPS_BITS")
SHARED_BYTES = 32768  # Metal's threadgroup memory


def plan(M: int, K: int, PW: int, bits: int, Dk: int, Dv: int) -> dict:
    """deltanet_step's block (its WARPS) for both phases; qmv's rows planned for it, every row block its own block
    (no persistent loop: the step's blocks wait on all of them). qmv's block-count floor scales with the block size,
    so a lane keeps as many weight chunks in flight as qmv's own plan gives it."""
    step = ds.plan(Dk, Dv)
    p = qmv.plan(M, K, PW, bits, min_blocks=qmv.MIN_BLOCKS * 8 // step["WARPS"], warps=step["WARPS"])
    proj_blocks = -(-PW // (p["WARPS"] * (32 // p["LANES"]) * p["RPS"]))
    return {"step": step, "qmv": p, "WARPS": step["WARPS"], "proj_blocks": proj_blocks}


def shared_bytes(M: int, K: int, Dk: int, Dv: int, warps: int, bits: int) -> int:
    """deltanet_chain.inc's threadgroup memory: qmv's x tile and chunk sums, its norm scratch, the step's vectors."""
    tile = M * min(K, qmv.XBUDGET // M)  # at most XBUDGET floats (qmv.plan's tile)
    return 4 * (tile + tile * bits // 128 + M * warps + 2 * Dk + 2 * Dv + 1)


def unsupported(x, norm, in_proj, conv_weight, conv_state, A_log, dt_bias, norm_weight, state, num_key_heads: int,
                eps: float, mask=None) -> Optional[str]:
    """Why deltanet_chain does not apply (None when it does): the checks of qmv (normed input) and deltanet_step."""
    if norm is None or in_proj is None:
        return "the chained step needs the input norm and the quantized fused projection"
    w, scales, biases, bits, group_size = in_proj
    why = qmv.unsupported(x, w, scales, biases, group_size, bits, norm=norm)
    if why:
        return why
    if x.ndim != 3 or x.shape[1] != 1:
        return f"x [B, 1, K] expected, got {x.shape}"
    proj = kernels.Shaped((x.shape[0], 1, w.shape[0]), x.dtype)
    why = ds.unsupported(proj, conv_weight, conv_state, A_log, dt_bias, norm_weight, state, num_key_heads, eps, mask)
    if why:
        return why
    Hk, Hv, Dk, Dv, _ = ds.split_heads(proj, conv_weight, A_log, norm_weight.shape[0], num_key_heads)
    M = kernels.row_bucket(x.shape[0])
    if shared_bytes(M, x.shape[-1], Dk, Dv, ds.plan(Dk, Dv)["WARPS"], bits) > SHARED_BYTES:
        return f"over Metal's {SHARED_BYTES} bytes of threadgroup memory"
    return None


def instance(dtype, scale_dtype, norm_in_dtype, M: int, K: int, bits: int, group_size: int, step_dtypes, Hk: int,
             Hv: int, Dk: int, Dv: int, W: int, masked: bool, eps: float, eps_in: float) -> kernels.Instance:
    """step_dtypes: deltanet_step's (conv weight, A_log, dt_bias, gated norm weight) dtypes."""
    PW = 2 * Hk * Dk + 2 * Hv * Dv + 2 * Hv
    p = plan(M, K, PW, bits, Dk, Dv)
    step = ds.instance(dtype, *step_dtypes, M, Hk, Hv, Dk, Dv, W, masked, eps, p["step"])
    template = step.template + (("QTN", norm_in_dtype), ("BITS", bits), ("GS", group_size), ("M", M), ("K", K),
                                ("LANES", p["qmv"]["LANES"]), ("RPS", p["qmv"]["RPS"]),
                                ("QEPS_BITS", kernels.float_bits(eps_in)))
    inputs = ((dtype, (M, 1, K)), (mx.uint32, (PW, K * bits // 32)), (scale_dtype, (PW, K // group_size)),
              (scale_dtype, (PW, K // group_size)), (norm_in_dtype, (K,))) + step.inputs[1:] \
        + ((mx.int32, (kernels.SYNC_SLOTS,)),)
    return kernels.Instance(template, inputs, step.output_dtypes + (dtype,))


_LAUNCH: dict = {}  # argument signature -> (template, grid, threadgroup, Hv, Dv, Dk, PW) or None


def _launch(x, norm, in_proj, args, num_key_heads, eps, mask):
    key = (tuple((a.shape, a.dtype) for a in (x, norm[0], *in_proj[:3], *args) if a is not None),
           in_proj[3:], norm[1], args[-1] is None, num_key_heads, eps, None if mask is None else mask.shape)
    hit = _LAUNCH.get(key, False)
    if hit is not False:
        return hit
    launch = None
    if unsupported(x, norm, in_proj, *args, num_key_heads, eps, mask) is None:
        conv_weight, conv_state, A_log, dt_bias, norm_weight, _ = args
        w, scales, _, bits, group_size = in_proj
        PW, K = w.shape[0], x.shape[-1]
        Hk, Hv, Dk, Dv, _ = ds.split_heads(kernels.Shaped((1, 1, PW), x.dtype), conv_weight, A_log,
                                           norm_weight.shape[0], num_key_heads)
        M = kernels.row_bucket(x.shape[0])
        inst = instance(x.dtype, scales.dtype, norm[0].dtype, M, K, bits, group_size,
                        (conv_weight.dtype, A_log.dtype, dt_bias.dtype, norm_weight.dtype), Hk, Hv, Dk, Dv,
                        conv_weight.shape[1], mask is not None, eps, norm[1])
        p = plan(M, K, PW, bits, Dk, Dv)
        threads = 32 * p["WARPS"]
        blocks = p["proj_blocks"] + x.shape[0] * Hv
        launch = (list(inst.template), (blocks * threads, 1, 1), (threads, 1, 1), Hv, Dv, Dk, PW)
    _LAUNCH[key] = launch
    return launch


def step(x, norm, in_proj, conv_weight, conv_state, A_log, dt_bias, norm_weight, state, *, num_key_heads: int,
         eps: float, mask=None, backend: str, init_value: Optional[float] = None):
    """One decode token from the layer's input: x [B, 1, K], norm = (input norm weight [K], eps), in_proj = (w, scales,
    biases, bits, group_size) of the fused projection [qkv | z | b | a]; the rest as deltanet_step takes them.
    -> (out [B, 1, Hv*Dv], conv state, state, proj [B, 1, PW]) or None if not applicable."""
    if norm is None or in_proj is None:
        return None
    args = (conv_weight, conv_state, A_log, dt_bias, norm_weight, state)
    launch = _launch(x, norm, in_proj, args, num_key_heads, eps, mask)
    if launch is None:
        return None
    template, grid, group, Hv, Dv, Dk, PW = launch
    B = x.shape[0]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    inputs = [x, *in_proj[:3], norm[0], conv_weight, conv_state, A_log, dt_bias, norm_weight, state,
              kernels.placeholder(mx.bool_) if mask is None else mask, kernels.sync_counters(in_proj[0])]
    shapes = [(B, 1, Hv * Dv), conv_state.shape, (B, Hv, Dv, Dk), (B, 1, PW)]
    return tuple(kernels.call("deltanet_chain", backend, inputs, template, grid, group, shapes,
                              [x.dtype, x.dtype, mx.float32, x.dtype], init_value))


def _instances() -> list[kernels.Instance]:
    """The 35B-A3B layer (2048 -> 12,352, group 64) and the embedded models' heads, at decode row buckets; the test
    shapes in float32 and bf16."""
    f32, bf16 = mx.float32, mx.bfloat16
    insts = [instance(t, bf16, t, M, 2048, 4, 64, (t, f32, t, t), *heads, 4, masked, 1e-6, 1e-6)
             for heads in ds.MODEL_HEADS for M in (1, 2, 4, 8) for t in (bf16, f32) for masked in (False, True)]
    insts += [instance(t, bf16, t, M, K, b, g, (t, f32, t, t), *heads, 4, False, 1e-6, 1e-5)
              for heads in ds.TEST_HEADS[:2] for M in (1, 4) for t in (bf16, f32) for K, b, g in ((96, 4, 32), (256, 8, 64))]
    return kernels.unique_instances(insts, key=kernels.source_key)


SPEC = kernels.register_spec(kernels.KernelSpec(
    name="deltanet_chain", body="deltanet_chain.inc",
    input_names=("x", "w", "scales", "biases", "nw") + ds.SPEC.input_names[1:] + ("sync",),
    output_names=ds.SPEC.output_names + ("proj",), template_params=SPEC_PARAMS,
    description="a Gated DeltaNet decode token in one launch: input norm, fused projection, the step",
    instances=_instances, defines=("LILY_CHAIN",),
))


def _dispatch(*args, **kwargs):
    from . import backend

    out = step(*args, **kwargs, backend=backend())
    return None if out is None else out[:3]


# Opt-in until its cuda tests and the decode step's timing have run on the H200.
register_kernel("deltanet_chain", SPEC.description, _dispatch, default_on=False)
