"""Pipeline parallelism: a model cut by layers into stages (:mod:`.cut`), run by ``torch.distributed.pipelining``'s
stages and schedules (:mod:`.schedule`), DeepSpeed's grid queries over the mesh (:mod:`.grid`);
docs/pipeline-parallel.md."""

from shardtrain.pipeline_parallel.cut import check_can_cut, cut_model, layers_of_stages, tied_across_stages
from shardtrain.pipeline_parallel.grid import PipelineGrid
from shardtrain.pipeline_parallel.order import last_stage_rank, stage_ids_of_rank
from shardtrain.pipeline_parallel.schedule import Pipeline, check_micro_batches, split_micro_batch

__all__ = [
    "Pipeline",
    "PipelineGrid",
    "check_can_cut",
    "check_micro_batches",
    "cut_model",
    "last_stage_rank",
    "layers_of_stages",
    "split_micro_batch",
    "stage_ids_of_rank",
    "tied_across_stages",
]
