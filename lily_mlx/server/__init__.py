"""OpenAI-compatible server: `lily-mlx serve --model PATH` or `python -m lily_mlx.server --model PATH`."""

from .cli import build_parser, main, serve

__all__ = ["build_parser", "main", "serve"]
