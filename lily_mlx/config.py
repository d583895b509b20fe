"""Model configuration for the Qwen3.5/3.6 hybrid MoE, read from HF or MLX-converted config.json."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
LAYER_TYPES = ("linear_attention", "full_attention")


class ConfigError(ValueError):
    """A config.json the model cannot run; the message names the field."""


@dataclass
class ModelConfig:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    layer_types: list[str]
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 262_144
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mtp_num_hidden_layers: int = 0
    # MLX-converted checkpoints: {"group_size", "bits", "mode", "<module path>": {...}} overrides.
    quantization: Optional[dict[str, Any]] = None
    eos_token_id: Any = None
    source: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def rope_dims(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == "linear_attention"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("source")
        return d

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, where: str = "config.json") -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: expected a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{where}: field 'model_type' is {model_type!r}; lily_mlx runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        text = raw.get("text_config", raw) if model_type == "qwen3_5_moe" else raw
        if not isinstance(text, dict):
            raise ConfigError(f"{where}: field 'text_config' must be an object")
        prefix = "text_config." if text is not raw else ""

        def need(name: str, kind=int, positive: bool = True):
            if name not in text or text[name] is None:
                raise ConfigError(f"{where}: missing field '{prefix}{name}'")
            value = text[name]
            if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"{where}: field '{prefix}{name}' must be an integer, got {value!r}")
            if kind is float and not isinstance(value, (int, float)):
                raise ConfigError(f"{where}: field '{prefix}{name}' must be a number, got {value!r}")
            if positive and value <= 0:
                raise ConfigError(f"{where}: field '{prefix}{name}' must be positive, got {value!r}")
            return value

        def opt(name: str, default):
            value = text.get(name, default)
            return default if value is None else value

        hidden = need("hidden_size")
        n_layers = need("num_hidden_layers")
        n_heads = need("num_attention_heads")
        head_dim = text.get("head_dim") or hidden // n_heads
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", text.get("rope_theta", 10_000_000.0))
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope", None):
            raise ConfigError(f"{where}: field '{prefix}rope_parameters.rope_type' is {rope_type!r}; only 'default' is supported")

        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = opt("full_attention_interval", 4)
            if not isinstance(interval, int) or interval <= 0:
                raise ConfigError(f"{where}: field '{prefix}full_attention_interval' must be a positive integer")
            layer_types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)
            ]
        if not isinstance(layer_types, list) or len(layer_types) != n_layers:
            raise ConfigError(
                f"{where}: field '{prefix}layer_types' must list {n_layers} entries (num_hidden_layers)"
            )
        for i, t in enumerate(layer_types):
            if t not in LAYER_TYPES:
                raise ConfigError(f"{where}: field '{prefix}layer_types[{i}]' is {t!r}; expected one of {LAYER_TYPES}")

        cfg = cls(
            model_type=model_type,
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            vocab_size=need("vocab_size"),
            num_attention_heads=n_heads,
            num_key_value_heads=need("num_key_value_heads"),
            head_dim=head_dim,
            linear_num_key_heads=need("linear_num_key_heads"),
            linear_num_value_heads=need("linear_num_value_heads"),
            linear_key_head_dim=need("linear_key_head_dim"),
            linear_value_head_dim=need("linear_value_head_dim"),
            num_experts=need("num_experts"),
            num_experts_per_tok=need("num_experts_per_tok"),
            moe_intermediate_size=need("moe_intermediate_size"),
            shared_expert_intermediate_size=need("shared_expert_intermediate_size"),
            layer_types=list(layer_types),
            linear_conv_kernel_dim=opt("linear_conv_kernel_dim", 4),
            rms_norm_eps=float(opt("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            partial_rotary_factor=float(partial),
            max_position_embeddings=opt("max_position_embeddings", 262_144),
            norm_topk_prob=bool(opt("norm_topk_prob", True)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            attention_bias=bool(opt("attention_bias", False)),
            mtp_num_hidden_layers=opt("mtp_num_hidden_layers", 0),
            quantization=raw.get("quantization", text.get("quantization")),
            eos_token_id=raw.get("eos_token_id", text.get("eos_token_id")),
            source=raw,
        )
        cfg._validate(where, prefix)
        return cfg

    def _validate(self, where: str, prefix: str) -> None:
        def bad(name: str, why: str):
            raise ConfigError(f"{where}: field '{prefix}{name}' {why}")

        if self.num_attention_heads % self.num_key_value_heads:
            bad("num_key_value_heads", f"({self.num_key_value_heads}) must divide num_attention_heads ({self.num_attention_heads})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            bad(
                "linear_num_key_heads",
                f"({self.linear_num_key_heads}) must divide linear_num_value_heads ({self.linear_num_value_heads})",
            )
        if self.num_experts_per_tok > self.num_experts:
            bad("num_experts_per_tok", f"({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})")
        if not 0.0 < self.partial_rotary_factor <= 1.0 or self.rope_dims % 2:
            bad("partial_rotary_factor", f"({self.partial_rotary_factor}) must give an even rotary width <= head_dim ({self.head_dim})")
        if self.linear_conv_kernel_dim < 1:
            bad("linear_conv_kernel_dim", "must be >= 1")
        if not isinstance(self.mtp_num_hidden_layers, int) or self.mtp_num_hidden_layers < 0:
            bad("mtp_num_hidden_layers", "must be a non-negative integer")
        q = self.quantization
        if q is not None:
            if not isinstance(q, dict):
                raise ConfigError(f"{where}: field 'quantization' must be an object")
            for key in ("bits", "group_size"):
                if key in q and q[key] not in {"bits": (2, 3, 4, 5, 6, 8), "group_size": (32, 64, 128)}[key]:
                    raise ConfigError(f"{where}: field 'quantization.{key}' has unsupported value {q[key]!r}")
            if q.get("mode", "affine") != "affine":
                raise ConfigError(f"{where}: field 'quantization.mode' is {q.get('mode')!r}; only 'affine' is supported")


def read_config_json(model_dir: str | Path) -> tuple[dict[str, Any], Path]:
    """The raw config.json of a model folder and its path."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json in the model folder")
    try:
        return json.loads(path.read_text()), path
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def read_config(model_dir: str | Path) -> ModelConfig:
    raw, path = read_config_json(model_dir)
    return ModelConfig.from_dict(raw, where=str(path))
