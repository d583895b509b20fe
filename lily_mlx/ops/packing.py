"""Quantized weights packed as one array each: codes, then scales, then biases, every block 16-byte aligned.

MLX's CPU cost of a decode step grows with the constant arrays of its compiled graph and with every kernel input:
compile replays insert each constant into a map, each evaluation walks each input edge, and the CUDA backend records
each input per launch (bench/step_dispatch.py measures it). A kernel that takes a weight's three arrays as one
packed input (kernels.KernelSpec.weights) removes two constants and two edges per weight. The model's own
weight/scales/biases become views of the packed array, so nothing is held twice and every other path reads them as
before.

A packed array of a weight [*lead, WROW] uint32 with scales/biases [*lead, SROW] has shape [*lead, R]: its leading
dims are the weight's, which is how a kernel learns the rows at run time; R only makes the size cover the blocks.
"""

from __future__ import annotations

import math
import weakref
from typing import Optional

import mlx.core as mx

ALIGN_WORDS = 4  # 16 bytes: every block starts where a 16-byte load may read it
_PACKED: dict[int, tuple] = {}  # id(codes view) -> (weakref codes, weakref scales, weakref biases, packed)


def _round_up(n: int) -> int:
    return -(-n // ALIGN_WORDS) * ALIGN_WORDS


def offsets(rows: int, wrow: int, srow: int, scale_bytes: int) -> tuple[int, int, int]:
    """(scales, biases, end) in uint32 words from the packed array's start, for `rows` rows of wrow words of codes
    and srow scales (and biases) of scale_bytes each: the layout kernels.packed_preamble reads."""
    scales = _round_up(rows * wrow)
    block = _round_up(-(-rows * srow * scale_bytes // 4))
    return scales, scales + block, scales + 2 * block


def why_not(w: mx.array, scales: mx.array, biases: mx.array) -> Optional[str]:
    """Why (w, scales, biases) cannot be packed, or None."""
    if w.dtype != mx.uint32 or w.ndim < 2:
        return f"codes are {w.dtype} with {w.ndim} dims, not uint32 [..., words]"
    if scales.dtype != biases.dtype or scales.shape != biases.shape:
        return f"scales {scales.dtype}{scales.shape} and biases {biases.dtype}{biases.shape} differ"
    if scales.shape[:-1] != w.shape[:-1]:
        return f"scales' leading dims {scales.shape[:-1]} are not the codes' {w.shape[:-1]}"
    if 4 % scales.dtype.size:
        return f"scales of {scales.dtype.size} bytes do not tile 4-byte words"
    return None


def pack(w: mx.array, scales: mx.array, biases: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """(packed, w', scales', biases'): the packed array and views of it equal to the inputs, evaluated. Callers put
    the views where the inputs were; lookup(w', scales', biases') then finds the packed array."""
    reason = why_not(w, scales, biases)
    if reason is not None:
        raise ValueError(f"cannot pack this quantized weight: {reason}")
    lead = w.shape[:-1]
    rows, wrow, n_scales = math.prod(lead), w.shape[-1], scales.size
    per_word = 4 // scales.dtype.size
    s_at, b_at, end = offsets(rows, wrow, scales.shape[-1], scales.dtype.size)
    R = -(-end // rows)

    def words(a: mx.array) -> mx.array:  # a's elements as uint32 words, the last one zero-filled
        flat = a.reshape(-1)
        tail = -n_scales % per_word
        return (mx.concatenate([flat, mx.zeros((tail,), dtype=a.dtype)]) if tail else flat).view(mx.uint32)

    def pad(n: int) -> list:
        return [mx.zeros((n,), dtype=mx.uint32)] if n else []

    s_words = -(-n_scales // per_word)
    parts = [w.reshape(-1), *pad(s_at - rows * wrow), words(scales), *pad(b_at - s_at - s_words), words(biases),
             *pad(rows * R - b_at - s_words)]
    packed = mx.concatenate(parts).reshape(*lead, R)
    mx.eval(packed)
    flat = packed.reshape(-1)
    views = (flat[:rows * wrow].reshape(w.shape),
             flat[s_at:s_at + s_words].view(scales.dtype)[:n_scales].reshape(scales.shape),
             flat[b_at:b_at + s_words].view(biases.dtype)[:n_scales].reshape(biases.shape))
    mx.eval(*views)
    key = id(views[0])
    _PACKED[key] = (*(weakref.ref(v) for v in views), packed)
    weakref.finalize(views[0], _PACKED.pop, key, None)
    return (packed, *views)


def lookup(w: mx.array, scales: mx.array, biases: mx.array) -> Optional[mx.array]:
    """The packed array whose views are exactly these three arrays (the objects pack() returned), else None."""
    entry = _PACKED.get(id(w))
    if entry is None:
        return None
    rw, rs, rb, packed = entry
    return packed if rw() is w and rs() is scales and rb() is biases else None

