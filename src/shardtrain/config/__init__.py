"""Typed, validated configuration: the schema (:mod:`.schema`), DeepSpeed's key table (:mod:`.deepspeed_keys`) and
the ``"auto"`` values resolved at ``initialize`` (:mod:`.auto`)."""

from shardtrain.config.schema import Config, ZeroConfig, inspect_config, load_config

__all__ = ["Config", "ZeroConfig", "inspect_config", "load_config"]
