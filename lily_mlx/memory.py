"""Bounded prefill memory, opt-in: MLX dispatches a long prompt's layers far ahead of the GPU, and every
dispatched layer holds its temporaries (a 2048-token MoE layer dequantizes all 256 experts: 1.6 GB) until the
GPU runs it, so peak memory grows with how far the CPU runs ahead, not with the prompt. MLX's evaluator waits
for queued work while active memory is over its memory limit (mlx/transforms.cpp), so a limit a little above
the memory in use when the prefill starts caps the run-ahead.

H200, 35B-A3B, bench/profile_prefill.py: with 2 GB of headroom the peak over the weights falls from 14-21.5 GB
to 3.2-4.4 GB (512 to 16,384 tokens), but the prefill is 7-27% slower, as the GPU idles while MLX waits. So it
is off unless LILY_MLX_PREFILL_HEADROOM (bytes, or with a K/M/G suffix) is set, or a headroom is passed."""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import mlx.core as mx

HEADROOM_ENV = "LILY_MLX_PREFILL_HEADROOM"
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'2G', '512M', '1048576' -> bytes; ValueError naming the text otherwise."""
    t = text.strip().upper().removesuffix("B")
    try:
        n = float(t[:-1]) * _UNITS[t[-1]] if t and t[-1] in _UNITS else float(t)
    except ValueError:
        raise ValueError(f"{HEADROOM_ENV}={text!r}: expected bytes, optionally with a K, M or G suffix") from None
    if not 0 < n < 2**62:
        raise ValueError(f"{HEADROOM_ENV}={text!r}: must be positive and finite")
    return int(n)


def default_headroom() -> Optional[int]:
    text = os.environ.get(HEADROOM_ENV)
    return parse_size(text) if text else None


@contextlib.contextmanager
def bounded_prefill(headroom: Optional[int] = None):
    """Within the block, MLX's memory limit is min(its limit, active memory now + headroom), restored after.
    headroom None: $LILY_MLX_PREFILL_HEADROOM, and when that is unset the block changes nothing."""
    headroom = default_headroom() if headroom is None else headroom
    previous = mx.get_memory_limit()
    limit = None if headroom is None else mx.get_active_memory() + headroom
    if limit is None or limit >= previous:
        yield
        return
    mx.set_memory_limit(limit)
    try:
        yield
    finally:
        mx.set_memory_limit(previous)
