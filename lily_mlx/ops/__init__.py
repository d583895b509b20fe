"""The one entry point per hot op. Models import only this module.

Each op picks an implementation by device and shape: a custom kernel (CUDA or Metal) where one is
registered, enabled and applicable, else the plain-MLX reference (which is also the CPU path).
Every fused path can be switched off for A/B attribution, by API (`set_enabled`) or by the
environment: LILY_MLX_DISABLE=qmv,moe_dequant_gemm,... (or `all`). Kernels not yet verified on hardware are
registered off by default and opted into with LILY_MLX_ENABLE=name,... (or `set_enabled(name, True)`); a path measured
on one backend only is on by default there and opt-in elsewhere.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable, Iterable, Optional, Union

import mlx.core as mx

from . import reference

KERNEL_NAMES: dict[str, str] = {}  # switch name -> one-line description, filled by kernel modules
_disabled: set[str] = {s.strip() for s in os.environ.get("LILY_MLX_DISABLE", "").split(",") if s.strip()}
_opted_in: set[str] = {s.strip() for s in os.environ.get("LILY_MLX_ENABLE", "").split(",") if s.strip()}
_default_off: set[str] = set()
_default_backend: dict[str, str] = {}  # switch -> the one backend it is on by default on (opt-in on the others)


def backend() -> str:
    """'cuda', 'metal' or 'cpu': where ops placed on the default device run."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return "cpu"


def enabled(name: str) -> bool:
    if "all" in _disabled or name in _disabled:
        return False
    return name not in _default_off or name in _opted_in or (name in _default_backend and
                                                               _default_backend[name] == backend())


def backend_defaults(name: str) -> tuple[str, ...]:
    """The switches on by default on backend `name` only (register_switch's default_on=name)."""
    return tuple(n for n, b in _default_backend.items() if b == name)


# The decode chains (moe_chain, deltanet_chain_out, attn_chain) with packed_weights, bundled_weights and kv_scatter
# are on by default on CUDA: 363.9 tok/s at context 256 and 334.4 at 4096 against the unchained kernels' 170.7 and
# 187.0, tokens identical to stock mlx-lm's (H100 run 53); their cuda tests pass (run 51). MTP's 2-token verify takes
# them too: its kernels take longer (3,568 us against 3,134) but it dispatches in 1.44 ms of host CPU against 3.20, so
# it runs in 3.61 ms pipelined against 3.72, and MTP decoding at acceptance 1 / 0.8 went 440 / 286 -> 505 / 359 tok/s
# (H100 runs 80 and 82). At 3 tokens (4.21 against 5.02 ms) and in batches (unmeasured) they stay opt-in.
def chain_takes(name: str, x: mx.array) -> bool:
    """Whether decode chain `name` takes x [..., K]: one row of one token (batch-1 decode), the two tokens of one row
    (MTP's verify, x [1, 2, K]), or any rows where it was opted into by name."""
    rows = x.size // x.shape[-1]
    return rows == 1 or (rows == 2 and x.ndim == 3 and x.shape[0] == 1) or name in _opted_in


def switch_key() -> tuple:
    """Every switch's setting, for keying what was built under them: on or off, and opted into by name (which lets a
    chain take any rows, chain_takes)."""
    return tuple((enabled(n), n in _opted_in) for n in sorted(KERNEL_NAMES))


def set_enabled(name: str, on: bool) -> None:
    if name != "all" and name not in KERNEL_NAMES:
        raise KeyError(f"unknown kernel switch {name!r}; known: {sorted(KERNEL_NAMES)} or 'all'")
    (_disabled.discard if on else _disabled.add)(name)
    (_opted_in.add if on else _opted_in.discard)(name)


@contextmanager
def disabled(*names: str):
    """Temporarily switch fused paths off: `with ops.disabled('qmv'): ...`."""
    before = set(_disabled), set(_opted_in)
    for n in names:
        set_enabled(n, False)
    try:
        yield
    finally:
        _disabled.clear(), _opted_in.clear()
        _disabled.update(before[0]), _opted_in.update(before[1])


@contextmanager
def switched(names: Union[str, Iterable[str]], on: bool):
    """Temporarily force one path (or several) on or off, opt-in ones too: `with ops.switched('deltanet_chunk', True):
    ...`, `with ops.switched(('moe_chain', 'attn_chain'), False): ...`."""
    with disabled():  # restores every switch afterwards
        for name in [names] if isinstance(names, str) else names:
            set_enabled(name, on)
        yield


# Kernel modules register here: name -> fn(*args, **kwargs) -> result or None (not applicable).
_kernels: dict[str, Callable] = {}


def register_kernel(name: str, description: str, fn: Callable, default_on: Union[bool, str] = True) -> None:
    """default_on=False for a kernel not yet verified on GPU hardware: it runs only when opted into; a backend name
    ('cuda') for one measured there only: on by default there, opt-in elsewhere."""
    _kernels[name] = fn
    register_switch(name, description, default_on)


def register_switch(name: str, description: str, default_on: Union[bool, str] = True) -> None:
    """A fused path that is not a single kernel (e.g. the compiled decode step): switchable like one."""
    KERNEL_NAMES[name] = description
    if default_on is not True:
        _default_off.add(name)
    if isinstance(default_on, str):
        _default_backend[name] = default_on


# Calls each switched-on kernel declined (its arguments outside what it takes) since the process started: a kernel
# that declines in a real run is silently not measured (bench/profile_prefill.py prints these).
declined: dict[str, int] = {}


def _try(name: str, *args, **kwargs):
    fn = _kernels.get(name)
    if fn is None or not enabled(name) or backend() == "cpu":
        return None
    out = fn(*args, **kwargs)
    if out is None:
        declined[name] = declined.get(name, 0) + 1
    return out


# Rows and weight elements from which a dense quantized projection runs as dequantize + a dense bf16 GEMM on
# CUDA. H200, 2048 rows (bench/profile_prefill.py): DeltaNet in_proj 0.96 -> 0.50 ms, o_proj 0.49 -> 0.19 ms. The
# small ones (the shared expert's 1M-element weights, the router's 0.5M) were left to MLX's quantized matmul by an
# older dequantize's figures (0.27 -> 0.35 ms); ncu of a 512-token prefill (run 20) has that matmul at 54-62 us a
# call on 32 blocks (the router's 257 columns: its naive kernel), where dequantize + GEMM is some 10 us.
DENSE_DEQUANT_MIN_ROWS = 512
DENSE_DEQUANT_MIN_WEIGHTS = 1 << 18
register_switch("dense_dequant_gemm", "prefill projections: dequantize the weight, then a dense GEMM (CUDA)")


def dequantize(w, scales, biases, *, group_size: int, bits: int, dtype) -> mx.array:
    """Affine-quantized w [..., K*bits/32] (scales/biases [..., K/group]) -> [..., K] in dtype: the operand of the
    prefill's dequantized GEMMs. One kernel launch where it applies, else mx.dequantize."""
    out = _try("dequant", w, scales, biases, group_size=group_size, bits=bits, dtype=dtype)
    if out is not None:
        return out
    return mx.dequantize(w, scales, biases, group_size=group_size, bits=bits).astype(dtype)


def embedding_lookup(ids, w, scales, biases, *, group_size: int, bits: int) -> mx.array:
    """Rows ids [...] of an affine-quantized table w [V, K*bits/32] (scales/biases [V, K/group]), dequantized:
    [..., K] in the scales' dtype, as mlx.nn.QuantizedEmbedding returns them. One launch where it applies."""
    kernel_ids = ids.astype(mx.int32) if ids.dtype == mx.int64 else ids  # numpy's ids (row numbers < 2^31 anyway)
    out = _try("dequant_rows", kernel_ids, w, scales, biases, group_size=group_size, bits=bits)
    if out is not None:
        return out
    return mx.dequantize(w[ids], scales[ids], biases[ids], group_size=group_size, bits=bits)


def _many_rows_matmul(x, w, scales, biases, group_size: int, bits: int) -> mx.array:
    """The quantized matmul where no kernel applies: on CUDA from DENSE_DEQUANT_MIN_ROWS rows and
    DENSE_DEQUANT_MIN_WEIGHTS weight elements, the weight dequantized to x's dtype and a dense GEMM on the tensor
    cores; else MLX's quantized matmul."""
    if (x.size // x.shape[-1] >= DENSE_DEQUANT_MIN_ROWS and w.shape[0] * x.shape[-1] >= DENSE_DEQUANT_MIN_WEIGHTS
            and backend() == "cuda" and enabled("dense_dequant_gemm")):
        return x @ dequantize(w, scales, biases, group_size=group_size, bits=bits, dtype=x.dtype).T  # [..., N]
    return reference.quantized_matmul(x, w, scales, biases, group_size=group_size, bits=bits)


def quantized_matmul(x, w, scales, biases, *, group_size: int, bits: int) -> mx.array:
    """x [..., K] times affine-quantized w [N, K*bits/32] (scales/biases [N, K/group]) -> [..., N]."""
    out = _try("qmv", x, w, scales, biases, group_size=group_size, bits=bits)
    if out is not None:
        return out
    return _many_rows_matmul(x, w, scales, biases, group_size, bits)


def norm_quantized_matmul(x, norm_weight, eps: float, w, scales, biases, *, group_size: int, bits: int) -> mx.array:
    """quantized_matmul(rms_norm(x, norm_weight, eps), w, ...): a layer's input norm and projection, one launch."""
    out = _try("qmv", x, w, scales, biases, group_size=group_size, bits=bits, norm=(norm_weight, eps))
    if out is not None:
        return out
    return _many_rows_matmul(reference.rms_norm(x, norm_weight, eps), w, scales, biases, group_size, bits)


def quantized_matmul_add(x, w, scales, biases, residual, *, group_size: int, bits: int) -> mx.array:
    """residual + quantized_matmul(x, w, ...): an output projection and the residual add, one launch."""
    out = _try("qmv", x, w, scales, biases, group_size=group_size, bits=bits, residual=residual)
    if out is not None:
        return out
    return residual + _many_rows_matmul(x, w, scales, biases, group_size, bits)


# Sorted expert rows (tokens x top-k) from which dequantizing every expert and running MLX's grouped GEMM
# beats its quantized gather on CUDA (H200, bench/profile_prefill.py: 3.2 vs 4.7 ms at 2048 rows, 22 vs 5.3 ms at 16384).
DEQUANT_GEMM_MIN_ROWS = 4096
register_switch("moe_dequant_gemm", "prefill experts: dequantize to bf16, then MLX's grouped GEMM (CUDA)")
# On for CUDA: H100 run 62 (2026-12-06), every chain, context 64, fresh processes in turn: the step's dispatch took
# 1.27 / 1.35 ms of thread CPU with it, 1.89 / 1.78 without (MLX hashed ~2.8 MB of inline source a step: 19% of the
# dispatch's samples in run 60's native profile). Its earlier "slower" verdicts came from in-process A/Bs that timed
# one configuration in both arms (profile_decode.switch_ab before the twenty-fifth session).
register_switch("cuda_source_files", "CUDA kernel sources #included from files: MLX hashes a short stub per launch",
                default_on="cuda")
register_switch("kernel_cache", "CUDA kernels built once per machine into MLX's on-disk cache, which MLX reads but "
                "never writes for custom kernels (ops/kernel_cache.py)")
# On: H100 run 51, every chain, attn_chain_long 92.6 -> 61.9 us a call at context 4096 and 43.6 -> 39.5 at 64 (its
# attention blocks had waited for the managed page); the pipelined step 3.48 -> 3.44 ms, 2.72 -> 2.70.
register_switch("device_scalars", "the decode step's offset and the attention planes as views of 16 bytes in device "
                "memory, not in MLX's managed pool of arrays up to 8 bytes (kernels.int32_scalar)")
# On: the compiled step's kernels took as long either way (H100 run 50: 2,506 us off, 2,522 on), but with the counters
# in managed memory bench/chain_trace.py's readback stalled the first tickets 6-17 us (a fresh host-made array a launch
# did not: kernels/scratch/counter_memory.py).
register_switch("device_counters", "decode chains' phase counters in device memory, not managed memory the host's "
                "writes move (kernels.sync_counters)")


def gather_matmul_dequantized(x, w, indices, *, scales, biases, group_size: int, bits: int) -> mx.array:
    """gather_matmul of many rows sorted by expert: all experts dequantized to x's dtype (w [E, N, K]), then
    gather_mm, which on CUDA runs sorted rows as one cutlass grouped GEMM on the tensor cores."""
    wd = dequantize(w, scales, biases, group_size=group_size, bits=bits, dtype=x.dtype)  # [E, N, K]
    return mx.gather_mm(x, wd.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=True)  # [..., k, 1, N]


# Sorted expert rows from which moe_gemm beats MLX's quantized gather (H200, bench/profile_prefill.py --sweep, one
# layer's routed experts: 1.12 vs 0.59 ms at 256 rows, 1.02 vs 1.11 at 512, 1.98 vs 22.4 at 16,384).
MOE_GEMM_MIN_ROWS = 512


def _moe_gemm_runs(rows: int) -> bool:
    return (_kernels.get("moe_gemm") is not None and enabled("moe_gemm") and backend() != "cpu"
            and rows >= MOE_GEMM_MIN_ROWS)


def sorted_expert_starts(indices, experts: int) -> Optional["_moe_gemm.ExpertStarts"]:
    """For rows sorted by expert: what moe_gemm's blocks search (computed once for a layer's three projections),
    or None where moe_gemm will not run."""
    if not _moe_gemm_runs(indices.size):
        return None
    return _moe_gemm.expert_starts(indices, experts, _moe_gemm.tile_rows(indices.size, experts))


def sort_by_expert(indices, experts: int):
    """indices [..., k] (each token's experts) -> the flat rows (t * k + j) grouped by expert: (each sorted row's
    expert [R], inv_order [R] (each flat row's sorted place), x_rows [R] int32 (each sorted row's token), moe_gemm's
    ExpertStarts or None where moe_gemm will not run). One launch where moe_sort applies (its rows within an expert
    in no set order), else MLX's argsorts (stable)."""
    rows, k = indices.size, indices.shape[-1]
    bm = _moe_gemm.tile_rows(rows, experts)
    out = _try("moe_sort", indices, experts, bm)
    if out is not None:
        starts = _moe_gemm.ExpertStarts(out.row_starts, out.tile_starts, bm) if _moe_gemm_runs(rows) else None
        return out.indices, out.inv_order, out.x_rows, starts
    flat = indices.flatten()
    order = mx.argsort(flat)
    idx = flat[order]
    return idx, mx.argsort(order), (order // k).astype(mx.int32), sorted_expert_starts(idx, experts)


def gather_matmul(x, w, indices, *, scales=None, biases=None, group_size=64, bits=4, sorted_indices=False,
                  expert_starts=None, x_rows=None):
    """x [..., 1|k, 1, K], experts w [E, N, K(packed)], indices [..., k] -> [..., k, 1, N]. expert_starts: from
    sorted_expert_starts(indices, E), where the caller has it. x_rows [R]: the rows are x[x_rows] (x [T, 1, K]),
    which moe_gemm reads in place and every other path gathers first."""
    if scales is not None and sorted_indices and indices.size >= MOE_GEMM_MIN_ROWS:
        out = _try("moe_gemm", x, w, indices, scales=scales, biases=biases, group_size=group_size, bits=bits,
                   starts=expert_starts, x_rows=x_rows)
        if out is not None:
            return out
    if x_rows is not None:
        x = x[x_rows]
    if (scales is not None and sorted_indices and indices.size >= DEQUANT_GEMM_MIN_ROWS and backend() == "cuda"
            and enabled("moe_dequant_gemm")):
        return gather_matmul_dequantized(x, w, indices, scales=scales, biases=biases, group_size=group_size, bits=bits)
    return reference.gather_matmul(
        x, w, indices, scales=scales, biases=biases, group_size=group_size, bits=bits, sorted_indices=sorted_indices
    )


def rms_norm(x, weight, eps: float) -> mx.array:
    return reference.rms_norm(x, weight, eps)


def gated_rms_norm(x, z, weight, eps: float) -> mx.array:
    """rmsnorm(x [..., D]) * weight * silu(z [..., D])."""
    return reference.gated_rms_norm(x, z, weight, eps)


def causal_conv1d(x, weight, state, lengths=None):
    """x [B, T, C], weight [C, W, 1], state [B, W-1, C] -> (silu(conv(x)) [B, T, C], new state)."""
    return reference.causal_conv1d(x, weight, state, lengths)


# Below this many tokens the sequential scan beats the chunked form's fixed cost.
CHUNKED_MIN_TOKENS = 16


def gated_delta(q, k, v, log_g, beta, state: Optional[mx.array] = None, mask=None):
    """Gated delta rule. q, k [B, T, Hk, Dk] normalised; v [B, T, Hv, Dv]; log_g, beta [B, T, Hv]
    float32; state [B, Hv, Dv, Dk] float32; mask [B, T] bool. Returns (y [B, T, Hv, Dv], state)."""
    out = _try("deltanet", q, k, v, log_g, beta, state, mask)
    if out is not None:
        return out
    if q.shape[1] >= CHUNKED_MIN_TOKENS:
        return reference.gated_delta_chunked(q, k, v, log_g, beta, state, mask, scan=chunk_scan, intra=chunk_intra)
    return reference.gated_delta_sequential(q, k, v, log_g, beta, state, mask)


def chunk_intra(q, k, v, log_g, beta, state=None, mask=None, chunk_size: int = 64):
    """The intra-chunk part of the chunked gated delta rule (reference.chunk_intra's arguments and result):
    one launch for all chunks where the kernel applies."""
    log_g, beta = reference.masked_gates(log_g, beta, mask)
    qkv = (q, k, v)
    if not q.dtype == k.dtype == v.dtype:  # deltanet_mix: float32 q, k (l2-normalised), the conv's 16-bit v
        qkv = tuple(x.astype(mx.float32) for x in qkv)  # the kernel takes one dtype; the reference is float32
    out = _try("deltanet_intra", *qkv, log_g, beta, chunk_size=chunk_size)
    if out is None:
        return reference.chunk_intra(q, k, v, log_g, beta, state, None, chunk_size)
    if state is None:
        state = mx.zeros((q.shape[0], v.shape[2], v.shape[3], q.shape[3]), dtype=mx.float32)
    return (*out, state)


def chunk_scan(u, w, q_dec, qk, k_dec, g_last, state):
    """The scan over chunks of the chunked gated delta rule (reference.chunk_scan_reference's arguments
    and result): one launch for all chunks where the kernel applies, else chunk by chunk."""
    out = _try("deltanet_chunk", u, w, q_dec, qk, k_dec, g_last, state)
    if out is not None:
        return out
    return reference.chunk_scan_reference(u, w, q_dec, qk, k_dec, g_last, state)


def _deltanet_qk_gates(q, k, a, b, A_log, dt_bias, q_scale: float):
    """q, k [B, T, Hk, Dk] -> l2-normalised float32 (q also scaled); a, b [B, T, Hv] -> log g and beta float32."""
    log_g, beta = reference.deltanet_gates(a, b, A_log, dt_bias)
    return reference.l2_normalize(q) * q_scale, reference.l2_normalize(k), log_g, beta


# The same with each run of elementwise ops between the reductions fused into one launch (mx.compile): the mixer's
# graph holds 42 primitives that launch, 22 with these (tests/test_deltanet_chunk.py), where a 512-token prefill is
# partly bound by launches on the CPU. H200 run 24, one process: 62.5 vs 67.5 ms at 512 tokens, 96.1 vs 98.2 at 2048.
# Shapeless: one trace serves every prompt length.
_deltanet_qk_gates_compiled = mx.compile(_deltanet_qk_gates, shapeless=True)
_gated_rms_norm_compiled = mx.compile(reference.gated_rms_norm, shapeless=True)
register_switch("compiled_mixer", "prefill DeltaNet mixer: the q/k norms and gates, and the gated output norm, "
                "each one mx.compile'd graph (fewer launches)")


def deltanet_mix(proj, conv_weight, conv_state, A_log, dt_bias, norm_weight, state, *, num_key_heads: int,
                 eps: float, mask=None, lengths=None):
    """The Gated DeltaNet mixer after its input projection. proj [B, T, C + Hv*Dv + 2*Hv] is the fused
    projection [qkv (C = 2*Hk*Dk + Hv*Dv) | z (Hv*Dv) | b (Hv) | a (Hv)]; conv_weight [C, W, 1],
    conv_state [B, W-1, C]; A_log, dt_bias [Hv]; norm_weight [Dv]; state [B, Hv, Dv, Dk] float32 or None;
    mask [B, T] bool; lengths [B] (right-padded rows). Returns (rmsnorm(y) * w * silu(z) [B, T, Hv*Dv],
    new conv state, new state)."""
    B, T, _ = proj.shape
    Hv, Dv, C = A_log.shape[0], norm_weight.shape[0], conv_weight.shape[0]
    key_dim = (C - Hv * Dv) // 2
    Dk = key_dim // num_key_heads
    z = proj[..., C:C + Hv * Dv]
    compiled = enabled("compiled_mixer")
    # One launch up to the delta rule, its padding tokens already no-ops (right-padded rows: the composition).
    prep = None if lengths is not None else _try("deltanet_prep", proj, conv_weight, conv_state, A_log, dt_bias,
                                                 value_head_dim=Dv, num_key_heads=num_key_heads, mask=mask)
    if prep is not None:
        q, k, v, log_g, beta, conv_state = prep  # float32 q, k, v, gates
        y, state = gated_delta(q, k, v, log_g, beta, state)
        y = y.astype(proj.dtype)
    else:
        qkv, b, a = proj[..., :C], proj[..., C + Hv * Dv:C + Hv * Dv + Hv], proj[..., C + Hv * Dv + Hv:]
        if mask is not None:
            qkv = mx.where(mask[..., None], qkv, 0)
        conv_out, conv_state = causal_conv1d(qkv, conv_weight, conv_state, lengths=lengths)
        q, k, v = mx.split(conv_out, [key_dim, 2 * key_dim], axis=-1)
        qk_gates = _deltanet_qk_gates_compiled if compiled else _deltanet_qk_gates
        q, k, log_g, beta = qk_gates(q.reshape(B, T, num_key_heads, Dk), k.reshape(B, T, num_key_heads, Dk), a, b,
                                     A_log, dt_bias, Dk**-0.5)
        y, state = gated_delta(q, k, v.reshape(B, T, Hv, Dv), log_g, beta, state, mask)
    norm = _gated_rms_norm_compiled if compiled else gated_rms_norm
    out = norm(y, z.reshape(B, T, Hv, Dv), norm_weight, eps)
    return out.reshape(B, T, Hv * Dv), conv_state, state


def deltanet_decode_step(proj, conv_weight, conv_state, A_log, dt_bias, norm_weight, state, *, num_key_heads: int,
                         eps: float, mask=None, lengths=None, source=None, keep: bool = False, alt=None):
    """deltanet_mix for decode tokens (T = 1, or a few after a cache: a speculative verify): one fused launch where
    the kernel applies, else the same composition. Right-padded batches (lengths) always take the composition. proj:
    the fused projection [B, T, qkv | z | b | a], or a function returning it; source = (x [B, T, K], (input norm
    weight, eps), (w, scales, biases, bits, group_size) of the quantized projection) lets deltanet_chain compute
    proj in the same launch, and a function given for proj is then not called. keep (T >= 2, no lengths): the conv
    state and state after all but the last token follow, what a speculative verify rolls a rejected draft back to.
    alt = (conv state, state, use_alt [1] bool): the tokens start from that pair where use_alt, else from conv_state
    and state (a verify whose start the GPU picks; the kernels read the picked pair in place)."""
    if lengths is None and source is not None and enabled("deltanet_step") and enabled("qmv"):
        out = _try("deltanet_chain", *source, conv_weight, conv_state, A_log, dt_bias, norm_weight, state,
                   num_key_heads=num_key_heads, eps=eps, mask=mask, keep=keep, alt=alt)
        if out is not None:
            return out
    proj = proj() if callable(proj) else proj
    if lengths is None:
        out = _try("deltanet_step", proj, conv_weight, conv_state, A_log, dt_bias, norm_weight, state,
                   num_key_heads=num_key_heads, eps=eps, mask=mask, keep=keep, alt=alt)
        if out is not None:
            return out
    conv_state, state = picked_states(conv_state, state, alt)
    mix = lambda p, m: deltanet_mix(p, conv_weight, conv_state, A_log, dt_bias, norm_weight, state,  # noqa: E731
                                    num_key_heads=num_key_heads, eps=eps, mask=m, lengths=lengths)
    if not keep:
        return mix(proj, mask)
    return (*mix(proj, mask), *mix(proj[:, :-1], None if mask is None else mask[:, :-1])[1:])


def deltanet_decode_add(x, norm, in_proj, out_proj, residual, conv_weight, conv_state, A_log, dt_bias, norm_weight,
                        state, *, num_key_heads: int, eps: float, mask=None, keep: bool = False, alt=None):
    """residual + out_proj(the DeltaNet step of x) for decode tokens, the layer's whole mixer half in one launch
    (deltanet_chain_out): (h [B, T, H], conv state, state[, and with keep the two states after all but the last
    token]), or None where that does not apply (the caller runs deltanet_decode_step and its output projection).
    norm = (weight, eps); in_proj, out_proj = (w, scales, biases, bits, group_size) of the fused input projection
    and of the output projection; alt as deltanet_decode_step takes it."""
    if not (enabled("deltanet_step") and enabled("qmv")):
        return None
    return _try("deltanet_chain_out", x, norm, in_proj, conv_weight, conv_state, A_log, dt_bias, norm_weight, state,
                num_key_heads=num_key_heads, eps=eps, mask=mask, out_proj=out_proj, residual=residual, keep=keep,
                alt=alt)


def picked_states(conv_state, state, alt) -> tuple:
    """(conv state, state): alt's pair (conv state, state, use_alt [1] bool) where use_alt, else the given one. The
    reference of the decode kernels' ALT, which read the picked pair in place instead."""
    if alt is None:
        return conv_state, state
    conv_alt, state_alt, use_alt = alt
    return mx.where(use_alt, conv_alt, conv_state), mx.where(use_alt, state_alt, state)


def rope(x, dims: int, base: float, offset) -> mx.array:
    return reference.rope(x, dims, base, offset)


# Scores one prefill attention may hold at once: 2^27 (512 MB in float32) bounds a 65,536-token prompt's
# attention to the memory of a 2,048-token one (16 query heads: blocks of 128 queries at the end).
MAX_ATTENTION_SCORES = 1 << 27


# Scores (B * Hq * L * S) from which prefill attention takes flash_attn: H200, 35B-A3B, whole prefills in 2048-token
# chunks (2^26 scores a layer), flash_attn from 2^26 vs from 2^28, one process (run 11): 2048 tokens 124.8 vs
# 126.6 ms, 8192 519.8 vs 542.6, 16,384 1102.5 vs 1131.2 (run 9, 2048 tokens: 163.1 vs 160.3 without it).
FLASH_MIN_SCORES = 1 << 26


def attention(q, k, v, *, scale: float, mask=None) -> mx.array:
    """q [B, Hq, L, D], k/v [B, Hkv, S, D] -> [B, Hq, L, D]; mask None, 'causal' (bottom-right) or an array."""
    scores = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
    if scores >= FLASH_MIN_SCORES:
        out = _try("flash_attn", q, k, v, scale=scale, mask=mask)
        if out is not None:
            return out
    if scores > MAX_ATTENTION_SCORES:
        return reference.attention_query_blocked(q, k, v, scale=scale, mask=mask, max_scores=MAX_ATTENTION_SCORES)
    return reference.attention(q, k, v, scale=scale, mask=mask)


def attention_decode(proj, q_norm_weight, k_norm_weight, eps: float, keys, values, offset, *, n_heads: int,
                     n_kv_heads: int, rope_dims: int, rope_theta: float, scale: float, plane: int = 0,
                     row_start=None, row_pos=None):
    """Decode tokens of gated full attention. proj [B, T, Hq*2*D + 2*Hkv*D] the fused projection (per query head
    [q | gate], then k, then v) of T new tokens (1 a step; a few, at most attn_decode.MAX_TOKENS, in a speculative
    verify: token t sees tokens 0..t); q/k_norm_weight [D]; keys, values [P*B, Hkv, capacity, D] the cache (plane
    `plane` of P stacked ones: rows plane*B to plane*B + B), of which the first offset [1] int32 positions hold the
    earlier tokens. q and k are RMS-normalised and rotated at position offset + t. A left-padded batch gives
    row_start, row_pos [B] int32: row b's tokens are columns [row_start[b], offset) and its first new token rotates
    at row_pos[b]. Returns (softmax(q K^T scale) V * sigmoid(gate) [B, T, Hq*D], and the new cache rows k_new, v_new
    [B, Hkv, T, D] for the caller to store from column offset)."""
    args = (proj, q_norm_weight, k_norm_weight, eps, keys, values, offset)
    kw = dict(n_heads=n_heads, n_kv_heads=n_kv_heads, rope_dims=rope_dims, rope_theta=rope_theta, scale=scale,
              plane=plane, row_start=row_start, row_pos=row_pos)
    out = _try("attn_decode", *args, **kw)
    if out is not None:
        return out
    return reference.attention_decode(*args, **kw)


def attention_decode_add(proj, q_norm_weight, k_norm_weight, eps: float, keys, values, offset, o_proj, residual, *,
                         n_heads: int, n_kv_heads: int, rope_dims: int, rope_theta: float, scale: float,
                         group_size: int, bits: int, plane: int = 0, row_start=None, row_pos=None, source=None,
                         kv_write: bool = False):
    """residual + o_proj(attention_decode(...)): a decode token's attention through its quantized output projection,
    o_proj = (w [N, Hq*D*bits/32], scales, biases [N, Hq*D/group]), and the residual add. Returns (h [B, T, N], k_new,
    v_new). With switch qmv_attn, a split cache's merge happens inside the projection (one launch fewer). proj: the
    fused projection, or a function returning it; source = (x [B, T, K], (input norm weight, eps), (w, scales,
    biases, bits, group_size) of the quantized projection) lets attn_chain run the whole layer half in one launch,
    and a function given for proj is then not called. kv_write: attn_chain may also write k_new and v_new into keys
    and values in place (attn_decode.written_in_place(k_new) says whether it did)."""
    kw = dict(n_heads=n_heads, n_kv_heads=n_kv_heads, rope_dims=rope_dims, rope_theta=rope_theta, scale=scale,
              plane=plane, row_start=row_start, row_pos=row_pos)
    if source is not None and enabled("attn_decode") and enabled("qmv"):
        out = _try("attn_chain", *source, q_norm_weight, k_norm_weight, eps, keys, values, offset,
                   (*o_proj, bits, group_size), residual, fold=enabled("qmv_attn"), kv_write=kv_write, **kw)
        if out is not None:
            return out
    proj = proj() if callable(proj) else proj
    args = (proj, q_norm_weight, k_norm_weight, eps, keys, values, offset)
    out = _try("qmv_attn", *args, o_proj, residual, group_size=group_size, bits=bits, **kw)
    if out is not None:
        return out
    attn, k_new, v_new = attention_decode(*args, **kw)
    return quantized_matmul_add(attn, *o_proj, residual, group_size=group_size, bits=bits), k_new, v_new


def moe_route(logits, top_k: int, normalize: bool, experts: Optional[int] = None):
    """Router logits [..., E] (or the first `experts` columns of wider ones) -> (expert indices [..., k] uint32,
    weights [..., k] float32): one launch where moe_route applies."""
    experts = logits.shape[-1] if experts is None else experts
    out = _try("moe_route", logits, top_k, normalize, experts)
    if out is not None:
        return out
    return reference.moe_route(logits[..., :experts], top_k, normalize)


def weighted_top_k(y, scores, dtype) -> mx.array:
    """The top-k experts' outputs y [..., k, H] summed weighted by scores [..., k] -> [..., H] in dtype."""
    return reference.weighted_top_k(y, scores, dtype)


def combine_sorted_experts(y, inv_order, scores, dtype, shared=None, residual=None) -> mx.array:
    """Sorted expert rows y [R, H], inv_order [R], scores [..., k] -> the weighted sum over the top-k [..., H] in
    dtype: one launch where the kernel applies (moe_combine), else the unsort gather and a float32 weighted sum.
    shared (hs [..., H], logits [..., E + 1]) and residual [..., H] add the MoE block's tail (moe_block_tail), in the
    same launch where moe_combine_shared applies."""
    if shared is not None and residual is not None:
        hs, logits = shared
        out = _try("moe_combine_shared", y, inv_order, scores, dtype, hs, logits, residual, logits.shape[-1] - 1)
        if out is not None:
            return out
    out = _try("moe_combine", y, inv_order, scores, dtype)
    out = out if out is not None else reference.moe_combine(y, inv_order, scores, dtype)
    return moe_block_tail(out, shared, residual)


def moe_block_tail(y, shared=None, residual=None) -> mx.array:
    """The routed experts' sum y [..., H], plus the shared expert's output hs gated by sigmoid(logits[..., E]) where
    shared = (hs, logits [..., E + 1]), plus the residual where given."""
    if shared is not None:
        hs, logits = shared
        y = y + mx.sigmoid(logits[..., -1:]) * hs
    return y if residual is None else residual + y


def moe_decode(x, norm_weight, eps: float, logits, gate, up, down, shared_gate, shared_up, shared_down, *,
               top_k: int, normalize: bool, group_size: int, bits: int, router=None):
    """x + MoE(rmsnorm(x)) for a few tokens: the routed top-k SwiGLU experts and the sigmoid-gated
    shared expert, in two launches where the kernels apply (moe_gate_up, moe_down_combine).

    x [..., H] the residual stream; norm_weight [H] (None: x is used as it is); logits [..., E + 1] the
    router's logits with the shared-expert gate's last, or a function returning them; gate, up: (w [E, I,
    H*bits/32], scales, biases [E, I, H/group]); down the same for [E, H, I]; shared_*: the same without E.
    Returns [..., H]. router: the quantized router that gives the logits, (w [E + 1, H*b/32], scales, biases, b,
    group); with moe_chain (the whole block in one launch) or moe_router_fold (the gate/up kernel) the logits are
    computed from it, and a function given for `logits` is not called (no router launch is built)."""
    E = gate[0].shape[0]
    q = {"group_size": group_size, "bits": bits}
    norm = None if norm_weight is None else (norm_weight, eps)
    logits_of = logits if callable(logits) else lambda: logits
    if router is not None and enabled("moe_gate_up") and enabled("moe_down_combine"):
        y = _try("moe_chain", x, norm, router, gate, up, down, shared_gate, shared_up, shared_down, top_k=top_k,
                 normalize=normalize, **q)
        if y is not None:
            return y
    folded = None
    if router is not None and enabled("moe_down_combine"):
        folded = _try("moe_router_fold", x, norm, router, gate, up, shared_gate, shared_up, top_k=top_k,
                      normalize=normalize, **q)
    if folded is not None:
        h, hs, inds, scores, logits = folded  # the kernel's own logits: the down step reads the shared gate's column
    else:
        logits = logits_of()
        if enabled("moe_gate_up") and enabled("moe_down_combine"):
            y = _try("moe_packed", x, norm, logits, gate, up, down, shared_gate, shared_up, shared_down, top_k=top_k,
                     normalize=normalize, **q)
            if y is not None:
                return y
        out = _try("moe_gate_up", x, norm, logits, gate, up, shared_gate, shared_up, top_k=top_k, normalize=normalize,
                   **q)
        if out is None:
            xn = x if norm is None else reference.rms_norm(x, norm_weight, eps)
            inds, scores = moe_route(logits[..., :E], top_k, normalize)
            h, hs = _moe.gate_up_unfused(xn, inds, gate, up, shared_gate, shared_up, **q)
        else:
            h, hs, inds, scores = out
    y = _try("moe_down_combine", h, hs, inds, scores, logits, down, shared_down, x, **q)
    if y is not None:
        return y
    return _moe.down_combine_unfused(h, hs, inds, scores, logits[..., E:E + 1], down, shared_down, x, **q)


def to_logprobs(logits, *, greedy: bool = False) -> tuple[mx.array, Optional[mx.array]]:
    """logits [..., V] -> (logprobs = logits - logsumexp(logits) [..., V] in the logits' dtype, as generate_step
    hands them to the sampler; with greedy, the greedy sampler's token [...] uint32 (their argmax), else None).
    One launch where the kernel applies."""
    out = _try("logprobs", logits, greedy=greedy)
    if out is not None:
        return out
    lp = reference.logprobs(logits)
    return lp, mx.argmax(lp, axis=-1) if greedy else None


def argmax(logits) -> mx.array:
    """logits [..., V] -> the index of each row's first maximum [...] uint32 (mx.argmax). One launch of many
    blocks where the kernel applies."""
    out = _try("logprobs_argmax", logits)
    return out if out is not None else mx.argmax(logits, axis=-1)


# Kernel modules register themselves on import; they need register_kernel above.
from . import qmv as _qmv  # noqa: E402,F401
from . import moe as _moe  # noqa: E402,F401
from . import deltanet_step as _deltanet_step  # noqa: E402,F401
from . import deltanet_chunk as _deltanet_chunk  # noqa: E402,F401
from . import deltanet_intra as _deltanet_intra  # noqa: E402,F401
from . import flash_attn as _flash_attn  # noqa: E402,F401
from . import attn_decode as _attn_decode  # noqa: E402,F401
from . import dequant as _dequant  # noqa: E402,F401
from . import moe_gemm as _moe_gemm  # noqa: E402,F401
from . import moe_sort as _moe_sort  # noqa: E402,F401
from . import deltanet_prep as _deltanet_prep  # noqa: E402,F401
from . import moe_router as _moe_router  # noqa: E402,F401
from . import moe_combine as _moe_combine  # noqa: E402,F401
from . import moe_chain as _moe_chain  # noqa: E402,F401
from . import deltanet_chain as _deltanet_chain  # noqa: E402,F401
from . import logprobs as _logprobs  # noqa: E402,F401
from . import attn_chain as _attn_chain  # noqa: E402,F401

# Rows (tokens in a step) up to which the decode kernels apply; each power-of-two bucket below is one JIT build.
DECODE_KERNEL_ROWS = max(_qmv.MAX_M, _moe.MAX_M)
