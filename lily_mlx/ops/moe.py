"""The fused MoE decode path: two launches per MoE block for a few tokens (M <= 8).

moe_gate_up (kernels/moe_gate_up.inc): the router's top-k from its logits, the post-attention RMSNorm
of x, and silu(x Wg^T) * (x Wu^T) for each token's top-k experts and the shared expert; it also
writes the routing (ids, weights). moe_down_combine (kernels/moe_down_combine.inc): the down
projections, the routing-weighted sum, the sigmoid-gated shared expert (its gate logit is the router
logits' last column) and the residual add. Expert ids never leave the GPU. One body per kernel for
CUDA and Metal. This module plans launches, checks that a kernel applies (else the dispatcher runs
the unfused ops) and registers both switches (their cuda tests passed on the H200, 2026-12-02).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from . import gather_matmul, kernels, metal_source, quantized_matmul, reference, register_kernel

MAX_M = 8  # tokens; beyond this the weights are re-read per token and MLX's gather_qmm wins
MAX_K = 16
MAX_E = 1024  # routed experts: a lane holds E/32 logits during the top-k
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
X_DTYPES = (mx.float32, mx.bfloat16, mx.float16)
SCALE_DTYPES = (mx.float32, mx.bfloat16, mx.float16)
INDEX_DTYPES = (mx.int32, mx.uint32)  # moe_route's argpartition gives uint32
STAGE_BUDGET = 6144  # floats one block stages in shared memory (24 KB, under Metal's 32 KB)
MAX_INFLIGHT = 32  # 16-byte weight chunks a lane holds before computing (registers)
MIN_BLOCKS = 256  # fewer jobs than this: shrink the blocks so the GPU fills
GATE_UP_PARAMS = ("T", "TN", "BITS", "GS", "H", "I", "IS", "K", "E", "LS", "NORMTOPK", "NORM", "EPS_BITS",
                  "LANES", "RPS", "WARPS")
DOWN_PARAMS = ("T", "BITS", "GS", "H", "I", "IS", "K", "E", "LS", "LANES", "RPS", "WARPS")


def _lanes(*chunks: int) -> int:
    """Lanes per row: the largest power of two <= 32 dividing every row's 16-byte chunk count."""
    lanes = 32
    while lanes > 1 and any(c % lanes for c in chunks):
        lanes //= 2
    return lanes


def _shrink(blocks, rps: int, warps: int, min_warps: int = 4) -> tuple[int, int]:
    # Fewer rows per block until the GPU has MIN_BLOCKS jobs; keep >= 4 warps (x staging, qmv NOTES).
    while rps > 1 and blocks(rps, warps) < MIN_BLOCKS:
        rps //= 2
    while warps > min_warps and blocks(rps, warps) < MIN_BLOCKS:
        warps //= 2
    return rps, warps


def _overridden(kernel: str, rps: int, warps: int) -> tuple[int, int]:
    """(rps, warps), or $LILY_MLX_PLAN's for `kernel` where it sets them (kernels.plan_overrides)."""
    chosen = kernels.plan_overrides().get(kernel, {})
    return chosen.get("RPS", rps), chosen.get("WARPS", warps)


def plan_gate_up(M: int, K: int, H: int, I: int, IS: int, bits: int, rps: Optional[int] = None,
                 warps: Optional[int] = None) -> dict:
    """Launch shape; `rps` and `warps` given (tests) are taken as they are; else $LILY_MLX_PLAN's where it sets
    them (moe_chain's blocks follow this plan too)."""
    chunks = H * bits // 128
    lanes = _lanes(chunks)
    cpl, sub = chunks // lanes, 32 // lanes

    def blocks(r, w, m=M):
        rb = w * sub * r
        return m * K * -(-I // rb) + m * -(-IS // rb)

    if rps is None or warps is None:  # <= 8 chunks of gate + up in flight per lane
        # Sized for M's bucket, so all token counts of a bucket share one build (the grid follows M itself). 4-warp
        # blocks: at ~90 registers an SM holds five (20 warps) where it holds two of 8 warps (16), and the 35B shape's
        # 576 jobs fit one wave on 132 SMs, 288 of 8 warps two (H100: 14.4 -> 12.0 us a call, 2026-12-05).
        rps, warps = _overridden("moe_gate_up", *_shrink(lambda r, w: blocks(r, w, kernels.row_bucket(M)),
                                                         max(1, min(4, 4 // cpl)), 4))
    return {"LANES": lanes, "RPS": rps, "WARPS": warps, "blocks": blocks(rps, warps)}


def plan_down(M: int, K: int, H: int, I: int, IS: int, bits: int, rps: Optional[int] = None,
              warps: Optional[int] = None) -> dict:
    """Launch shape; `rps` and `warps` given (tests) are taken as they are; `warps` alone is kept (moe_chain's blocks
    are all one size) and the rows planned for it."""
    ci, cs = I * bits // 128, IS * bits // 128
    lanes = _lanes(ci, cs)
    per_row = K * (ci // lanes) + cs // lanes  # chunks in flight per lane per output row
    sub = 32 // lanes

    def blocks(r, w, m=M):
        return m * -(-H // (w * sub * r))

    if rps is None or warps is None:
        fixed = warps if rps is None else None
        rps, warps = _shrink(lambda r, w: blocks(r, w, kernels.row_bucket(M)), max(1, min(4, 16 // per_row)),
                             fixed or 8, fixed or 4)
        if fixed is None:  # moe_chain's phase keeps the chain's block
            rps, warps = _overridden("moe_down_combine", rps, warps)
    return {"LANES": lanes, "RPS": rps, "WARPS": warps, "blocks": blocks(rps, warps), "inflight": per_row * rps}


def _quant_shapes_ok(q, rows: int, K: int, bits: int, group_size: int, experts: Optional[int]) -> bool:
    """(w, scales, biases) of a [rows, K] weight, stacked over `experts` when given."""
    w, s, b = q
    lead = () if experts is None else (experts,)
    return (w.dtype == mx.uint32 and w.shape == (*lead, rows, K * bits // 32) and b is not None
            and s.shape == (*lead, rows, K // group_size) and b.shape == s.shape
            and s.dtype in SCALE_DTYPES and b.dtype in SCALE_DTYPES)


def _routing_ok(logits, lead, E: int, K: int, min_cols: int) -> Optional[str]:
    if logits.dtype not in X_DTYPES or logits.shape[:-1] != lead or logits.shape[-1] < min_cols:
        return f"logits: a float [..., >= {min_cols}] expected, got {logits.dtype} {logits.shape}"
    if not 1 <= K <= min(MAX_K, E) or E > MAX_E:
        return f"top-k {K} of {E} experts (kernel: k <= {MAX_K}, E <= {MAX_E})"
    return None


def unsupported_gate_up(x, norm, logits, gate, up, shared_gate, shared_up, top_k: int, group_size: int,
                        bits: int) -> Optional[str]:
    """Why moe_gate_up does not apply to these arguments (None when it does). norm: (weight [H], eps) or None."""
    if bits not in BITS:
        return f"bits={bits} (kernel has {BITS})"
    if group_size not in GROUP_SIZES:
        return f"group_size={group_size} (kernel has {GROUP_SIZES})"
    if x.dtype not in X_DTYPES:
        return "dtypes"
    if x.ndim < 1 or gate[0].ndim != 3 or shared_gate[0].ndim != 2:
        return "shapes"
    H, K = x.shape[-1], top_k
    E, I, IS = gate[0].shape[0], gate[0].shape[1], shared_gate[0].shape[0]
    why = _routing_ok(logits, x.shape[:-1], E, K, E)
    if why:
        return why
    if norm is not None and (norm[0].shape != (H,) or norm[0].dtype not in X_DTYPES or not norm[1] > 0):
        return "norm: weight [H] of a float dtype and eps > 0 expected"
    if H % group_size or not all(_quant_shapes_ok(q, I, H, bits, group_size, E) for q in (gate, up)):
        return "shapes"
    if not all(_quant_shapes_ok(q, IS, H, bits, group_size, None) for q in (shared_gate, shared_up)):
        return "shapes"
    scales = [a for q in (gate, up, shared_gate, shared_up) for a in q[1:]]
    if len({a.dtype for a in scales}) != 1:
        return "dtypes: the kernel picks expert or shared scales through one pointer type"
    if min(a.size for a in scales) < metal_source.MAX_CONSTANT_ARRAY_SIZE:
        return "shapes: scales this small are in Metal's constant address space"
    if x.size == 0 or x.size // H > MAX_M:
        return f"tokens {x.size // max(H, 1)} > {MAX_M}"
    if H > STAGE_BUDGET:
        return f"hidden size {H} > {STAGE_BUDGET} staged floats"
    return None


def unsupported_down(h, hs, inds, weights, logits, down, shared_down, residual, group_size: int,
                     bits: int) -> Optional[str]:
    """Why moe_down_combine does not apply to these arguments (None when it does)."""
    if bits not in BITS:
        return f"bits={bits} (kernel has {BITS})"
    if group_size not in GROUP_SIZES:
        return f"group_size={group_size} (kernel has {GROUP_SIZES})"
    floats = (mx.float32, mx.bfloat16, mx.float16)
    if residual.dtype not in X_DTYPES or inds.dtype not in INDEX_DTYPES or any(a.dtype not in floats for a in (h, hs, weights)):
        return "dtypes"
    if residual.ndim < 1 or inds.ndim < 1 or down[0].ndim != 3 or shared_down[0].ndim != 2:
        return "shapes"
    lead, H, K = residual.shape[:-1], residual.shape[-1], inds.shape[-1]
    E, I, IS = down[0].shape[0], h.shape[-1], hs.shape[-1]
    why = _routing_ok(logits, lead, E, K, E + 1)
    if why:
        return why
    if inds.shape[:-1] != lead or weights.shape != inds.shape or h.shape != (*lead, K, I) or hs.shape != (*lead, IS):
        return "shapes"
    if I % group_size or IS % group_size or not _quant_shapes_ok(down, H, I, bits, group_size, E):
        return "shapes"
    if not _quant_shapes_ok(shared_down, H, IS, bits, group_size, None):
        return "shapes"
    M = residual.size // max(H, 1)
    if residual.size == 0 or M > MAX_M:
        return f"tokens {M} > {MAX_M}"
    if K * I + IS > STAGE_BUDGET:
        return f"k*I + Is = {K * I + IS} > {STAGE_BUDGET} staged floats"
    if plan_down(M, K, H, I, IS, bits)["inflight"] > MAX_INFLIGHT:
        return f"more than {MAX_INFLIGHT} weight chunks in flight per lane"
    return None


def gate_up_instance(x_dtype, scale_dtype, M, K, E, H, I, IS, bits, group_size, *, norm_dtype=None, eps=1e-6,
                     logits_dtype=None, LS=None, normalize=True, plan: Optional[dict] = None) -> kernels.Instance:
    p = plan or plan_gate_up(M, K, H, I, IS, bits)
    LS = LS or E + 1
    nd = norm_dtype or x_dtype
    template = (("T", x_dtype), ("TN", nd), ("BITS", bits), ("GS", group_size), ("H", H), ("I", I), ("IS", IS),
                ("K", K), ("E", E), ("LS", LS), ("NORMTOPK", bool(normalize)),
                ("NORM", norm_dtype is not None), ("EPS_BITS", kernels.float_bits(eps) if norm_dtype is not None else 0),
                ("LANES", p["LANES"]), ("RPS", p["RPS"]), ("WARPS", p["WARPS"]))
    w, s = (mx.uint32, (E, I, H * bits // 32)), (scale_dtype, (E, I, H // group_size))
    sw, ss = (mx.uint32, (IS, H * bits // 32)), (scale_dtype, (IS, H // group_size))
    inputs = ((x_dtype, (M, H)), (nd, (H,) if norm_dtype is not None else (1,)), (logits_dtype or x_dtype, (M, LS)),
              w, s, s, w, s, s, sw, ss, ss, sw, ss, ss)
    return kernels.Instance(template, inputs, (mx.float32, mx.float32, mx.int32, mx.float32))


def down_instance(x_dtype, scale_dtype, M, K, E, H, I, IS, bits, group_size, *, h_dtype=mx.float32,
                  inds_dtype=mx.int32, logits_dtype=None, LS=None, plan: Optional[dict] = None) -> kernels.Instance:
    p = plan or plan_down(M, K, H, I, IS, bits)
    LS = LS or E + 1
    template = (("T", x_dtype), ("BITS", bits), ("GS", group_size), ("H", H), ("I", I), ("IS", IS), ("K", K),
                ("E", E), ("LS", LS), ("LANES", p["LANES"]), ("RPS", p["RPS"]), ("WARPS", p["WARPS"]))
    inputs = ((h_dtype, (M, K, I)), (h_dtype, (M, IS)), (inds_dtype, (M, K)), (mx.float32, (M, K)),
              (logits_dtype or x_dtype, (M, LS)), (mx.uint32, (E, H, I * bits // 32)),
              (scale_dtype, (E, H, I // group_size)), (scale_dtype, (E, H, I // group_size)),
              (mx.uint32, (H, IS * bits // 32)), (scale_dtype, (H, IS // group_size)),
              (scale_dtype, (H, IS // group_size)), (x_dtype, (M, H)))
    return kernels.Instance(template, inputs, (x_dtype,))


_LAUNCH: dict = {}  # argument signature -> launch tuple, or None (not applicable)


def _signature(*arrays) -> tuple:
    return tuple((a.shape, a.dtype) for a in arrays)


def _launch_gate_up(x, norm, logits, gate, up, shared_gate, shared_up, top_k, normalize, group_size, bits, plan):
    # Decode calls the same few shapes thousands of times: plan once per signature.
    key = ("gate_up", _signature(x, logits, *gate, *up, *shared_gate, *shared_up),
           None if norm is None else (norm[0].shape, norm[0].dtype, norm[1]), top_k, normalize, group_size, bits,
           None if plan is None else tuple(sorted(plan.items())))
    hit = _LAUNCH.get(key, False)
    if hit is not False:
        return hit
    launch = None
    if unsupported_gate_up(x, norm, logits, gate, up, shared_gate, shared_up, top_k, group_size, bits) is None:
        H, K = x.shape[-1], top_k
        M, (E, I, _), IS = x.size // H, gate[0].shape, shared_gate[0].shape[0]
        p = plan or plan_gate_up(M, K, H, I, IS, bits)
        inst = gate_up_instance(x.dtype, gate[1].dtype, M, K, E, H, I, IS, bits, group_size,
                                norm_dtype=None if norm is None else norm[0].dtype, eps=1e-6 if norm is None else norm[1],
                                logits_dtype=logits.dtype, LS=logits.shape[-1], normalize=normalize, plan=p)
        threads = 32 * p["WARPS"]
        launch = (list(inst.template), (p["blocks"] * threads, 1, 1), (threads, 1, 1), M, K, I, IS)
    _LAUNCH[key] = launch
    return launch


def packed_width(K: int, I: int, IS: int) -> int:
    """A token's row of moe_gate_up_packed's output: h (K * I), hs (IS), the ids as floats (K), weights (K)."""
    return K * I + IS + 2 * K


def gate_up(x, norm, logits, gate, up, shared_gate, shared_up, *, top_k: int, normalize: bool, group_size: int,
            bits: int, backend: str, init_value: Optional[float] = None, plan: Optional[dict] = None,
            packed: bool = False, router: Optional[tuple] = None):
    """x [..., H] (RMS-normalised by norm = (weight, eps) first unless None), router logits [..., >= E] ->
    (h [..., k, I], hs [..., Is], inds [..., k] int32, weights [..., k] float32), or with `packed` the four in
    one float32 [..., packed_width(k, I, Is)]; None if not applicable. With router = (w, scales, biases, bits,
    group_size) of the fused router [E + 1, H], the kernel computes the logits itself (`logits` unread, None) and
    returns them last, [..., E + 1] in x's dtype (moe_gate_up_routed)."""
    if router is not None:
        if unsupported_router(x, router, gate[0].shape[0]) is not None:
            return None
        logits = kernels.Shaped((*x.shape[:-1], router[0].shape[0]), x.dtype)  # what the kernel writes
    launch = _launch_gate_up(x, norm, logits, gate, up, shared_gate, shared_up, top_k, normalize, group_size, bits, plan)
    if launch is None:
        return None
    template, grid, group, M, K, I, IS = launch
    nw = kernels.placeholder(x.dtype) if norm is None else norm[0]
    lead = x.shape[:-1]
    if router is not None:
        wr, sr, br, rbits, rgs = router
        return tuple(kernels.call("moe_gate_up_routed", backend,
                                  [x, nw, wr, sr, br, *gate, *up, *shared_gate, *shared_up],
                                  template + [("RBITS", rbits), ("RGS", rgs)], grid, group,
                                  [(*lead, K, I), (*lead, IS), (*lead, K), (*lead, K), logits.shape],
                                  [mx.float32, mx.float32, mx.int32, mx.float32, x.dtype], init_value))
    inputs = [x, nw, logits, *gate, *up, *shared_gate, *shared_up]
    if packed:
        return kernels.call("moe_gate_up_packed", backend, inputs, template, grid, group,
                            [(*lead, packed_width(K, I, IS))], [mx.float32], init_value)[0]
    return tuple(kernels.call("moe_gate_up", backend, inputs, template, grid, group,
                              [(*lead, K, I), (*lead, IS), (*lead, K), (*lead, K)],
                              [mx.float32, mx.float32, mx.int32, mx.float32], init_value))


ROUTED_PARAMS = GATE_UP_PARAMS + ("RBITS", "RGS")
MAX_ROUTER_ROWS = 2048  # the token's logits sit in shared memory
SHARED_FLOATS = metal_source.THREADGROUP_BYTES // 4


def routed_instance(inst: kernels.Instance, router_bits: int, router_group: int, router_scale_dtype) -> kernels.Instance:
    """moe_gate_up_routed's instance from moe_gate_up's: the router's codes, scales and biases for the logits input,
    and the logits as a fifth output in x's dtype."""
    (x_dtype, (M, H)), (_, (_, LS)) = inst.inputs[0], inst.inputs[2]
    r = ((mx.uint32, (LS, H * router_bits // 32)), (router_scale_dtype, (LS, H // router_group)),
         (router_scale_dtype, (LS, H // router_group)))
    return kernels.Instance(inst.template + (("RBITS", router_bits), ("RGS", router_group)),
                            inst.inputs[:2] + r + inst.inputs[3:], inst.output_dtypes + (x_dtype,))


def unsupported_router(x, router, experts: int) -> Optional[str]:
    """Why moe_gate_up_routed cannot compute these router logits itself (None when it can). router: (w [LS,
    H*bits/32], scales, biases [LS, H/group], bits, group_size), the shared-expert gate's row last."""
    w, s, b, bits, group_size = router
    H = x.shape[-1]
    if bits not in BITS or group_size not in GROUP_SIZES or H % group_size or group_size % (128 // bits):
        return f"router bits={bits}, group_size={group_size} (kernel: bits {BITS}, groups {GROUP_SIZES})"
    LS = w.shape[0] if w.ndim == 2 else 0
    if not experts < LS <= MAX_ROUTER_ROWS or not _quant_shapes_ok((w, s, b), LS, H, bits, group_size, None):
        return f"router: [E + 1 <= rows <= {MAX_ROUTER_ROWS}, {H}] codes with scales and biases expected"
    if s.size < metal_source.MAX_CONSTANT_ARRAY_SIZE:
        return "shapes: scales this small are in Metal's constant address space"
    if H + H // 16 + 8 + LS > SHARED_FLOATS:  # staged x', its chunk sums (16 codes a chunk at most), the norm's scratch
        return f"router rows {LS} at hidden size {H}: over {SHARED_FLOATS} floats of threadgroup memory"
    return None


def _launch_down(h, hs, inds, weights, logits, down, shared_down, residual, group_size, bits, plan):
    key = ("down", _signature(h, hs, inds, weights, logits, *down, *shared_down, residual), group_size, bits,
           None if plan is None else tuple(sorted(plan.items())))
    hit = _LAUNCH.get(key, False)
    if hit is not False:
        return hit
    launch = None
    if unsupported_down(h, hs, inds, weights, logits, down, shared_down, residual, group_size, bits) is None:
        H, K, I, IS = residual.shape[-1], inds.shape[-1], h.shape[-1], hs.shape[-1]
        M, E = residual.size // H, down[0].shape[0]
        p = plan or plan_down(M, K, H, I, IS, bits)
        inst = down_instance(residual.dtype, down[1].dtype, M, K, E, H, I, IS, bits, group_size, h_dtype=h.dtype,
                             inds_dtype=inds.dtype, logits_dtype=logits.dtype, LS=logits.shape[-1], plan=p)
        threads = 32 * p["WARPS"]
        launch = (list(inst.template), (p["blocks"] * threads, 1, 1), (threads, 1, 1))
    _LAUNCH[key] = launch
    return launch


def down_combine(h, hs, inds, weights, logits, down, shared_down, residual, *, group_size: int, bits: int,
                 backend: str, init_value: Optional[float] = None, plan: Optional[dict] = None):
    """-> [..., H] in residual's dtype (see ops.moe_decode); None if not applicable."""
    launch = _launch_down(h, hs, inds, weights, logits, down, shared_down, residual, group_size, bits, plan)
    if launch is None:
        return None
    template, grid, group = launch
    inputs = [h, hs, inds, weights.astype(mx.float32), logits, *down, *shared_down, residual]
    (y,) = kernels.call("moe_down_combine", backend, inputs, template, grid, group, [residual.shape], [residual.dtype],
                        init_value)
    return y


def _packed_parts(lead: tuple, K: int, I: int, IS: int) -> tuple:
    """What a packed buffer holds, as down_combine's checks see its four inputs: h, hs, inds, weights."""
    return (kernels.Shaped((*lead, K, I), mx.float32), kernels.Shaped((*lead, IS), mx.float32),
            kernels.Shaped((*lead, K), mx.int32), kernels.Shaped((*lead, K), mx.float32))


def down_combine_packed(packed, logits, down, shared_down, residual, *, top_k: int, group_size: int, bits: int,
                        backend: str, init_value: Optional[float] = None, plan: Optional[dict] = None):
    """down_combine with h, hs, inds and weights read from gate_up(..., packed=True)'s one buffer; None if not
    applicable."""
    lead, K = residual.shape[:-1], top_k
    I, IS = down[0].shape[-1] * 32 // bits, shared_down[0].shape[-1] * 32 // bits
    if packed.dtype != mx.float32 or packed.shape != (*lead, packed_width(K, I, IS)):
        return None
    launch = _launch_down(*_packed_parts(lead, K, I, IS), logits, down, shared_down, residual, group_size, bits, plan)
    if launch is None:
        return None
    template, grid, group = launch
    return kernels.call("moe_down_combine_packed", backend, [packed, logits, *down, *shared_down, residual], template,
                        grid, group, [residual.shape], [residual.dtype], init_value)[0]


def decode_packed(x, norm, logits, gate, up, down, shared_gate, shared_up, shared_down, *, top_k: int, normalize: bool,
                  group_size: int, bits: int, backend: str) -> Optional[mx.array]:
    """ops.moe_decode through the packed pair (one output and one input where there were four), or None when
    either kernel does not apply (checked before anything is launched)."""
    q = {"group_size": group_size, "bits": bits}
    if _launch_gate_up(x, norm, logits, gate, up, shared_gate, shared_up, top_k, normalize, group_size, bits,
                       None) is None:
        return None
    parts = _packed_parts(x.shape[:-1], top_k, gate[0].shape[1], shared_gate[0].shape[0])
    if _launch_down(*parts, logits, down, shared_down, x, group_size, bits, None) is None:
        return None
    packed = gate_up(x, norm, logits, gate, up, shared_gate, shared_up, top_k=top_k, normalize=normalize,
                     backend=backend, packed=True, **q)
    return down_combine_packed(packed, logits, down, shared_down, x, top_k=top_k, backend=backend, **q)


def gate_up_unfused(x, inds, gate, up, shared_gate, shared_up, *, group_size: int, bits: int):
    """The ops SwitchGLU (unsorted gather) and MLP run: x [..., H] already normalised -> (h [..., k, I], hs [..., Is])."""
    q = {"group_size": group_size, "bits": bits}
    xe = mx.expand_dims(x, (-2, -3))  # [..., 1, 1, H]
    g = gather_matmul(xe, gate[0], inds, scales=gate[1], biases=gate[2], **q)  # [..., k, 1, I]
    u = gather_matmul(xe, up[0], inds, scales=up[1], biases=up[2], **q)
    hs = nn.silu(quantized_matmul(x, *shared_gate, **q)) * quantized_matmul(x, *shared_up, **q)  # [..., Is]
    return (nn.silu(g) * u).squeeze(-2), hs


def down_combine_unfused(h, hs, inds, scores, gate_logit, down, shared_down, residual, *, group_size: int, bits: int):
    """The ops SwitchGLU, SparseMoeBlock and the decoder layer's residual add run, in the same order."""
    q = {"group_size": group_size, "bits": bits}
    y = gather_matmul(mx.expand_dims(h, -2), down[0], inds, scales=down[1], biases=down[2], **q).squeeze(-2)  # [..., k, H]
    y = reference.weighted_top_k(y, scores, residual.dtype)
    y = y + mx.sigmoid(gate_logit) * quantized_matmul(hs, *shared_down, **q)
    return residual + y


# (E, H, I, Is, k) of Qwen3.5/3.6-35B-A3B's MoE, then small odd shapes (lanes 1/2/4/8/16/32, Is != I).
MODEL_SHAPES = ((256, 2048, 512, 512, 8),)
SMALL_SHAPES = ((5, 64, 32, 96, 2), (7, 96, 64, 32, 2), (5, 128, 64, 128, 2), (7, 2048, 64, 32, 2), (5, 256, 128, 256, 3))


def _combos():
    out = [(t, mx.bfloat16, M, k, E, H, I, IS, 4, 64) for (E, H, I, IS, k) in MODEL_SHAPES for M in (1, 2, 3, 4, 8)
           for t in ((mx.bfloat16, mx.float16, mx.float32) if M == 1 else (mx.bfloat16,))]
    out += [(t, mx.bfloat16, M, k, E, H, I, IS, b, g) for (E, H, I, IS, k) in SMALL_SHAPES for M in (1, 3)
            for t in (mx.float32, mx.bfloat16) for b in BITS for g in GROUP_SIZES
            if H % g == 0 and I % g == 0 and IS % g == 0]
    return out


def _gate_up_instances() -> list[kernels.Instance]:
    """The model (normed input, bf16 logits) and the test shapes, with and without the norm."""
    insts = [gate_up_instance(*c, norm_dtype=c[0]) for c in _combos()]
    insts += [gate_up_instance(*c, normalize=c[3] != 3) for c in _combos()]
    return kernels.unique_instances(insts, key=kernels.source_key)


def _down_instances() -> list[kernels.Instance]:
    insts = [down_instance(*c) for c in _combos()]
    insts.append(down_instance(mx.bfloat16, mx.bfloat16, 1, 8, 256, 2048, 512, 512, 4, 64, h_dtype=mx.bfloat16,
                               inds_dtype=mx.uint32))  # the unfused gate/up's h and moe_route's uint32 ids
    return kernels.unique_instances(insts, key=kernels.source_key)


# The quantized weights each kernel reads, as (codes, scales, biases) inputs: packable (ops/packing.py).
ROUTER_WEIGHTS = (("wr", "sr", "br"),)
GATE_UP_WEIGHTS = (("wg", "sg", "bg"), ("wu", "su", "bu"), ("swg", "ssg", "sbg"), ("swu", "ssu", "sbu"))
DOWN_WEIGHTS = (("wd", "sd", "bd"), ("swd", "ssd", "sbd"))
GATE_UP_SPEC = kernels.register_spec(kernels.KernelSpec(
    name="moe_gate_up", body="moe_gate_up.inc",
    input_names=("x", "nw", "logits", "wg", "sg", "bg", "wu", "su", "bu", "swg", "ssg", "sbg", "swu", "ssu", "sbu"),
    output_names=("h", "hs", "inds", "weights"), template_params=GATE_UP_PARAMS,
    description="fused MoE routing (top-k of the logits) + input RMSNorm + gate/up + SwiGLU of the top-k and "
                "shared experts, M <= 8 tokens (decode)",
    instances=_gate_up_instances, weights=GATE_UP_WEIGHTS,
))
DOWN_SPEC = kernels.register_spec(kernels.KernelSpec(
    name="moe_down_combine", body="moe_down_combine.inc",
    input_names=("h", "hs", "inds", "weights", "logits", "wd", "sd", "bd", "swd", "ssd", "sbd", "residual"),
    output_names=("y",), template_params=DOWN_PARAMS,
    description="fused MoE down projections + top-k combine + gated shared expert + residual, M <= 8 tokens (decode)",
    instances=_down_instances, weights=DOWN_WEIGHTS,
))


def _routed_instances() -> list[kernels.Instance]:
    """The model's (8-bit router, group 64) and the test shapes' (4- and 8-bit routers) routed builds."""
    insts = [routed_instance(gate_up_instance(*c, norm_dtype=c[0]), 8, 64, mx.bfloat16) for c in _combos()
             if c[5] % 64 == 0]
    insts += [routed_instance(gate_up_instance(*c, normalize=c[3] != 3), 4, 32, mx.bfloat16) for c in _combos()
              if c[5] % 32 == 0]
    return kernels.unique_instances(insts, key=kernels.source_key)


ROUTED_SPEC = kernels.register_spec(kernels.KernelSpec(
    name="moe_gate_up_routed", body="moe_gate_up.inc",
    input_names=("x", "nw", "wr", "sr", "br") + GATE_UP_SPEC.input_names[3:],
    output_names=GATE_UP_SPEC.output_names + ("logits",), template_params=ROUTED_PARAMS,
    description="moe_gate_up computing the router's logits itself (no router launch in a decode step)",
    instances=_routed_instances, defines=("LILY_MOE_ROUTER",), weights=ROUTER_WEIGHTS + GATE_UP_WEIGHTS,
))


def _packed(inst: kernels.Instance, down: bool) -> kernels.Instance:
    """The packed variant's instance: gate/up's four outputs, or down's first four inputs, as one float32 buffer."""
    if not down:
        return kernels.Instance(inst.template, inst.inputs, (mx.float32,))
    (_, (M, K, I)), (_, (_, IS)) = inst.inputs[0], inst.inputs[1]
    return kernels.Instance(inst.template, ((mx.float32, (M, packed_width(K, I, IS))),) + inst.inputs[4:],
                            inst.output_dtypes)


GATE_UP_PACKED_SPEC = kernels.register_spec(kernels.KernelSpec(
    name="moe_gate_up_packed", body="moe_gate_up.inc", input_names=GATE_UP_SPEC.input_names, output_names=("packed",),
    template_params=GATE_UP_PARAMS, description="moe_gate_up writing h, hs, ids and weights as one buffer",
    instances=lambda: kernels.unique_instances([_packed(i, False) for i in _gate_up_instances()], key=kernels.source_key),
    defines=("LILY_MOE_PACKED",), weights=GATE_UP_WEIGHTS,
))
DOWN_PACKED_SPEC = kernels.register_spec(kernels.KernelSpec(
    name="moe_down_combine_packed", body="moe_down_combine.inc", input_names=("packed",) + DOWN_SPEC.input_names[4:],
    output_names=("y",), template_params=DOWN_PARAMS, description="moe_down_combine reading moe_gate_up_packed's buffer",
    instances=lambda: kernels.unique_instances([_packed(i, True) for i in _down_instances()
                                                if i.inputs[0][0] == mx.float32 and i.inputs[2][0] == mx.int32],
                                               key=kernels.source_key),
    defines=("LILY_MOE_PACKED",), weights=DOWN_WEIGHTS,
))


def _dispatch_packed(*args, **kwargs):
    from . import backend

    return decode_packed(*args, **kwargs, backend=backend())


def _dispatch_routed(x, norm, router, *args, **kwargs):
    from . import backend

    return gate_up(x, norm, None, *args, **kwargs, router=router, backend=backend())


def _dispatch_gate_up(*args, **kwargs):
    from . import backend

    return gate_up(*args, **kwargs, backend=backend())


def _dispatch_down(*args, **kwargs):
    from . import backend

    return down_combine(*args, **kwargs, backend=backend())


register_kernel("moe_gate_up", GATE_UP_SPEC.description, _dispatch_gate_up)
register_kernel("moe_down_combine", DOWN_SPEC.description, _dispatch_down)
# Opt-in until timed on the H200: every routed block reads the router (0.5 MB at the 35B shape, from L2 after the
# first), against one launch fewer a MoE block.
register_kernel("moe_router_fold", ROUTED_SPEC.description, _dispatch_routed, default_on=False)
# Off: no faster on the H200 (run 29, dispatch thread CPU 3.17 vs 3.13 ms a step): a launch's cost is not its arity.
register_kernel("moe_packed", "the MoE decode pair passing its routing and activations as one buffer",
                _dispatch_packed, default_on=False)
