"""ZeRO sharding: the layout of every parameter's shard (:mod:`.layout`, built by :mod:`.build`), stage-3 units
(:mod:`.units`, :mod:`.guarded`) with the gather service (:mod:`.gather`, :mod:`.hpz`, :mod:`.departure`), gradient
reduction (:mod:`.reducer`) and the optimizer step on shards (:mod:`.optimizer`, :mod:`.step_gather`).
``shardtrain.zero.Init`` is sharded construction (:mod:`shardtrain.construction`)."""

from shardtrain.construction.sharded_init import Init

__all__ = ["Init"]
