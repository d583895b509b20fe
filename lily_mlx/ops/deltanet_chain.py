"""deltanet_chain: a Gated DeltaNet layer's decode token in one launch (kernels/deltanet_chain.inc, CUDA and Metal):
qmv's body (input RMSNorm + the fused projection [qkv | z | b | a]) and deltanet_step's body as two phases of one
grid, ordered through the launch's counters (`kernels.sync_counters`) as moe_chain orders its three. Variant
deltanet_chain_out adds a third phase, qmv's body again for the output projection and the residual add, so the
layer's whole mixer half is one launch. One or two launches fewer in each of the 30 DeltaNet layers of a decode
step, the GPU's work unchanged.

Switch "deltanet_chain_out", on by default on CUDA at one row and in MTP's 2-token verify (ops.chain_takes), opt-in
on Metal; "deltanet_chain" opt-in.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from . import deltanet_step as ds
from . import enabled, kernels, metal_source, qmv, register_kernel

_QMV_PARAMS = ds.SPEC_PARAMS + ("QTN", "BITS", "GS", "M", "K", "LANES", "RPS", "QEPS_BITS")
SPEC_PARAMS = _QMV_PARAMS + ("PF",)  # PF: switch chain_prefetch (ops/moe_chain.py), the later phases' reads in L2
OUT_PARAMS = _QMV_PARAMS + ("OBITS", "OGS", "OK", "OLANES", "ORPS", "PF")


def plan(M: int, K: int, PW: int, bits: int, Dk: int, Dv: int, out: Optional[tuple] = None,
         sms: Optional[int] = None) -> dict:
    """deltanet_step's block (its WARPS) for every phase, the projections' rows planned for it. out: (K, N, bits) of
    the output projection (deltanet_chain_out); sms: the GPU's multiprocessors, each holding one block (512 threads
    under the 512-thread launch bound's 128 registers), so that the input projection fits one wave of them.
    $LILY_MLX_PLAN's deltanet_chain.IN_RPS / OUT_RPS set the projections' rows a lane segment instead."""
    step, override = ds.plan(Dk, Dv), kernels.plan_overrides().get("deltanet_chain", {})
    p = {"step": step, "qmv": qmv.plan_chained(M, K, PW, bits, step["WARPS"], wave=sms, rps=override.get("IN_RPS")),
         "WARPS": step["WARPS"]}
    p["proj_blocks"] = p["qmv"]["blocks"]
    if out is not None:
        p["out"] = qmv.plan_chained(M, *out, step["WARPS"], rps=override.get("OUT_RPS"))
    return p


def shared_bytes(M: int, K: int, Dk: int, Dv: int, warps: int, bits: int) -> int:
    """deltanet_chain.inc's threadgroup memory: qmv's x tile and chunk sums (K: the larger projection input), its norm
    scratch, the step's vectors."""
    tile = M * min(K, qmv.XBUDGET // M)  # at most XBUDGET floats (qmv.plan's tile)
    return 4 * (tile + tile * bits // 128 + M * warps + 2 * Dk + 2 * Dv + 1)


def unsupported(x, norm, in_proj, conv_weight, conv_state, A_log, dt_bias, norm_weight, state, num_key_heads: int,
                eps: float, mask=None, out_proj=None, residual=None, alt=None) -> Optional[str]:
    """Why deltanet_chain (with out_proj and residual: deltanet_chain_out) does not apply (None when it does): the
    checks of qmv (normed input; residual output) and deltanet_step."""
    if norm is None or in_proj is None:
        return "the chained step needs the input norm and the quantized fused projection"
    why, proj = qmv.unsupported_chain_input(x, norm, in_proj, ds.MAX_TOKENS)
    if why:
        return why
    (B, L, _), bits = proj.shape, in_proj[3]
    why = ds.unsupported(proj, conv_weight, conv_state, A_log, dt_bias, norm_weight, state, num_key_heads, eps, mask,
                         alt)
    if why:
        return why
    Hk, Hv, Dk, Dv, _ = ds.split_heads(proj, conv_weight, A_log, norm_weight.shape[0], num_key_heads)
    K = x.shape[-1]
    if out_proj is not None:
        wo, so, bo, obits, ogs = out_proj
        out = kernels.Shaped((B, L, Hv * Dv), x.dtype)
        why = qmv.unsupported(out, wo, so, bo, ogs, obits, residual=residual)
        if why:
            return f"output projection: {why}"
        K = max(K, Hv * Dv)
    M = kernels.row_bucket(B * L)
    if shared_bytes(M, K, Dk, Dv, ds.plan(Dk, Dv)["WARPS"], bits) > metal_source.THREADGROUP_BYTES:
        return f"over Metal's {metal_source.THREADGROUP_BYTES} bytes of threadgroup memory"
    return None


def instance(dtype, scale_dtype, norm_in_dtype, M: int, K: int, bits: int, group_size: int, step_dtypes, Hk: int,
             Hv: int, Dk: int, Dv: int, W: int, masked: bool, eps: float, eps_in: float,
             out: Optional[tuple] = None, p: Optional[dict] = None, prefetch: bool = False,
             keep: bool = False, alt: bool = False) -> kernels.Instance:
    """step_dtypes: deltanet_step's (conv weight, A_log, dt_bias, gated norm weight) dtypes; out: (H, bits, group,
    scale dtype) of the output projection [H, Hv*Dv] (deltanet_chain_out); p: plan()'s, when the caller has it;
    prefetch: chain_prefetch's L2 hints (PF); keep: deltanet_step's KEEP; alt: an instance of the _alt variant."""
    PW = 2 * Hk * Dk + 2 * Hv * Dv + 2 * Hv
    p = p or plan(M, K, PW, bits, Dk, Dv, None if out is None else (Hv * Dv, out[0], out[1]))
    step = ds.instance(dtype, *step_dtypes, M, Hk, Hv, Dk, Dv, W, masked, eps, p["step"], keep, alt)
    template = step.template + (("QTN", norm_in_dtype), ("BITS", bits), ("GS", group_size), ("M", M), ("K", K),
                                ("LANES", p["qmv"]["LANES"]), ("RPS", p["qmv"]["RPS"]),
                                ("QEPS_BITS", kernels.float_bits(eps_in)))
    inputs = ((dtype, (M, 1, K)), (mx.uint32, (PW, K * bits // 32)), (scale_dtype, (PW, K // group_size)),
              (scale_dtype, (PW, K // group_size)), (norm_in_dtype, (K,))) + step.inputs[1:]
    outputs = step.output_dtypes + (dtype,)
    if out is not None:
        H, obits, ogs, oscale = out
        template += (("OBITS", obits), ("OGS", ogs), ("OK", Hv * Dv), ("OLANES", p["out"]["LANES"]),
                     ("ORPS", p["out"]["RPS"]))
        inputs += ((mx.uint32, (H, Hv * Dv * obits // 32)), (oscale, (H, Hv * Dv // ogs)), (oscale, (H, Hv * Dv // ogs)),
                   (dtype, (M, 1, H)))
        outputs += (dtype,)
    template += (("PF", int(prefetch)),)
    return kernels.Instance(template, inputs + ((mx.int32, (kernels.SYNC_SLOTS,)),), outputs)


_LAUNCH: dict = {}  # argument signature -> (template, grid, threadgroup, Hv, Dv, Dk, PW) or None


def _launch(x, norm, in_proj, args, num_key_heads, eps, mask, out_proj, residual, keep=False, alt=None):
    key = (tuple((a.shape, a.dtype) for a in (x, norm[0], *in_proj[:3], *args) if a is not None),
           in_proj[3:], norm[1], args[-1] is None, num_key_heads, eps, None if mask is None else mask.shape,
           None if out_proj is None else (tuple((a.shape, a.dtype) for a in (*out_proj[:3], residual)), out_proj[3:]),
           keep, None if alt is None else tuple((a.shape, a.dtype) for a in alt), kernels.sm_count(),
           enabled("chain_prefetch"))
    hit = _LAUNCH.get(key, False)
    if hit is not False:
        return hit
    launch = None
    if unsupported(x, norm, in_proj, *args, num_key_heads, eps, mask, out_proj, residual, alt) is None:
        conv_weight, conv_state, A_log, dt_bias, norm_weight, _ = args
        w, scales, _, bits, group_size = in_proj
        PW, K = w.shape[0], x.shape[-1]
        Hk, Hv, Dk, Dv, _ = ds.split_heads(kernels.Shaped((1, 1, PW), x.dtype), conv_weight, A_log,
                                           norm_weight.shape[0], num_key_heads)
        M = kernels.row_bucket(x.shape[0] * x.shape[1])
        out = None if out_proj is None else (out_proj[0].shape[0], out_proj[3], out_proj[4], out_proj[1].dtype)
        p = plan(M, K, PW, bits, Dk, Dv, None if out is None else (Hv * Dv, out[0], out[1]), key[-2])
        inst = instance(x.dtype, scales.dtype, norm[0].dtype, M, K, bits, group_size,
                        (conv_weight.dtype, A_log.dtype, dt_bias.dtype, norm_weight.dtype), Hk, Hv, Dk, Dv,
                        conv_weight.shape[1], mask is not None, eps, norm[1], out, p, prefetch=key[-1], keep=keep,
                        alt=alt is not None)
        threads = 32 * p["WARPS"]
        blocks = p["proj_blocks"] + x.shape[0] * Hv + (0 if out is None else p["out"]["blocks"])
        launch = (list(inst.template), (blocks * threads, 1, 1), (threads, 1, 1), Hv, Dv, Dk, PW)
    _LAUNCH[key] = launch
    return launch


def step(x, norm, in_proj, conv_weight, conv_state, A_log, dt_bias, norm_weight, state, *, num_key_heads: int,
         eps: float, mask=None, out_proj=None, residual=None, backend: str, init_value: Optional[float] = None,
         keep: bool = False, alt: Optional[tuple] = None):
    """Decode tokens from the layer's input: x [B, T, K] (T: 1, or a speculative verify's few), norm = (input norm
    weight [K], eps), in_proj = (w, scales, biases, bits, group_size) of the fused projection [qkv | z | b | a]; the
    rest as deltanet_step takes them. -> (out [B, T, Hv*Dv], conv state, state, proj [B, T, PW]), and with out_proj
    (the output projection [H, Hv*Dv] as in_proj) and residual [B, T, H] also h = residual + out_proj(out) last
    (deltanet_chain_out); None if not applicable. keep (T >= 2): the conv state and state after all but the last
    token follow (deltanet_step's KEEP); alt: the pair picked on the GPU (deltanet_step's)."""
    if norm is None or in_proj is None or (out_proj is None) != (residual is None):
        return None
    args = (conv_weight, conv_state, A_log, dt_bias, norm_weight, state)
    launch = _launch(x, norm, in_proj, args, num_key_heads, eps, mask, out_proj, residual, keep, alt)
    if launch is None:
        return None
    template, grid, group, Hv, Dv, Dk, PW = launch
    B = x.shape[0]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    inputs = [x, *in_proj[:3], norm[0], conv_weight, conv_state, A_log, dt_bias, norm_weight, state,
              kernels.placeholder(mx.bool_) if mask is None else mask, *(alt or ())]
    L = x.shape[1]
    shapes = [(B, L, Hv * Dv), ds.kept_shape(conv_state.shape, keep), ds.kept_shape((B, Hv, Dv, Dk), keep), (B, L, PW)]
    dtypes = [x.dtype, x.dtype, mx.float32, x.dtype]
    name = "deltanet_chain"
    if out_proj is not None:
        name, inputs = "deltanet_chain_out", inputs + [*out_proj[:3], residual]
        shapes.append(residual.shape)
        dtypes.append(x.dtype)
    inputs.append(kernels.sync_counters())
    out = kernels.call(ds.variant(name, alt), backend, inputs, template, grid, group, shapes, dtypes, init_value)
    return ds.split_kept(out, 1, keep)


def _out_weight(out: bool, H: int, bits: int, heads: tuple) -> Optional[tuple]:
    """With out (deltanet_chain_out), the output projection [H, Hv*Dv] of an instance: group 64 where Hv*Dv allows
    it, else 32."""
    return (H, bits, 64 if heads[1] * heads[3] % 64 == 0 else 32, mx.bfloat16) if out else None


def _instances(out: bool) -> list[kernels.Instance]:
    """The 35B-A3B layer (2048 -> 12,352, group 64; output 4096 -> 2048) and the embedded models' heads, at decode
    row buckets; the test shapes in float32 and bf16."""
    f32, bf16 = mx.float32, mx.bfloat16
    insts = [instance(t, bf16, t, M, 2048, 4, 64, (t, f32, t, t), *heads, 4, masked, 1e-6, 1e-6,
                      _out_weight(out, 2048, 4, heads))
             for heads in ds.MODEL_HEADS for M in (1, 2, 4, 8) for t in (bf16, f32) for masked in (False, True)]
    insts += [instance(bf16, bf16, bf16, 1, 2048, 4, 64, (bf16, f32, bf16, bf16), *heads, 4, False, 1e-6, 1e-6,
                       _out_weight(out, 2048, 4, heads), prefetch=True) for heads in ds.MODEL_HEADS]  # chain_prefetch's
    insts += [instance(t, bf16, t, M, K, b, g, (t, f32, t, t), *heads, 4, False, 1e-6, 1e-5,
                       _out_weight(out, K, b, heads))
              for heads in ds.TEST_HEADS[:2] for M in (1, 4) for t in (bf16, f32) for K, b, g in ((96, 4, 32), (256, 8, 64))
              if not out or heads[1] * heads[3] % 32 == 0]
    # KEEP: MTP's 2-token verify of the 35B layer, and the emulated test's case
    insts += [instance(bf16, bf16, bf16, 2, 2048, 4, 64, (bf16, f32, bf16, bf16), *ds.MODEL_HEADS[0], 4, False, 1e-6,
                       1e-6, _out_weight(out, 2048, 4, ds.MODEL_HEADS[0]), keep=True),
              instance(bf16, bf16, bf16, 8, 96, 4, 32, (bf16, f32, bf16, bf16), 1, 3, 64, 32, 4, False, 1e-6, 1e-6,
                       _out_weight(out, 96, 4, (1, 3, 64, 32)), keep=True)]
    return kernels.unique_instances(insts, key=kernels.source_key)


def _alt_instances(out: bool) -> list[kernels.Instance]:
    """The _alt variants': MTP's 2-token verify of the 35B layer and of the embedded model, and the emulated test's
    case, each with KEEP."""
    f32, bf16 = mx.float32, mx.bfloat16
    insts = [instance(bf16, bf16, bf16, 2, 2048, 4, 64, (bf16, f32, bf16, bf16), *heads, 4, False, 1e-6, 1e-6,
                      _out_weight(out, 2048, 4, heads), keep=True, alt=True) for heads in ds.MODEL_HEADS[:2]]
    insts.append(instance(bf16, bf16, bf16, 8, 96, 4, 32, (bf16, f32, bf16, bf16), 1, 3, 64, 32, 4, False, 1e-6, 1e-6,
                          _out_weight(out, 96, 4, (1, 3, 64, 32)), keep=True, alt=True))
    return kernels.unique_instances(insts, key=kernels.source_key)


_BUNDLE = ("w", "nw", "conv_weight", "A_log", "dt_bias", "norm_weight")  # the layer's constants, ahead of the step


def _register_cap(template: dict) -> int:
    """A 512-thread block's full 128 registers from M = 4 rows on. Bounded by its threads alone, ptxas chose 64 for the
    35B instance at M = 4 (1,648 bytes spilled): 242 us a call on the H100 (run 80), 74.9 capped (run 81). At M = 2 it
    chose 128 itself, and the cap's build was slower (54.8 us against 48.5); the one-row build keeps no cap either."""
    return 0 if template["M"] <= 2 else kernels.SM_REGISTERS // (32 * ds.MAX_WARPS)


SPEC = kernels.register_spec(kernels.KernelSpec(
    name="deltanet_chain", body="deltanet_chain.inc",
    input_names=("x", "w", "scales", "biases", "nw") + ds.SPEC.input_names[1:] + ("sync",),
    output_names=ds.SPEC.output_names + ("proj",), template_params=SPEC_PARAMS,
    description="a Gated DeltaNet decode token in one launch: input norm, fused projection, the step",
    instances=lambda: _instances(False), defines=("LILY_CHAIN",),
    cuda_launch_bounds=(32 * ds.MAX_WARPS,), cuda_max_registers=_register_cap, weights=(("w", "scales", "biases"),),
    bundle=_BUNDLE,
))
OUT_SPEC = kernels.register_spec(kernels.KernelSpec(
    name="deltanet_chain_out", body="deltanet_chain.inc",
    input_names=SPEC.input_names[:-1] + ("wo", "so", "bo", "res", "sync"),
    output_names=SPEC.output_names + ("h",), template_params=OUT_PARAMS,
    description="a Gated DeltaNet layer's mixer half in one launch: deltanet_chain, then the output projection and "
                "the residual add",
    instances=lambda: _instances(True), defines=("LILY_CHAIN", "LILY_CHAIN_OUT"),
    cuda_launch_bounds=(32 * ds.MAX_WARPS,), cuda_max_registers=_register_cap,
    weights=(("w", "scales", "biases"), ("wo", "so", "bo")), bundle=_BUNDLE + ("wo",),
))
ALT_SPEC = ds.alt_spec(SPEC, lambda: _alt_instances(False))
OUT_ALT_SPEC = ds.alt_spec(OUT_SPEC, lambda: _alt_instances(True))


def _dispatch(x, *args, keep: bool = False, **kwargs):
    from . import backend, chain_takes

    out = step(x, *args, **kwargs, keep=keep, backend=backend()) if chain_takes("deltanet_chain", x) else None
    return None if out is None else out[:3] + (out[-2:] if keep else ())


def _dispatch_out(x, *args, keep: bool = False, **kwargs):
    from . import backend, chain_takes

    out = step(x, *args, **kwargs, keep=keep, backend=backend()) if chain_takes("deltanet_chain_out", x) else None
    return None if out is None else (out[4], out[1], out[2]) + (out[-2:] if keep else ())


# deltanet_chain_out on by default on CUDA at one row (and a 2-token verify), opt-in on Metal (compile-checked only):
# see ops.chain_takes. deltanet_chain stays opt-in: deltanet_chain_out replaced it in every measured setup.
register_kernel("deltanet_chain", SPEC.description, _dispatch, default_on=False)
register_kernel("deltanet_chain_out", OUT_SPEC.description, _dispatch_out, default_on="cuda")
