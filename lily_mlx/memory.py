"""Bounded prefill memory, opt-in: MLX dispatches a long prompt's layers far ahead of the GPU, and every
dispatched layer holds its temporaries until the GPU runs it, so peak memory grows with how far the CPU runs
ahead, not with the prompt. Two bounds, either or both:

- headroom: MLX's evaluator waits for queued work while active memory is over its memory limit
  (mlx/transforms.cpp), so a limit a little above the memory in use when the prefill starts caps the run-ahead.
  H200, 35B-A3B, bench/profile_prefill.py, 8192 tokens with moe_gemm: 0.5 GB of headroom took the peak over the
  weights from 12.45 to 2.83 GB, and the prefill from 871 to 1248 ms, as the GPU idles while MLX waits.
  $LILY_MLX_PREFILL_HEADROOM (bytes, or with a K/M/G suffix).
- layers: the model dispatches each decoder layer and then waits for the one `layers` back, so at most that many
  layers are queued ahead of the GPU, whose temporaries alone are alive (TextModel.hidden). Not yet measured on a
  GPU. $LILY_MLX_PREFILL_LAYERS.

Off unless the variables are set or a bound is passed."""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import mlx.core as mx

HEADROOM_ENV = "LILY_MLX_PREFILL_HEADROOM"
LAYERS_ENV = "LILY_MLX_PREFILL_LAYERS"
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_layers_ahead: Optional[int] = None  # set inside bounded_prefill; read by TextModel.hidden


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


def default_layers() -> Optional[int]:
    text = os.environ.get(LAYERS_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{LAYERS_ENV}={text!r}: expected a whole number of layers >= 1")
    return int(text)


def layers_ahead() -> Optional[int]:
    """How many decoder layers a prefill may queue ahead of the GPU (None: no bound)."""
    return _layers_ahead


@contextlib.contextmanager
def bounded_prefill(headroom: Optional[int] = None, layers: Optional[int] = None):
    """Within the block, MLX's memory limit is min(its limit, active memory now + headroom), and a prefill queues
    at most `layers` decoder layers ahead of the GPU; both restored after. None: $LILY_MLX_PREFILL_HEADROOM and
    $LILY_MLX_PREFILL_LAYERS, and what is unset there is not bounded."""
    global _layers_ahead
    headroom = default_headroom() if headroom is None else headroom
    layers = default_layers() if layers is None else layers
    if layers is not None and layers < 1:
        raise ValueError(f"layers={layers}: a prefill must be allowed at least one layer ahead")
    previous, previous_layers = mx.get_memory_limit(), _layers_ahead
    limit = None if headroom is None else mx.get_active_memory() + headroom
    if limit is not None and limit < previous:
        mx.set_memory_limit(limit)
    _layers_ahead = layers
    try:
        yield
    finally:
        _layers_ahead = previous_layers
        mx.set_memory_limit(previous)
