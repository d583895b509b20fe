"""Bounded prefill memory: MLX dispatches a long prompt's layers far ahead of the GPU, and every dispatched
layer holds its temporaries (a 2048-token MoE layer dequantizes all 256 experts: 1.6 GB) until the GPU runs
it, so peak memory grows with how far the CPU runs ahead, not with the prompt. MLX's evaluator waits for
queued work while active memory is over its memory limit (mlx/transforms.cpp), so a limit a little above
the memory in use when the prefill starts caps the run-ahead at about one layer."""

from __future__ import annotations

import contextlib

import mlx.core as mx

PREFILL_HEADROOM_BYTES = 2 << 30  # above the memory in use at the prefill's start: one layer's work fits


@contextlib.contextmanager
def bounded_prefill(headroom: int = PREFILL_HEADROOM_BYTES):
    """Within the block, MLX's memory limit is min(its limit, active memory now + headroom); restored after."""
    previous = mx.get_memory_limit()
    limit = mx.get_active_memory() + headroom
    if limit >= previous:
        yield
        return
    mx.set_memory_limit(limit)
    try:
        yield
    finally:
        mx.set_memory_limit(previous)
