"""logprobs: a sampling step's log-softmax and greedy token in ONE launch (kernels/logprobs.inc, CUDA and Metal).

generate_step turns the last position's logits into logprobs (logits - logsumexp) and hands them to the sampler;
the greedy sampler takes their argmax. MLX reduces a row in one block, so over the 248,320-token vocabulary each
reduction is tens of microseconds of one SM (argmax: 40 us on the H200, ncu run 33), three launches a token. This
kernel spreads a row over NB chunk blocks in two ticket-ordered phases (kernels.sync_counters' protocol), and
with the greedy sampler picks the token in the same launch; variant logprobs_argmax takes the argmax alone (the
MTP head's draft). Each result equals the reference's bit for bit where the float32 logsumexp rounds to the same
T (the reduction orders differ).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from . import kernels, metal_source, register_kernel

FLOAT_DTYPES = (mx.float32, mx.bfloat16, mx.float16)
THREADS = 256
PER = 8  # elements a thread takes from its chunk: CHUNK = 2048, 122 chunks a row of the 248,320 vocabulary
CHUNK = THREADS * PER
MAX_V = 1 << 24  # token indices travel as exact float32
SPEC_PARAMS = ("T", "THREADS", "PER")


def unsupported(logits: mx.array) -> Optional[str]:
    """Why the kernel does not apply (None when it does)."""
    if logits.dtype not in FLOAT_DTYPES:
        return f"logits dtype {logits.dtype}: float32, bfloat16 or float16 expected"
    if logits.ndim < 1 or logits.size == 0 or not 0 < logits.shape[-1] < MAX_V or logits.size >= 2**31:
        return f"logits shape {logits.shape}: a non-empty [..., V] with V < 2^24 and under 2^31 elements expected"
    return None


def instance(dtype, R: int, V: int) -> kernels.Instance:
    return kernels.Instance((("T", dtype), ("THREADS", THREADS), ("PER", PER)),
                            ((dtype, (R, V)), (mx.int32, (kernels.SYNC_SLOTS,))), (dtype, mx.uint32, mx.float32))


def _launch(name: str, logits: mx.array, backend: str, init_value: Optional[float]):
    V = logits.shape[-1]
    x = logits.reshape(-1, V)
    R, NB = x.shape[0], -(-V // CHUNK)
    blocks = R * NB * (1 if name == "logprobs_argmax" else 2)
    shapes = [(1,) if name == "logprobs_argmax" else x.shape, (R,), (R, NB, 4)]
    inst = instance(logits.dtype, R, V)
    return kernels.call(name, backend, [x, kernels.sync_counters()], list(inst.template), (blocks * THREADS, 1, 1),
                        (THREADS, 1, 1), shapes, list(inst.output_dtypes), init_value)


def logprobs(logits: mx.array, *, greedy: bool, backend: str,
             init_value: Optional[float] = None) -> Optional[tuple[mx.array, Optional[mx.array]]]:
    """logits [..., V] -> (logits - logsumexp(logits) [..., V] in their dtype, their argmax [...] uint32 when greedy
    else None), or None when the kernel does not apply."""
    if unsupported(logits) is not None:
        return None
    lp, token, _ = _launch("logprobs", logits, backend, init_value)
    return lp.reshape(logits.shape), token.reshape(logits.shape[:-1]) if greedy else None


def argmax(logits: mx.array, *, backend: str, init_value: Optional[float] = None) -> Optional[mx.array]:
    """logits [..., V] -> their argmax [...] uint32 (the first maximum), or None when the kernel does not apply."""
    if unsupported(logits) is not None:
        return None
    return _launch("logprobs_argmax", logits, backend, init_value)[1].reshape(logits.shape[:-1])


# The 35B-A3B's vocabulary (a token, an MTP verify's two, a batch of 8), the tiny checkpoints', odd widths.
def _instances() -> list[kernels.Instance]:
    insts = [instance(mx.bfloat16, R, 248320) for R in (1, 2, 8)]
    insts += [instance(mx.float32, 1, 248320), instance(mx.float32, 3, 1000), instance(mx.float16, 2, 4097),
              instance(mx.bfloat16, 1, 512)]
    return kernels.unique_instances(insts, key=lambda i: metal_source.metal_kernel_name("logprobs", i.template,
                                                                                      i.inputs, i.output_dtypes))


SPEC = kernels.register_spec(kernels.KernelSpec(
    name="logprobs", body="logprobs.inc", input_names=("x", "sync"), output_names=("logprobs", "token", "part"),
    template_params=SPEC_PARAMS, instances=_instances,
    description="a sampling step's logprobs (logits - logsumexp) and greedy token in one launch",
))
ARGMAX_SPEC = kernels.register_spec(kernels.KernelSpec(
    name="logprobs_argmax", body="logprobs.inc", input_names=("x", "sync"), output_names=("logprobs", "token", "part"),
    template_params=SPEC_PARAMS, instances=_instances, defines=("LILY_ARGMAX_ONLY",),
    description="the argmax over a row of logits in one launch of many blocks (the MTP head's draft)",
))


def _dispatch(logits, **kwargs):
    from . import backend

    return logprobs(logits, backend=backend(), **kwargs)


def _dispatch_argmax(logits, **kwargs):
    from . import backend

    return argmax(logits, backend=backend(), **kwargs)


# On for CUDA: H100 run 59 (2026-12-06), the chained step's timeline: one 9.2 us launch where MLX's argmax, logsumexp
# and subtract took 54 us (each one block over the 248,320 logits). Its cuda tests, the model's greedy tokens with and
# without it (MTP's draft argmax too) among them, pass under CUDA's defaults (run 60). Its only whole-step A/B (run 35)
# was one of profile_decode's void in-process ones.
register_kernel("logprobs", SPEC.description, _dispatch, default_on="cuda")
register_kernel("logprobs_argmax", ARGMAX_SPEC.description, _dispatch_argmax, default_on="cuda")
