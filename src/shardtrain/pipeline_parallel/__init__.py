"""Pipeline parallelism: a model cut by layers into stages (:mod:`.cut`), run by ``torch.distributed.pipelining``'s
stages and schedules (:mod:`.schedule`), DeepSpeed's grid queries over the mesh (:mod:`.grid`);
docs/pipeline-parallel.md."""

from shardtrain.pipeline_parallel.cut import check_can_cut, cut_model, layers_of_stages, tied_across_stages
from shardtrain.pipeline_parallel.grid import PipelineGrid
from shardtrain.pipeline_parallel.schedule import Pipeline, check_micro_batches, split_micro_batch

__all__ = [
    "Pipeline",
    "PipelineGrid",
    "check_can_cut",
    "check_micro_batches",
    "cut_model",
    "layers_of_stages",
    "split_micro_batch",
    "tied_across_stages",
]
