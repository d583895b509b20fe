"""The embedded default model: lily-tiny, a 2M-parameter Qwen3.5-MoE trained on CPython docstrings and
shipped inside the package (lily_mlx/assets/lily-tiny, written by scripts/train_tiny.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

EMBEDDED_NAME = "embedded"
EMBEDDED_MODEL = Path(__file__).resolve().parent / "assets" / "lily-tiny"


def resolve_embedded(path_or_repo: Optional[str | Path]) -> str | Path:
    """None or "embedded" -> the shipped checkpoint folder; anything else comes back unchanged.

    The alias wins over a local folder called "embedded"; pass "./embedded" for that one.
    """
    if path_or_repo is not None and not (isinstance(path_or_repo, str) and path_or_repo == EMBEDDED_NAME):
        return path_or_repo
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (EMBEDDED_MODEL / name).is_file():
            raise FileNotFoundError(
                f"{EMBEDDED_MODEL / name}: the embedded model is missing from this install "
                "(rebuild it with scripts/train_tiny.py)"
            )
    return EMBEDDED_MODEL
