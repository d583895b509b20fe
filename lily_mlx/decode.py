"""The compiled decode step: one `mx.compile`d function over fixed shapes per cache capacity.

Eager MLX rebuilds the whole graph in Python for every token (thousands of primitives for 40
layers); compiled, the graph is traced once and MLX fuses its elementwise runs. Fixed shapes need a
fixed-capacity KV cache: keys/values are written at `offset` into [B, Hkv, capacity, D] buffers and
attention masks the unwritten tail, so the traced graph is the same at every step. When the
capacity is reached it grows by `STEP` tokens (one retrace). DeltaNet states are fixed-size already.
The compiled function is shared by every decoder of the same model, weights and switches, so a new
request re-traces only for a capacity it has not seen (a trace of the 40-layer graph costs far more
than a step).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from . import ops
from .ops import attn_decode, kernels

STEP = 256
ops.register_switch("compiled_decode", "decode steps as one mx.compile'd graph over a fixed-capacity KV cache")
# stacked_kv: H200, 2026-12-03, pipelined step 3.86 -> 3.70 ms at 256 cached positions, 3.94 -> 3.77 at 4096.
ops.register_switch("stacked_kv", "compiled decode: every attention layer's K/V in one buffer, written once a step")
# MLX's CUDA DynamicSliceUpdate (0.32.4 and main, 2026-12-05) sizes its copy's grid by the whole cache while it
# indexes by the update's shape, so each new K/V element is written capacity / T times (ncu, H200 run 33: 33-43 us
# twice a step); a scatter's grid is the update's. On by default on CUDA (2 primitives more a step): with every chain
# the copies took 240 us of a step's 3,269 us of kernels at context 4096, the scatters 8 us (H100 run 52).
ops.register_switch("kv_scatter", "compiled decode: K/V cache writes as a scatter, not a dynamic slice update",
                    default_on="cuda")
# Even as a scatter, a write MLX cannot donate its cache to (every attention launch of the step still holds it) copies
# the whole stacked cache: 1.4-1.9 such copies a step, 10 us at context 64 and 43 at 4096, besides the 20 copies that
# concatenate the layers' rows (45-50 us; H100 run 70). With kv_write, attn_chain writes its rows into the cache in
# place and the step returns the same buffers (mx.depends on the launches): no concatenation, no scatter, no copy.
# Per-layer caches (stacked_kv off, or one attention layer) likewise lose their 2 scatters a layer. On by default on
# CUDA: the step's kernels 2,235 -> 2,229 us at context 64, 2,486 -> 2,419 at 4096, 3,136 -> 2,894 at 16,384, its
# window 2,352 -> 2,278 us at 64 (H100 run 71, every chain).
ops.register_switch("kv_write", "compiled decode: attn_chain writes the new K/V rows into the cache in place",
                    default_on="cuda")
# Opt-in until the server's 8-client load has been timed with it on the H200 (its cuda tests pass there).
ops.register_switch("batched_attn_decode", "a left-padded batch's decode attention in the fused kernel",
                    default_on=False)
# A rejected draft then costs no re-run: the next verify takes [sample, draft] from the kept states, where without it
# the rejected forward's tokens go again (3-5 tokens a verify). Where mtp_resident does not apply (logits processors).
# On by default on CUDA: bench.mtp in one process, H100 run 86, tok/s at acceptance 0 / 0.5 / 0.8 / 1: 93 -> 131,
# 196 -> 252, 330 -> 397, 517 -> 522.
ops.register_switch("verify_keep", "MTP's verify forward keeps the DeltaNet states before its last token, which a "
                    "rejected draft rolls back to", default_on="cuda")
# Without it the host decides each draft and queues the next forward as if it stood, so a rejection wastes the forward
# queued ahead: (1 + a) / (2 - a) tokens a forward at acceptance a instead of 1 + a. Its select of the DeltaNet states
# runs beside the layers (CUDA graph branches: +100 us a forward). On by default on CUDA: H100 run 86, against
# verify_keep, 131 -> 253, 252 -> 368, 397 -> 449 (0.98x plain greedy's 456), 522 -> 501 tok/s.
ops.register_switch("mtp_resident", "MTP decoding decides each draft on the GPU: the next verify forward starts from "
                    "the states its draft's fate picks, so no forward is queued on a guess", default_on="cuda")


def row_positions(start1: mx.array, shape) -> mx.array:
    """Where new K/V rows [B, H, T, D] (shape) go in a cache, for write_rows: with kv_scatter, start1 [1] int32 + t
    along T broadcast to shape (one array shared by a step's writes: put_along_axis would broadcast its own each
    time); else start1 itself."""
    if not ops.enabled("kv_scatter"):
        return start1
    T = shape[2]
    pos = start1 if T == 1 else start1 + mx.array(list(range(T)), dtype=mx.int32)  # a constant: no Arange primitive
    return mx.broadcast_to(pos.reshape(1, 1, T, 1), shape)


def write_rows(cache: mx.array, new: mx.array, pos: mx.array) -> mx.array:
    """cache [B, H, capacity, D] with new [B, H, T, D] written at row_positions pos."""
    if pos.ndim == 1:  # kv_scatter off: pos is the start
        return mx.slice_update(cache, new.astype(cache.dtype), pos, axes=(2,))
    return mx.put_along_axis(cache, pos, new.astype(cache.dtype), axis=2)


class _StaticKV:
    decode_tokens = True  # several new tokens may take the decode attention (model._decodes_tokens)

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array, offset1: mx.array, pos: mx.array):
        self.keys, self.values, self.offset = keys, values, offset  # offset: int32 scalar array
        self.offset1 = offset1  # the same, shape [1]: what the fused decode attention reads
        self.pos = pos  # row_positions of the step's new rows
        self.kv_write = ops.enabled("kv_write")  # the fused attention may write its rows in place (model.Attention)

    def decode_view(self):
        """(keys, values, offset [1], plane, row_start, row_pos): what ops.attention_decode reads before
        update_and_fetch."""
        return self.keys, self.values, self.offset1, 0, None, None

    def update_and_fetch(self, k: mx.array, v: mx.array):
        if attn_decode.written_in_place(k):  # kv_write: the launch wrote them; order after it
            self.keys, self.values = mx.depends([self.keys, self.values], [k, v])
        else:
            self.keys = write_rows(self.keys, k, self.pos)
            self.values = write_rows(self.values, v, self.pos)
        return self.keys, self.values

    def make_mask(self, N: int, **_) -> mx.array:
        pos = self.offset + mx.arange(N)[:, None]  # [N, 1]: each query's absolute position
        return mx.arange(self.keys.shape[2])[None, :] <= pos  # [N, capacity]


class _StackedKV(_StaticKV):
    """Attention layer `plane`'s view of the stacked cache [P*B, Hkv, capacity, D]: the fused attention reads
    its plane in place and hands its new row to `rows`, which the step writes for every layer at once (2
    primitives per step instead of 2 per layer). The mask is _StaticKV's."""

    def __init__(self, keys: mx.array, values: mx.array, plane: int, offset: mx.array, offset1: mx.array, rows: list):
        super().__init__(keys, values, offset, offset1, None)
        self.plane, self.rows = plane, rows

    def decode_view(self):
        return self.keys, self.values, self.offset1, self.plane, None, None

    def update_and_fetch(self, k: mx.array, v: mx.array):
        self.rows.append((k, v))
        B = k.shape[0]  # the generic (several-token) attention reads its plane with the new rows written
        rows = slice(self.plane * B, (self.plane + 1) * B)
        pos = row_positions(self.offset1, k.shape)
        return write_rows(self.keys[rows], k, pos), write_rows(self.values[rows], v, pos)


class _StaticBatchKV:
    """A BatchKVCache's rows at a fixed capacity: the step writes column `idx` of every row, row i holds its
    tokens in columns [left_padding[i], idx], and `offset` [B] (tokens per row) positions RoPE."""

    def __init__(self, keys: mx.array, values: mx.array, idx1: mx.array, left_padding: mx.array, offset: mx.array,
                 pos: mx.array):
        self.keys, self.values, self.idx1, self.pos = keys, values, idx1, pos  # idx1: int32 [1]
        self.left_padding, self.offset = left_padding, offset

    def decode_view(self):
        """As _StaticKV's, each row from its own first column and RoPE position (None: the generic attention)."""
        if not ops.enabled("batched_attn_decode"):
            return None
        return self.keys, self.values, self.idx1, 0, self.left_padding, self.offset.astype(mx.int32)

    def update_and_fetch(self, k: mx.array, v: mx.array):
        self.keys = write_rows(self.keys, k, self.pos)
        self.values = write_rows(self.values, v, self.pos)
        return self.keys, self.values

    def make_mask(self, N: int, **_) -> mx.array:
        pos = mx.arange(self.keys.shape[2])[None, :]  # [1, capacity]
        visible = (pos >= self.left_padding[:, None]) & (pos <= self.idx1 + N - 1)  # [B, capacity]
        return visible[:, None, None, :]


class _StaticState:
    lengths = None

    def __init__(self, conv: mx.array, state: mx.array, keep: bool = False, alt: Optional[tuple] = None):
        self.cache = [conv, state]
        self.keep = keep  # the model's DeltaNet layer then sets kept: (conv, state) before the last token
        self.kept = None
        self.alt = alt  # (conv, state, use_alt [1] bool): the pair the step starts from instead where use_alt

    def __getitem__(self, i):
        return self.cache[i]

    def __setitem__(self, i, v):
        self.cache[i] = v

    def advance(self, n):
        pass

    def make_mask(self, N):
        return None


class CompiledDecoder:
    """Decode steps of a lily_mlx Model from a prefilled cache (plain KVCache / ArraysCache, batch B).

    `decoder(tokens [B, 1]) -> logits [B, V]` advances the cache by one token; `write_back()` puts the
    state into the original cache objects (which then continue as usual).
    """

    KIND = "single"  # the traced step's output: the last logits ("verify": CompiledVerifier's)

    def _kind(self, kind: Optional[str] = None) -> str:
        """The traced step: _step_function's name for this decoder's output (kind, default KIND) over its K/V
        layout."""
        kind = kind or self.KIND
        if self.stacked:
            return "stacked" if kind == "single" else "stacked_" + kind
        return kind

    def __init__(self, model, cache: List[Any], reserve: int = STEP):
        self.model, self.cache = model, cache
        # Outside the trace: a concatenation traced in would rerun every step.
        model.fuse_projections(ops.enabled("packed_weights"))
        self.kv_index = [i for i, c in enumerate(cache) if isinstance(c, KVCache)]
        self.state_index = [i for i, c in enumerate(cache) if isinstance(c, ArraysCache)]
        self.offset = cache[self.kv_index[0]].offset if self.kv_index else 0
        capacity = _round_up(self.offset + reserve)
        self.kv = []
        for i in self.kv_index:
            c = cache[i]
            k, v = c.keys[..., : self.offset, :], c.values[..., : self.offset, :]
            self.kv.append((_pad_to(k, capacity), _pad_to(v, capacity)))
        self.stacked = ops.enabled("stacked_kv") and len(self.kv) > 1
        if self.stacked:  # [P*B, Hkv, capacity, D]: plane p holds attention layer p's B rows
            self.kv = [(mx.concatenate([k for k, _ in self.kv]), mx.concatenate([v for _, v in self.kv]))]
        self.states = [(cache[i][0], cache[i][1]) for i in self.state_index]
        if ops.enabled("bundled_weights"):  # outside the trace too: the trace then holds the bundles as constants
            B = cache[self.kv_index[0]].keys.shape[0] if self.kv_index else cache[self.state_index[0]][0].shape[0]
            tokens, offset = mx.zeros((B, 1), dtype=mx.int32), mx.array([self.offset], dtype=mx.int32)
            _bundle_once(model, self._kind(), B, lambda: self._step(tokens, offset, *_flatten(self.kv, self.states)))
        self._fn = _shared_step(model, len(cache), self.kv_index, self.state_index, self._kind())

    @staticmethod
    def applicable(model, cache: List[Any]) -> bool:
        from .model import Model

        if not isinstance(model, Model) or not ops.enabled("compiled_decode"):
            return False
        kinds_ok = all(type(c) is KVCache or type(c) is ArraysCache for c in cache)
        states_ready = all(c[0] is not None and c[1] is not None for c in cache if type(c) is ArraysCache)
        kv_ready = all(c.keys is not None for c in cache if type(c) is KVCache)
        return kinds_ok and states_ready and kv_ready and all(c.lengths is None for c in cache if type(c) is ArraysCache)

    def _step(self, tokens, offset, *flat):
        """The uncompiled step (what is traced): logits [B, V], then every updated cache array."""
        step = _step_function(self._kind())
        return step(self.model, len(self.cache), self.kv_index, self.state_index, tokens, offset, *flat)

    def _advance(self, tokens: mx.array, n_out: int) -> list:
        """The compiled step over tokens [B, T]: its first n_out outputs and what follows the cache arrays (a verify's
        kept states); the cache arrays kept."""
        self.kv = _with_room(self.kv, self.offset + tokens.shape[1])
        out = self._fn(_token_ids(tokens), kernels.int32_scalar(self.offset), *_flatten(self.kv, self.states))
        n = n_out + 2 * (len(self.kv) + len(self.states))
        self.kv, self.states = _unflatten(out[n_out:n], len(self.kv), len(self.states))
        self.offset += tokens.shape[1]
        return out[:n_out] + out[n:]

    def __call__(self, tokens: mx.array) -> mx.array:
        return self._advance(tokens, 1)[0]

    def write_back(self) -> None:
        kv = self.kv
        if self.stacked:
            (keys, values), P = kv[0], len(self.kv_index)
            B = keys.shape[0] // P
            kv = [(keys[p * B:(p + 1) * B], values[p * B:(p + 1) * B]) for p in range(P)]
        for (k, v), i in zip(kv, self.kv_index):
            c = self.cache[i]
            c.keys, c.values, c.offset = k, v, self.offset
        for (conv, state), i in zip(self.states, self.state_index):
            self.cache[i][0], self.cache[i][1] = conv, state


class CompiledVerifier(CompiledDecoder):
    """Speculative decoding's forward (lily_mlx.speculative), compiled per token count: `verifier(tokens [B, T])
    -> (hidden [B, min(T, 2), H], logits [B, min(T, 2), V])`, the last positions' final-norm hidden states (the MTP
    head's input) and logits; the tokens take the decode kernels (model.DECODE_TOKENS_MAX). `snapshot()` /
    `restore()` roll a rejected draft back: the DeltaNet states and the length; K/V rows past the length are never
    read."""

    KIND = "verify"

    def __init__(self, model, cache: List[Any], reserve: int = STEP):
        if ops.enabled("verify_keep"):
            self.KIND = "verify_keep"
        self._kept = self._selected = None
        super().__init__(model, cache, reserve)

    def __call__(self, tokens: mx.array) -> tuple[mx.array, mx.array]:
        hidden, logits, *kept = self._advance(tokens, 2)
        if kept:
            self._kept = _unflatten(kept, 0, len(self.states))[1], self.offset - 1
        return hidden, logits

    def kept(self) -> Optional[tuple]:
        """With switch verify_keep, a snapshot of the last forward's states before its last token (restore() takes
        it: a rejected draft rolls back to it, its other tokens kept); else None."""
        return self._kept

    def selected(self, tokens: mx.array, offset1: mx.array, accept1: mx.array, after: list, before: list,
                 length: int) -> tuple[mx.array, mx.array, list, list]:
        """A forward whose start the GPU picks (switch mtp_resident): tokens [B, T] at offset1 ([1] int32, computed
        on the GPU), from the DeltaNet (conv, state) pairs `after` where accept1 ([1] bool) else `before`. ->
        (hidden, logits, the pairs after its tokens, the pairs before its last token). K/V rows go at offset1 and
        past; `length` bounds offset1 + T for the cache's room. The host's states and offset stay as they were
        (restore() sets them)."""
        if self._selected is None:
            self._selected = _shared_step(self.model, len(self.cache), self.kv_index, self.state_index,
                                          self._kind("verify_select"))
        self.kv = _with_room(self.kv, length)
        out = self._selected(_token_ids(tokens), offset1, accept1, *_flatten(self.kv, after), *_flatten([], before))
        n = 2 + 2 * (len(self.kv) + len(self.states))
        self.kv, after = _unflatten(out[2:n], len(self.kv), len(self.states))
        return out[0], out[1], after, _unflatten(out[n:], 0, len(self.states))[1]

    def snapshot(self) -> tuple:
        return list(self.states), self.offset

    def restore(self, snapshot: tuple) -> None:
        self.states, self.offset = list(snapshot[0]), snapshot[1]


class CompiledDrafter:
    """The MTP head's drafts (lily_mlx.speculative) compiled per position count, over its own fixed-capacity KV cache
    made from `mtp_cache` (mlx-lm KVCaches holding tokens): `drafter(hidden [B, L, H], next_tokens [B, L]) -> the
    argmax draft for the token after the last [B] int32`, its cache grown by L. `snapshot()` / `restore()` undo a
    draft queued ahead: the length (rows past it are never read)."""

    def __init__(self, model, mtp_cache: List[Any], reserve: int = STEP):
        self.offset = mtp_cache[0].offset
        capacity = _round_up(self.offset + reserve)
        self.kv = [(_pad_to(c.keys[..., :self.offset, :], capacity), _pad_to(c.values[..., :self.offset, :], capacity))
                   for c in mtp_cache]
        n = len(mtp_cache)
        self._fn = _shared_step(model, n, list(range(n)), [], "draft")
        self.model, self._picked = model, None  # picked(): traced at its first use

    def __call__(self, hidden: mx.array, next_tokens: mx.array) -> mx.array:
        L = next_tokens.shape[-1]
        self.kv = _with_room(self.kv, self.offset + L)
        out = self._fn(hidden, _token_ids(next_tokens), kernels.int32_scalar(self.offset), *_flatten(self.kv, []))
        self.kv, _ = _unflatten(out[1:], len(self.kv), 0)
        self.offset += L
        return out[0]

    def picked(self, hidden: mx.array, next_tokens: mx.array, offset1: mx.array, pick1: mx.array,
               length: int) -> mx.array:
        """The draft [B] int32 after position pick1 ([1] int32) of hidden [B, L, H] and next_tokens [B, L], whose
        K/V rows go at offset1 ([1] int32): both computed on the GPU (switch mtp_resident); `length` bounds
        offset1 + L. The host's offset stays as it was."""
        if self._picked is None:
            n = len(self.kv)
            self._picked = _shared_step(self.model, n, list(range(n)), [], "draft_pick")
        self.kv = _with_room(self.kv, length)
        out = self._picked(hidden, _token_ids(next_tokens), offset1, pick1, *_flatten(self.kv, []))
        self.kv, _ = _unflatten(out[1:], len(self.kv), 0)
        return out[0]

    def snapshot(self) -> int:
        return self.offset

    def restore(self, snapshot: int) -> None:
        self.offset = snapshot


class SlotBatchDecoder:
    """Decode steps of a batch of `slots` rows (a kernel row bucket), compiled like CompiledDecoder and traced once a
    (slots, capacity): a sequence joins a free slot, its prefilled cache (KVCache / ArraysCache) copied in, and leaves
    by freeing it, so rows come and go without a trace, an eager step or a copy of the other rows. Every slot runs
    each step; a free slot's output is not read. The rows share the K/V column `idx` a step writes: slot s holds its
    tokens in columns [left_padding[s], idx) and RoPE-positions at offset[s] (its token count).
    `decoder(tokens [slots, 1]) -> logits [slots, V]`."""

    def __init__(self, model, layout: List[Any], slots: int):
        """layout: a sequence's prefilled cache, for the shapes (it does not join)."""
        self.model = model
        model.fuse_projections(ops.enabled("packed_weights"))
        self.n_cache = len(layout)
        self.kv_index, self.state_index = _layer_kinds(layout)
        self.idx = layout[self.kv_index[0]].offset
        capacity = _round_up(self.idx + STEP)
        self.kv = [(_empty_rows(layout[i].keys, slots, capacity), _empty_rows(layout[i].values, slots, capacity))
                   for i in self.kv_index]
        self.states = [(_empty_rows(layout[i][0], slots), _empty_rows(layout[i][1], slots)) for i in self.state_index]
        self.start = [self.idx] * slots  # each slot's first column; a free slot sees its own columns only
        self._place()
        self.free = list(range(slots))
        self._fn = _shared_step(model, self.n_cache, self.kv_index, self.state_index, "batch")

    @property
    def slots(self) -> int:
        return len(self.start)

    @staticmethod
    def applicable(model, cache: List[Any]) -> bool:
        """Whether a decoder can be laid out from this sequence cache (CompiledDecoder's conditions, and K/V layers)."""
        return CompiledDecoder.applicable(model, cache) and any(type(c) is KVCache for c in cache)

    def join(self, cache: List[Any]) -> int:
        """A sequence's cache (the model's make_cache() layout, prefilled or empty) copied into the lowest free slot
        -> that slot. A sequence longer than `idx` moves every row right first."""
        if not self.free:
            raise ValueError(f"all {self.slots} slots are taken: grow() before join()")
        if _layer_kinds(cache) != (self.kv_index, self.state_index):
            raise ValueError("the joining cache's layers are not this decoder's (KVCache / ArraysCache per layer)")
        length = cache[self.kv_index[0]].offset
        if length > self.idx:
            self._shift(length - self.idx)
        s, start = self.free.pop(0), self.idx - length
        for j, i in enumerate(self.kv_index):
            k, v = self.kv[j]
            if length:
                k[s:s + 1, :, start:self.idx] = cache[i].keys[..., :length, :]
                v[s:s + 1, :, start:self.idx] = cache[i].values[..., :length, :]
        for j, i in enumerate(self.state_index):
            for arr, new in zip(self.states[j], cache[i].cache):  # None: a sequence not prefilled starts from zeros
                arr[s:s + 1] = 0 if new is None else new
        self.start[s] = start
        self._place()
        return s

    def leave(self, slot: int) -> None:
        self.free = sorted(self.free + [slot])

    def grow(self, slots: int) -> None:
        """Free slots added up to `slots` (the arrays copied once; a new shape traces once)."""
        extra = slots - self.slots
        more = lambda a: mx.concatenate([a, _empty_rows(a, extra)])  # noqa: E731
        self.kv = [(more(k), more(v)) for k, v in self.kv]
        self.states = [(more(c), more(s)) for c, s in self.states]
        self.free += list(range(self.slots, slots))
        self.start += [self.idx] * extra
        self._place()

    def compact(self, slots: int) -> dict[int, int]:
        """The taken slots moved to the first ones of a batch of `slots` -> {old slot: new slot}."""
        taken = [s for s in range(self.slots) if s not in self.free]
        if len(taken) > slots:
            raise ValueError(f"{len(taken)} rows do not fit {slots} slots")
        picked = taken + self.free[:slots - len(taken)]
        at = mx.array(picked)
        self.kv = [(k[at], v[at]) for k, v in self.kv]
        self.states = [(c[at], s[at]) for c, s in self.states]
        self.start = [self.start[s] for s in picked]
        self._place()
        self.free = list(range(len(taken), slots))
        return {old: new for new, old in enumerate(taken)}

    def sequence_cache(self, slot: int) -> List[Any]:
        """A slot's row as a sequence cache (KVCache / ArraysCache per layer), e.g. to go on in a CompiledDecoder."""
        cache: List[Any] = [None] * self.n_cache
        for (k, v), i in zip(self.kv, self.kv_index):
            c = cache[i] = KVCache()
            c.keys, c.values = k[slot:slot + 1, :, self.start[slot]:self.idx], v[slot:slot + 1, :, self.start[slot]:self.idx]
            c.offset = self.idx - self.start[slot]
        for (conv, state), i in zip(self.states, self.state_index):
            c = cache[i] = ArraysCache(2)
            c[0], c[1] = conv[slot:slot + 1], state[slot:slot + 1]
        return cache

    def _shift(self, columns: int) -> None:
        """Every row `columns` to the right (a longer sequence joins): K/V, left_padding and idx."""
        capacity = _round_up(self.idx + columns + STEP)
        moved = lambda a: _pad_to(mx.concatenate(  # noqa: E731
            [mx.zeros((*a.shape[:2], columns, a.shape[3]), dtype=a.dtype), a[..., :self.idx, :]], axis=2), capacity)
        self.kv = [(moved(k), moved(v)) for k, v in self.kv]
        self.idx += columns
        self.start = [s + columns for s in self.start]
        self._place()

    def _place(self) -> None:
        """The step's inputs from the host's `start` and `idx`: left_padding [slots], and offset [slots], each row's
        token count (idx - start; a step then returns it one further, as idx moves)."""
        self.left_padding = mx.array(self.start, dtype=mx.int32)
        self.offset = mx.array([self.idx - s for s in self.start], dtype=mx.int32)

    def __call__(self, tokens: mx.array) -> mx.array:
        if self.idx + tokens.shape[1] > self.kv[0][0].shape[2]:
            capacity = _round_up(self.idx + tokens.shape[1] + STEP)
            self.kv = [(_pad_to(k, capacity), _pad_to(v, capacity)) for k, v in self.kv]
        flat = _flatten(self.kv, self.states)
        out = self._fn(_token_ids(tokens), kernels.int32_scalar(self.idx), self.left_padding, self.offset, *flat)
        self.offset = out[1]
        self.kv, self.states = _unflatten(out[2:], len(self.kv), len(self.states))
        self.idx += tokens.shape[1]
        return out[0]


def _layer_kinds(cache: List[Any]) -> tuple[list[int], list[int]]:
    """(the layers holding a KVCache, those holding an ArraysCache) of a sequence cache."""
    return ([i for i, c in enumerate(cache) if type(c) is KVCache],
            [i for i, c in enumerate(cache) if type(c) is ArraysCache])


def _empty_rows(like: mx.array, rows: int, capacity: Optional[int] = None) -> mx.array:
    """zeros of `like`'s shape with `rows` rows ([B, H, T, D] K/V: and `capacity` columns)."""
    shape = (rows, *like.shape[1:]) if capacity is None else (rows, like.shape[1], capacity, like.shape[3])
    return mx.zeros(shape, dtype=like.dtype)


def _flatten(kv, states) -> list:
    return [a for pair in kv for a in pair] + [a for pair in states for a in pair]


def _unflatten(flat, n_kv: int, n_states: int) -> tuple[list, list]:
    """(kv pairs, state pairs) from _flatten's order."""
    pairs = [(flat[2 * j], flat[2 * j + 1]) for j in range(n_kv + n_states)]
    return pairs[:n_kv], pairs[n_kv:]


def _last_logits(model, tokens, cache) -> tuple[mx.array]:
    """A decode step's output: the last position's logits [B, V]."""
    return (model(tokens, cache=cache)[:, -1, :],)


def verify_outputs(model, tokens, cache) -> tuple[mx.array, mx.array]:
    """A speculative verify's output (CompiledVerifier's, and speculative's eager forward): the model over tokens
    [B, T] after `cache`, the last two positions' final-norm hidden states [B, min(T, 2), H] (the MTP head's input)
    and their logits."""
    lm = model.language_model
    hidden = lm.model(tokens, cache=cache)[:, -2:]
    return hidden, lm.logits(hidden)


def _run_model(model, tokens, n_cache: int, kv_index, state_index, kv_shims, states, head,
               keep: bool = False, alt: Optional[tuple] = None) -> tuple[tuple, list, list]:
    """head(model, tokens, shims of its cache) (kv_shims for the attention layers, in kv_index order), the updated
    DeltaNet (conv, state) pairs and with keep the pairs before the last token (else []). alt = (pairs, use_alt [1]
    bool): where use_alt, the DeltaNet layers start from those pairs instead of `states`."""
    shims: List[Any] = [None] * n_cache
    for i, s in zip(kv_index, kv_shims):
        shims[i] = s
    for j, (i, (conv, state)) in enumerate(zip(state_index, states)):
        shims[i] = _StaticState(conv, state, keep, None if alt is None else (*alt[0][j], alt[1]))
    out = head(model, tokens, shims)
    return out, [tuple(shims[i].cache) for i in state_index], [shims[i].kept for i in state_index] if keep else []


def _batch_step(model, n_cache: int, kv_index: List[int], state_index: List[int], tokens, idx1, left_padding,
                offset, *flat):
    kv, states = _unflatten(flat, len(kv_index), len(state_index))
    pos = _new_rows(kv, tokens.shape[1], idx1)
    shims = [_StaticBatchKV(k, v, idx1, left_padding, offset, pos) for k, v in kv]
    (logits,), states, _ = _run_model(model, tokens, n_cache, kv_index, state_index, shims, states, _last_logits)
    return (logits, offset + tokens.shape[1], *_flatten([(s.keys, s.values) for s in shims], states))


def _decode_step(model, n_cache: int, kv_index: List[int], state_index: List[int], tokens, offset1, *flat,
                 head: Callable = _last_logits, keep: bool = False, alt: Optional[tuple] = None):
    """offset1 [1] int32, what the fused attention reads; the scalar is for the several-token path only (a
    decode step's trace drops it). -> (*head's outputs, every updated cache array[, with keep the DeltaNet states
    before the last token]). alt: _run_model's."""
    offset = offset1.reshape(())
    kv, states = _unflatten(flat, len(kv_index), len(state_index))
    pos = _new_rows(kv, tokens.shape[1], offset1)
    shims = [_StaticKV(k, v, offset, offset1, pos) for k, v in kv]
    out, states, kept = _run_model(model, tokens, n_cache, kv_index, state_index, shims, states, head, keep, alt)
    return (*out, *_flatten([(s.keys, s.values) for s in shims], states), *_flatten([], kept))


def _draft_step(model, n_cache: int, kv_index: List[int], state_index: List[int], hidden, next_tokens, offset1, *flat,
                pick1: Optional[mx.array] = None):
    """The MTP head over positions hidden [B, L, H] with tokens next_tokens [B, L], its K/V written from offset1: the
    argmax draft for the token after the last (or after position pick1 [1] int32) [B] int32, then its K/V arrays."""
    offset = offset1.reshape(())
    kv, _ = _unflatten(flat, len(kv_index), 0)
    pos = _new_rows(kv, next_tokens.shape[1], offset1)
    shims = [_StaticKV(k, v, offset, offset1, pos) for k, v in kv]
    draft = model.mtp_draft(hidden, next_tokens, shims, pick=pick1)
    return (draft, *_flatten([(s.keys, s.values) for s in shims], []))


def _draft_pick_step(model, n_cache: int, kv_index: List[int], state_index: List[int], hidden, next_tokens, offset1,
                     pick1, *flat):
    return _draft_step(model, n_cache, kv_index, state_index, hidden, next_tokens, offset1, *flat, pick1=pick1)


def _selected_step(step: Callable, model, n_cache: int, kv_index: List[int], state_index: List[int], tokens, offset1,
                   accept1, *flat):
    """A verify forward from the last one's DeltaNet states after its draft where accept1 [1] bool (the draft
    confirmed), else before it: flat holds the K/V, then both sets of (conv, state) pairs. The DeltaNet kernels read
    the picked pair in place (their _alt variants): 60 selects a forward had cost the host their dispatch (H100, MTP at
    acceptance 0.8: 441 -> 538 tok/s without them, runs 88-89)."""
    n = 2 * len(state_index)
    after, before = flat[len(flat) - 2 * n:len(flat) - n], flat[len(flat) - n:]
    return step(model, n_cache, kv_index, state_index, tokens, offset1, *flat[:len(flat) - 2 * n], *before,
                head=verify_outputs, keep=True, alt=(_unflatten(after, 0, len(state_index))[1], accept1))


def _stacked_step(model, n_cache: int, kv_index: List[int], state_index: List[int], tokens, offset1, *flat,
                  head: Callable = _last_logits, keep: bool = False, alt: Optional[tuple] = None):
    """_decode_step over one stacked K and V [P*B, Hkv, capacity, D]: every layer's new rows written at once."""
    offset = offset1.reshape(())
    ((keys, values),), states = _unflatten(flat, 1, len(state_index))
    rows: list = []
    shims = [_StackedKV(keys, values, p, offset, offset1, rows) for p in range(len(kv_index))]
    out, states, kept = _run_model(model, tokens, n_cache, kv_index, state_index, shims, states, head, keep, alt)
    if rows and all(attn_decode.written_in_place(k) for k, _ in rows):  # kv_write: written; order after the launches
        keys, values = mx.depends([keys, values], [a for row in rows for a in row])
    else:
        k_new = mx.concatenate([k for k, _ in rows])  # [P*B, Hkv, T, D], layer order
        pos = row_positions(offset1, k_new.shape)
        keys, values = write_rows(keys, k_new, pos), write_rows(values, mx.concatenate([v for _, v in rows]), pos)
    return (*out, *_flatten([(keys, values)], states), *_flatten([], kept))


def _new_rows(kv: list, T: int, start1: mx.array):
    """row_positions of a step's T new rows in per-layer caches kv [(K, V) [B, Hkv, capacity, D]] (None: none)."""
    if not kv:
        return None
    B, H, _, D = kv[0][0].shape
    return row_positions(start1, (B, H, T, D))


# id(model) -> (weak reference to it, {(cache layout, parameter ids, switches): compiled step})
_SHARED: dict[int, tuple[Any, dict]] = {}


def _model_entry(model) -> tuple[Any, dict, tuple]:
    """(weak ref to model, its dict of traces by key, the key's last part: its parameter arrays and the switches)."""
    from .ops import switch_key

    params = model.parameter_ids()
    switches = switch_key()
    ref, steps = _SHARED.get(id(model), (None, None))
    if ref is None or ref() is not model:
        steps = {}
        ref = weakref.ref(model, lambda _, k=id(model): _SHARED.pop(k, None))
        _SHARED[id(model)] = (ref, steps)
    return ref, steps, (params, switches)


def _bundle_once(model, kind: str, batch: int, run: Callable) -> None:
    """model.bundle_weights(run), unless the model already went through it for a step of this kind and batch with
    these arrays and switches (a trace of the step costs milliseconds; nothing would change)."""
    _, steps, last = _model_entry(model)
    if ("bundled", kind, batch, *last) not in steps:
        model.bundle_weights(run)
        _, steps, last = _model_entry(model)  # the arrays it bundled are new
        steps[("bundled", kind, batch, *last)] = None


def _token_ids(tokens: mx.array) -> mx.array:
    """tokens as uint32, the samplers' dtype: a compiled step is traced per input dtype, so an int32 first token
    (a prompt's) would trace the 40-layer step a second time, under whatever switches are set by then."""
    return tokens if tokens.dtype == mx.uint32 else tokens.astype(mx.uint32)


def _shared_step(model, n_cache: int, kv_index: List[int], state_index: List[int], kind: str = "single") -> Callable:
    """One mx.compile'd step per model, cache layout, parameter arrays and kernel switches. A trace holds the
    parameters it saw as constants, so new weights (load_weights, update) or switches key a new trace."""
    ref, steps, last = _model_entry(model)
    key = (kind, n_cache, tuple(kv_index), tuple(state_index), *last)
    if key not in steps:
        for old in [k for k in steps if k[-2:] != key[-2:]]:  # the old trace's weights or switches are gone: free it
            del steps[old]
        # The traced function holds the model weakly: a dropped model frees its entry, traces and weights.
        step = _step_function(kind)
        steps[key] = mx.compile(lambda *args: step(ref(), n_cache, kv_index, state_index, *args))
    return steps[key]


def _step_function(kind: str) -> Callable:
    """The traced step of a kind: a decode step over per-layer or stacked K/V ("single", "stacked"), a batch's,
    or either of the first two returning a speculative verify's outputs ("verify", "stacked_verify"; "_keep" with the
    states before the last token; "_select" from states picked on the GPU, CompiledVerifier.selected), or the MTP
    head's draft ("draft"; "draft_pick" after a position picked on the GPU)."""
    if kind.startswith("draft"):
        return _draft_pick_step if kind == "draft_pick" else _draft_step
    if kind.endswith("verify_select"):
        step = _stacked_step if kind.startswith("stacked") else _decode_step
        return lambda *args: _selected_step(step, *args)
    if kind.endswith(("verify", "verify_keep")):
        step = _stacked_step if kind.startswith("stacked") else _decode_step
        keep = kind.endswith("keep")
        return lambda *args: step(*args, head=verify_outputs, keep=keep)
    return {"single": _decode_step, "stacked": _stacked_step, "batch": _batch_step}[kind]


def _round_up(n: int) -> int:
    return -(-n // STEP) * STEP


def _with_room(kv: list, length: int) -> list:
    """(K, V) pairs [B, H, capacity, D] holding `length` positions: grown by a STEP past it where they do not."""
    if not kv or length <= kv[0][0].shape[2]:
        return kv
    capacity = _round_up(length + STEP)
    return [(_pad_to(k, capacity), _pad_to(v, capacity)) for k, v in kv]


def _pad_to(x: mx.array, capacity: int) -> mx.array:
    """[B, H, T, D] -> [B, H, capacity, D], zeros after T."""
    extra = capacity - x.shape[2]
    if extra <= 0:
        return x
    return mx.concatenate([x, mx.zeros((*x.shape[:2], extra, x.shape[3]), dtype=x.dtype)], axis=2)
