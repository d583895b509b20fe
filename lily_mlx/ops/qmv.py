"""qmv: the fused affine dequant-GEMV, y = x @ dequant(w)^T for a few rows of x (decode).

One body (kernels/qmv.inc) for CUDA and Metal, with two optional fusions: an RMSNorm of x before
(the layer's input norm) and a residual add after (the output projection). This module picks the
launch shape, checks that the kernel applies (else the dispatcher runs the reference) and
registers switch "qmv".
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from . import kernels, register_kernel

MAX_M = 8  # rows of x; beyond this the matmul is compute-bound and MLX's qmm wins
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
X_DTYPES = (mx.float32, mx.bfloat16, mx.float16)
SCALE_DTYPES = (mx.float32, mx.bfloat16, mx.float16)
XBUDGET = 6144  # floats of x one block stages per K tile; the same constant as in qmv.inc
MIN_BLOCKS = 256  # fewer row blocks than this: shrink them, so small N still fills the GPU
MAX_BLOCKS = 528  # persistent grid: blocks loop over row blocks beyond this
MAX_CHAINED_CHUNKS = 12  # plan_chained's weight chunks in flight a lane (12 x 16 bytes: 128 registers held)
# The dispatcher takes qmv only from this many weight bytes on: measured on the H200 (eager MLX,
# bench/kernels.py), a custom kernel costs ~8-10 us more per call than mx.quantized_matmul, which
# outweighs its faster kernel below ~10 MB (2048->8192: 33.0 vs 29.9 us; lm_head: 128 vs 538 us).
DISPATCH_MIN_WEIGHT_BYTES = 12 << 20

SPEC_PARAMS = ("T", "TN", "BITS", "GS", "M", "K", "LANES", "RPS", "WARPS", "NORM", "RES", "EPS_BITS")

# (K, N, bits) of Qwen3.5/3.6-35B-A3B's dense projections: attention q (with gate) / k, v / o,
# DeltaNet qkv / z / a, b / out, shared expert gate, up / down, router, shared-expert gate, lm_head.
MODEL_SHAPES = (
    (2048, 8192, 4), (2048, 512, 4), (4096, 2048, 4), (2048, 4096, 4), (2048, 32, 4),
    (512, 2048, 4), (2048, 256, 8), (2048, 1, 8), (2048, 248320, 4),
)


def chunks_per_lane(M: int, K: int, bits: int, lanes: int) -> int:
    """A lane's 16-byte weight chunks of one row in a K tile (qmv.inc's CPL; the tile holds XBUDGET floats of x)."""
    cpc = 128 // bits
    tch = min(K // cpc, XBUDGET // (M * cpc) // lanes * lanes)
    return -(-tch // lanes)


def plan(M: int, K: int, N: int, bits: int, min_blocks: int = MIN_BLOCKS, warps: Optional[int] = None,
         kernel: str = "qmv") -> dict:
    """Launch shape: LANES lanes per row (a power of two dividing the row's 16-byte chunks, small
    enough that x's tile fits), RPS rows per lane segment, WARPS per block (`warps` given: kept, as a
    chained kernel's blocks are all one size; else $LILY_MLX_PLAN's for `kernel` where it sets them), and the
    block count."""
    cpc = 128 // bits
    chunks = K // cpc
    lanes = 32
    while lanes > 1 and (chunks % lanes or M * lanes * cpc > XBUDGET):
        lanes //= 2
    cpl = chunks_per_lane(M, K, bits, lanes)
    sub = 32 // lanes
    rps = max(1, min(4, 8 // cpl))  # at most 8 chunks (128 bytes) of w in flight per lane
    fixed, warps = warps is not None, warps or 8
    while rps > 1 and -(-N // (warps * sub * rps)) < min_blocks:
        rps //= 2
    while not fixed and warps > 4 and -(-N // (warps * sub * rps)) < min_blocks:  # below 4 warps x staging drags
        warps //= 2
    if not fixed:
        chosen = kernels.plan_overrides().get(kernel, {})
        rps, warps = chosen.get("RPS", rps), chosen.get("WARPS", warps)
    row_blocks = -(-N // (warps * sub * rps))
    return {"LANES": lanes, "RPS": rps, "WARPS": warps, "blocks": min(row_blocks, MAX_BLOCKS)}


def plan_chained(M: int, K: int, N: int, bits: int, warps: int, min_blocks: int = MIN_BLOCKS,
                 wave: Optional[int] = None, rps: Optional[int] = None) -> dict:
    """plan() for a phase of a chained kernel (deltanet_chain, attn_chain), whose blocks all have `warps`: every row
    block its own block (no persistent loop: a later phase waits on all of them), the block-count floor scaled with
    the block size so that a lane keeps as many weight chunks in flight as qmv's own plan gives it. wave: the blocks
    the GPU holds at once: where the phase takes more, the fewest rows a lane that fit it in one (at most
    MAX_CHAINED_CHUNKS chunks in flight a lane), as a second wave repeats each block's fixed cost (ticket, staging x')
    for what is left of the rows; at one row of x only. Each row of x holds a lane's chunks in flight again in
    registers, so from M = 2 the rows a lane segment stay within MAX_CHAINED_CHUNKS / (M x chunks): deltanet_chain's
    2-row build spilled 424 bytes a lane at 4, none at 3 (NVRTC), and its verify ran 48.1 -> 32.2 us a call (H100 run
    88). rps: an experiment's rows a lane segment instead."""
    p = plan(M, K, N, bits, min_blocks=min_blocks * 8 // warps, warps=warps)
    blocks = lambda rps: -(-N // (warps * (32 // p["LANES"]) * rps))  # noqa: E731
    cpl = chunks_per_lane(M, K, bits, p["LANES"])
    fits = (r for r in range(p["RPS"], MAX_CHAINED_CHUNKS // cpl + 1) if wave and M == 1 and blocks(r) <= wave)
    rps = rps or next(fits, min(p["RPS"], max(1, MAX_CHAINED_CHUNKS // (M * cpl))))
    return dict(p, RPS=rps, blocks=blocks(rps))


def unsupported(x, w, scales, biases, group_size: int, bits: int, norm=None, residual=None) -> Optional[str]:
    """Why the kernel does not apply to these arguments (None when it does). norm: (weight [K], eps)."""
    if bits not in BITS:
        return f"bits={bits} (kernel has {BITS})"
    if group_size not in GROUP_SIZES:
        return f"group_size={group_size} (kernel has {GROUP_SIZES})"
    if x.dtype not in X_DTYPES or scales.dtype not in SCALE_DTYPES or biases is None or biases.dtype not in SCALE_DTYPES:
        return "dtypes"
    if x.ndim < 1 or x.size == 0 or w.ndim != 2 or w.dtype != mx.uint32:
        return "shapes"
    K, N = x.shape[-1], w.shape[0]
    if K % group_size or w.shape[1] * 32 != K * bits or scales.shape != (N, K // group_size) or biases.shape != scales.shape:
        return "shapes"
    if x.size // K > MAX_M or N == 0:
        return f"rows of x {x.size // K} > {MAX_M}"
    if N * K >= 2**31:
        return "int32 indexing"
    if norm is not None and (norm[0].shape != (K,) or norm[0].dtype not in X_DTYPES or not norm[1] > 0):
        return "norm: weight [K] of a float dtype and eps > 0 expected"
    if residual is not None and (residual.shape != (*x.shape[:-1], N) or residual.dtype != x.dtype):
        return "residual: x's dtype and shape [..., N] expected"
    return None


def unsupported_chain_input(x, norm, proj_weights, max_tokens: int):
    """(why not, None) or (None, the projection's Shaped [B, T, N]) for a chained kernel's first phase (deltanet_chain,
    attn_chain): the input norm and a fused projection (w, scales, biases, bits, group_size) over x [B, T, K],
    T <= max_tokens new tokens a row."""
    w, scales, biases, bits, group_size = proj_weights
    why = unsupported(x, w, scales, biases, group_size, bits, norm=norm)
    if why:
        return why, None
    if x.ndim != 3 or not 1 <= x.shape[1] <= max_tokens:
        return f"x [B, T <= {max_tokens}, K] expected, got {x.shape}", None
    return None, kernels.Shaped((*x.shape[:2], w.shape[0]), x.dtype)


def instance(x_dtype, scale_dtype, M: int, K: int, N: int, bits: int, group_size: int, norm_dtype=None,
             res: bool = False, eps: float = 0.0) -> kernels.Instance:
    """norm_dtype: the RMSNorm weight's dtype when x is normalised first (None: no norm)."""
    p = plan(M, K, N, bits)
    nd = norm_dtype or x_dtype
    template = (("T", x_dtype), ("TN", nd), ("BITS", bits), ("GS", group_size), ("M", M), ("K", K),
                ("LANES", p["LANES"]), ("RPS", p["RPS"]), ("WARPS", p["WARPS"]), ("NORM", norm_dtype is not None),
                ("RES", bool(res)), ("EPS_BITS", kernels.float_bits(eps) if norm_dtype is not None else 0))
    inputs = ((x_dtype, (M, K)), (mx.uint32, (N, K * bits // 32)),
              (scale_dtype, (N, K // group_size)), (scale_dtype, (N, K // group_size)),
              (nd, (K,) if norm_dtype is not None else (1,)), (x_dtype, (M, N) if res else (1,)))
    return kernels.Instance(template, inputs, (x_dtype,))


_LAUNCH: dict = {}  # argument signature -> (template, grid, threadgroup, M, N) or None (not applicable)


def _launch(x, w, scales, biases, group_size: int, bits: int, norm, residual):
    # Decode calls the same few shapes thousands of times: plan once per signature.
    key = (x.shape, x.dtype, w.shape, w.dtype, scales.shape, scales.dtype,
           None if biases is None else (biases.shape, biases.dtype), group_size, bits,
           None if norm is None else (norm[0].shape, norm[0].dtype, norm[1]),
           None if residual is None else (residual.shape, residual.dtype))
    hit = _LAUNCH.get(key, False)
    if hit is not False:
        return hit
    launch = None
    if unsupported(x, w, scales, biases, group_size, bits, norm, residual) is None:
        K, N = x.shape[-1], w.shape[0]
        M = kernels.row_bucket(x.size // K)  # the build's rows; the kernel reads the actual count from x_shape
        p = plan(M, K, N, bits)
        threads = 32 * p["WARPS"]
        inst = instance(x.dtype, scales.dtype, M, K, N, bits, group_size, None if norm is None else norm[0].dtype,
                        residual is not None, 0.0 if norm is None else norm[1])
        launch = (list(inst.template), (p["blocks"] * threads, 1, 1), (threads, 1, 1), M, N)
    _LAUNCH[key] = launch
    return launch


def qmv(x, w, scales, biases, *, group_size: int, bits: int, backend: str, norm=None, residual=None,
        init_value: Optional[float] = None):
    """x [..., K] @ dequant(w [N, K*bits/32])^T -> [..., N] in x's dtype; None if not applicable.
    norm (weight [K], eps): x is RMS-normalised first. residual [..., N]: added to the result."""
    launch = _launch(x, w, scales, biases, group_size, bits, norm, residual)
    if launch is None:
        return None
    template, grid, group, M, N = launch
    nw = kernels.placeholder(x.dtype) if norm is None else norm[0]
    res = kernels.placeholder(x.dtype) if residual is None else residual
    (y,) = kernels.call("qmv", backend, [x, w, scales, biases, nw, res], template, grid, group,
                        [(*x.shape[:-1], N)], [x.dtype], init_value)
    return y


def _instances() -> list[kernels.Instance]:
    """Model shapes at decode row counts in every x dtype (plain, normed input, residual output), plus the
    test matrix's group sizes."""
    combos = [(t, mx.bfloat16, M, K, N, b, 64) for (K, N, b) in MODEL_SHAPES for M in (1, 2, 3, 4, 8) for t in X_DTYPES]
    combos += [(t, mx.bfloat16, M, 2048, N, b, 64, t, False, 1e-6) for (N, b) in ((8192 + 4096 + 64, 4), (257, 8),
               (248320, 4), (16 * 512 + 1024, 4)) for M in (1, 2, 4) for t in X_DTYPES]
    combos += [(t, mx.bfloat16, M, K, 2048, 4, 64, None, True) for K in (4096, 512) for M in (1, 2, 4) for t in X_DTYPES]
    combos += [(t, s, M, K, N, b, g) for b in BITS for g in GROUP_SIZES for M in (1, 3, 8) for t in (mx.float32, mx.bfloat16)
               for s in (mx.bfloat16,) for K in (g * 4, 2048) for N in (1, 33, 8200)]
    combos += [(t, mx.bfloat16, M, g * 4, N, b, g, nt, r, 1e-5) for b in BITS for g in GROUP_SIZES for M in (1, 3)
               for t in (mx.float32, mx.bfloat16) for N in (33,) for nt, r in ((mx.float32, False), (None, True), (t, True))]
    combos += [(mx.float16, mx.float16, 1, 2048, 8192, 4, 64), (mx.float32, mx.float32, 1, 2048, 8192, 8, 32)]
    return kernels.unique_instances((instance(*c) for c in combos), key=kernels.source_key)


SPEC = kernels.register_spec(kernels.KernelSpec(
    name="qmv", body="qmv.inc", input_names=("x", "w", "scales", "biases", "nw", "res"), output_names=("y",),
    template_params=SPEC_PARAMS, description="fused affine dequant GEMV, M <= 8 rows (decode), optional input "
    "RMSNorm and residual add", instances=_instances, weights=(("w", "scales", "biases"),),
    cuda_max_registers=lambda t: kernels.plan_overrides().get("qmv", {}).get("MAXREG", 0),
))


ATTN_SPEC_PARAMS = SPEC_PARAMS + ("HQ", "HKV", "D")
# Every qmv_attn block merges all of x from the partials (NS * K floats from L2), so it runs fewer, larger
# blocks than qmv: at the 35B o_proj (N 2048, K 4096) and NS 17, 64 blocks read ~18 MB where 256 read ~71 MB.
ATTN_MIN_BLOCKS = 64


def attn_instance(dtype, scale_dtype, M: int, Hq: int, Hkv: int, D: int, N: int, bits: int, group_size: int,
                  nsplit: int = 2) -> kernels.Instance:
    """qmv_attn: o_proj (+ residual) of a split decode attention's partials (kernels/qmv.inc, LILY_QMV_ATTN)."""
    K = Hq * D
    p = plan(M, K, N, bits, ATTN_MIN_BLOCKS, kernel="qmv_attn")
    template = (("T", dtype), ("TN", dtype), ("BITS", bits), ("GS", group_size), ("M", M), ("K", K),
                ("LANES", p["LANES"]), ("RPS", p["RPS"]), ("WARPS", p["WARPS"]), ("NORM", False), ("RES", True),
                ("EPS_BITS", 0), ("HQ", Hq), ("HKV", Hkv), ("D", D))
    inputs = ((mx.float32, (M, Hq, nsplit, D)), (mx.float32, (M, Hq, nsplit, 2)),
              (dtype, (M, 1, Hq * 2 * D + 2 * Hkv * D)), (mx.uint32, (N, K * bits // 32)),
              (scale_dtype, (N, K // group_size)), (scale_dtype, (N, K // group_size)), (dtype, (M, N)))
    return kernels.Instance(template, inputs, (dtype,))


def qmv_attn(part_acc, part_ml, proj, w, scales, biases, residual, *, n_kv_heads: int, group_size: int, bits: int,
             backend: str, init_value: Optional[float] = None):
    """residual + merge(part_acc [R, Hq, NS, D], part_ml [R, Hq, NS, 2]) * sigmoid(gates of proj) @ dequant(w)^T, of
    proj [B, T, Hq*2*D + 2*Hkv*D] (R = B*T rows: a speculative verify's tokens too), [B, T, N] in proj's dtype:
    attn_combine and the output projection in one launch. None if not applicable."""
    R, Hq, ns, D = part_acc.shape
    K = Hq * D
    if (part_ml.shape != (R, Hq, ns, 2) or part_acc.dtype != mx.float32 or part_ml.dtype != mx.float32
            or proj.ndim != 3 or proj.shape[0] * proj.shape[1] != R or proj.shape[2] != Hq * 2 * D + 2 * n_kv_heads * D
            or D % 32):
        return None
    key = ("attn", proj.shape, Hq, n_kv_heads, D, proj.dtype, w.shape, scales.dtype, group_size, bits, residual.shape,
           residual.dtype)
    launch = _LAUNCH.get(key, False)
    if launch is False:
        launch = None
        if unsupported(kernels.Shaped((*proj.shape[:2], K), proj.dtype), w, scales, biases, group_size, bits, None,
                       residual) is None:
            M, N = kernels.row_bucket(R), w.shape[0]
            p = plan(M, K, N, bits, ATTN_MIN_BLOCKS, kernel="qmv_attn")
            inst = attn_instance(proj.dtype, scales.dtype, M, Hq, n_kv_heads, D, N, bits, group_size)
            launch = (list(inst.template), (p["blocks"] * 32 * p["WARPS"], 1, 1), (32 * p["WARPS"], 1, 1), N)
        _LAUNCH[key] = launch
    if launch is None:
        return None
    template, grid, group, N = launch
    (y,) = kernels.call("qmv_attn", backend, [part_acc, part_ml, proj, w, scales, biases, residual], template, grid,
                        group, [residual.shape], [proj.dtype], init_value)
    return y


def _attn_instances() -> list[kernels.Instance]:
    combos = [(t, mx.bfloat16, M, 16, 2, 256, 2048, 4, 64) for M in (1, 2, 4, 8) for t in X_DTYPES]
    combos += [(t, mx.bfloat16, M, Hq, Hkv, D, N, b, g) for (Hq, Hkv, D) in ((4, 2, 32), (6, 2, 64), (3, 3, 96))
               for M in (1, 4) for t in (mx.float32, mx.bfloat16) for (N, b, g) in ((33, 4, 32), (70, 8, 32))]
    return kernels.unique_instances((attn_instance(*c) for c in combos), key=kernels.source_key)


ATTN_SPEC = kernels.register_spec(kernels.KernelSpec(
    name="qmv_attn", body="qmv.inc", input_names=("part_acc", "part_ml", "proj", "w", "scales", "biases", "res"),
    output_names=("y",), template_params=ATTN_SPEC_PARAMS, description="a split decode attention's merge and "
    "output gate in the o_proj dequant GEMV (+ residual): no attn_combine launch", instances=_attn_instances,
    defines=("LILY_QMV_ATTN",), weights=(("w", "scales", "biases"),),
))


def _dispatch(x, w, scales, biases, *, group_size: int, bits: int, norm=None, residual=None):
    from . import backend

    # Alone, a custom kernel loses to mx.quantized_matmul below ~10 MB (its fixed cost); fused with a
    # norm or a residual add it replaces two or three primitives and always pays.
    if norm is None and residual is None and w.nbytes < DISPATCH_MIN_WEIGHT_BYTES:
        return None
    return qmv(x, w, scales, biases, group_size=group_size, bits=bits, backend=backend(), norm=norm, residual=residual)


register_kernel("qmv", SPEC.description, _dispatch)
