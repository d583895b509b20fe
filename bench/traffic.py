"""Bytes a decode step must read (and write), from the checkpoint's tensor sizes and the model's shapes.

Per step of a batch of b sequences at context c:
  weights   every dense tensor once (attention / DeltaNet projections, norms, router, shared expert,
            lm_head), the routed experts' share of the stacked expert tensors, one embedding row per sequence;
  state     per sequence: float32 DeltaNet state S [Hv, Dv, Dk] read and written, conv state read and written;
  KV cache  per sequence: K and V of c tokens read in every full-attention layer, one token's written.
Experts touched by a batch: E * (1 - (1 - k/E)^b), the expectation under uniform routing (k for b = 1).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_ITEMSIZE = {"U32": 4, "I32": 4, "F32": 4, "BF16": 2, "F16": 2, "U8": 1, "I8": 1, "U16": 2, "I64": 8, "F64": 8}
_SKIP = ("mtp.", "model.visual.", "visual.", "vision_tower.")


def _text_config(raw: dict) -> dict:
    return raw.get("text_config", raw) if isinstance(raw.get("text_config"), dict) else raw


class DecodeTraffic:
    def __init__(self, model_dir: str | Path):
        from lily_mlx.loading import read_safetensors_header, weight_files

        model_dir = Path(model_dir)
        raw = json.loads((model_dir / "config.json").read_text())
        cfg = _text_config(raw)
        self.dense = self.experts = self.embedding = 0
        act_itemsize = 2
        for f in weight_files(model_dir):
            for name, t in read_safetensors_header(f).items():
                if name.startswith(_SKIP):
                    continue
                size = _ITEMSIZE.get(t["dtype"], 2)
                for d in t["shape"]:
                    size *= d
                if ".switch_mlp." in name or ".experts." in name:
                    self.experts += size
                elif "embed_tokens" in name:
                    self.embedding += size
                    if name.endswith(("embed_tokens.scales", "embed_tokens.weight")) and t["dtype"] in ("BF16", "F16", "F32"):
                        act_itemsize = _ITEMSIZE[t["dtype"]]  # activations take the embedding's float dtype
                else:
                    self.dense += size
        layer_types = cfg.get("layer_types") or [
            "full_attention" if (i + 1) % cfg.get("full_attention_interval", 4) == 0 else "linear_attention"
            for i in range(cfg["num_hidden_layers"])
        ]
        n_full = sum(t == "full_attention" for t in layer_types)
        n_linear = len(layer_types) - n_full
        Hv, Dv, Dk, Hk = (cfg[k] for k in ("linear_num_value_heads", "linear_value_head_dim", "linear_key_head_dim", "linear_num_key_heads"))
        conv_dim = 2 * Hk * Dk + Hv * Dv
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        self.vocab = cfg["vocab_size"]
        self.num_experts, self.top_k = cfg["num_experts"], cfg["num_experts_per_tok"]
        self.act_itemsize = act_itemsize
        self.state_per_seq = n_linear * (2 * Hv * Dv * Dk * 4 + 2 * (cfg.get("linear_conv_kernel_dim", 4) - 1) * conv_dim * act_itemsize)
        self.kv_per_token = n_full * 2 * cfg["num_key_value_heads"] * head_dim * act_itemsize

    def experts_touched(self, batch: int) -> float:
        E, k = self.num_experts, self.top_k
        return E * (1 - (1 - k / E) ** batch)

    def per_step(self, batch: int, context: float) -> dict[str, float]:
        """Bytes of one decode step (batch tokens) at `context` tokens of KV per sequence, by component."""
        parts = {
            "dense_weights": float(self.dense),
            "experts": self.experts * self.experts_touched(batch) / self.num_experts,
            "embedding_rows": batch * self.embedding / self.vocab,
            "deltanet_state": batch * float(self.state_per_seq),
            "kv_cache": batch * (context + 1) * float(self.kv_per_token),
        }
        parts["total"] = sum(parts.values())
        return parts

    def summary(self) -> dict[str, Any]:
        return {
            "dense_weight_bytes": self.dense,
            "expert_weight_bytes": self.experts,
            "embedding_bytes": self.embedding,
            "deltanet_state_bytes_per_seq_read_write": self.state_per_seq,
            "kv_bytes_per_token": self.kv_per_token,
            "activation_itemsize": self.act_itemsize,
            "model": "dense once per step; experts E*(1-(1-k/E)^b)/E of stacked experts; 1 embedding row, "
            "f32 DeltaNet+conv state read+write and KV read of the context per sequence",
        }
