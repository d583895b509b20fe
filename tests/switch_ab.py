"""A kernel's switch on vs off in the embedded 4-bit model's prefill (bf16 activations): the GPU tests' model-level
check that the kernel path is taken and the logits agree."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from lily_mlx import ops


def prefill_rel_err(switch: str, tokens: int = 300, kernel: Optional[str] = None,
                    calls: Optional[list] = None, dtype=mx.bfloat16) -> float:
    """Relative error (L2) of the prefill logits with `switch` on against off. The switch's own kernel must run
    only when on; a switch that steers another `kernel` gets that kernel's calls as (on, kwargs) in `calls`."""
    import lily_mlx
    from lily_mlx.embedded import EMBEDDED_4BIT_MODEL

    model, _ = lily_mlx.load_model(EMBEDDED_4BIT_MODEL, dtype=dtype)
    toks = mx.array(np.random.default_rng(0).integers(0, 2048, (1, tokens)))
    name = kernel or switch
    calls, real = [] if calls is None else calls, ops._kernels[name]
    logits = {}
    for on in (False, True):
        with ops.switched(switch, on):
            ops._kernels[name] = lambda *a, **k: calls.append((on, k)) or real(*a, **k)
            try:
                logits[on] = model(toks, cache=model.make_cache()).astype(mx.float32)
            finally:
                ops._kernels[name] = real
    if kernel is None:
        assert calls and all(on for on, _ in calls), f"the {switch} kernel path was not taken"
    return (mx.linalg.norm(logits[True] - logits[False]) / mx.linalg.norm(logits[False])).item()
