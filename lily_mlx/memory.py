"""Bounded prefill memory: MLX dispatches a long prompt's layers far ahead of the GPU, and every dispatched
layer holds its temporaries until the GPU runs it, so peak memory grows with how far the CPU runs ahead, not
with the prompt. Two bounds, either or both:

- layers (on by default for chunks of MIN_TOKENS tokens or more): the model dispatches each half of a decoder
  layer (its mixer, then its MoE block) and then waits for the half 2 * layers - 1 back, so at most `layers`
  layers are queued ahead of the GPU, whose temporaries alone are alive (TextModel.hidden). H200, 35B-A3B,
  bench/profile_prefill.py, 8192 tokens (run 9, one process, whole layers then): one layer ahead 546 ms at
  weights + 3.99 GB, unbounded 712 ms at weights + 12.45 GB; two layers 547 ms (+5.86), four 551 ms (+8.28).
  Half-layer steps since the seventh session, when a DeltaNet mixer held 1.0 GB at 2048 tokens (run 14; 0.5 GB
  once deltanet_intra ran again): 8192 tokens at weights + 2.34 GB, 16,384 at + 2.34 (run 16; + 3.94 in run 14).
  $LILY_MLX_PREFILL_LAYERS (0: no bound).
- headroom (opt-in): MLX's evaluator waits for queued work while active memory is over its memory limit
  (mlx/transforms.cpp), so a limit a little above the memory in use when the prefill starts caps the run-ahead.
  The same run: 0.5 GB of headroom 1024 ms at weights + 2.83 GB, as the GPU idles while MLX waits.
  $LILY_MLX_PREFILL_HEADROOM (bytes, or with a K/M/G suffix).
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import mlx.core as mx

HEADROOM_ENV = "LILY_MLX_PREFILL_HEADROOM"
LAYERS_ENV = "LILY_MLX_PREFILL_LAYERS"
DEFAULT_LAYERS = 1  # layers a long chunk may queue ahead of the GPU where nothing else is asked for
MIN_TOKENS = 1024  # the default bound's smallest chunk: shorter prefills are dispatch-bound (not measured bounded)
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_layers_ahead: Optional[int] = None  # set inside bounded_prefill; read by TextModel.hidden
_layers_default = False  # whether _layers_ahead is the default (then only chunks of MIN_TOKENS or more are bounded)


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
    """$LILY_MLX_PREFILL_LAYERS (0: no bound), None where it is unset."""
    text = os.environ.get(LAYERS_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit():
        raise ValueError(f"{LAYERS_ENV}={text!r}: expected a whole number of layers (0: no bound)")
    return int(text)


def dispatch(*arrays) -> bool:
    """mx.async_eval(*arrays), so the GPU starts on them while Python builds what follows; False, doing nothing,
    inside mx.compile, grad or vmap, where MLX allows no evaluation."""
    try:
        mx.async_eval(*arrays)
    except ValueError as e:
        if "graph transformation" not in str(e):
            raise
        return False
    return True


def layers_ahead(tokens: int) -> Optional[int]:
    """How many decoder layers a prefill chunk of `tokens` tokens may queue ahead of the GPU (None: no bound)."""
    if _layers_ahead is None or (_layers_default and tokens < MIN_TOKENS):
        return None
    return _layers_ahead


@contextlib.contextmanager
def bounded_prefill(headroom: Optional[int] = None, layers: Optional[int] = None):
    """Within the block, MLX's memory limit is min(its limit, active memory now + headroom), and a prefill queues
    at most `layers` decoder layers ahead of the GPU (0: no bound); both restored after. None: the environment
    variables; where $LILY_MLX_PREFILL_LAYERS is unset too, DEFAULT_LAYERS for chunks of MIN_TOKENS or more."""
    global _layers_ahead, _layers_default
    headroom = default_headroom() if headroom is None else headroom
    layers = default_layers() if layers is None else layers
    is_default = layers is None
    if is_default:
        layers = DEFAULT_LAYERS
    if layers < 0:
        raise ValueError(f"layers={layers}: a whole number of layers ahead expected (0: no bound)")
    previous, previous_layers = mx.get_memory_limit(), (_layers_ahead, _layers_default)
    limit = None if headroom is None else mx.get_active_memory() + headroom
    if limit is not None and limit < previous:
        mx.set_memory_limit(limit)
    _layers_ahead, _layers_default = (layers or None), is_default
    try:
        yield
    finally:
        _layers_ahead, _layers_default = previous_layers
        mx.set_memory_limit(previous)
