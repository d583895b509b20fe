"""Tiny random Qwen3.5-MoE checkpoints written by transformers itself, in the real on-disk layouts.

Dims are all distinct (Hk != Hv, Dk != Dv, head_dim 24 not a power of two, 5 experts) and divisible by
32 so the same weights quantize with group 32; norms, A_log and dt_bias are perturbed away from their
init so the zero-centred offsets and gates matter.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TEXT_CONFIG = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=24,
    linear_conv_kernel_dim=4,
    num_experts=5,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=96,
    vocab_size=512,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    initializer_range=0.15,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
VISION_CONFIG = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=40, out_hidden_size=64)


def hf_model(seed: int = 0, **text_overrides):
    """A transformers Qwen3_5MoeForConditionalGeneration in float32 with perturbed norms and gates."""
    import torch
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Qwen3_5MoeConfig(text_config={**TEXT_CONFIG, **text_overrides}, vision_config=VISION_CONFIG)
    model = Qwen3_5MoeForConditionalGeneration(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                continue
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))  # zero-centred: stored as w - 1
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 4 + 0.5))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("conv1d.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return model


def _config_dict(model) -> dict:
    cfg = json.loads(model.config.to_json_string(use_diff=False))
    cfg["architectures"] = ["Qwen3_5MoeForConditionalGeneration"]
    return cfg


def write_hf(model, path: Path, shards: int = 1) -> Path:
    """HF release layout: model.language_model.*, fused gate_up_proj experts, a vision tower, sharded optionally."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    keys = sorted(state)
    (path / "config.json").write_text(json.dumps(_config_dict(model), indent=2))
    if shards == 1:
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k] for k in keys[i::shards]}
        save_file(part, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def write_per_expert(model, path: Path) -> Path:
    """The layout transformers' save_pretrained writes: one tensor per expert."""
    model.save_pretrained(str(path))
    return path


def write_mlx(hf_path: Path, path: Path, quantize: bool = False, group_size: int = 32, bits: int = 4, dtype=None) -> Path:
    """MLX-converted layout, written by stock mlx-lm's own converter (8-bit router / shared-expert gate)."""
    from mlx_lm.convert import convert

    if path.exists():
        shutil.rmtree(path)
    convert(str(hf_path), str(path), quantize=quantize, q_group_size=group_size, q_bits=bits, dtype=dtype)
    return path


def add_mtp(hf_path: Path, seed: int = 0) -> None:
    """Append `mtp.*` tensors shaped like the release's MTP head (transformers does not write them)."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    cfg = json.loads((hf_path / "config.json").read_text())["text_config"]
    H, E, I, SI = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    Hq, Hkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    rng = np.random.default_rng(seed)

    def r(*shape):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    p = "mtp.layers.0."
    extra = {
        "mtp.fc.weight": r(H, 2 * H),
        "mtp.pre_fc_norm_embedding.weight": r(H),
        "mtp.pre_fc_norm_hidden.weight": r(H),
        "mtp.norm.weight": r(H),
        p + "input_layernorm.weight": r(H),
        p + "post_attention_layernorm.weight": r(H),
        p + "self_attn.q_proj.weight": r(2 * Hq * D, H),
        p + "self_attn.k_proj.weight": r(Hkv * D, H),
        p + "self_attn.v_proj.weight": r(Hkv * D, H),
        p + "self_attn.o_proj.weight": r(H, Hq * D),
        p + "self_attn.q_norm.weight": r(D),
        p + "self_attn.k_norm.weight": r(D),
        p + "mlp.gate.weight": r(E, H),
        p + "mlp.experts.gate_up_proj": r(E, 2 * I, H),
        p + "mlp.experts.down_proj": r(E, H, I),
        p + "mlp.shared_expert.gate_proj.weight": r(SI, H),
        p + "mlp.shared_expert.up_proj.weight": r(SI, H),
        p + "mlp.shared_expert.down_proj.weight": r(H, SI),
        p + "mlp.shared_expert_gate.weight": r(1, H),
    }
    f = hf_path / "model.safetensors"
    tensors = load_file(str(f))
    tensors.update(extra)
    save_file(tensors, str(f), metadata={"format": "pt"})


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def write_tokenizer(path: Path, vocab_size: int = 500, corpus=None, chat_template: str = CHAT_TEMPLATE) -> Path:
    """A byte-level BPE tokenizer trained here with `tokenizers`, with Qwen's special tokens and a chat template."""
    import inspect

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if corpus is None:
        corpus = [inspect.getdoc(obj) or "" for obj in (json, shutil, Path, dict, list, str, int, open, zip, map)] * 4
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=chat_template,
        model_max_length=4096,
    )
    fast.save_pretrained(str(path))
    return path
