import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


def _has_cuda() -> bool:
    import mlx.core as mx

    return hasattr(mx, "cuda") and mx.cuda.is_available()


def _has_metal() -> bool:
    import mlx.core as mx

    return mx.metal.is_available()


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs MLX's CUDA backend and an NVIDIA GPU")
    skip_metal = pytest.mark.skip(reason="needs an Apple GPU (mx.metal.is_available())")
    cuda, metal = _has_cuda(), _has_metal()
    for item in items:
        if "cuda" in item.keywords and not cuda:
            item.add_marker(skip_cuda)
        if "metal" in item.keywords and not metal:
            item.add_marker(skip_metal)
