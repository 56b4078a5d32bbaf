"""``deepspeed.runtime.pipe``: DeepSpeed's pipeline module and engine on shardtrain's pipeline parallelism
(docs/pipeline-parallel.md)."""

from shardtrain.compat.deepspeed.runtime.pipe.engine import PipelineEngine
from shardtrain.compat.deepspeed.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineEngine", "PipelineModule", "TiedLayerSpec"]
