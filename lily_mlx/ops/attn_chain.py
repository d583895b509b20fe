"""attn_chain: a gated-attention layer's decode token in one launch (kernels/attn_chain.inc, CUDA and Metal): qmv's body
(input RMSNorm + the fused q|k|v projection), attn_decode's body (split over the cache) and qmv_attn's body (the
splits merged and gated inside o_proj, the residual added) as three phases of one grid, ordered through the launch's
counters (`kernels.sync_counters`) as moe_chain orders its three. Where the cache is split (FOLD_MAX_SPLITS), or
qmv_attn is switched off, variant attn_chain_long runs attn_combine's body and then qmv's as phases 2 and 3. Two
launches fewer in each of the 10 attention layers of a 35B-A3B decode step, the GPU's work unchanged.

Switch "attn_chain", on by default on CUDA at one row and in MTP's 2-token verify (ops.chain_takes), opt-in on Metal.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from . import attn_decode as ad
from . import enabled, kernels, metal_source, qmv, register_kernel

SPEC_PARAMS = ad.SPEC_PARAMS + ("WARPS", "QTN", "BITS", "GS", "M", "K", "LANES", "RPS", "QEPS_BITS", "OBITS", "OGS",
                                "OLANES", "ORPS", "PF")  # PF: switch chain_prefetch (ops/moe_chain.py)
# A lane's registers on CUDA at one decode row (M 1): NVRTC gave the 35B instance 168, one 8-warp block an SM, so the
# projection phase's 288 blocks took three waves; at 128 two blocks fit (64 B spilled). At M >= 2 the cap would spill
# ~1 KB a lane, so those instances keep NVRTC's choice. A block of more than 16 warps could not launch under it.
MAX_REGISTERS = 128
SM_REGISTERS = 64 * 1024
# o_proj merges the splits itself (qmv_attn's body) only where there is one: each of its blocks reads every split, and
# at 17 splits (context 64 in a 272-position cache) that phase took 19.9 us a block; merging once in a phase of its
# own (attn_chain_long) made the launch 43.4 us instead of 60.9 (H100, run 48). Unchained, qmv_attn saves a launch.
FOLD_MAX_SPLITS = 1
# The blocks a long cache's attention phase aims for (attn_decode's own: 512). Behind the projection's 231 blocks, two
# an SM, 512 ran in two waves; 256 fit one: 62.3 -> 53.8 us a launch at context 4096, 128 took 63.7 (H100, run 68).
TARGET_BLOCKS = 256


def plan(M: int, K: int, Hq: int, Hkv: int, D: int, bits: int, H: int, obits: int, fold: bool,
         sms: Optional[int] = None) -> dict:
    """attn_decode's block (a warp per query head of a kv head) for every phase, both projections' rows planned for
    it; the output projection with qmv_attn's block floor when it merges the splits (fold). sms: the GPU's
    multiprocessors, each holding the blocks MAX_REGISTERS leave room for, so that the input projection fits one
    wave of them (35B on 132 SMs: 231 blocks of 40 rows, not 288 of 32); $LILY_MLX_PLAN's attn_chain.IN_RPS sets
    its rows a lane segment instead."""
    warps = Hq // Hkv
    PW = Hq * 2 * D + 2 * Hkv * D
    wave = sms * (SM_REGISTERS // (32 * warps * MAX_REGISTERS)) if sms else None  # plan_chained: at M 1 only
    rps = kernels.plan_overrides().get("attn_chain", {}).get("IN_RPS")  # an experiment's
    return {"WARPS": warps, "qkv": qmv.plan_chained(M, K, PW, bits, warps, wave=wave, rps=rps),
            "out": qmv.plan_chained(M, Hq * D, H, obits, warps, qmv.ATTN_MIN_BLOCKS if fold else qmv.MIN_BLOCKS)}


def blocks(p: dict, rows: int, Hq: int, Hkv: int, nsplit: int, fold: bool) -> int:
    """The grid's blocks: the input projection's, the attention's (a block per row, kv head and split; rows = batch
    rows x new tokens), attn_combine's (a block per row and query head; attn_chain_long), the output projection's."""
    return p["qkv"]["blocks"] + rows * Hkv * nsplit + (0 if fold else rows * Hq) + p["out"]["blocks"]


def shared_bytes(M: int, K: int, Hq: int, Hkv: int, D: int, bits: int, obits: int, fold: bool, tokens: int = 1) -> int:
    """attn_chain.inc's threadgroup memory, at most: the larger x tile of the two projections or the attention's
    vectors, the tiles' chunk sums, the norm's scratch, qmv_attn's per-head merge (or attn_combine's), the ticket."""
    warps, budget = Hq // Hkv, qmv.XBUDGET
    tiles = min(M * K, budget), min(M * Hq * D, budget)
    sums = max(tiles[0] * bits // 128, tiles[1] * obits // 128)
    vectors = (warps + 2 * kernels.row_bucket(tokens)) * D
    return 4 * (max(*tiles, vectors) + 3 + sums + M * warps + (2 * M * Hq if fold else 2 * warps) + 1)


def unsupported(x, norm, qkv, q_norm_weight, k_norm_weight, eps, keys, values, offset, o_proj, residual, n_heads: int,
                n_kv_heads: int, rope_dims: int, scale: float, plane: int = 0, rows=None) -> Optional[str]:
    """Why attn_chain does not apply (None when it does): the checks of qmv (normed input; residual output) and
    attn_decode, and Metal's threadgroup memory."""
    if norm is None or qkv is None or o_proj is None or residual is None:
        return "the chained layer needs the input norm, the quantized fused q|k|v and output projections, the residual"
    why, proj = qmv.unsupported_chain_input(x, norm, qkv, ad.MAX_TOKENS)
    if why:
        return why
    (B, L, _), bits = proj.shape, qkv[3]
    why = ad.unsupported(proj, q_norm_weight, k_norm_weight, eps, keys, values, offset, n_heads, n_kv_heads, rope_dims,
                         scale, plane, rows)
    if why:
        return why
    D = keys.shape[-1]
    wo, so, bo, obits, ogs = o_proj
    why = qmv.unsupported(kernels.Shaped((B, L, n_heads * D), x.dtype), wo, so, bo, ogs, obits, residual=residual)
    if why:
        return f"output projection: {why}"
    M = kernels.row_bucket(B * L)
    if M == 1 and 32 * (n_heads // n_kv_heads) * MAX_REGISTERS > SM_REGISTERS:
        return f"{n_heads // n_kv_heads} query heads a kv head: a block of that many warps over an SM's registers"
    if max(shared_bytes(M, x.shape[-1], n_heads, n_kv_heads, D, bits, obits, fold, L)
           for fold in (False, True)) > metal_source.THREADGROUP_BYTES:
        return f"over Metal's {metal_source.THREADGROUP_BYTES} bytes of threadgroup memory"
    return None


def instance(dtype, cache_dtype, norm_dtype, norm_in_dtype, scale_dtype, oscale_dtype, B: int, K: int, bits: int,
             group_size: int, Hq: int, Hkv: int, D: int, rope_dims: int, rope_theta: float, eps: float, eps_in: float,
             scale: float, H: int, obits: int, ogs: int, fold: bool, rows: bool = False, capacity: int = 16,
             p: Optional[dict] = None, tokens: int = 1, wide: bool = False,
             prefetch: bool = False, kv_write: bool = False, stage: bool = False) -> kernels.Instance:
    """norm_dtype: q_norm/k_norm's; norm_in_dtype: the input norm's; scale_dtype / oscale_dtype: the input and output
    projections' scales and biases; H: the output projection's rows; p: plan()'s, when the caller has it; tokens:
    new tokens a row; prefetch: chain_prefetch's L2 hints (PF); kv_write: attn_decode's KVW; stage: its STAGE."""
    M = kernels.row_bucket(B * tokens)
    p = p or plan(M, K, Hq, Hkv, D, bits, H, obits, fold)
    attn = ad.instance(dtype, cache_dtype, norm_dtype, B, Hq, Hkv, D, rope_dims, rope_theta, eps, scale, True,
                       capacity, rows, tokens, wide, kv_write, stage)
    template = attn.template + (("WARPS", p["WARPS"]), ("QTN", norm_in_dtype), ("BITS", bits), ("GS", group_size),
                                ("M", M), ("K", K), ("LANES", p["qkv"]["LANES"]), ("RPS", p["qkv"]["RPS"]),
                                ("QEPS_BITS", kernels.float_bits(eps_in)), ("OBITS", obits), ("OGS", ogs),
                                ("OLANES", p["out"]["LANES"]), ("ORPS", p["out"]["RPS"]), ("PF", int(prefetch)))
    PW = Hq * 2 * D + 2 * Hkv * D
    inputs = ((dtype, (B, tokens, K)), (mx.uint32, (PW, K * bits // 32)), (scale_dtype, (PW, K // group_size)),
              (scale_dtype, (PW, K // group_size)), (norm_in_dtype, (K,))) + attn.inputs[1:] + (
        (mx.uint32, (H, Hq * D * obits // 32)), (oscale_dtype, (H, Hq * D // ogs)), (oscale_dtype, (H, Hq * D // ogs)),
        (dtype, (B, tokens, H)), (mx.int32, (kernels.SYNC_SLOTS,)))
    outputs = attn.output_dtypes[1:] + (dtype,) + (() if fold else (dtype,)) + (dtype,)
    return kernels.Instance(template, inputs, outputs)


_LAUNCH: dict = {}  # argument signature -> (spec name, template, grid, threadgroup, nsplit) or None


def _launch(x, norm, qkv, qn, kn, eps, keys, values, offset, o_proj, residual, kw, rows, fold, kv_write=False):
    wide, prefetch = enabled("attn_decode_wide"), enabled("chain_prefetch")
    target = kernels.plan_overrides().get("attn_chain", {}).get("BLOCKS", TARGET_BLOCKS)
    key = (tuple((a.shape, a.dtype) for a in (x, norm[0], *qkv[:3], qn, kn, keys, values, offset, *o_proj[:3],
                                               residual)),
           qkv[3:], o_proj[3:], norm[1], eps, tuple(sorted(kw.items())), None if rows is None else rows[0].shape, fold,
           wide, prefetch, target, ad.stage_rows(), kv_write, kernels.sm_count())
    hit = _LAUNCH.get(key, False)
    if hit is not False:
        return hit
    launch = None
    heads = (kw["n_heads"], kw["n_kv_heads"], kw["rope_dims"], kw["scale"], kw["plane"])
    if unsupported(x, norm, qkv, qn, kn, eps, keys, values, offset, o_proj, residual, *heads, rows) is None:
        (B, L, K), (_, Hkv, cap, D), Hq = x.shape, keys.shape, kw["n_heads"]
        ns = ad.splits(B * L, Hkv, cap, target)
        fold = fold and ns <= FOLD_MAX_SPLITS
        w, scales, _, bits, group_size = qkv
        wo, so, _, obits, ogs = o_proj
        p = plan(kernels.row_bucket(B * L), K, Hq, Hkv, D, bits, wo.shape[0], obits, fold, key[-1])
        inst = instance(x.dtype, keys.dtype, qn.dtype, norm[0].dtype, scales.dtype, so.dtype, B, K, bits, group_size,
                        Hq, Hkv, D, kw["rope_dims"], kw["rope_theta"], eps, norm[1], kw["scale"], wo.shape[0], obits,
                        ogs, fold, rows is not None, p=p, tokens=L, wide=wide, prefetch=prefetch, kv_write=kv_write,
                        stage=ad.staged(cap, ns))
        threads = 32 * p["WARPS"]
        launch = ("attn_chain" if fold else "attn_chain_long", list(inst.template),
                  (blocks(p, B * L, Hq, Hkv, ns, fold) * threads, 1, 1), (threads, 1, 1), ns)
    _LAUNCH[key] = launch
    return launch


def decode_add(x, norm, qkv, q_norm_weight, k_norm_weight, eps: float, keys, values, offset, o_proj, residual, *,
               n_heads: int, n_kv_heads: int, rope_dims: int, rope_theta: float, scale: float, plane: int = 0,
               row_start=None, row_pos=None, fold: bool = True, backend: str, init_value: Optional[float] = None,
               kv_write: bool = False):
    """Decode tokens' attention half from the layer's input: x [B, T, K] (T new tokens: 1, or a speculative verify's
    few), norm = (input norm weight [K], eps), qkv = (w, scales, biases, bits, group_size) of the fused projection
    [q | gate per head, k, v], o_proj the same of the output projection [H, Hq*D], residual [B, T, H]; the rest as
    ops.attention_decode takes them. fold: merge the splits inside o_proj where FOLD_MAX_SPLITS allows (switch
    qmv_attn), else attn_chain_long. -> (k_new, v_new [B, Hkv, T, D], part_acc, part_ml [B*T, Hq, NS, .],
    proj [B, T, PW], out [B, T, Hq*D] (attn_chain_long only), h [B, T, H] = residual + o_proj(attention)), or None
    if not applicable. kv_write: the new rows also written into keys and values in place (switch kv_write; k_new is
    then marked, attn_decode.written_in_place)."""
    if norm is None or qkv is None or o_proj is None or residual is None:
        return None
    rows = None if row_start is None else (row_start, row_pos)
    kw = dict(n_heads=n_heads, n_kv_heads=n_kv_heads, rope_dims=rope_dims, rope_theta=rope_theta, scale=scale,
              plane=plane)
    launch = _launch(x, norm, qkv, q_norm_weight, k_norm_weight, eps, keys, values, offset, o_proj, residual, kw, rows,
                     fold, kv_write)
    if launch is None:
        return None
    name, template, grid, group, ns = launch
    (B, L, _), (_, Hkv, _, D) = x.shape, keys.shape
    Hq, PW = n_heads, qkv[0].shape[0]
    inputs = [x, *qkv[:3], norm[0], q_norm_weight, k_norm_weight, keys, values, offset, ad._plane_array(plane),
              *(rows or (ad._plane_array(0), ad._plane_array(0))), *o_proj[:3], residual, kernels.sync_counters()]
    shapes = [(B, Hkv, L, D), (B, Hkv, L, D), (B * L, Hq, ns, D), (B * L, Hq, ns, 2), (B, L, PW)]
    dtypes = [keys.dtype, keys.dtype, mx.float32, mx.float32, x.dtype]
    if name == "attn_chain_long":
        shapes.append((B, L, Hq * D))
        dtypes.append(x.dtype)
    shapes.append(residual.shape)
    dtypes.append(x.dtype)
    out = tuple(kernels.call(name, backend, inputs, template, grid, group, shapes, dtypes, init_value))
    if kv_write:
        ad.mark_written(out[0])
    return out


def _instances(fold: bool) -> list[kernels.Instance]:
    """The 35B-A3B layer (2048 -> 9216, group 64; o_proj 4096 -> 2048) and the embedded models' heads at decode batch
    rows, bf16 and float32, a left-padded batch; the test shapes."""
    f32, bf16 = mx.float32, mx.bfloat16
    insts = [instance(t, t, t, t, bf16, bf16, B, 2048 if D == 256 else 64 * Hq, 4, 64, Hq, Hkv, D, rd,
                      1e7 if D == 256 else 1e4, 1e-6, 1e-6, D**-0.5, 2048 if D == 256 else 64 * Hq, 4, 64, fold, rows)
             for B, Hq, Hkv, D, rd in ad.MODEL_HEADS for t in (bf16, f32) for rows in ((False, True) if B > 1 else (False,))]
    insts += [instance(t, t, t, t, bf16, bf16, B, 96, 8, 32, Hq, Hkv, D, rd, 1e4, 1e-6, 1e-5, D**-0.5, 70, 4, 32, fold,
                       False)
              for B, Hq, Hkv, D, rd in ad.TEST_HEADS for t in (bf16, f32)]
    insts += [instance(bf16, bf16, bf16, bf16, bf16, bf16, 1, 2048, 4, 64, 16, 2, 256, 64, 1e7, 1e-6, 1e-6, 256**-0.5,
                       2048, 4, 64, fold, tokens=L) for L in (2, 5)]  # a speculative verify's tokens
    insts += [instance(t, t, t, t, bf16, bf16, 1, 2048, 4, 64, 16, 2, 256, 64, 1e7, 1e-6, 1e-6, 256**-0.5, 2048, 4, 64,
                       fold, wide=True) for t in (bf16, f32)]  # attn_decode_wide
    insts += [instance(bf16, bf16, bf16, bf16, bf16, bf16, 1, 2048, 4, 64, 16, 2, 256, 64, 1e7, 1e-6, 1e-6, 256**-0.5,
                       2048, 4, 64, fold, prefetch=True)]  # chain_prefetch
    insts += [instance(t, t, t, t, bf16, bf16, 1, 2048, 4, 64, 16, 2, 256, 64, 1e7, 1e-6, 1e-6, 256**-0.5, 2048, 4, 64,
                       fold, kv_write=True) for t in (bf16, f32)]  # kv_write
    return kernels.unique_instances(insts, key=kernels.source_key)


_WEIGHTS = (("w", "scales", "biases"), ("wo", "so", "bo"))


def _register_cap(template: dict) -> int:
    return MAX_REGISTERS if template["M"] == 1 else 0

_BUNDLE = ("w", "nw", "qn", "kn", "wo")
_INPUTS = ("x", "w", "scales", "biases", "nw") + ad.SPEC.input_names[1:] + ("wo", "so", "bo", "res", "sync")
SPEC = kernels.register_spec(kernels.KernelSpec(
    name="attn_chain", body="attn_chain.inc", input_names=_INPUTS,
    output_names=ad.SPEC.output_names[1:] + ("proj", "h"), template_params=SPEC_PARAMS,
    description="a gated-attention layer's decode half in one launch: input norm, fused q|k|v projection, split "
                "attention, the splits' merge inside o_proj, the residual add",
    instances=lambda: _instances(True), defines=("LILY_CHAIN",), weights=_WEIGHTS, bundle=_BUNDLE,
    cuda_max_registers=_register_cap,
))
LONG_SPEC = kernels.register_spec(kernels.KernelSpec(
    name="attn_chain_long", body="attn_chain.inc", input_names=_INPUTS,
    output_names=ad.SPEC.output_names[1:] + ("proj", "out", "h"), template_params=SPEC_PARAMS,
    description="attn_chain for a finely split cache: the splits merged once (attn_combine's body), then o_proj",
    instances=lambda: _instances(False), defines=("LILY_CHAIN", "LILY_CHAIN_COMBINE"), weights=_WEIGHTS,
    bundle=_BUNDLE, cuda_max_registers=_register_cap,
))


def _dispatch(x, *args, **kwargs):
    from . import backend, chain_takes

    out = decode_add(x, *args, **kwargs, backend=backend()) if chain_takes("attn_chain", x) else None
    return None if out is None else (out[-1], out[0], out[1])


# On by default on CUDA at one row (and a 2-token verify), opt-in on Metal (compile-checked only): see ops.chain_takes.
register_kernel("attn_chain", SPEC.description, _dispatch, default_on="cuda")
