"""The model parity and reference-op suites again, marked `cuda`: on the H200 they run on MLX's CUDA
backend (the default device there), against transformers (CPU torch) and stock mlx-lm (CUDA)."""

import mlx.core as mx
import pytest

from test_model_parity import *  # noqa: F401,F403  (re-collected here under the cuda marker)
from test_reference_ops import *  # noqa: F401,F403

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def on_the_gpu():
    assert mx.default_device() == mx.gpu, "cuda tests must run with the GPU as MLX's default device"
    yield
