"""Bad checkpoints and configs fail whole, with one error naming the file, tensor or field."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import subprocess_env
from lily_mlx import CheckpointError, ConfigError, ModelConfig, load_model
from tiny import TEXT_CONFIG


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_no_weight_files(tiny_checkpoints, tmp_path):
    (tmp_path / "config.json").write_text((tiny_checkpoints[0]["hf"] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no .safetensors"):
        load_model(tmp_path)


def test_shard_named_in_index_but_absent(tiny_checkpoints, tmp_path):
    path = copy_ckpt(tiny_checkpoints[0]["hf_sharded"], tmp_path / "m")
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json: shard model-00002-of-00003.safetensors .* missing"):
        load_model(path)


def test_truncated_safetensors(tiny_checkpoints, tmp_path):
    path = copy_ckpt(tiny_checkpoints[0]["hf"], tmp_path / "m")
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"model.safetensors: truncated"):
        load_model(path)


def test_garbage_safetensors(tiny_checkpoints, tmp_path):
    path = copy_ckpt(tiny_checkpoints[0]["hf"], tmp_path / "m")
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CheckpointError, match="malformed safetensors header"):
        load_model(path)


def _edit_tensors(path, fn):
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    fn(tensors)
    save_file(tensors, str(f))


KEY = "model.language_model.layers.1.linear_attn.in_proj_z.weight"


def test_tensor_of_wrong_shape(tiny_checkpoints, tmp_path):
    path = copy_ckpt(tiny_checkpoints[0]["hf"], tmp_path / "m")
    _edit_tensors(path, lambda t: t.__setitem__(KEY, t[KEY][:-1]))
    with pytest.raises(CheckpointError, match=rf"model.safetensors: tensor {KEY} has shape \(95, 64\), the model expects \(96, 64\)"):
        load_model(path)


def test_missing_tensor(tiny_checkpoints, tmp_path):
    path = copy_ckpt(tiny_checkpoints[0]["hf"], tmp_path / "m")
    _edit_tensors(path, lambda t: t.pop(KEY))
    with pytest.raises(CheckpointError, match=r"tensor language_model.model.layers.1.linear_attn.in_proj_z.weight .* is missing"):
        load_model(path)


def test_unknown_tensor(tiny_checkpoints, tmp_path):
    path = copy_ckpt(tiny_checkpoints[0]["hf"], tmp_path / "m")
    _edit_tensors(path, lambda t: t.__setitem__("model.language_model.layers.0.mystery.weight", np.zeros(3, np.float32)))
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor model.language_model.layers.0.mystery.weight is not part of the model"):
        load_model(path)


def test_missing_expert_in_per_expert_layout(tiny_checkpoints, tmp_path):
    path = copy_ckpt(tiny_checkpoints[0]["per_expert"], tmp_path / "m")
    _edit_tensors(path, lambda t: t.pop("model.language_model.layers.2.mlp.experts.3.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"layers.2.mlp.experts: up_proj tensors missing for experts \[3\]"):
        load_model(path)


def test_quantized_tensor_disagreeing_with_config(tiny_checkpoints, tmp_path):
    path = copy_ckpt(tiny_checkpoints[0]["mlx_q4"], tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization"]["language_model.model.layers.0.mlp.gate"]["bits"] = 4
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"layers.0.mlp.gate.scales is bits=8 but config.json quantization says 4"):
        load_model(path)


def test_wrong_model_type(tiny_checkpoints, tmp_path):
    path = copy_ckpt(tiny_checkpoints[0]["hf"], tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"config.json: field 'model_type' is 'llama'"):
        load_model(path)


def test_invalid_json_config(tiny_checkpoints, tmp_path):
    path = copy_ckpt(tiny_checkpoints[0]["hf"], tmp_path / "m")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model(path)


def text_cfg(**overrides):
    cfg = {"model_type": "qwen3_5_moe", "text_config": {**TEXT_CONFIG, **overrides}}
    return {k: v for k, v in cfg.items()}


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"num_key_value_heads": 3}, "text_config.num_key_value_heads"),
        ({"linear_num_key_heads": 3}, "text_config.linear_num_key_heads"),
        ({"hidden_size": None}, "text_config.hidden_size"),
        ({"num_experts": 0}, "text_config.num_experts"),
        ({"num_experts_per_tok": 9}, "text_config.num_experts_per_tok"),
        ({"vocab_size": "512"}, "text_config.vocab_size"),
        ({"layer_types": ["linear_attention"] * 3}, "text_config.layer_types"),
        ({"layer_types": ["linear_attention"] * 3 + ["sliding"]}, r"text_config.layer_types\[3\]"),
        ({"partial_rotary_factor": 0.3, "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.3}}, "text_config.partial_rotary_factor"),
    ],
)
def test_config_refuses_unrunnable_fields(overrides, field):
    with pytest.raises(ConfigError, match=rf"field '{field}'"):
        ModelConfig.from_dict(text_cfg(**overrides))


def test_config_layer_types_fallback_and_text_only():
    cfg = {k: v for k, v in TEXT_CONFIG.items()}
    cfg.update(model_type="qwen3_5_moe_text", full_attention_interval=2)
    c = ModelConfig.from_dict(cfg)
    assert c.layer_types == ["linear_attention", "full_attention"] * 2
    assert c.rope_dims == 6 and c.rope_theta == 10000.0


def test_loading_is_lazy_and_peak_memory_near_weight_size(tmp_path):
    """A 4-bit checkpoint loads without passing through float: peak <= 1.1x the weights."""
    script = f"""
import json, mlx.core as mx, mlx.nn as nn
from mlx.utils import tree_flatten
from lily_mlx import Model, ModelConfig, load_model
from tiny import TEXT_CONFIG
cfg = dict(TEXT_CONFIG, hidden_size=512, moe_intermediate_size=256, shared_expert_intermediate_size=256,
           num_experts=32, vocab_size=4096, linear_value_head_dim=64, head_dim=64)
raw = {{"model_type": "qwen3_5_moe", "text_config": cfg, "quantization": {{"group_size": 64, "bits": 4}}}}
m = Model(ModelConfig.from_dict(raw))
nn.quantize(m, 64, 4, class_predicate=lambda p, mod: hasattr(mod, "to_quantized"))
params = dict(tree_flatten(m.parameters()))
mx.eval(params)
mx.save_safetensors("{tmp_path}/model.safetensors", params)
json.dump(raw, open("{tmp_path}/config.json", "w"))
"""
    subprocess.run([sys.executable, "-c", script], check=True, env=subprocess_env())
    size = (tmp_path / "model.safetensors").stat().st_size
    probe = f"""
import mlx.core as mx
from lily_mlx import load_model
mx.reset_peak_memory()
model, _ = load_model("{tmp_path}")
print(mx.get_peak_memory(), mx.get_active_memory())
"""
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True, env=subprocess_env()).stdout.split()
    peak, active = int(out[0]), int(out[1])
    assert size > 20e6
    assert active >= 0.95 * size and peak <= 1.1 * size, (peak, active, size)


def test_first_layers_only(tiny_checkpoints):
    """load_model(layers=k), as the server's warm-up workers load: the first k decoder layers, the same modules and
    weights as the whole model's (quantized ones too), none of the later layers' tensors; k out of range is refused."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from lily_mlx.server.warm_up import layers_to_hold

    path = tiny_checkpoints[0]["mlx_q4"]
    whole, _ = load_model(path)
    kinds = [layer.is_linear for layer in whole.language_model.model.layers]
    assert layers_to_hold(str(path)) == kinds.index(False) + 1  # up to the first attention layer
    k = 2
    part, _ = load_model(path, layers=k)
    assert [layer.is_linear for layer in part.language_model.model.layers] == kinds[:k]
    want = {n: a for n, a in tree_flatten(whole.parameters()) if not n.startswith(tuple(
        f"language_model.model.layers.{i}." for i in range(k, len(kinds))))}
    got = dict(tree_flatten(part.parameters()))
    assert got.keys() == want.keys() and any(a.dtype == mx.uint32 for a in got.values())
    assert all(mx.array_equal(got[n], want[n]).item() for n in got)
    for bad in (0, len(kinds) + 1):
        with pytest.raises(ValueError, match=rf"layers={bad}: .* has {len(kinds)} decoder layers"):
            load_model(path, layers=bad)
