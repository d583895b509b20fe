"""`lily-mlx <command> [flags]`: one line per command in COMMANDS ("module:function" taking argv, returning an exit code).

Modules named `bench.*` are the repo's `bench/` package: imported as `bench` from a source checkout, or as
`lily_mlx.bench` from an installed wheel (pyproject force-includes bench/ there).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Optional

COMMANDS: dict[str, str] = {
    "generate": "lily_mlx.generate:main",
    "convert": "lily_mlx.convert:main",
    "bench": "bench.ab:main",
    "perplexity": "bench.perplexity:main",
    "serve": "lily_mlx.server.cli:main",
}


def bench_package() -> str:
    """'bench' when lily_mlx runs from a source checkout that has bench/, else the wheel's 'lily_mlx.bench'."""
    root = Path(__file__).resolve().parents[1]
    if (root / "bench" / "__init__.py").is_file() and (root / "pyproject.toml").is_file():
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        return "bench"
    return "lily_mlx.bench"


def resolve(spec: str):
    module, _, func = spec.partition(":")
    if module == "bench" or module.startswith("bench."):
        module = bench_package() + module[len("bench"):]
    return getattr(importlib.import_module(module), func)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: lily-mlx <command> [flags]   (lily-mlx <command> --help for its flags)\ncommands: " + ", ".join(COMMANDS))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"lily-mlx: unknown command {name!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return resolve(COMMANDS[name])(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
