"""shardtrain: ZeRO sharded data-parallel training for PyTorch, with convergence debugging."""

from shardtrain.compat.hf_pretrained import from_pretrained
from shardtrain.config.sections import Config, load_config
from shardtrain.engine.engine import Engine, initialize
from shardtrain.errors import (
    CollectiveError,
    CollectiveTimeoutError,
    ConfigError,
    GraphCaptureError,
    LayoutError,
    OffloadError,
    OptimizerError,
    PeerLostError,
    RankMismatchError,
    ShardtrainError,
)

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "graph":  # imported on first use: it imports TorchDynamo, which costs seconds
        import importlib

        return importlib.import_module("shardtrain.graph")
    raise AttributeError(f"module 'shardtrain' has no attribute {name!r}")


__all__ = [
    "CollectiveError",
    "CollectiveTimeoutError",
    "Config",
    "ConfigError",
    "Engine",
    "GraphCaptureError",
    "LayoutError",
    "OffloadError",
    "OptimizerError",
    "PeerLostError",
    "RankMismatchError",
    "ShardtrainError",
    "from_pretrained",
    "graph",
    "initialize",
    "load_config",
]
