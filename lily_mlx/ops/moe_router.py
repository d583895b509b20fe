"""moe_route: a prefill's router (softmax, top-k, renormalisation) in one launch (kernels/moe_route.inc, CUDA and
Metal), where MLX's composition takes five a layer: one warp a token runs lily_topk, the routing the decode kernels
already do (moe_gate_up). Reads the router's fused logits [..., E + 1] in place (the shared-expert gate last), so no
slice is copied. Switch "moe_route", on since the tenth session: its cuda tests pass (H200 run 26), and whole prefills
were 2-5% faster with it from 2048 tokens in every run that timed it, and level at 512 once the arms were timed in
interleaved rounds (BENCHMARKS.md).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from . import kernels, metal_source, register_kernel

WARPS = 8
LOGIT_DTYPES = (mx.float32, mx.bfloat16, mx.float16)
MAX_EXPERTS = 1024  # a lane holds E / 32 logits in registers
SPEC_PARAMS = ("TL", "E", "K", "LS", "NORMTOPK", "WARPS")


def unsupported(logits, top_k: int, experts: int) -> Optional[str]:
    """Why the kernel does not apply (None when it does)."""
    if logits.ndim < 1 or logits.dtype not in LOGIT_DTYPES:
        return f"logits {logits.dtype} {logits.shape}: float [..., E] expected"
    if not 1 <= experts <= min(MAX_EXPERTS, logits.shape[-1]):
        return f"{experts} experts of {logits.shape[-1]} logit columns (at most {MAX_EXPERTS})"
    if not 1 <= top_k <= min(32, experts):
        return f"top-k {top_k}: 1 to min(32, experts) expected"
    if logits.size >= 2**31:
        return "int32 indexing"
    return None


def instance(logit_dtype, M: int, experts: int, top_k: int, columns: int, normalize: bool) -> kernels.Instance:
    template = (("TL", logit_dtype), ("E", experts), ("K", top_k), ("LS", columns), ("NORMTOPK", bool(normalize)),
                ("WARPS", WARPS))
    return kernels.Instance(template, ((logit_dtype, (M, columns)),), (mx.uint32, mx.float32))


def route(logits, top_k: int, normalize: bool, experts: int, *, backend: str, init_value: Optional[float] = None):
    """logits [..., LS], the first `experts` columns routing -> (ids [..., k] uint32, weights [..., k] float32), or
    None when the kernel does not apply."""
    if unsupported(logits, top_k, experts) is not None:
        return None
    columns = logits.shape[-1]
    M = logits.size // columns
    inst = instance(logits.dtype, M, experts, top_k, columns, normalize)
    blocks = -(-M // WARPS)
    ids, weights = kernels.call("moe_route", backend, [logits.reshape(M, columns)], list(inst.template),
                                (blocks * 32 * WARPS, 1, 1), (32 * WARPS, 1, 1), [(M, top_k)] * 2,
                                list(inst.output_dtypes), init_value)
    lead = logits.shape[:-1]
    return ids.reshape(*lead, top_k), weights.reshape(*lead, top_k)


def _instances() -> list[kernels.Instance]:
    insts = [instance(d, 512, 256, 8, 257, True) for d in LOGIT_DTYPES]
    insts += [instance(mx.bfloat16, 512, 16, 4, 17, True), instance(mx.float32, 37, 100, 3, 100, False),
              instance(mx.float16, 5, 40, 32, 41, False)]
    return kernels.unique_instances(insts, key=lambda i: metal_source.metal_kernel_name("moe_route", i.template,
                                                                                      i.inputs, i.output_dtypes))


SPEC = kernels.register_spec(kernels.KernelSpec(
    name="moe_route", body="moe_route.inc", input_names=("logits",), output_names=("ids", "weights"),
    template_params=SPEC_PARAMS,
    description="prefill router: softmax, top-k and renormalisation in one launch, one warp a token",
    instances=_instances,
))


def _dispatch(logits, top_k, normalize, experts):
    from . import backend

    return route(logits, top_k, normalize, experts, backend=backend())


# On: H200 run 29, interleaved rounds, 2048 tokens 89.2 vs 91.0 ms, 8192 367.5 vs 375.1, 512 58.7 vs 58.7.
register_kernel("moe_route", SPEC.description, _dispatch)
