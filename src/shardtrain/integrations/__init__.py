"""Public names of the Trainer adapters, which live in :mod:`shardtrain.compat`: ``shardtrain.integrations.hf_trainer``
and ``shardtrain.integrations.trl_trainers`` (each imported on use: each needs its framework)."""
