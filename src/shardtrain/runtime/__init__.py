"""How a step runs around the model: the one interface (:mod:`.interface`) and its eager implementation
(:mod:`.eager`: at ZeRO-3, module hooks that gather, prefetch and release units). The graph implementation is
:mod:`shardtrain.graph.runtime`."""
