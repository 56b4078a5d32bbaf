"""DeepSpeed's pipeline queries (``engine.grid``, ``is_first_stage()``, ``stage_id``, ...) answer as DeepSpeed
0.19's own ``PipelineParallelGrid`` and ``PipelineEngine`` do for the same layout."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

import shardtrain
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.pipeline_parallel import PipelineGrid
from shardtrain.testing import run_distributed

topology = pytest.importorskip("deepspeed.runtime.pipe.topology")

QUERIES = (
    "get_global_rank",
    "get_stage_id",
    "get_data_parallel_id",
    "get_pipe_parallel_rank",
    "get_pipeline_model_parallel_rank",
    "get_pipe_parallel_world_size",
    "get_pipeline_model_parallel_world_size",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_data_parallel_group_ranks",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_slice_parallel_rank",
    "get_tensor_model_parallel_rank",
    "get_slice_parallel_world_size",
    "get_tensor_model_parallel_world_size",
)
ATTRIBUTES = ("is_first_stage", "is_last_stage", "pp_group", "dp_group", "stage_id", "data_parallel_id")


def _deepspeed_answers(rank: int, pp: int, dp: int, tp: int) -> dict:
    """What DeepSpeed's grid answers on ``rank``, from its topology (the arithmetic of PipelineParallelGrid, whose
    constructor also makes process groups)."""
    topo = topology.PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    coord = topo.get_coord(rank)
    model_ranks = sorted(topo.filter_match(data=coord.data))
    pipe = next(g for g in topo.get_axis_comm_lists("pipe") if rank in g)
    data = next(g for g in topo.get_axis_comm_lists("data") if rank in g)
    return {
        "stage_id": coord.pipe,
        "data_parallel_id": coord.data,
        "slice": coord.model,
        "model_parallel": (model_ranks.index(rank), len(model_ranks)),
        "pp_group": pipe,
        "dp_group": data,
        "stages": [topo.get_rank(**coord._replace(pipe=s)._asdict()) for s in range(pp)],
    }


@pytest.mark.parametrize(("pp", "dp", "tp"), [(2, 2, 2), (3, 1, 2), (2, 3, 1), (1, 2, 2), (4, 2, 1)])
def test_grid_arithmetic_is_deepspeeds(pp, dp, tp):
    for rank, (s, d, t) in enumerate(itertools.product(range(pp), range(dp), range(tp))):  # the (pp, dp, tp) mesh
        ours = PipelineGrid(rank, pp * dp * tp, pp, dp, tp, stage_id=s, data_parallel_id=d, slice_rank=t)
        theirs = _deepspeed_answers(rank, pp, dp, tp)
        assert (ours.get_stage_id(), ours.get_data_parallel_rank(), ours.get_slice_parallel_rank()) == (
            theirs["stage_id"],
            theirs["data_parallel_id"],
            theirs["slice"],
        )
        assert (ours.get_model_parallel_rank(), ours.get_model_parallel_world_size()) == theirs["model_parallel"]
        assert ours.pp_group == theirs["pp_group"] and ours.dp_group == theirs["dp_group"]
        assert [ours.stage_to_global(x) for x in range(pp)] == theirs["stages"]
        assert (ours.is_first_stage, ours.is_last_stage) == (s == 0, s == pp - 1)


def _queries(pp: int) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layer=3, n_head=2))
    config = {"pipeline_parallel_size": pp, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 3}
    engine = shardtrain.initialize(model, config, optimizer=torch.optim.SGD(model.parameters()))
    world, grid = dist.get_world_size(), engine.grid
    # DeepSpeed's own grid over the same (pipe, data) layout, with its process groups (its comm adopts the world)
    import deepspeed.comm

    deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    theirs = topology.PipelineParallelGrid(topology.PipeDataParallelTopology(num_pp=pp, num_dp=world // pp))
    out = {
        "ours": {q: getattr(grid, q)() for q in QUERIES} | {a: getattr(grid, a) for a in ATTRIBUTES},
        "theirs": {q: getattr(theirs, q)() for q in QUERIES} | {a: getattr(theirs, a) for a in ATTRIBUTES},
        "groups": [
            (dist.get_process_group_ranks(getattr(grid, g)()), dist.get_process_group_ranks(getattr(theirs, g)()))
            for g in ("get_pipe_parallel_group", "get_data_parallel_group", "get_slice_parallel_group")
        ],
        "engine": (engine.is_first_stage(), engine.is_last_stage(), engine.stage_id, engine.num_stages),
        "micro_batches": engine.micro_batches,
    }
    engine.close()
    return out


@pytest.mark.parametrize(("pp", "world"), [(2, 4), (3, 3)])
def test_engine_answers_as_deepspeeds_grid(pp, world):
    for rank, r in enumerate(run_distributed(_queries, world, pp)):
        assert r["ours"] == r["theirs"], rank
        for ours, theirs in r["groups"]:
            assert ours == theirs, (rank, r["groups"])
        stage = rank // (world // pp)
        assert r["engine"] == (stage == 0, stage == pp - 1, stage, pp)
        assert r["micro_batches"] == 3
