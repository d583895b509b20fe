"""Parameter-holding layers whose forward goes through `lily_mlx.ops` (so kernels can take over).

They mirror mlx.nn's Linear / QuantizedLinear and mlx-lm's SwitchLinear / QuantizedSwitchLinear
(same parameter names, same `to_quantized`), so `mlx.nn.quantize` and mlx-lm's tooling work on them.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from . import ops


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

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_):
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

    def __call__(self, x, indices, sorted_indices=False):
        return ops.gather_matmul(x, self["weight"], indices, sorted_indices=sorted_indices)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_):
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

    def __call__(self, x, indices, sorted_indices=False):
        return ops.gather_matmul(
            x, self["weight"], indices, scales=self["scales"], biases=self["biases"],
            group_size=self.group_size, bits=self.bits, sorted_indices=sorted_indices,
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
