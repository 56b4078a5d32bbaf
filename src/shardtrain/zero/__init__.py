"""ZeRO: the layout of every parameter's shard (:mod:`.layout`, built by :mod:`.build`), stage-3 units with their
gathers and releases (:mod:`.units`, :mod:`.unit_runtime`, :mod:`.hpz`), gradient reduction (:mod:`.reducer`), the
optimizer step on shards (:mod:`.optimizer`, :mod:`.step_gather`), precision (:mod:`.precision`) and sharded
construction (:mod:`.init`, public as ``shardtrain.zero.Init``)."""

from shardtrain.zero.init import Init

__all__ = ["Init"]
