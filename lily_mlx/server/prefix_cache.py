"""Prefix cache for the hybrid model: per-layer state after a token prefix, LRU by bytes.

An entry holds, for each layer, either the attention K/V of the prefix (KVCache) or the DeltaNet
conv + recurrent state at exactly that position (ArraysCache). DeltaNet state cannot be trimmed
back, so the engine snapshots it at positions a later prompt may resume from (message boundaries,
the end of a prompt) and a lookup only considers those positions of the new prompt.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache


def prefix_key(tokens: list[int], length: int) -> bytes:
    return hashlib.blake2b(np.asarray(tokens[:length], dtype=np.int64).tobytes(), digest_size=16).digest()


@dataclass
class Snapshot:
    length: int
    layers: list[tuple]  # ("kv", keys [1,H,L,D], values) or ("ssm", [conv, state])
    nbytes: int


def snapshot(cache: list[Any], length: int) -> list[tuple]:
    """The layer states of a batch-1 prompt cache at its current position `length` (not yet evaluated)."""
    layers = []
    for c in cache:
        if isinstance(c, KVCache):
            if c.offset != length:
                raise ValueError(f"KV cache at offset {c.offset}, snapshot asked at {length}")
            k, v = (None, None) if c.keys is None else (c.keys[..., :length, :], c.values[..., :length, :])
            layers.append(("kv", k, v))
        elif isinstance(c, ArraysCache):
            # contiguous: the conv state is a view into the whole chunk's input; keep only its W-1 rows.
            layers.append(("ssm", [None if a is None else mx.contiguous(a) for a in c.cache]))
        else:
            raise TypeError(f"prefix cache cannot snapshot a {type(c).__name__}")
    return layers


def restore(layers: list[tuple], length: int) -> list[Any]:
    """A fresh batch-1 prompt cache positioned after the snapshot's prefix."""
    out = []
    for entry in layers:
        if entry[0] == "kv":
            c = KVCache()
            if entry[1] is not None:
                # The next update reallocates (offset == capacity), so the stored arrays are never written.
                c.keys, c.values, c.offset = entry[1], entry[2], length
            out.append(c)
        else:
            c = ArraysCache(len(entry[1]))
            c.cache = list(entry[1])
            out.append(c)
    return out


def _nbytes(layers: list[tuple]) -> int:
    total = 0
    for entry in layers:
        arrays = entry[1:] if entry[0] == "kv" else entry[1]
        total += sum(a.nbytes for a in arrays if a is not None)
    return total


class PrefixCache:
    """LRU of snapshots keyed by the exact token prefix; capacity in bytes (0 disables)."""

    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
        self._entries: OrderedDict[tuple[int, bytes], Snapshot] = OrderedDict()
        self._lock = threading.Lock()  # the engine writes; /metrics reads sizes
        self.bytes = 0

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self):
        return len(self._entries)

    def lookup(self, tokens: list[int], positions: list[int]) -> Optional[Snapshot]:
        """The deepest stored snapshot at one of `positions` (prefix lengths of `tokens`), marked recently used."""
        if not self.enabled:
            return None
        with self._lock:
            for length in sorted(set(positions), reverse=True):
                key = (length, prefix_key(tokens, length))
                snap = self._entries.get(key)
                if snap is not None:
                    self._entries.move_to_end(key)
                    return snap
        return None

    def contains(self, tokens: list[int], length: int) -> bool:
        with self._lock:
            return (length, prefix_key(tokens, length)) in self._entries

    def insert(self, tokens: list[int], length: int, layers: list[tuple]) -> None:
        if not self.enabled:
            return
        mx.eval([a for entry in layers for a in (entry[1:] if entry[0] == "kv" else entry[1]) if a is not None])
        snap = Snapshot(length, layers, _nbytes(layers))
        if snap.nbytes > self.capacity:
            return
        key = (length, prefix_key(tokens, length))
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old.nbytes
            self._entries[key] = snap
            self.bytes += snap.nbytes
            while self.bytes > self.capacity:
                _, evicted = self._entries.popitem(last=False)
                self.bytes -= evicted.nbytes
