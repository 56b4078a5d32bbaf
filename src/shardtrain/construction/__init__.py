"""Sharded construction (:mod:`.sharded_init`): build a model so that no rank ever holds it whole, either sharded as
each module is built or deferred on ``meta`` and materialized as each rank's chunk after the split. Public as
``shardtrain.zero.Init``."""
