import os
import sys
from pathlib import Path

import pytest

# MLX's CUDA backend runs float32 matmuls as TF32 unless told otherwise; parity tests need full float32.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

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


@pytest.fixture
def kernel_env(monkeypatch):
    """set(name, value): one of the kernels' experiment variables ($LILY_MLX_KERNEL_DEFINES, $LILY_MLX_PLAN) set to
    value (None: unset) for the rest of the test or until set again. lily_mlx.ops.kernels reads each once a process,
    so both caches are cleared at every set and after the test."""
    from lily_mlx.ops import kernels

    def clear():
        kernels.experiment_values.cache_clear()
        kernels.plan_overrides.cache_clear()

    def set_env(name: str, value):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        clear()

    yield set_env
    clear()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """The same tiny random model in every layout: hf, hf_sharded, per_expert, mlx (fp32), mlx_bf16, mlx_q4.

    Returns (paths dict, the transformers model)."""
    import tiny

    root = tmp_path_factory.mktemp("tiny")
    hf = tiny.hf_model()
    paths = {
        "hf": tiny.write_hf(hf, root / "hf"),
        "hf_sharded": tiny.write_hf(hf, root / "hf_sharded", shards=3),
        "per_expert": tiny.write_per_expert(hf, root / "per_expert"),
    }
    for p in paths.values():
        tiny.write_tokenizer(p)
    paths["mlx"] = tiny.write_mlx(paths["hf"], root / "mlx")
    paths["mlx_bf16"] = tiny.write_mlx(paths["hf"], root / "mlx_bf16", dtype="bfloat16")
    paths["mlx_q4"] = tiny.write_mlx(paths["hf"], root / "mlx_q4", quantize=True, group_size=32, bits=4)
    return paths, hf


REPO_ROOT = Path(__file__).resolve().parent.parent


def subprocess_env(**extra) -> dict:
    """Environment for a child python that imports lily_mlx from this checkout and tests/ helpers."""
    import os

    env = dict(os.environ, **extra)
    paths = [str(REPO_ROOT), str(REPO_ROOT / "tests")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env
