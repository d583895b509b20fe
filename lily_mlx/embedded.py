"""The embedded default model: lily-tiny, a 2M-parameter Qwen3.5-MoE with an MTP head, trained on CPython
docstrings and shipped inside the package (written by scripts/train_tiny.py) in two layouts:
"embedded" is the HF release layout in bf16 (lily_mlx/assets/lily-tiny), "embedded-4bit" the MLX 4-bit
layout (lily_mlx/assets/lily-tiny-4bit)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

ASSETS = Path(__file__).resolve().parent / "assets"
EMBEDDED_NAME = "embedded"
EMBEDDED_MODEL = ASSETS / "lily-tiny"
EMBEDDED_4BIT_NAME = "embedded-4bit"
EMBEDDED_4BIT_MODEL = ASSETS / "lily-tiny-4bit"
EMBEDDED_MODELS = {EMBEDDED_NAME: EMBEDDED_MODEL, EMBEDDED_4BIT_NAME: EMBEDDED_4BIT_MODEL}


def resolve_embedded(path_or_repo: Optional[str | Path]) -> str | Path:
    """None or "embedded" -> the shipped bf16 checkpoint folder, "embedded-4bit" -> the 4-bit one; anything
    else comes back unchanged.

    The aliases win over local folders of those names; pass "./embedded" for such a folder.
    """
    if path_or_repo is None:
        folder = EMBEDDED_MODEL
    elif isinstance(path_or_repo, str) and path_or_repo in EMBEDDED_MODELS:
        folder = EMBEDDED_MODELS[path_or_repo]
    else:
        return path_or_repo
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (folder / name).is_file():
            raise FileNotFoundError(
                f"{folder / name}: the embedded model is missing from this install "
                "(rebuild it with scripts/train_tiny.py)"
            )
    return folder
