"""moe_chain: a decode step's whole MoE block in one launch (kernels/moe_chain.inc, CUDA and Metal): the router's
logits, moe_gate_up's body and moe_down_combine's body as three phases of one grid, ordered through counters in
device memory. A decode step is bound by MLX's CPU cost per launch (H200: ~12.8 us for each of its 247 primitives,
BENCHMARKS.md); this takes the router's and the down step's launches out of every layer (80 of the 247 at the
35B-A3B shape) and leaves the GPU's work as the separate kernels do it, the router computed once. The down phase routes
each token again from the logits (each gate/up job does too), so its weight loads go out before h is written.

Each launch gets its own counters (`kernels.sync_counters`), int32 zeros that it leaves zero again. Switch
"moe_chain", on by default on CUDA at one row and in MTP's 2-token verify (ops.chain_takes), opt-in on Metal.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from . import enabled, kernels, metal_source, moe, register_kernel, register_switch

SPEC_PARAMS = moe.GATE_UP_PARAMS + ("DLANES", "DRPS", "RBITS", "RGS", "RROWS", "PF")
# H100 run 36 (ncu): moe_chain reads 16.5 MB a layer in 39.7 us (0.42 TB/s), its phases waiting on one another.
# With chain_prefetch, phase 1 asks the L2 for the down weights phase 2 will read (kernels/moe_chain.inc, PF); the
# DeltaNet and attention chains take the same switch (their state, cache and output projection).
register_switch("chain_prefetch", "decode chains: a later phase's weights asked into L2 while an earlier phase runs",
                default_on=False)


def router_rows_in_flight(H: int, router_bits: int) -> int:
    """Router rows a warp computes at once (lily_router_rows' RR): up to 4 rows' 16-byte chunks a lane."""
    chunks_per_lane = -(-(H * router_bits // 128) // 32)
    return 1 if chunks_per_lane >= 4 else 4 // chunks_per_lane


def plan(M: int, K: int, H: int, I: int, IS: int, LS: int, bits: int, router_bits: int, rps: Optional[int] = None,
         warps: Optional[int] = None) -> dict:
    """One block size for the three phases (moe_gate_up's plan; `rps` and `warps` forced by tests), moe_down_combine's
    rows planned for it, and the router's rows per block: a warp's rows in flight, once."""
    gate_up = moe.plan_gate_up(M, K, H, I, IS, bits, rps, warps)
    warps = gate_up["WARPS"]
    down = moe.plan_down(M, K, H, I, IS, bits, warps=warps)
    rrows = warps * router_rows_in_flight(H, router_bits)
    return {"gate_up": gate_up, "down": down, "WARPS": warps, "RROWS": rrows,
            "blocks": M * -(-LS // rrows) + gate_up["blocks"] + down["blocks"]}


def shared_bytes(K: int, H: int, I: int, IS: int, bits: int, warps: int) -> int:
    """moe_chain.inc's threadgroup memory: staged floats, their chunk sums, the norm's scratch, the ticket."""
    floats = max(H, K * I + IS)
    return 4 * (floats + floats // (128 // bits) + warps + 1)


def unsupported(x, norm, router, gate, up, down, shared_gate, shared_up, shared_down, top_k: int, group_size: int,
                bits: int) -> Optional[str]:
    """Why moe_chain does not apply (None when it does): every check of the kernels whose bodies it runs."""
    if norm is None:
        return "no norm: the chained block stages the post-attention RMSNorm's output"
    E, I, IS = gate[0].shape[0], gate[0].shape[1], shared_gate[0].shape[0]
    why = moe.unsupported_router(x, router, E)
    if why:
        return why
    lead, H = x.shape[:-1], x.shape[-1]
    logits = kernels.Shaped((*lead, router[0].shape[0]), x.dtype)
    why = moe.unsupported_gate_up(x, norm, logits, gate, up, shared_gate, shared_up, top_k, group_size, bits)
    if why:
        return why
    parts = moe._packed_parts(lead, top_k, I, IS)
    why = moe.unsupported_down(*parts, logits, down, shared_down, x, group_size, bits)
    if why:
        return why
    p = plan(x.size // H, top_k, H, I, IS, logits.shape[-1], bits, router[3])
    if p["down"]["inflight"] > moe.MAX_INFLIGHT:
        return f"more than {moe.MAX_INFLIGHT} weight chunks in flight per lane at {p['WARPS']} warps"
    if shared_bytes(top_k, H, I, IS, bits, p["WARPS"]) > metal_source.THREADGROUP_BYTES:
        return f"over Metal's {metal_source.THREADGROUP_BYTES} bytes of threadgroup memory"
    return None


def instance(x_dtype, scale_dtype, M, K, E, H, I, IS, bits, group_size, router_bits, router_group, *, norm_dtype=None,
             eps=1e-6, normalize=True, router_scale_dtype=mx.bfloat16, p: Optional[dict] = None,
             prefetch: bool = False) -> kernels.Instance:
    LS = E + 1
    p = p or plan(M, K, H, I, IS, LS, bits, router_bits)
    gate_up = moe.gate_up_instance(x_dtype, scale_dtype, M, K, E, H, I, IS, bits, group_size,
                                   norm_dtype=norm_dtype or x_dtype, eps=eps, LS=LS, normalize=normalize,
                                   plan=p["gate_up"])
    down = moe.down_instance(x_dtype, scale_dtype, M, K, E, H, I, IS, bits, group_size, LS=LS, plan=p["down"])
    template = gate_up.template + (("DLANES", p["down"]["LANES"]), ("DRPS", p["down"]["RPS"]), ("RBITS", router_bits),
                                   ("RGS", router_group), ("RROWS", p["RROWS"]), ("PF", int(prefetch)))
    router = ((mx.uint32, (LS, H * router_bits // 32)), (router_scale_dtype, (LS, H // router_group)),
              (router_scale_dtype, (LS, H // router_group)))
    inputs = gate_up.inputs[:2] + router + gate_up.inputs[3:] + down.inputs[5:11] + ((mx.int32, (kernels.SYNC_SLOTS,)),)
    return kernels.Instance(template, inputs, (x_dtype, x_dtype, mx.float32))


_LAUNCH: dict = {}  # argument signature -> (template, grid, threadgroup, LS, packed width), or None


def _launch(x, norm, router, gate, up, down, shared_gate, shared_up, shared_down, top_k, normalize, group_size, bits):
    key = (moe._signature(x, *router[:3], *gate, *up, *down, *shared_gate, *shared_up, *shared_down), router[3:],
           None if norm is None else (norm[0].shape, norm[0].dtype, norm[1]), top_k, normalize, group_size, bits,
           enabled("chain_prefetch"))
    hit = _LAUNCH.get(key, False)
    if hit is not False:
        return hit
    launch = None
    if unsupported(x, norm, router, gate, up, down, shared_gate, shared_up, shared_down, top_k, group_size,
                   bits) is None:
        H, K = x.shape[-1], top_k
        M, (E, I, _), IS = x.size // H, gate[0].shape, shared_gate[0].shape[0]
        LS = router[0].shape[0]
        p = plan(M, K, H, I, IS, LS, bits, router[3])
        inst = instance(x.dtype, gate[1].dtype, M, K, E, H, I, IS, bits, group_size, router[3], router[4],
                        norm_dtype=norm[0].dtype, eps=norm[1], normalize=normalize, router_scale_dtype=router[1].dtype,
                        p=p, prefetch=key[-1])
        threads = 32 * p["WARPS"]
        launch = (list(inst.template), (p["blocks"] * threads, 1, 1), (threads, 1, 1), LS, moe.packed_width(K, I, IS))
    _LAUNCH[key] = launch
    return launch


def chain(x, norm, router, gate, up, down, shared_gate, shared_up, shared_down, *, top_k: int, normalize: bool,
          group_size: int, bits: int, backend: str, init_value: Optional[float] = None):
    """x + MoE(rmsnorm(x)) as ops.moe_decode computes it, from the quantized router itself: router = (w [E + 1,
    H*b/32], scales, biases, b, group), the shared-expert gate's row last. -> (y [..., H], logits [..., E + 1] in x's
    dtype, packed [..., moe.packed_width(k, I, Is)] float32: h, hs, ids, weights), or None if not applicable."""
    launch = _launch(x, norm, router, gate, up, down, shared_gate, shared_up, shared_down, top_k, normalize,
                     group_size, bits)
    if launch is None:
        return None
    template, grid, group, LS, width = launch
    lead = x.shape[:-1]
    inputs = [x, norm[0], *router[:3], *gate, *up, *shared_gate, *shared_up, *down, *shared_down,
              kernels.sync_counters()]
    return tuple(kernels.call("moe_chain", backend, inputs, template, grid, group,
                              [x.shape, (*lead, LS), (*lead, width)], [x.dtype, x.dtype, mx.float32], init_value))


def _instances() -> list[kernels.Instance]:
    """The model's (8-bit router, group 64) and the test shapes' (4- and 8-bit routers); chain_prefetch's at every
    shape for one token in bf16."""
    insts = []
    for (x_dt, scale_dt, M, K, E, H, I, IS, bits, gs) in moe._combos():
        if H % 64 == 0:
            for prefetch in (False, True) if M == 1 and x_dt == mx.bfloat16 else (False,):
                insts.append(instance(x_dt, scale_dt, M, K, E, H, I, IS, bits, gs, 8, 64, normalize=K != 3,
                                      prefetch=prefetch))
        if H % 32 == 0:
            insts.append(instance(x_dt, scale_dt, M, K, E, H, I, IS, bits, gs, 4, 32, normalize=K != 3))
    return kernels.unique_instances(insts, key=kernels.source_key)


# Under LILY_CHAIN_TRACE the records took 128 registers a lane (4 blocks an SM, so phase 1 ran in two waves) where the
# default build takes 96 (5 an SM, one wave): the trace's build is capped there, so its waves are the default's.
TRACE_REGISTERS = 96


def _register_cap(template: dict) -> int:
    return TRACE_REGISTERS if kernels.chain_trace_blocks() else 0


SPEC = kernels.register_spec(kernels.KernelSpec(
    name="moe_chain", body="moe_chain.inc",
    input_names=("x", "nw", "wr", "sr", "br") + moe.GATE_UP_SPEC.input_names[3:] + moe.DOWN_SPEC.input_names[5:11]
    + ("sync",),
    output_names=("y", "logits", "packed"), template_params=SPEC_PARAMS,
    description="a decode step's MoE block in one launch: router, routed and shared gate/up, down, combine, residual",
    instances=_instances, defines=("LILY_MOE_PACKED", "LILY_CHAIN"),
    weights=moe.ROUTER_WEIGHTS + moe.GATE_UP_WEIGHTS + moe.DOWN_WEIGHTS,
    bundle=("nw", "wr", "wg", "wu", "swg", "swu", "wd", "swd"), cuda_max_registers=_register_cap,
))


def _dispatch(x, *args, **kwargs):
    from . import backend, chain_takes

    out = chain(x, *args, **kwargs, backend=backend()) if chain_takes("moe_chain", x) else None
    return None if out is None else out[0]


# On by default on CUDA at one row (and a 2-token verify), opt-in on Metal (compile-checked only): see ops.chain_takes.
register_kernel("moe_chain", SPEC.description, _dispatch, default_on="cuda")
