"""shardtrain: ZeRO sharded data-parallel training for PyTorch, with convergence debugging."""

from shardtrain.config import Config, load_config
from shardtrain.engine import Engine, initialize
from shardtrain.errors import (
    CollectiveError,
    CollectiveTimeoutError,
    ConfigError,
    LayoutError,
    OptimizerError,
    PeerLostError,
    RankMismatchError,
    ShardtrainError,
)
from shardtrain.hf import from_pretrained

__version__ = "0.1.0"

__all__ = [
    "CollectiveError",
    "CollectiveTimeoutError",
    "Config",
    "ConfigError",
    "Engine",
    "LayoutError",
    "OptimizerError",
    "PeerLostError",
    "RankMismatchError",
    "ShardtrainError",
    "from_pretrained",
    "initialize",
    "load_config",
]
