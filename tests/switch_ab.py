"""A kernel's switch on vs off in the embedded 4-bit model's prefill or decode steps: the GPU tests' model-level
check that the kernel path is taken and the logits agree."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from lily_mlx import ops


def _model(dtype):
    import lily_mlx
    from lily_mlx.embedded import EMBEDDED_4BIT_MODEL

    return lily_mlx.load_model(EMBEDDED_4BIT_MODEL, dtype=dtype)[0]


def _tokens(n: int) -> mx.array:
    return mx.array(np.random.default_rng(0).integers(0, 2048, (1, n)))


def _rel_err_on_vs_off(switch: str, run, kernel: Optional[str], calls: Optional[list]) -> float:
    """Relative error (L2) of run()'s float32 logits with `switch` on against off. The switch's own kernel must run
    only when on; a switch that steers another `kernel` gets that kernel's calls as (on, kwargs) in `calls`."""
    name = kernel or switch
    calls, real = [] if calls is None else calls, ops._kernels[name]
    logits = {}
    for on in (False, True):
        with ops.switched(switch, on):
            ops._kernels[name] = lambda *a, **k: calls.append((on, k)) or real(*a, **k)
            try:
                logits[on] = run().astype(mx.float32)
            finally:
                ops._kernels[name] = real
    if kernel is None:
        assert calls and all(on for on, _ in calls), f"the {switch} kernel path was not taken"
    return (mx.linalg.norm(logits[True] - logits[False]) / mx.linalg.norm(logits[False])).item()


def prefill_rel_err(switch: str, tokens: int = 300, kernel: Optional[str] = None,
                    calls: Optional[list] = None, dtype=mx.bfloat16) -> float:
    """_rel_err_on_vs_off of a `tokens`-token prefill's logits."""
    model, toks = _model(dtype), _tokens(tokens)
    return _rel_err_on_vs_off(switch, lambda: model(toks, cache=model.make_cache()), kernel, calls)


def decode_rel_err(switch: str, prompt: int = 40, steps: int = 6, kernel: Optional[str] = None,
                   calls: Optional[list] = None, dtype=mx.bfloat16, superseded_by: tuple = ()) -> float:
    """_rel_err_on_vs_off of the logits of `steps` greedy one-token steps after a `prompt`-token prefill, with the
    switches in `superseded_by` (paths that take the same layers first, e.g. a chain on by default) off in both arms."""
    model, toks = _model(dtype), _tokens(prompt)

    def run():
        cache = model.make_cache()
        model(toks, cache=cache)
        tok, out = toks[:, -1:], []
        for _ in range(steps):
            logits = model(tok, cache=cache)[:, -1]
            out.append(logits)
            tok = mx.argmax(logits, axis=-1)[:, None]
        return mx.stack(out)

    with ops.switched(superseded_by, False):
        return _rel_err_on_vs_off(switch, run, kernel, calls)


def assert_chain_decodes(switch: str, backend_marker: str, superseded_by: tuple = ()) -> None:
    """A chained kernel's model-level GPU check: the embedded 4-bit model in float32, a prompt then 6 one-token steps
    with `switch` on vs off (decode_rel_err's `superseded_by` off); the chain runs in every layer it serves (none
    declined) and the step logits agree."""
    before = ops.declined.get(switch, 0)
    err = decode_rel_err(switch, dtype=mx.float32, superseded_by=superseded_by)
    assert ops.declined.get(switch, 0) == before, f"{switch} declined the embedded model's layers"
    assert err < 1e-4, f"{backend_marker}: decode logits with {switch}: rel err {err:.2e}"
