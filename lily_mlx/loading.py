"""Checkpoint loading: the HF release layout, the per-expert layout transformers writes, and MLX-converted
(quantized) checkpoints; sharded or not; lazily, validated before anything is evaluated."""

from __future__ import annotations

import dataclasses
import json
import re
import struct
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .config import ModelConfig, read_config_json
from .embedded import resolve_embedded
from .model import Model

WEIGHT_PATTERNS = ["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and tensor."""


def resolve_model_path(path_or_repo: str | Path, revision: Optional[str] = None) -> Path:
    """A local folder, or a hub repo fetched with huggingface_hub (offline mode and local cache honoured)."""
    path = Path(resolve_embedded(path_or_repo)).expanduser()  # "embedded" -> the shipped checkpoint
    if path.is_dir():
        return path
    if path.exists():
        raise FileNotFoundError(f"{path}: expected a model folder, found a file")
    repo = str(path_or_repo)
    if repo.startswith((".", "/", "~")) or repo.count("/") != 1:
        raise FileNotFoundError(f"{repo}: no such model folder (and not a hub repo id 'owner/name')")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=WEIGHT_PATTERNS))
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise FileNotFoundError(f"{repo}: not found on the hub ({type(e).__name__})") from None
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"{repo}: not in the local hub cache and the hub is unreachable or offline (HF_HUB_OFFLINE)"
        ) from None
    except HFValidationError as e:
        raise FileNotFoundError(f"{repo}: not a model folder or a valid hub repo id ({e})") from None


def read_safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """Tensor name -> {dtype, shape} from a safetensors header, refusing truncated or malformed files."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(f"{path}: truncated safetensors file (header of {n} bytes, file of {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: malformed safetensors header ({e})") from None
    header.pop("__metadata__", None)
    end = max((t["data_offsets"][1] for t in header.values()), default=0)
    if 8 + n + end > size:
        raise CheckpointError(f"{path}: truncated safetensors file (tensors need {8 + n + end} bytes, file has {size})")
    return {name: {"dtype": t["dtype"], "shape": tuple(t["shape"])} for name, t in header.items()}


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: malformed index ({e})") from None
        files = sorted(set(weight_map.values()))
        for name in files:
            if not (model_dir / name).is_file():
                tensor = next(k for k, v in weight_map.items() if v == name)
                raise CheckpointError(f"{index}: shard {name} (holding {tensor}, ...) is missing from {model_dir}")
        return [model_dir / name for name in files]
    files = sorted(p for p in model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no .safetensors weight files")
    return files


def _infer_bits(key: str, w_shape, s_shape, in_dims: int, where: str):
    if in_dims % s_shape[-1]:
        raise CheckpointError(f"{where}: tensor {key}.scales has {s_shape[-1]} groups, which do not divide {in_dims} inputs")
    group = in_dims // s_shape[-1]
    bits = w_shape[-1] * 32 // in_dims
    if w_shape[-1] * 32 != bits * in_dims:
        raise CheckpointError(f"{where}: tensor {key}.weight of shape {w_shape} is not a packing of {in_dims} inputs")
    return group, bits


def _quantized_modules(model: Model, cfg: ModelConfig, shapes: dict, origin: dict) -> dict[str, dict]:
    """Module path -> {group_size, bits} for every module the checkpoint stores quantized."""
    modules = dict(model.named_modules())
    quant = cfg.quantization or {}
    found = {}
    for key in shapes:
        if not key.endswith(".scales"):
            continue
        path = key[: -len(".scales")]
        where = origin.get(key, ("?", "?"))[1]
        module = modules.get(path)
        if module is None or not hasattr(module, "to_quantized"):
            raise CheckpointError(f"{where}: tensor {origin[key][0]} quantizes {path}, which the model has no quantizable layer for")
        if f"{path}.weight" not in shapes or f"{path}.biases" not in shapes:
            raise CheckpointError(f"{where}: tensor {origin[key][0]} has no matching .weight and .biases")
        in_dims = module.weight.shape[-1]
        group, bits = _infer_bits(path, shapes[f"{path}.weight"], shapes[key], in_dims, where)
        declared = quant.get(path) if isinstance(quant.get(path), dict) else quant
        for name, value in (("group_size", group), ("bits", bits)):
            if declared.get(name) is not None and declared[name] != value:
                raise CheckpointError(
                    f"{where}: tensor {origin[key][0]} is {name}={value} but config.json quantization says {declared[name]}"
                )
        if quant.get(path) is False:
            raise CheckpointError(f"{where}: tensor {origin[key][0]} is quantized but config.json marks {path} unquantized")
        found[path] = {"group_size": group, "bits": bits}
    return found


def _past_layers(key: str, layers: int) -> bool:
    """Whether a sanitized tensor name belongs to a decoder layer at or past `layers` (not the MTP's layers)."""
    m = re.match(r"language_model\.model\.layers\.(\d+)\.", key)
    return m is not None and int(m.group(1)) >= layers


def _shape_of(a) -> tuple:
    return tuple(a.shape)


def load_model(
    model_path: str | Path,
    lazy: bool = False,
    strict: bool = True,
    model_config: Optional[dict[str, Any]] = None,
    *,
    quantize: Optional[dict[str, int] | bool] = None,
    dtype: Optional[mx.Dtype] = None,
    progress: Optional[bool] = None,
    layers: Optional[int] = None,
) -> tuple[Model, dict[str, Any]]:
    """Build the model from a checkpoint folder. Returns (model, raw config dict) like mlx_lm.utils.load_model.

    quantize: {"bits": 4, "group_size": 64} (or True for that) quantizes a float checkpoint on load with
    mlx-lm's predicate (8-bit router and shared-expert gate). dtype casts float parameters (not A_log).
    layers keeps the first that many decoder layers and reads none of the others' tensors (the server's warm-up
    workers build the kernels of a few layers of the very model). Every tensor is checked (presence, shape) before
    anything is read, so a bad checkpoint fails whole.
    """
    model_dir = Path(model_path)
    raw, cfg_path = read_config_json(model_dir)
    for k, v in (model_config or {}).items():
        target = raw["text_config"] if isinstance(raw.get("text_config"), dict) and k in raw["text_config"] else raw
        target[k] = v
    cfg = ModelConfig.from_dict(raw, where=str(cfg_path))
    if layers is not None:
        if not 1 <= layers <= cfg.num_hidden_layers:
            raise ValueError(f"layers={layers}: {model_dir} has {cfg.num_hidden_layers} decoder layers")
        cfg = dataclasses.replace(cfg, num_hidden_layers=layers, layer_types=cfg.layer_types[:layers])

    files = weight_files(model_dir)
    headers = {f: read_safetensors_header(f) for f in files}
    key_file: dict[str, Path] = {}
    for f, header in headers.items():
        for name in header:
            if name in key_file:
                raise CheckpointError(f"{f}: tensor {name} also appears in {key_file[name]}")
            key_file[name] = f

    weights: dict[str, mx.array] = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:  # MLX's own message lacks the file name
            raise CheckpointError(f"{f}: cannot read safetensors file ({e})") from None

    probe = Model(cfg)
    try:
        sanitized, origin_keys = probe.sanitize_with_origins(weights)
    except KeyError as e:
        raise CheckpointError(f"{model_dir}: {e.args[0]}") from None
    if layers is not None:
        sanitized = {k: v for k, v in sanitized.items() if not _past_layers(k, layers)}
    origin = {k: (o, str(key_file.get(o, "?"))) for k, o in origin_keys.items()}
    mtp_layers = 1 + max(
        (int(k.split(".")[2]) for k in sanitized if k.startswith("mtp.layers.")), default=-1
    )
    model = Model(cfg, mtp_layers=mtp_layers) if mtp_layers else probe

    shapes = {k: _shape_of(v) for k, v in sanitized.items()}
    qmods = _quantized_modules(model, cfg, shapes, origin)
    if qmods:
        nn.quantize(model, class_predicate=lambda p, m: qmods.get(p, False))

    expected = dict(tree_flatten(model.parameters()))
    problems = []
    for key, arr in expected.items():
        if key not in sanitized:
            problems.append(f"tensor {key} (expected by the model, shape {tuple(arr.shape)}) is missing")
        elif shapes[key] != tuple(arr.shape):
            o, f = origin[key]
            problems.append(f"{f}: tensor {o} has shape {shapes[key]}, the model expects {tuple(arr.shape)} for {key}")
    if strict:
        for key in sanitized:
            if key not in expected:
                o, f = origin[key]
                problems.append(f"{f}: tensor {o} is not part of the model (as {key})")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointError(f"{model_dir}: " + "; ".join(problems[:5]) + more)

    for key, value in sanitized.items():
        if key in expected and expected[key].dtype == mx.uint32 and value.dtype != mx.uint32:
            o, f = origin[key]
            raise CheckpointError(f"{f}: tensor {o} must hold uint32 packed codes, found {value.dtype}")
    if dtype is not None:
        keep = model.cast_predicate
        sanitized = {
            k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) and keep(k) else v for k, v in sanitized.items()
        }
    model.load_weights(list((k, v) for k, v in sanitized.items() if k in expected), strict=strict)

    if quantize:
        q = {"bits": 4, "group_size": 64} if quantize is True else dict(quantize)
        pred = model.quant_predicate

        def predicate(path, module):
            if not hasattr(module, "to_quantized") or path in qmods:
                return False
            chosen = pred(path, module)
            chosen = chosen if isinstance(chosen, dict) else {"group_size": q["group_size"], "bits": q["bits"]}
            return chosen if module.weight.shape[-1] % chosen["group_size"] == 0 else False

        nn.quantize(model, class_predicate=predicate)
        raw["quantization"] = _quantization_record(model, q)
        raw.pop("quantization_config", None)
    model.eval()
    model.fuse_projections()
    if not lazy:
        _evaluate(model, progress)
    return model, raw


def _quantization_record(model: nn.Module, q: dict) -> dict:
    """The config.json `quantization` entry mlx-lm expects: global bits/group plus per-module overrides."""
    record: dict[str, Any] = {"group_size": q["group_size"], "bits": q["bits"], "mode": "affine"}
    for path, m in model.named_modules():
        if hasattr(m, "scales") and hasattr(m, "bits") and (m.bits, m.group_size) != (q["bits"], q["group_size"]):
            record[path] = {"group_size": m.group_size, "bits": m.bits}
    return record


def _evaluate(model: Model, progress: Optional[bool]) -> None:
    """Evaluate parameters one layer at a time, so peak memory stays near the final size."""
    from tqdm import tqdm

    lm = model.language_model
    groups = [lm.model.embed_tokens] + list(lm.model.layers) + [lm.model.norm]
    if "lm_head" in lm:
        groups.append(lm.lm_head)
    if "mtp" in model:
        groups.append(model.mtp)
    # progress None: a bar only on a terminal (tqdm's disable=None).
    disable = None if progress is None else not progress
    for g in tqdm(groups, desc="Loading", unit="layer", disable=disable, leave=False):
        mx.eval(g.parameters())


def load(
    path_or_hf_repo: str,
    tokenizer_config: Optional[dict[str, Any]] = None,
    model_config: Optional[dict[str, Any]] = None,
    adapter_path: Optional[str] = None,
    lazy: bool = False,
    return_config: bool = False,
    revision: Optional[str] = None,
    trust_remote_code: bool = False,
):
    """mlx_lm.load's signature: returns (model, tokenizer) or (model, tokenizer, config)."""
    from mlx_lm.utils import load_tokenizer

    if adapter_path is not None:
        raise NotImplementedError("adapter_path (LoRA adapters) is not supported by lily_mlx yet")
    model_path = resolve_model_path(path_or_hf_repo, revision=revision)
    model, config = load_model(model_path, lazy, model_config=model_config)
    tokenizer = load_tokenizer(model_path, tokenizer_config, eos_token_ids=_eos_ids(config))
    return (model, tokenizer, config) if return_config else (model, tokenizer)


def _eos_ids(config: dict):
    eos = config.get("eos_token_id")
    if eos is None and isinstance(config.get("text_config"), dict):
        eos = config["text_config"].get("eos_token_id")
    return eos
