"""Typed, validated configuration: the typed sections (:mod:`.sections`), DeepSpeed's key table
(:mod:`.deepspeed_keys`), the ``"auto"`` values resolved at ``initialize`` (:mod:`.auto`), and the one place a config
becomes the typed plan the engine is built from (:mod:`.plan`)."""

from shardtrain.config.sections import Config, ZeroConfig, inspect_config, load_config

__all__ = ["Config", "ZeroConfig", "inspect_config", "load_config"]
