"""DeepSpeed's pipeline grid (``engine.grid``): the queries a DeepSpeed pipeline script makes of its process grid,
answered from shardtrain's mesh with DeepSpeed 0.19's names and meanings (``deepspeed/runtime/pipe/topology.py``,
``PipelineParallelGrid``).

DeepSpeed lays ranks out as ``(pipe, data, model)``, the model axis innermost; shardtrain's mesh is ``(pp, dp, tp)``
the same way ([Note: the pipeline axis] in :mod:`shardtrain.distributed.mesh`), so the coordinates are the same
numbers: ``stage_id`` is ``pp_rank``, the data-parallel id ``dp_rank``, the slice (model) rank ``tp_rank``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class PipelineGrid:
    """This rank's place in the ``(pipe, data, model)`` grid and its groups; ``sp``: the ranks sharing a sequence,
    ``sp * cp`` (DeepSpeed's pipeline grid has no such axis: its ranks sit between the data and the model axes
    here)."""

    global_rank: int
    world_size: int
    pipe_parallel_size: int
    data_parallel_size: int
    slice_parallel_size: int  # the tensor-parallel size (DeepSpeed's "model" axis)
    stage_id: int
    data_parallel_id: int
    slice_rank: int
    pipe_group: dist.ProcessGroup | None = None  # None without pipeline parallelism
    data_group: dist.ProcessGroup | None = None
    slice_group: dist.ProcessGroup | None = None
    sp: int = 1

    @property
    def model_parallel_size(self) -> int:
        return self.slice_parallel_size

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.pipe_parallel_size - 1

    @property
    def pp_group(self) -> list[int]:
        """The global ranks of this rank's pipeline, stage by stage (DeepSpeed's ``grid.pp_group``)."""
        return [self.stage_to_global(s) for s in range(self.pipe_parallel_size)]

    @property
    def dp_group(self) -> list[int]:
        """The global ranks of this stage and slice rank, one per data-parallel id (DeepSpeed's ``grid.dp_group``)."""
        return [self.stage_to_global(self.stage_id, data=d) for d in range(self.data_parallel_size)]

    def stage_to_global(self, stage_id: int, data: int | None = None, model: int | None = None) -> int:
        """The global rank of ``stage_id`` at this rank's data-parallel id and slice rank, or at ``data`` /
        ``model`` where given."""
        data = self.data_parallel_id if data is None else data
        model = self.slice_rank if model is None else model
        stage_world = self.world_size // self.pipe_parallel_size
        return (
            self.global_rank
            + (stage_id - self.stage_id) * stage_world
            + (data - self.data_parallel_id) * self.sp * self.slice_parallel_size
            + (model - self.slice_rank)
        )

    # -- DeepSpeed's MPU functions, under their names -----------------------------------------------------------
    def get_global_rank(self) -> int:
        return self.global_rank

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def get_pipe_parallel_rank(self) -> int:
        """The stage of the pipeline this rank resides in."""
        return self.stage_id

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        """The number of stages in the pipeline."""
        return self.pipe_parallel_size

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> dist.ProcessGroup | None:
        """The group of ranks within the same pipeline (None without pipeline parallelism)."""
        return self.pipe_group

    def get_data_parallel_rank(self) -> int:
        """Which pipeline this rank resides in."""
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        """The number of pipelines."""
        return self.data_parallel_size

    def get_data_parallel_group(self) -> dist.ProcessGroup | None:
        """The group of ranks within the same stage of all pipelines."""
        return self.data_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_group

    def get_model_parallel_rank(self) -> int:
        """The index among the ranks of this data-parallel id (every stage and slice), as DeepSpeed numbers them."""
        return self.stage_id * self.slice_parallel_size + self.slice_rank

    def get_model_parallel_world_size(self) -> int:
        return self.pipe_parallel_size * self.slice_parallel_size

    def get_slice_parallel_rank(self) -> int:
        """The tensor-parallel (Megatron slicing) rank."""
        return self.slice_rank

    def get_tensor_model_parallel_rank(self) -> int:
        return self.slice_rank

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self) -> dist.ProcessGroup | None:
        return self.slice_group


__all__ = ["PipelineGrid"]
