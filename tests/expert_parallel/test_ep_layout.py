"""The expert axis of the mesh and the config key: which ranks form an expert group and an expert-data-parallel
group ([Note: the expert axis]), and the layouts and features ``expert_parallel_size`` is not built with, refused by
name before any process group exists."""

from __future__ import annotations

import pytest

from shardtrain.config.plan import check_layout
from shardtrain.config.sections import load_config
from shardtrain.distributed.mesh import make_groups
from shardtrain.errors import ConfigError


def _partitions(world: int, ep: int) -> dict[int, dict[str, list[int]]]:
    """Each rank's groups on every axis, from make_groups with groups recorded as their rank lists."""
    out = {}
    for rank in range(world):
        main, _ = make_groups(rank, world, 1, "gloo", "world", lambda ranks, backend: ranks, ep=ep)
        out[rank] = {axis: getattr(main, axis) for axis in ("dp", "ep", "edp")}
    return out


def test_expert_groups_are_adjacent_ranks_and_expert_data_parallel_groups_stride_over_them():
    groups = _partitions(4, 2)
    assert [groups[r]["ep"] for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [groups[r]["edp"] for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(groups[r]["dp"] == "world" for r in range(4))  # dense parameters: the whole data-parallel axis
    six = _partitions(6, 3)
    assert six[4]["ep"] == [3, 4, 5] and six[4]["edp"] == [1, 4]


def test_an_expert_group_of_every_rank_leaves_one_rank_per_expert_data_parallel_group():
    groups = _partitions(3, 3)
    assert [groups[r]["ep"] for r in range(3)] == ["world"] * 3
    assert [groups[r]["edp"] for r in range(3)] == [[0], [1], [2]]


def test_hybrid_sharding_keeps_the_expert_groups_beside_its_shard_and_replicate_groups():
    groups = {}
    for rank in range(4):
        main, _ = make_groups(rank, 4, 1, "gloo", "world", lambda ranks, backend: ranks, shard_size=2, ep=2)
        groups[rank] = {axis: getattr(main, axis) for axis in ("shard", "replicate", "ep", "edp")}
    assert [groups[r]["shard"] for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [groups[r]["replicate"] for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [groups[r]["ep"] for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [groups[r]["edp"] for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def test_under_sequence_parallelism_expert_groups_are_cut_from_the_data_and_sequence_parallel_ranks():
    # [Note: experts under sequence parallelism]: E adjacent ranks of the dp * sp axis (zero_rank = dp_rank * sp +
    # sp_rank), within a sequence group, spanning several, or straddling them
    def groups(world: int, sp: int, ep: int) -> list[dict]:
        out = []
        for rank in range(world):
            main, _ = make_groups(rank, world, 1, "gloo", "world", lambda ranks, backend: ranks, sp=sp, ep=ep)
            out.append({axis: getattr(main, axis) for axis in ("sp", "dp_sp", "ep", "edp")})
        return out

    within = groups(4, 2, 2)  # dp 2 x sp 2, E 2: each expert group is a sequence-parallel group
    assert [g["ep"] for g in within] == [g["sp"] for g in within] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["edp"] for g in within] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(g["dp_sp"] == "world" for g in within)  # dense parameters: every rank
    spanning = groups(4, 2, 4)  # E 4: one expert group over both sequences, each expert on one rank
    assert [g["ep"] for g in spanning] == ["world"] * 4 and [g["edp"] for g in spanning] == [[0], [1], [2], [3]]
    straddling = groups(6, 2, 3)  # dp 3 x sp 2, E 3: sequence groups {0, 1} {2, 3} {4, 5}
    assert [g["ep"] for g in straddling] == [[0, 1, 2]] * 3 + [[3, 4, 5]] * 3
    assert [g["edp"] for g in straddling] == [[0, 3], [1, 4], [2, 5]] * 2
    assert check_layout(load_config({"expert_parallel_size": 4, "sequence_parallel_size": 2}), 4) == 2
    both = {"expert_parallel_size": 4, "sequence_parallel_size": 2, "tensor_parallel": {"size": 2}}
    assert check_layout(load_config(both), 8) == 2  # with tensor parallelism too: E up to dp * sp at each tp rank


def test_without_expert_parallelism_there_is_no_expert_group():
    assert _partitions(2, 1)[0]["ep"] is None and _partitions(2, 1)[0]["edp"] is None


@pytest.mark.parametrize(
    "config, world, words",
    [
        ({"expert_parallel_size": 3}, 4, "expert_parallel_size (ep_size) 3 does not divide the data-parallel size 4"),
        (
            {"expert_parallel_size": 4, "sequence_parallel_size": 2, "tensor_parallel": {"size": 2}},
            4,
            "4 does not divide the 2 ranks ZeRO shards over (data-parallel size 1 x sequence_parallel_size 2)",
        ),
        (
            {"expert_parallel_size": 3, "sequence_parallel_size": 2},
            4,
            "3 does not divide the 4 ranks ZeRO shards over (data-parallel size 2 x sequence_parallel_size 2)",
        ),
        (
            {"expert_parallel_size": 2, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}},
            4,
            "with ZeRO++ hpZ (zero_optimization.zero_hpz_partition_size 2)",
        ),
        ({"expert_parallel_size": 2, "graph": {"enabled": True}}, 2, "with graph mode"),
    ],
)
def test_layouts_expert_parallelism_is_not_built_for_are_refused_by_name(config, world, words):
    with pytest.raises(ConfigError, match="ep_size") as err:
        check_layout(load_config(config), world)
    assert words in str(err.value)


@pytest.mark.parametrize(
    "tp, sp, ep, world, words",
    [
        (2, 2, 2, 8, None),  # at each tp rank, from the dp * sp ranks: [Note: experts under sequence parallelism]
        (2, 2, 4, 4, "4 does not divide the 2 ranks ZeRO shards over (data-parallel size 1 x sequence_parallel_size"),
        (
            1,
            2,
            3,
            4,
            "3 does not divide the 4 ranks ZeRO shards over (data-parallel size 2 x sequence_parallel_size 2)",
        ),
        (1, 2, 4, 4, None),  # one expert group over both sequences
    ],
)
def test_init_topology_cuts_expert_groups_from_the_sequence_parallel_ranks_or_says_why_not(
    monkeypatch, tp, sp, ep, world, words
):
    import torch

    from shardtrain.distributed import mesh
    from shardtrain.errors import LayoutError
    from shardtrain.plan.dims import ParallelDims

    monkeypatch.setattr(mesh, "pick_device", lambda device: torch.device("cpu"))
    monkeypatch.setattr(mesh, "ensure_process_group", lambda timeout_s, device=None: False)
    monkeypatch.setattr(mesh.dist, "get_world_size", lambda group=None: world)
    laid = {}

    def make_mesh_groups(device, world, tp, timeout_s, created, **axes):
        laid.update(axes)
        raise RuntimeError("laid out")  # the groups would be made next

    monkeypatch.setattr(mesh, "_make_mesh_groups", make_mesh_groups)
    with pytest.raises((LayoutError, RuntimeError)) as err:
        mesh.init_topology(ParallelDims(world, tp=tp, sp=sp, ep=ep))
    if words is None:
        assert laid == {"sp": sp, "shard_size": world // tp, "ep": ep, "hpz_size": 1}, laid  # no hpZ asked
    else:
        assert isinstance(err.value, LayoutError) and "expert_parallel_size (ep_size) " + words in str(err.value)
