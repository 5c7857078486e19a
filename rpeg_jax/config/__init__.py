"""Typed, frozen run configuration (pure Python; importable without JAX devices)."""

from rpeg_jax.config.base import ConfigError, build, to_dict
from rpeg_jax.config.costmodel import CostModelConfig
from rpeg_jax.config.data import DataConfig
from rpeg_jax.config.distributed import DistributedConfig
from rpeg_jax.config.env import EnvConfig
from rpeg_jax.config.eval import EvalConfig
from rpeg_jax.config.model import PRESETS as MODEL_PRESETS
from rpeg_jax.config.model import ModelConfig, RopeScaling, model_preset
from rpeg_jax.config.optim import OptimConfig
from rpeg_jax.config.pipeline import PipelineConfig
from rpeg_jax.config.rl import RLConfig
from rpeg_jax.config.rollout import RolloutConfig
from rpeg_jax.config.run import DEFAULT_CONFIG, RunConfig, dump_yaml, from_dict, load_config
from rpeg_jax.config.sft import SFTConfig
from rpeg_jax.config.sharding import ShardingConfig
from rpeg_jax.config.train import TrainConfig

__all__ = [
    "ConfigError",
    "build",
    "to_dict",
    "CostModelConfig",
    "DataConfig",
    "DistributedConfig",
    "EnvConfig",
    "EvalConfig",
    "MODEL_PRESETS",
    "ModelConfig",
    "RopeScaling",
    "model_preset",
    "OptimConfig",
    "PipelineConfig",
    "RLConfig",
    "RolloutConfig",
    "DEFAULT_CONFIG",
    "RunConfig",
    "dump_yaml",
    "from_dict",
    "load_config",
    "ShardingConfig",
    "SFTConfig",
    "TrainConfig",
]
