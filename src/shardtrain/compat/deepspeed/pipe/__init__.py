"""``deepspeed.pipe``: where DeepSpeed scripts import ``PipelineModule``, ``LayerSpec`` and ``TiedLayerSpec`` from
(``from deepspeed.pipe import PipelineModule, LayerSpec``); they live in :mod:`..runtime.pipe.module`, as in
DeepSpeed."""

from shardtrain.compat.deepspeed.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
