"""lily_mlx: fast MLX inference for the Qwen3.5/3.6 hybrid MoE, a drop-in for mlx_lm."""

from .config import ConfigError, ModelConfig
# through the generate package, so `lily_mlx.generate` stays the function after `import lily_mlx.generate`
from .generate import (
    BatchResponse,
    GenerationResponse,
    batch_generate,
    generate,
    generate_step,
    make_cache,
    stream_generate,
)
from .loading import CheckpointError, load, load_model
from .model import Model

__version__ = "0.1.0"
__all__ = [
    "BatchResponse", "CheckpointError", "ConfigError", "GenerationResponse", "Model", "ModelConfig",
    "batch_generate", "generate", "generate_step", "load", "load_model", "make_cache", "stream_generate",
]
