"""The plan: a config resolved once, without a process group, into ParallelDims and the policies; one verdict for
``initialize``, ``config check`` and ``estimate``."""

from __future__ import annotations

import json

import pytest
import torch

from shardtrain.cli.config_check import check_file
from shardtrain.config.plan import resolve_plan
from shardtrain.config.sections import load_config
from shardtrain.errors import ConfigError, LayoutError
from shardtrain.estimate.planner import Candidate, _plan, layout_config
from shardtrain.plan.dims import ParallelDims
from shardtrain.plan.policies import PrefetchPolicy


def test_a_config_becomes_its_dims_and_policies():
    cfg = load_config(
        {
            "tensor_parallel": {"size": 2},
            "sequence_parallel_size": 2,
            "bf16": {"enabled": True},
            "communication_data_type": "bf16",
            "graph": {"enabled": False, "cache_size": 3},
            "zero_optimization": {
                "stage": 2,
                "reduce_bucket_size": 1000,
                "allgather_bucket_size": 2000,
                "overlap_comm": False,
                "stage3_prefetch_bucket_size": 77,
                "stage3_unit_classes": ["Block"],
                "sub_group_size": 123,
                "offload_optimizer": {"device": "nvme", "nvme_path": "/x", "buffer_count": 3, "ratio": 0.5},
            },
        }
    )
    plan = resolve_plan(cfg, 8)
    assert (plan.dims.world, plan.dims.tp, plan.dims.sp, plan.dims.dp, plan.dims.zero) == (8, 2, 2, 2, 4)
    z = plan.zero
    assert (z.stage, z.shard_optimizer_state, z.shard_gradients, z.shard_parameters) == (2, True, True, False)
    assert (z.reduce_bucket_size, z.allgather_bucket_size, z.overlap_comm, z.unit_classes) == (
        1000,
        2000,
        False,
        ("Block",),
    )
    assert plan.prefetch == PrefetchPolicy(77)
    opt = plan.offload.optimizer
    assert (opt.enabled, opt.device, opt.nvme_path, opt.buffer_count, opt.ratio, opt.sub_group_size) == (
        True, "nvme", "/x", 3, 0.5, 123,
    )  # fmt: skip
    assert not plan.offload.param.enabled
    p = plan.precision
    assert (p.compute_dtype, p.reduce_dtype, p.mixed, p.loss_scale) == (torch.bfloat16, torch.bfloat16, True, None)
    assert plan.graph.cache_size == 3 and not plan.graph.enabled
    fp16 = resolve_plan(load_config({"fp16": {"enabled": True, "initial_scale_power": 5, "auto_cast": True}}), 1)
    assert fp16.precision.loss_scale is not None and fp16.precision.loss_scale.initial_scale_power == 5
    assert fp16.precision.cast_inputs


def test_hpz_counts_at_stage_3_only_and_when_smaller_than_the_zero_axis():
    def hpz(stage: int, size: int, world: int) -> int:
        cfg = {"zero_optimization": {"stage": stage, "zero_hpz_partition_size": size}}
        return resolve_plan(load_config(cfg), world).dims.hpz

    assert hpz(3, 2, 4) == 2
    assert hpz(2, 2, 4) == 1  # below stage 3 the key has no effect, as in DeepSpeed
    assert hpz(3, 4, 4) == 1  # one group of every rank: plain ZeRO-3
    assert hpz(3, 0, 4) == 1


def test_every_refusal_of_the_plan_is_a_config_error():
    """Sizes are LayoutErrors, combinations ConfigErrors; a caller catches both as ConfigError."""
    assert issubclass(LayoutError, ConfigError)
    with pytest.raises(LayoutError, match=r"tensor_parallel\.size 3 does not divide the 4 processes"):
        resolve_plan(load_config({"tensor_parallel": {"size": 3}}), 4)
    with pytest.raises(ConfigError, match=r"\(ZeRO\+\+ hpZ\) with tensor parallelism"):
        resolve_plan(load_config({"tensor_parallel": {"size": 2}, "zero_optimization": {"stage": 3,
                                  "zero_hpz_partition_size": 2}}), 8)  # fmt: skip
    with pytest.raises(ConfigError, match=r"tiled_logits_loss / tiled_mlp_compute with graph\.enabled"):
        resolve_plan(load_config({"tiled_mlp_compute": True, "graph": {"enabled": True}}), 1)
    offload_param = load_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    assert resolve_plan(offload_param, 2, "cpu").offload.param.device == "cpu"
    with pytest.raises(ConfigError, match=r"offload_param\.device 'cpu' on CUDA is not built without offload_opt"):
        resolve_plan(offload_param, 2, "cuda")


def test_sizes_that_cannot_be_laid_out_are_refused_by_name():
    # context parallelism is an axis of its own: dp = world / cp, ZeRO over dp x cp
    dims = ParallelDims(4, cp=2)
    assert (dims.dp, dims.zero) == (2, 4)
    with pytest.raises(LayoutError, match=r"context_parallel_size 3 does not divide the 4 processes.* \[1, 2, 4\]"):
        ParallelDims(4, cp=3)
    with pytest.raises(LayoutError, match="world size must be at least 1"):
        ParallelDims(0)


def test_one_prefetch_rule():
    """One unit ahead within the budget: the rule the eager runtime, graph mode's schedule and the estimate read."""
    assert [PrefetchPolicy(100).ahead(n) for n in (1, 100, 101)] == [True, True, False]
    assert not PrefetchPolicy(0).enabled and not PrefetchPolicy(0).ahead(1)


CASES = [
    (3, {"tensor_parallel": {"size": 2}}),
    (3, {"zero_optimization": {"stage": 3, "mics_shard_size": 3}}),
    (4, {"tensor_parallel": {"size": 3}}),
    (4, {"sequence_parallel_size": 3}),
    (8, {"tensor_parallel": {"size": 2}, "zero_optimization": {"stage": 1, "mics_shard_size": 3}}),
    (6, {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}}),
    (8, {"tensor_parallel": {"size": 2}, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}),
    (4, {"expert_parallel_size": 3}),
    (4, {"expert_parallel_size": 2, "graph": {"enabled": True}}),
    (4, {"expert_parallel_size": 2, "zero_optimization": {"stage": 2}}),
    (8, {"tensor_parallel": {"size": 2}, "sequence_parallel_size": 2, "zero_optimization": {"stage": 3}}),
]


@pytest.mark.parametrize(("world", "config"), CASES)
def test_config_check_and_the_estimate_give_the_plans_verdict(tmp_path, world, config):
    """The three entry points build the plan alike: the same dp, or the same refusal in the same words."""
    try:
        verdict: int | str = resolve_plan(load_config(config), world).dims.dp
    except ConfigError as err:
        verdict = str(err)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    ok, lines = check_file(str(path), world_size=world)
    assert ok == isinstance(verdict, int)
    if not ok:
        assert any(verdict in line for line in lines), lines
    zero = config.get("zero_optimization", {})
    candidate = Candidate(
        world,
        stage=zero.get("stage", 0),
        tp=config.get("tensor_parallel", {}).get("size", 1),
        sp=config.get("sequence_parallel_size", 1),
        ep=config.get("expert_parallel_size", 1),
        shard_size=zero.get("mics_shard_size"),
        hpz=zero.get("zero_hpz_partition_size", 1),
    )
    try:
        estimated: int | str = _plan(candidate, layout_config(config, candidate), "cpu").dims.dp
    except ConfigError as err:
        estimated = str(err)
    assert estimated == verdict


def test_pipeline_axis_is_cut_before_the_others():
    """pp stages of world / pp ranks each; dp is what is left within a stage."""
    dims = ParallelDims(6, pp=3)
    assert (dims.stage_world, dims.dp, dims.zero) == (2, 2, 2)
    with pytest.raises(LayoutError, match=r"pipeline_parallel_size 4 does not divide the 6 processes.*\[1, 2, 3, 6\]"):
        ParallelDims(6, pp=4)


NVME = {"device": "nvme", "nvme_path": "/tmp"}


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}, r"ZeRO\+\+ hpZ"),
        ({"sequence_parallel_size": 2, "context_parallel_size": 2}, "both sequence and context parallelism"),
        ({"sequence_parallel_size": 2, "expert_parallel_size": 2}, "expert parallelism"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, "parameter offload to host memory"),
        ({"zero_optimization": {"stage": 3, "offload_param": NVME}, "graph": {"enabled": True}}, "graph mode and"),
        ({"tiled_logits_loss": True}, "tiled_logits_loss"),
        ({"graph": {"enabled": True}, "tensor_parallel": {"size": 2}}, "graph mode and tensor parallelism"),
    ],
)
def test_pipeline_with_what_is_not_built_is_refused_by_name(extra, named):
    cfg = load_config({"pipeline_parallel_size": 2, **extra})
    with pytest.raises(ConfigError, match=f"pipeline_parallel_size 2 with {named}.*not built yet"):
        resolve_plan(cfg, 8)


@pytest.mark.parametrize(
    "zero",
    [
        {"stage": 1, "offload_optimizer": {"device": "cpu"}},
        {"stage": 2, "offload_optimizer": NVME},
        {"stage": 3, "offload_param": NVME},
        {"stage": 3, "mics_shard_size": 1},
        {"stage": 3, "mics_shard_size": 2},
    ],
)
def test_pipeline_with_what_is_built_is_planned(zero):
    """Built under pipelines (tests/pipeline_parallel/test_pipeline_composed.py): each stage's data-parallel
    ranks offload, or shard and replicate, as a world of their own would."""
    plan = resolve_plan(load_config({"pipeline_parallel_size": 2, "zero_optimization": zero}), 8)
    assert (plan.dims.pp, plan.dims.dp) == (2, 4)
    assert plan.dims.replicas == 4 // zero.get("mics_shard_size", 4)
    assert resolve_plan(load_config({"pipeline_parallel_size": 2, "graph": {"enabled": True}}), 8).graph.enabled
    assert resolve_plan(load_config({"pipeline_parallel_size": 2, "tiled_mlp_compute": True}), 8).tiling.mlp


def test_pipeline_with_tensor_parallelism_is_planned():
    """pp 2 x tp 2 is built (tests/pipeline_parallel/test_pipeline_tp.py), and pp 2 x sp 2 and pp 2 x cp 2
    (tests/pipeline_parallel/test_pipeline_sequence.py); a split sequence with tp beside it, still refused."""
    plan = resolve_plan(load_config({"pipeline_parallel_size": 2, "tensor_parallel": {"size": 2}}), 8)
    assert (plan.dims.pp, plan.dims.tp, plan.dims.dp) == (2, 2, 2)
    for split in ("sequence_parallel_size", "context_parallel_size"):
        plan = resolve_plan(load_config({"pipeline_parallel_size": 2, split: 2}), 8)
        assert (plan.dims.pp, plan.dims.sp * plan.dims.cp, plan.dims.dp) == (2, 2, 2)
        cfg = load_config({"pipeline_parallel_size": 2, "tensor_parallel": {"size": 2}, split: 2})
        with pytest.raises(ConfigError, match=r"pipeline_parallel_size 2 with tensor parallelism \(sequence_parallel"):
            resolve_plan(cfg, 8)


def test_pipeline_with_expert_parallelism_is_planned():
    """pp 2 x ep 2 is built (tests/pipeline_parallel/test_pipeline_moe.py): the expert groups are cut from each
    stage's data-parallel ranks, so ep must divide world / pp, not the world; hpZ beside it is still refused."""
    plan = resolve_plan(load_config({"pipeline_parallel_size": 2, "expert_parallel_size": 2}), 4)
    assert (plan.dims.pp, plan.dims.ep, plan.dims.dp) == (2, 2, 2)
    with pytest.raises(
        LayoutError, match=r"expert_parallel_size \(ep_size\) 4 does not divide the data-parallel size 2"
    ):
        resolve_plan(load_config({"pipeline_parallel_size": 2, "expert_parallel_size": 4}), 4)
    hpz = {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}
    cfg = load_config({"pipeline_parallel_size": 2, "expert_parallel_size": 2, **hpz})
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size 2 with ZeRO\+\+ hpZ.*not built yet"):
        resolve_plan(cfg, 8)


def test_pipeline_plan():
    cfg = load_config({"pipeline_parallel_size": 2, "pipeline": {"schedule": "gpipe"}})
    plan = resolve_plan(cfg, 4)
    # the schedule as torch's get_schedule_class spells it (matched without case)
    assert (plan.dims.pp, plan.dims.dp, plan.pipeline.schedule, plan.pipeline.stages_per_rank) == (2, 2, "GPipe", 1)
    for stage in (2, 3):  # ZeRO over each stage's data-parallel ranks
        plan = resolve_plan(load_config({"pipeline_parallel_size": 2, "zero_optimization": {"stage": stage}}), 4)
        assert (plan.dims.pp, plan.zero.stage) == (2, stage)
    with pytest.raises(ConfigError, match="'Zero' is not built"):
        load_config({"pipeline": {"schedule": "Zero"}})
    with pytest.raises(ConfigError, match="multi-stage schedule needs stages_per_rank of 2 or more"):
        load_config({"pipeline": {"schedule": "Interleaved1F1B"}})
    with pytest.raises(ConfigError, match="use Interleaved1F1B for several"):
        load_config({"pipeline": {"schedule": "1F1B", "stages_per_rank": 2}})


def test_the_planner_plans_pipeline_stages_and_refuses_a_rank_outside_them_by_name():
    """The planner learned pipeline stages (tests/estimate/test_estimate_new_axes.py checks its numbers): it plans the
    layout initialize would, and names a pipeline rank the layout does not have."""
    cfg = layout_config({}, Candidate(world=4, pp=2))
    assert cfg.pipeline_parallel_size == 2
    plan = _plan(Candidate(world=4, pp=2), cfg, "cpu")
    assert (plan.dims.pp, plan.dims.dp) == (2, 2)
    with pytest.raises(ConfigError, match="pp_rank 2: the pipeline ranks are 0 to 1"):
        _plan(Candidate(world=4, pp=2, pp_rank=2), cfg, "cpu")
