"""Quantized weights packed as one array each: codes, then scales, then biases, every block 16-byte aligned.

MLX's CPU cost of a decode step grows with the constant arrays of its compiled graph and with every kernel input:
compile replays insert each constant into a map, each evaluation walks each input edge, and the CUDA backend records
each input per launch (bench/step_dispatch.py measures it). A kernel that takes a weight's three arrays as one
packed input (kernels.KernelSpec.weights) removes two constants and two edges per weight. The model's own
weight/scales/biases become views of the packed array, so nothing is held twice and every other path reads them as
before.

A packed array of a weight [*lead, WROW] uint32 with scales/biases [*lead, SROW] has shape [*lead, R]: its leading
dims are the weight's, which is how a kernel learns the rows at run time; R only makes the size cover the blocks.

A bundle goes further for the decode chains (kernels.KernelSpec.bundle): every constant input of one launch (its
packed weights, norm weights, a DeltaNet layer's conv weight, A_log and dt_bias) in one array, read at offsets the
launch passes as template arguments; a layer's chain launch then takes one constant instead of up to 22.
"""

from __future__ import annotations

import math
import weakref
from typing import Optional, Sequence, Union

import mlx.core as mx

ALIGN_WORDS = 4  # 16 bytes: every block starts where a 16-byte load may read it


class ArrayTags:
    """A value tagged to an array object: found for that very object only (by id, checked through a weak reference),
    and dropped when the array goes."""

    def __init__(self):
        self._tags: dict[int, tuple] = {}

    def __len__(self) -> int:
        return len(self._tags)

    def set(self, a: mx.array, value) -> None:
        self._tags[id(a)] = (weakref.ref(a), value)
        weakref.finalize(a, self._tags.pop, id(a), None)

    def get(self, a: mx.array, default=None):
        entry = self._tags.get(id(a))
        return entry[1] if entry is not None and entry[0]() is a else default


_PACKED = ArrayTags()  # codes view -> (weakref scales, weakref biases, packed)
_BUNDLED = ArrayTags()  # member view -> (bundle, word offset)
_MAX_WORDS = 2**31 - 1


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


def packed_width(w, scales) -> int:
    """R, the last dim of the packed array [*lead, R] of codes w and its scales (arrays, or kernels.Shaped)."""
    rows = math.prod(w.shape[:-1])
    return -(-offsets(rows, w.shape[-1], scales.shape[-1], scales.dtype.size)[2] // rows)


def _triple_parts(w: mx.array, scales: mx.array, biases: mx.array) -> tuple[list, int]:
    """(uint32 parts, R): a quantized weight's packed layout as parts to concatenate, [*lead, R] words in all."""
    reason = why_not(w, scales, biases)
    if reason is not None:
        raise ValueError(f"cannot pack this quantized weight: {reason}")
    rows, wrow, n_scales = math.prod(w.shape[:-1]), w.shape[-1], scales.size
    s_at, b_at, _ = offsets(rows, wrow, scales.shape[-1], scales.dtype.size)
    R = packed_width(w, scales)
    s_words = -(-n_scales * scales.dtype.size // 4)
    parts = [w.reshape(-1), *_zeros(s_at - rows * wrow), _words(scales), *_zeros(b_at - s_at - s_words),
             _words(biases), *_zeros(rows * R - b_at - s_words)]
    return parts, R


def _words(a: mx.array) -> mx.array:
    """a's elements as uint32 words, the last one zero-filled."""
    flat = a.reshape(-1)
    tail = -a.size % (4 // a.dtype.size)
    return (mx.concatenate([flat, mx.zeros((tail,), dtype=a.dtype)]) if tail else flat).view(mx.uint32)


def _zeros(n: int) -> list:
    return [mx.zeros((n,), dtype=mx.uint32)] if n else []


def _view(flat: mx.array, at: int, like: mx.array) -> mx.array:
    """The array like `like` (shape, dtype) stored from word `at` of the uint32 array flat."""
    words = -(-like.size * like.dtype.size // 4)
    return flat[at:at + words].view(like.dtype)[:like.size].reshape(like.shape)


def _triple_views(packed: mx.array, w: mx.array, scales: mx.array, biases: mx.array) -> tuple:
    """Views of packed ([*lead, R], pack's layout) equal to w, scales, biases, evaluated and registered for lookup."""
    flat = packed.reshape(-1)
    s_at, b_at, _ = offsets(math.prod(w.shape[:-1]), w.shape[-1], scales.shape[-1], scales.dtype.size)
    views = (_view(flat, 0, w), _view(flat, s_at, scales), _view(flat, b_at, biases))
    mx.eval(*views)
    _PACKED.set(views[0], (weakref.ref(views[1]), weakref.ref(views[2]), packed))
    return views


def pack(w: mx.array, scales: mx.array, biases: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """(packed, w', scales', biases'): the packed array and views of it equal to the inputs, evaluated. Callers put
    the views where the inputs were; lookup(w', scales', biases') then finds the packed array."""
    parts, R = _triple_parts(w, scales, biases)
    packed = mx.concatenate(parts).reshape(*w.shape[:-1], R)
    mx.eval(packed)
    return (packed, *_triple_views(packed, w, scales, biases))


def lookup(w: mx.array, scales: mx.array, biases: mx.array) -> Optional[mx.array]:
    """The packed array whose views are exactly these three arrays (the objects pack() returned), else None."""
    entry = _PACKED.get(w)
    if entry is None:
        return None
    rs, rb, packed = entry
    return packed if rs() is scales and rb() is biases else None


Member = Union[mx.array, tuple[mx.array, mx.array, mx.array]]  # an array, or a quantized weight's three


def is_weight(m) -> bool:
    """Whether a bundle member is a quantized weight's (codes, scales, biases), not one array."""
    return type(m) is tuple  # kernels.Shaped, a named tuple, is one array


def _member_words(m) -> tuple[int, int]:
    """(words, R) a bundle member takes before alignment (R: a weight's packed row length, else 0). m may be known
    by shape and dtype only (kernels.Shaped)."""
    if is_weight(m):
        w, s, b = m
        reason = why_not(w, s, b)
        if reason is not None:
            raise ValueError(f"cannot bundle this quantized weight: {reason}")
        R = packed_width(w, s)
        return math.prod(w.shape[:-1]) * R, R
    if m.dtype.size > 4 or 4 % m.dtype.size:
        dtype = str(m.dtype).removeprefix("mlx.core.")
        raise ValueError(f"cannot bundle a {dtype} array {tuple(m.shape)}: its elements do not tile 4-byte words")
    return -(-m.size * m.dtype.size // 4), 0


def layout(members: Sequence) -> tuple[list[int], int]:
    """(each member's word offset, the bundle's words): members in order, each from a 16-byte boundary."""
    starts, at = [], 0
    for m in members:
        starts.append(at)
        at += _round_up(_member_words(m)[0])
    if at > _MAX_WORDS:
        raise ValueError(f"a bundle of {at} words, past {_MAX_WORDS}: kernels take its offsets as int")
    return starts, at


def bundle(members: Sequence[Member]) -> tuple[mx.array, list]:
    """(bundle, views): a launch's constant inputs in one uint32 array at layout()'s offsets. A member is an array
    (of 1, 2 or 4-byte elements) or a quantized weight's (codes, scales, biases), laid out as pack() lays it out.
    views: per member, an array equal to it (or the weight's three, whose packed array lookup finds), all views of
    the bundle and evaluated; bundled() gives a member's (bundle, word offset)."""
    starts, total = layout(members)
    parts = []
    for m, start, end in zip(members, starts, starts[1:] + [total]):
        parts += _triple_parts(*m)[0] if is_weight(m) else [_words(m)]
        parts += _zeros(end - start - _member_words(m)[0])
    blob = mx.concatenate(parts)
    mx.eval(blob)
    views = []
    for m, start in zip(members, starts):
        if is_weight(m):
            words, R = _member_words(m)
            head = blob[start:start + words].reshape(*m[0].shape[:-1], R)
            views.append(_triple_views(head, *m))
        else:
            head = _view(blob, start, m)
            mx.eval(head)
            views.append(head)
        _BUNDLED.set(head, (blob, start))
    return blob, views


def bundled(a: mx.array) -> Optional[tuple[mx.array, int]]:
    """(bundle, word offset) when a is a member view bundle() made (a weight's: its packed array), else None."""
    return _BUNDLED.get(a)
