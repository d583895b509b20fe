"""moe_combine: the prefill's routed-expert rows, sorted by expert, back in token order and weighted-summed over the
top-k in one launch (kernels/moe_combine.inc, CUDA and Metal).

SwitchGLU sorts a prefill's (token, expert) rows by expert for the grouped GEMMs, then MLX unsorts the down
projection's output (a gather copying all T * k rows) and sums it weighted by the router's scores (a float32 product
and a reduction over [T, k, H]). H200, 35B-A3B, one layer's MoE at 2048 tokens (run 12, bench/profile_prefill.py
--moe-parts, each part alone): the unsort 0.33 ms and the weighted sum 0.33 ms, against 0.55 ms for one expert
projection. This kernel reads the sorted rows once and writes [T, H]: 75.9 vs 435.6 us at 2048 tokens
(bench.kernels, run 13), and the whole prefill, on vs off in one process, 71.8 vs 97.0 ms at 512 tokens, 123.1 vs
130.7 at 2048, 466.9 vs 525.7 at 8192, 1001.5 vs 1113.4 at 16,384.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from . import kernels, metal_source, register_kernel

THREADS = 256
FLOAT_DTYPES = (mx.float32, mx.bfloat16, mx.float16)
SPEC_PARAMS = ("T", "TS", "TO", "H", "TOPK", "THREADS")


def unsupported(y, inv_order, scores, dtype) -> Optional[str]:
    """Why the kernel does not apply (None when it does)."""
    if y.ndim != 2 or y.dtype not in FLOAT_DTYPES or scores.dtype not in FLOAT_DTYPES or dtype not in FLOAT_DTYPES:
        return f"y {y.dtype} {y.shape}, scores {scores.dtype}, output {dtype}: 2-D float rows and float scores"
    if inv_order.dtype not in (mx.int32, mx.uint32) or inv_order.size != y.shape[0] or scores.size != y.shape[0]:
        return f"inv_order {inv_order.dtype} {inv_order.shape}, scores {scores.shape}: one int32 row and score per row of y {y.shape}"
    if not 1 <= scores.shape[-1] <= 64:
        return f"top-k {scores.shape[-1]}: 1 to 64 experts per token"
    if y.size >= 2**31:
        return "int32 indexing: more than 2^31 elements in y"
    return None


def instance(y_dtype, score_dtype, out_dtype, tokens: int, H: int, top_k: int, inv_dtype=mx.int32) -> kernels.Instance:
    template = (("T", y_dtype), ("TS", score_dtype), ("TO", out_dtype), ("H", H), ("TOPK", top_k), ("THREADS", THREADS))
    inputs = ((y_dtype, (tokens * top_k, H)), (inv_dtype, (tokens * top_k,)), (score_dtype, (tokens, top_k)))
    return kernels.Instance(template, inputs, (out_dtype,))


def combine(y, inv_order, scores, dtype, *, backend: str, init_value: Optional[float] = None) -> Optional[mx.array]:
    """y [R, H] sorted rows, inv_order [R] (row of y for each flat (token, j)), scores [..., k] -> [..., H] in
    dtype, or None when the kernel does not apply."""
    if unsupported(y, inv_order, scores, dtype) is not None:
        return None
    k, H = scores.shape[-1], y.shape[-1]
    inst = instance(y.dtype, scores.dtype, dtype, scores.size // k, H, k, inv_order.dtype)
    return _launch("moe_combine", inst, y, inv_order, scores, (), dtype, backend, init_value)


def _launch(name: str, inst: kernels.Instance, y, inv_order, scores, per_token, dtype, backend: str,
            init_value: Optional[float]) -> mx.array:
    """One block a token over [y, inv, scores] and the per-token arrays [..., *] -> [..., H] in dtype."""
    k, H = scores.shape[-1], y.shape[-1]
    tokens = scores.size // k
    inputs = [y, inv_order.reshape(-1), scores.reshape(tokens, k)] + [a.reshape(tokens, a.shape[-1]) for a in per_token]
    out = kernels.call(name, backend, inputs, list(inst.template), (tokens * THREADS, 1, 1), (THREADS, 1, 1),
                       [(tokens, H)], [dtype], init_value)[0]
    return out.reshape(*scores.shape[:-1], H)


def unsupported_shared(y, inv_order, scores, dtype, hs, logits, residual, gate_column: int) -> Optional[str]:
    """Why moe_combine_shared does not apply (None when it does)."""
    why = unsupported(y, inv_order, scores, dtype)
    if why is not None:
        return why
    lead = (*scores.shape[:-1], y.shape[-1])
    if hs.shape != lead or residual.shape != lead:
        return f"hs {hs.shape}, residual {residual.shape}: {lead} expected"
    if logits.shape[:-1] != scores.shape[:-1] or not 0 <= gate_column < logits.shape[-1]:
        return f"logits {logits.shape}: the gate column {gate_column} of [..., LS] a token expected"
    if not hs.dtype == residual.dtype == logits.dtype == dtype:
        return (f"dtypes: hs {hs.dtype}, residual {residual.dtype}, logits {logits.dtype} and the output {dtype} "
                "must agree")
    return None


def shared_instance(y_dtype, score_dtype, out_dtype, tokens: int, H: int, top_k: int, columns: int, gate_column: int,
                    inv_dtype=mx.int32) -> kernels.Instance:
    base = instance(y_dtype, score_dtype, out_dtype, tokens, H, top_k, inv_dtype)
    inputs = base.inputs + ((out_dtype, (tokens, H)), (out_dtype, (tokens, columns)), (out_dtype, (tokens, H)))
    return kernels.Instance(base.template + (("LS", columns), ("E", gate_column)), inputs, base.output_dtypes)


def combine_shared(y, inv_order, scores, dtype, hs, logits, residual, gate_column: int, *, backend: str,
                   init_value: Optional[float] = None) -> Optional[mx.array]:
    """combine(...) and the MoE block's tail in the same launch: residual + (the weighted sum + sigmoid(logits[...,
    gate_column]) * hs), [..., H] in dtype, or None when the kernel does not apply."""
    if unsupported_shared(y, inv_order, scores, dtype, hs, logits, residual, gate_column) is not None:
        return None
    k = scores.shape[-1]
    inst = shared_instance(y.dtype, scores.dtype, dtype, scores.size // k, y.shape[-1], k, logits.shape[-1],
                           gate_column, inv_order.dtype)
    return _launch("moe_combine_shared", inst, y, inv_order, scores, (hs, logits, residual), dtype, backend,
                   init_value)


def _shared_instances() -> list[kernels.Instance]:
    insts = [shared_instance(d, mx.float32, d, 2048, 2048, 8, 257, 256) for d in (mx.bfloat16, mx.float16, mx.float32)]
    insts.append(shared_instance(mx.float32, mx.bfloat16, mx.bfloat16, 3, 200, 3, 9, 8, mx.uint32))
    return kernels.unique_instances(insts, key=lambda i: metal_source.metal_kernel_name(
        "moe_combine_shared", i.template, i.inputs, i.output_dtypes))


def _instances() -> list[kernels.Instance]:
    insts = [instance(mx.bfloat16, mx.float32, mx.bfloat16, 2048, 2048, 8), instance(mx.float16, mx.float32, mx.float16, 2048, 2048, 8),
             instance(mx.float32, mx.float32, mx.float32, 2048, 2048, 8), instance(mx.bfloat16, mx.bfloat16, mx.float32, 3, 200, 3, mx.uint32)]
    return kernels.unique_instances(insts, key=lambda i: metal_source.metal_kernel_name("moe_combine", i.template, i.inputs,
                                                                                      i.output_dtypes))


SPEC = kernels.register_spec(kernels.KernelSpec(
    name="moe_combine", body="moe_combine.inc", input_names=("y", "inv", "scores"), output_names=("out",),
    template_params=SPEC_PARAMS,
    description="prefill experts: the sorted rows back in token order, weighted and summed over the top-k",
    instances=_instances,
))


SHARED_SPEC = kernels.register_spec(kernels.KernelSpec(
    name="moe_combine_shared", body="moe_combine.inc", input_names=("y", "inv", "scores", "hs", "logits", "residual"),
    output_names=("out",), template_params=SPEC_PARAMS + ("LS", "E"),
    description="prefill MoE block's end: moe_combine, the sigmoid-gated shared expert and the residual in one launch",
    instances=_shared_instances, defines=("LILY_COMBINE_SHARED",),
))


def _dispatch(y, inv_order, scores, dtype):
    from . import backend

    return combine(y, inv_order, scores, dtype, backend=backend())


register_kernel("moe_combine", SPEC.description, _dispatch)


def _dispatch_shared(y, inv_order, scores, dtype, hs, logits, residual, gate_column):
    from . import backend

    return combine_shared(y, inv_order, scores, dtype, hs, logits, residual, gate_column, backend=backend())


# On: its cuda tests pass (H200 run 28; the model test in float32, where a one-ulp rounding change alone moves the tiny
# bf16 model past any useful bound); run 29, interleaved rounds: 4 launches a layer fewer, 58.0 vs 58.7 ms at 512
# tokens, 90.5 vs 91.0 at 2048, equal at 8192; with moe_route and prefill_overlap the fastest at every length.
register_kernel("moe_combine_shared", SHARED_SPEC.description, _dispatch_shared)
