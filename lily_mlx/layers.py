"""Parameter-holding layers whose forward goes through `lily_mlx.ops` (so kernels can take over).

They mirror mlx.nn's Linear / QuantizedLinear and mlx-lm's SwitchLinear / QuantizedSwitchLinear
(same parameter names, same `to_quantized`), so `mlx.nn.quantize` and mlx-lm's tooling work on them.
`FusedLinears` runs several projections of one input as one matmul; `normed` and `added` fold a
layer's input RMSNorm or its residual add into the projection where a kernel can.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from . import ops
from .ops import packing


class Linear(nn.Module):
    def __init__(self, input_dims: int, output_dims: int, bias: bool = False):
        super().__init__()
        scale = math.sqrt(1.0 / input_dims)
        self.weight = mx.random.uniform(-scale, scale, (output_dims, input_dims))
        if bias:
            self.bias = mx.zeros((output_dims,))

    def __call__(self, x: mx.array) -> mx.array:
        y = x @ self["weight"].T
        return y + self["bias"] if "bias" in self else y

    def to_quantized(self, group_size: Optional[int] = None, bits: Optional[int] = None, mode: str = "affine", **_):
        # mlx.nn.quantize passes None for "the mode's default": affine 4-bit, group 64
        group_size, bits = group_size or 64, bits or 4
        out_dims, in_dims = self.weight.shape
        ql = QuantizedLinear(in_dims, out_dims, "bias" in self, group_size, bits, mode=mode, init=False)
        ql.weight, ql.scales, ql.biases = mx.quantize(self.weight, group_size, bits, mode=mode)
        if "bias" in self:
            ql.bias = self.bias
        return ql


class QuantizedLinear(nn.Module):
    def __init__(self, input_dims, output_dims, bias=False, group_size=64, bits=4, mode="affine", init=True):
        super().__init__()
        if mode != "affine":
            raise ValueError(f"quantization mode {mode!r} is not supported; only 'affine'")
        self.group_size, self.bits, self.mode = group_size, bits, mode
        if init:  # placeholders of the right shape; load_weights replaces them
            self.weight = mx.zeros((output_dims, input_dims * bits // 32), dtype=mx.uint32)
            self.scales = mx.zeros((output_dims, input_dims // group_size))
            self.biases = mx.zeros((output_dims, input_dims // group_size))
            if bias:
                self.bias = mx.zeros((output_dims,))
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        y = ops.quantized_matmul(x, self["weight"], self["scales"], self["biases"], group_size=self.group_size, bits=self.bits)
        return y + self["bias"] if "bias" in self else y


class SwitchLinear(nn.Module):
    """Stacked expert weights [E, out, in]; called with x [..., 1|k, 1, in] and indices [..., k]."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int):
        super().__init__()
        scale = math.sqrt(1.0 / input_dims)
        self.weight = mx.random.uniform(-scale, scale, (num_experts, output_dims, input_dims))

    def __call__(self, x, indices, sorted_indices=False, expert_starts=None, x_rows=None):
        return ops.gather_matmul(x, self["weight"], indices, sorted_indices=sorted_indices, x_rows=x_rows)

    def to_quantized(self, group_size: Optional[int] = None, bits: Optional[int] = None, mode: str = "affine", **_):
        group_size, bits = group_size or 64, bits or 4
        E, out_dims, in_dims = self.weight.shape
        ql = QuantizedSwitchLinear(in_dims, out_dims, E, group_size, bits, mode=mode, init=False)
        ql.weight, ql.scales, ql.biases = mx.quantize(self.weight, group_size, bits, mode=mode)
        return ql


class QuantizedSwitchLinear(nn.Module):
    def __init__(self, input_dims, output_dims, num_experts, group_size=64, bits=4, mode="affine", init=True):
        super().__init__()
        if mode != "affine":
            raise ValueError(f"quantization mode {mode!r} is not supported; only 'affine'")
        self.group_size, self.bits, self.mode = group_size, bits, mode
        if init:
            self.weight = mx.zeros((num_experts, output_dims, input_dims * bits // 32), dtype=mx.uint32)
            self.scales = mx.zeros((num_experts, output_dims, input_dims // group_size))
            self.biases = mx.zeros((num_experts, output_dims, input_dims // group_size))
        self.freeze()

    def __call__(self, x, indices, sorted_indices=False, expert_starts=None, x_rows=None):
        return ops.gather_matmul(
            x, self["weight"], indices, scales=self["scales"], biases=self["biases"],
            group_size=self.group_size, bits=self.bits, sorted_indices=sorted_indices, expert_starts=expert_starts,
            x_rows=x_rows,
        )


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = mx.ones((dims,))

    def __call__(self, x: mx.array) -> mx.array:
        return ops.rms_norm(x, self["weight"], self.eps)


class GatedRMSNorm(nn.Module):
    """rmsnorm(x) * weight * silu(z); the weight is not zero-centred (no +1 shift in any layout)."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = mx.ones((dims,))

    def __call__(self, x: mx.array, z: mx.array) -> mx.array:
        return ops.gated_rms_norm(x, z, self["weight"], self.eps)


def _quantized(layer) -> bool:
    return "scales" in layer


def normed(layer, x: mx.array, norm: "RMSNorm") -> mx.array:
    """layer(norm(x)): one launch where the layer is quantized and bias-free (the lm_head after the final norm)."""
    if _quantized(layer) and "bias" not in layer:
        return ops.norm_quantized_matmul(x, norm["weight"], norm.eps, layer["weight"], layer["scales"],
                                         layer["biases"], group_size=layer.group_size, bits=layer.bits)
    return layer(norm(x))


def embedded(layer, ids: mx.array) -> mx.array:
    """layer(ids) for an embedding: one launch where the table is affine-quantized (switch dequant_rows)."""
    if _quantized(layer) and "biases" in layer and getattr(layer, "mode", "affine") == "affine":
        return ops.embedding_lookup(ids, layer["weight"], layer["scales"], layer["biases"], group_size=layer.group_size,
                                    bits=layer.bits)
    return layer(ids)


def output_weights(layer, residual: mx.array, dtype) -> Optional[tuple]:
    """((w, scales, biases), group_size, bits) of a quantized, bias-free layer whose output adds to residual in
    dtype (output projections, which the kernels fuse with the add); else None."""
    if _quantized(layer) and "bias" not in layer and residual.dtype == dtype:
        return (layer["weight"], layer["scales"], layer["biases"]), layer.group_size, layer.bits
    return None


def added(layer, x: mx.array, residual: mx.array) -> mx.array:
    """residual + layer(x): one launch where the layer is quantized and bias-free (output projections)."""
    q = output_weights(layer, residual, x.dtype)
    if q is not None:
        return ops.quantized_matmul_add(x, *q[0], residual, group_size=q[1], bits=q[2])
    return residual + layer(x)


class FusedLinears:
    """Linear layers of one module that read the same input, run as ONE matmul over their weights
    concatenated along the output axis (DeltaNet qkv|z|b|a, attention q|k|v, router|shared-expert gate).

    `fuse()` (at load) concatenates them and leaves each part holding a slice of the concatenation, a
    view, so the parts still run, save and convert as before and no second copy is kept. If a part's
    arrays are replaced afterwards (load_weights, quantize), the fusion is stale: calls run the parts
    and concatenate their outputs until `fuse()` runs again.
    """

    def __init__(self, owner: nn.Module, names: Sequence[str]):
        self.owner, self.names = owner, tuple(names)
        self.arrays: Optional[dict[str, mx.array]] = None  # "weight", "scales", "biases", "bias"
        self.views: tuple = ()  # per part, the arrays fuse() assigned to it

    def parts(self) -> list[nn.Module]:
        return [getattr(self.owner, n) for n in self.names]

    def _keys(self) -> Optional[tuple[str, ...]]:
        """The array names the parts share, or None when they cannot be concatenated."""
        parts = self.parts()
        first = parts[0]
        keys = tuple(sorted(k for k, v in first.items() if isinstance(v, mx.array)))
        if _quantized(first):
            same = lambda p: (_quantized(p) and (p.bits, p.group_size, p.mode) == (first.bits, first.group_size, first.mode)
                              and p["scales"].dtype == first["scales"].dtype)
        else:
            same = lambda p: not _quantized(p) and p["weight"].dtype == first["weight"].dtype
        ok = all(same(p) and tuple(sorted(k for k, v in p.items() if isinstance(v, mx.array))) == keys for p in parts)
        return keys if ok else None

    def fuse(self, pack: bool = False) -> bool:
        """Concatenate the parts' arrays (no-op when already fused), quantized ones packed (ops/packing.py) when
        `pack`. False when they cannot be concatenated."""
        if self.current() and not (pack and self.packed() is None and self._packable(self.arrays)):
            return True
        keys = self._keys()
        if keys is None:
            self.arrays, self.views = None, ()
            return False
        parts = self.parts()
        self.arrays = {k: mx.concatenate([p[k] for p in parts], axis=0) for k in keys}
        a = self.arrays
        if pack and self._packable(a):
            _, a["weight"], a["scales"], a["biases"] = packing.pack(a["weight"], a["scales"], a["biases"])
        self.assign(self.arrays)
        return True

    def assign(self, arrays: dict[str, mx.array]) -> None:
        """Take `arrays` (equal to the fused ones, e.g. views of a bundle) as the concatenation, and give each part
        its slices of them."""
        self.arrays = dict(arrays)
        start, views = 0, []
        for p in self.parts():
            n = p["weight"].shape[0]
            view = {k: self.arrays[k][start:start + n] for k in sorted(self.arrays)}
            p.update(view)
            views.append(tuple(view[k] for k in sorted(self.arrays)))
            start += n
        self.views = tuple(views)

    @staticmethod
    def _packable(a: dict) -> bool:
        return "biases" in a and packing.why_not(a["weight"], a["scales"], a["biases"]) is None

    def packed(self) -> Optional[mx.array]:
        """The packed array of the fused quantized weight, if fuse() packed it."""
        a = self.arrays or {}
        return packing.lookup(a["weight"], a["scales"], a["biases"]) if "biases" in a else None

    def current(self) -> bool:
        """True while every part still holds the slices fuse() gave it."""
        if self.arrays is None:
            return False
        keys = sorted(self.arrays)
        return all(all(p.get(k) is v for k, v in zip(keys, view)) for p, view in zip(self.parts(), self.views))

    def quantized(self) -> Optional[tuple]:
        """(weight, scales, biases, bits, group_size) of the fused, bias-free quantized concatenation, else None."""
        if not self.current() or "scales" not in self.arrays or "bias" in self.arrays:
            return None
        first, a = self.parts()[0], self.arrays
        return a["weight"], a["scales"], a["biases"], first.bits, first.group_size

    def __call__(self, x: mx.array, norm: Optional["RMSNorm"] = None) -> mx.array:
        """[..., sum of the parts' outputs]: the parts applied to norm(x) (or x), concatenated."""
        if not self.current():
            xn = x if norm is None else norm(x)
            return mx.concatenate([p(xn) for p in self.parts()], axis=-1)
        a = self.arrays
        if "scales" in a:
            q = {"group_size": self.parts()[0].group_size, "bits": self.parts()[0].bits}
            if norm is None:
                y = ops.quantized_matmul(x, a["weight"], a["scales"], a["biases"], **q)
            else:
                y = ops.norm_quantized_matmul(x, norm["weight"], norm.eps, a["weight"], a["scales"], a["biases"], **q)
        else:
            y = (x if norm is None else norm(x)) @ a["weight"].T
        return y + a["bias"] if "bias" in a else y
