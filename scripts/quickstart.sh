#!/usr/bin/env bash
# One command on a fresh machine: make .venv, install lily-mlx (CUDA build of MLX when an NVIDIA GPU is
# present, else the CPU build), then generate with the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
backend=cpu
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && backend=cuda
[ "$(uname -s)" = Darwin ] && backend=""
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q ".${backend:+[$backend]}"
lily-mlx generate --prompt "${1:-Return a list of the keys of a dictionary.}" --max-tokens "${2:-64}"
