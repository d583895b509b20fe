"""attn_decode: decode tokens of the gated full-attention layer (one a step; a few in a speculative verify) from its
fused q|k|v projection.

q/k RMSNorm, partial RoPE, the new k/v row, attention over the KV cache (GQA, any head_dim that is a
multiple of 32: MLX has no fused attention for head_dim 256 on CUDA) and the sigmoid output gate, in
one launch (kernels/attn_decode.inc); for caches past SINGLE_MAX positions the cache is split over
blocks and a second launch (kernels/attn_combine.inc) merges the splits. One body each for CUDA and
Metal. This module plans the split, checks that the kernels apply (else the dispatcher runs the
reference) and registers switch "attn_decode".
"""

from __future__ import annotations

import math
from typing import Optional

import mlx.core as mx

from . import enabled, kernels, metal_source, packing, register_kernel, register_switch

ACT_DTYPES = (mx.float32, mx.bfloat16, mx.float16)
MAX_HEAD_DIM = 512  # a lane holds D/32 dims of q, k, v and the output
MAX_GROUP = 32  # query heads per kv head: one warp each
MAX_TOKENS = 8  # new tokens a row (model.DECODE_TOKENS_MAX): each block holds their k/v rows up to its own
# A block's positions are a chain of dependent loads (one memory latency per TP positions), so past a
# few dozen positions the cache is split over many blocks: measured on the H200 (2026-12-02), one block
# per kv head over 512 positions cost ~175 us per layer, 64 blocks of 64 positions ~20 us.
SINGLE_MAX = 32  # cache capacity up to which one launch (one block per kv head) does it all
MIN_CHUNK = 16  # positions per split at least
# A split's cached rows go through shared memory (STAGE) from this many positions a split: each row loaded once a
# block, not by each query head's warp. H100 run 75, attn_chain a call: 98.4 -> 66.0 us at context 16,384 (128 rows a
# split), 49.5 -> 43.0 at 4096 (32), but 32.2 -> 34.3 at 64, where no split holds a stage (the build alone costs).
STAGE_MIN_ROWS = 32
TARGET_BLOCKS = 512  # blocks of 8 warps: about four per multiprocessor
TP = 4  # positions a warp has in flight per iteration
COMBINE_WARPS = 8
SHARED_BYTES = metal_source.THREADGROUP_BYTES
SPEC_PARAMS = ("T", "TC", "TN", "B", "HQ", "HKV", "D", "ROPE", "LOG2_BASE_BITS", "EPS_BITS", "SCALE_BITS", "SPLIT", "TP",
               "ROWS", "TOKS", "WIDE", "KVW", "STAGE")


def splits(rows: int, n_kv_heads: int, capacity: int, target_blocks: int = TARGET_BLOCKS) -> int:
    """Blocks per (row, kv head), rows = batch rows x new tokens: 1 up to SINGLE_MAX cached positions, then enough
    to fill the GPU (about target_blocks in all)."""
    if capacity <= SINGLE_MAX:
        return 1
    return max(2, min(-(-(capacity + 1) // MIN_CHUNK), max(1, target_blocks // (rows * n_kv_heads))))


def stage_rows() -> int:
    """The positions a split needs to take the staged rows (STAGE): STAGE_MIN_ROWS, or $LILY_MLX_PLAN's
    attn_decode.STAGE_ROWS."""
    return kernels.plan_overrides().get("attn_decode", {}).get("STAGE_ROWS", STAGE_MIN_ROWS)


def staged(capacity: int, nsplit: int) -> bool:
    """Whether a cache of `capacity` positions in `nsplit` splits takes the staged rows."""
    return nsplit > 1 and capacity // nsplit >= stage_rows()


def unsupported(proj, q_norm_weight, k_norm_weight, eps, keys, values, offset, n_heads, n_kv_heads, rope_dims,
                scale, plane: int = 0, rows=None) -> Optional[str]:
    """Why the kernels do not apply to these arguments (None when they do)."""
    if keys.ndim != 4 or values.shape != keys.shape:
        return "keys, values: [P*B, Hkv, capacity, D] of one shape expected"
    B, (PB, Hkv, _, D) = proj.shape[0], keys.shape
    if B < 1 or PB % B or not 0 <= plane < PB // B:
        return f"keys: {PB} rows are not planes of the {B} rows of proj, or plane {plane} is not among them"
    if rows is not None and any(r.shape != (B,) or r.dtype != mx.int32 for r in rows):
        return f"row_start, row_pos: int32 [{B}] expected"
    Hq = n_heads
    if Hkv != n_kv_heads or Hq % Hkv or Hq // Hkv > MAX_GROUP:
        return f"heads: {Hq} query heads over {Hkv} kv heads (at most {MAX_GROUP} per kv head)"
    if D % 32 or D > MAX_HEAD_DIM or rope_dims % 2 or not 2 <= rope_dims <= D:
        return f"head_dim {D} (a multiple of 32 up to {MAX_HEAD_DIM}) / rope dims {rope_dims}"
    if proj.ndim != 3 or not 1 <= proj.shape[1] <= MAX_TOKENS or proj.shape[2] != Hq * 2 * D + 2 * Hkv * D:
        return f"proj: [B, T <= {MAX_TOKENS}, Hq*2*D + 2*Hkv*D] expected, got {proj.shape}"
    if proj.dtype not in ACT_DTYPES or keys.dtype not in ACT_DTYPES or values.dtype != keys.dtype:
        return "dtypes"
    if q_norm_weight.shape != (D,) or k_norm_weight.shape != (D,) or q_norm_weight.dtype not in ACT_DTYPES \
            or k_norm_weight.dtype != q_norm_weight.dtype or not eps > 0:
        return "norms: weights [D] of one float dtype and eps > 0 expected"
    if offset.shape != (1,) or offset.dtype != mx.int32:
        return "offset: int32 [1] expected"
    toks = kernels.row_bucket(proj.shape[1])
    if (Hq // Hkv + 2 * toks) * D * 4 > SHARED_BYTES:
        return (f"{Hq // Hkv} query heads and {toks} new k/v rows of {D} floats per block exceed {SHARED_BYTES} bytes "
                "of shared memory")
    if not scale > 0:
        return f"scale {scale}"
    return None


def instance(dtype, cache_dtype, norm_dtype, B: int, Hq: int, Hkv: int, D: int, rope_dims: int, rope_theta: float,
             eps: float, scale: float, split: bool, capacity: int = 16, rows: bool = False,
             tokens: int = 1, wide: bool = False, kv_write: bool = False, stage: bool = False) -> kernels.Instance:
    """tokens: new tokens a row; the build holds row_bucket(tokens) of them (TOKS). wide: a lane's dims consecutive,
    loaded 16 bytes at a time (switch attn_decode_wide). kv_write: the new rows written into keys and values in place
    too (KVW; switch kv_write). stage: a split's cached rows through shared memory (STAGE; staged())."""
    template = (("T", dtype), ("TC", cache_dtype), ("TN", norm_dtype), ("B", B), ("HQ", Hq), ("HKV", Hkv), ("D", D),
                ("ROPE", rope_dims), ("LOG2_BASE_BITS", kernels.float_bits(math.log2(rope_theta))),
                ("EPS_BITS", kernels.float_bits(eps)), ("SCALE_BITS", kernels.float_bits(scale)), ("SPLIT", bool(split)),
                ("TP", TP), ("ROWS", bool(rows)), ("TOKS", kernels.row_bucket(tokens)), ("WIDE", bool(wide)),
                ("KVW", bool(kv_write)), ("STAGE", bool(stage)))
    kv = (cache_dtype, (B, Hkv, capacity, D))
    per_row = (mx.int32, (B,) if rows else (1,))
    inputs = ((dtype, (B, tokens, Hq * 2 * D + 2 * Hkv * D)), (norm_dtype, (D,)), (norm_dtype, (D,)), kv, kv, (mx.int32, (1,)),
              (mx.int32, (1,)), per_row, per_row)
    return kernels.Instance(template, inputs, (dtype, cache_dtype, cache_dtype, mx.float32, mx.float32))


def combine_instance(dtype, B: int, Hq: int, Hkv: int, D: int, nsplit: int = 2) -> kernels.Instance:
    template = (("T", dtype), ("HQ", Hq), ("HKV", Hkv), ("D", D), ("WARPS", COMBINE_WARPS))
    inputs = ((mx.float32, (B, Hq, nsplit, D)), (mx.float32, (B, Hq, nsplit, 2)), (dtype, (B, 1, Hq * 2 * D + 2 * Hkv * D)))
    return kernels.Instance(template, inputs, (dtype,))


_LAUNCH: dict = {}
_WRITTEN = packing.ArrayTags()  # the k_new of launches that also wrote their rows into the cache (KVW)


def mark_written(k_new: mx.array) -> None:
    """Records that the launch which made k_new wrote the new rows into its keys and values in place."""
    _WRITTEN.set(k_new, True)


def written_in_place(k_new: mx.array) -> bool:
    """Whether k_new's launch wrote the new K and V rows into the cache it read (mark_written)."""
    return _WRITTEN.get(k_new, False)


_PLANES: dict = {}  # (plane index, device_scalars) -> its int32 [1] array, made once (a constant of the compiled step)


def _plane_array(plane: int) -> mx.array:
    key = (plane, enabled("device_scalars"))
    a = _PLANES.get(key)
    if a is None:
        a = _PLANES[key] = kernels.int32_scalar(plane)
        mx.eval(a)  # a constant of the compiled step, not an op replayed in it
    return a


def attention_decode(proj, q_norm_weight, k_norm_weight, eps: float, keys, values, offset, *, n_heads: int,
                     n_kv_heads: int, rope_dims: int, rope_theta: float, scale: float, backend: str, plane: int = 0,
                     row_start=None, row_pos=None, init_value: Optional[float] = None, merge: bool = True):
    """(out [B, T, Hq*D], k_new [B, Hkv, T, D], v_new [B, Hkv, T, D]) or None when the kernels do not apply.
    See ops.attention_decode for the arguments. merge=False leaves a split cache's partials unmerged: out is
    then (part_acc [B*T, Hq, NS, D], part_ml [B*T, Hq, NS, 2]) for qmv_attn to merge."""
    rows = None if row_start is None else (row_start, row_pos)
    wide = enabled("attn_decode_wide")
    key = (wide, stage_rows(), proj.shape, proj.dtype, q_norm_weight.dtype, keys.shape, keys.dtype, values.dtype,
           offset.shape, offset.dtype, eps, n_heads, n_kv_heads, rope_dims, rope_theta, scale, plane,
           None if rows is None else tuple((r.shape, r.dtype) for r in rows))
    launch = _LAUNCH.get(key, False)
    if launch is False:
        launch = None
        if unsupported(proj, q_norm_weight, k_norm_weight, eps, keys, values, offset, n_heads, n_kv_heads, rope_dims,
                       scale, plane, rows) is None:
            (B, L, _), (_, Hkv, cap, D) = proj.shape, keys.shape
            ns = splits(B * L, Hkv, cap)
            inst = instance(proj.dtype, keys.dtype, q_norm_weight.dtype, B, n_heads, Hkv, D, rope_dims, rope_theta,
                            eps, scale, ns > 1, rows=rows is not None, tokens=L, wide=wide, stage=staged(cap, ns))
            comb = combine_instance(proj.dtype, B, n_heads, Hkv, D)
            launch = (list(inst.template), list(comb.template), ns)
        _LAUNCH[key] = launch
    if launch is None:
        return None
    template, comb_template, ns = launch
    (B, L, _), (_, Hkv, _, D) = proj.shape, keys.shape
    Hq, threads = n_heads, 32 * (n_heads // Hkv)
    split = ns > 1
    shapes = [(B, L, Hq * D) if not split else (1,), (B, Hkv, L, D), (B, Hkv, L, D),
              (B * L, Hq, ns, D) if split else (1,), (B * L, Hq, ns, 2) if split else (1,)]
    out, k_new, v_new, part_acc, part_ml = kernels.call(
        "attn_decode", backend, [proj, q_norm_weight, k_norm_weight, keys, values, offset, _plane_array(plane),
                                 *(rows or (_plane_array(0), _plane_array(0)))], template,
        (B * L * Hkv * ns * threads, 1, 1), (threads, 1, 1), shapes,
        [proj.dtype, keys.dtype, keys.dtype, mx.float32, mx.float32], init_value)
    if split and not merge:
        return (part_acc, part_ml), k_new, v_new
    if split:  # attn_combine: a block per (row, new token, query head)
        threads = 32 * COMBINE_WARPS
        (out,) = kernels.call("attn_combine", backend, [part_acc, part_ml, proj], comb_template,
                              (B * L * Hq * threads, 1, 1), (threads, 1, 1), [(B, L, Hq * D)], [proj.dtype], init_value)
    return out, k_new, v_new


# (B, Hq, Hkv, D, rope dims) the project runs: Qwen3.5/3.6-35B-A3B, lily-tiny, tests/tiny.py; test shapes.
MODEL_HEADS = ((1, 16, 2, 256, 64), (2, 16, 2, 256, 64), (1, 4, 2, 32, 8), (1, 4, 2, 64, 16))
TEST_HEADS = ((2, 6, 2, 64, 16), (1, 3, 3, 96, 32), (3, 8, 1, 32, 32), (1, 5, 1, 128, 2))


def _instances() -> list[kernels.Instance]:
    out = []
    for B, Hq, Hkv, D, rd in MODEL_HEADS + TEST_HEADS:
        for dt in ACT_DTYPES:
            for split in (False, True):
                for rows in (False, True) if B > 1 and dt == mx.bfloat16 else (False,):  # a left-padded batch
                    out.append(instance(dt, dt, dt, B, Hq, Hkv, D, rd, 1e7 if D == 256 else 1e4, 1e-6, D**-0.5, split,
                                        rows=rows))
            for tokens in (2, 5):  # a speculative verify's tokens
                out.append(instance(dt, dt, dt, B, Hq, Hkv, D, rd, 1e7 if D == 256 else 1e4, 1e-6, D**-0.5, True,
                                    tokens=tokens))
            for split in (False, True):  # attn_decode_wide
                out.append(instance(dt, dt, dt, B, Hq, Hkv, D, rd, 1e7 if D == 256 else 1e4, 1e-6, D**-0.5, split,
                                    wide=True))
            out.append(instance(dt, dt, dt, B, Hq, Hkv, D, rd, 1e7 if D == 256 else 1e4, 1e-6, D**-0.5, True,
                                stage=True))  # a long split's rows through shared memory
    return kernels.unique_instances(out, key=kernels.source_key)


def _combine_instances() -> list[kernels.Instance]:
    return kernels.unique_instances([combine_instance(dt, B, Hq, Hkv, D) for B, Hq, Hkv, D, _ in MODEL_HEADS + TEST_HEADS
                                     for dt in ACT_DTYPES], key=kernels.source_key)


SPEC = kernels.register_spec(kernels.KernelSpec(
    name="attn_decode", body="attn_decode.inc",
    input_names=("proj", "qn", "kn", "keys", "values", "offset", "plane", "row_start", "row_pos"),
    output_names=("out", "k_new", "v_new", "part_acc", "part_ml"), template_params=SPEC_PARAMS,
    description="gated attention decode step: q/k norm + partial RoPE + new KV row + GQA attention over the cache "
                "(split over blocks for long caches) + output gate",
    instances=_instances,
))
COMBINE_SPEC = kernels.register_spec(kernels.KernelSpec(
    name="attn_combine", body="attn_combine.inc", input_names=("part_acc", "part_ml", "proj"), output_names=("out",),
    template_params=("T", "HQ", "HKV", "D", "WARPS"),
    description="merges split decode attention and applies the output gate",
    instances=_combine_instances,
))


def _dispatch(*args, **kwargs):
    from . import backend

    return attention_decode(*args, **kwargs, backend=backend())


register_kernel("attn_decode", SPEC.description, _dispatch)
# Opt-in: its cuda tests pass (H100 run 34) but it was no faster at context 64 or 4096 (run 35).
register_switch("attn_decode_wide", "decode attention (and attn_chain's): a lane's dims consecutive, 16-byte cache loads",
                default_on=False)


# Up to this many splits (cache capacity <= ~370 positions) qmv_attn merges them; every one of its blocks reads
# all NS partials, so past short caches attn_combine's one merge is cheaper.
FOLD_MAX_SPLITS = 24


def _dispatch_fold(proj, q_norm_weight, k_norm_weight, eps, keys, values, offset, o_proj, residual, *, group_size: int,
                   bits: int, **kw):
    """ops.attention_decode_add through attn_decode and qmv_attn (a split cache's merge inside o_proj's GEMV), or
    None where either kernel does not apply (the caller then runs the unfused path)."""
    from . import backend, enabled, quantized_matmul_add
    from .qmv import qmv_attn

    if not enabled("attn_decode") or splits(proj.shape[0] * proj.shape[1], kw["n_kv_heads"], keys.shape[2]) > FOLD_MAX_SPLITS:
        return None
    res = attention_decode(proj, q_norm_weight, k_norm_weight, eps, keys, values, offset, **kw, backend=backend(),
                           merge=False)
    if res is None:
        return None
    out, k_new, v_new = res
    if not isinstance(out, tuple):  # a short cache is not split: nothing to merge
        return quantized_matmul_add(out, *o_proj, residual, group_size=group_size, bits=bits), k_new, v_new
    h = qmv_attn(*out, proj, *o_proj, residual, n_kv_heads=kw["n_kv_heads"], group_size=group_size, bits=bits,
                 backend=backend())
    return None if h is None else (h, k_new, v_new)


# On: its cuda tests pass on the H200 (2026-12-03, run 9), where the decode step took 3.52 ms with it and dequant_rows
# and 3.53 without (run 6); with both the step is within issue 4's budget of 250 primitives.
register_kernel("qmv_attn", "decode attention's split merge and output gate inside the o_proj GEMV: one launch "
                "fewer per attention layer", _dispatch_fold)
