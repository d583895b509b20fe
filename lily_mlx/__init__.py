"""lily_mlx: fast MLX inference for the Qwen3.5/3.6 hybrid MoE, a drop-in for mlx_lm."""

from .config import ConfigError, ModelConfig
from .loading import CheckpointError, load, load_model
from .model import Model

__version__ = "0.1.0"
__all__ = ["CheckpointError", "ConfigError", "Model", "ModelConfig", "load", "load_model"]
