"""``config check --world-size N`` checks the layout as ``initialize`` does: dp = N / (tp x sp), the batch sizes
against that dp, mics and hpZ group sizes; ``check_layout`` gives the verdicts ``init_topology`` gives."""

from __future__ import annotations

import json

import pytest
import torch

from shardtrain.cli import main
from shardtrain.config.plan import check_layout, resolve_plan
from shardtrain.config.sections import load_config
from shardtrain.distributed import mesh
from shardtrain.errors import ConfigError


def check(tmp_path, capsys, world: int, **config) -> tuple[int, str]:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    code = main(["config", "check", "--world-size", str(world), str(path)])
    return code, capsys.readouterr().out


def test_batch_sizes_are_checked_against_the_data_parallel_size(tmp_path, capsys):
    # world 4, tp 2: dp 2, so 4 = 2 x 1 x 2 is right and 4 = 1 x 1 x 4 is not
    tp2 = {"tensor_parallel": {"size": 2}}
    assert check(tmp_path, capsys, 4, train_batch_size=4, train_micro_batch_size_per_gpu=2, **tp2)[0] == 0
    code, out = check(
        tmp_path, capsys, 4, train_batch_size=4, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, **tp2
    )
    assert code == 2 and "data-parallel size (2)" in out, out
    sp2 = {"sequence_parallel_size": 2, "tensor_parallel": {"size": 2}}  # world 8: dp 2
    assert check(tmp_path, capsys, 8, train_batch_size=2, train_micro_batch_size_per_gpu=1, **sp2)[0] == 0
    code, out = check(tmp_path, capsys, 8, train_batch_size=8, train_micro_batch_size_per_gpu=1,
                      gradient_accumulation_steps=1, **sp2)  # fmt: skip
    assert code == 2 and "data-parallel size (2)" in out, out
    cp2 = {"context_parallel_size": 2, "zero_optimization": {"stage": 3}}  # world 8: dp 4
    assert check(tmp_path, capsys, 8, train_batch_size=4, train_micro_batch_size_per_gpu=1, **cp2)[0] == 0
    code, out = check(tmp_path, capsys, 8, train_batch_size=8, train_micro_batch_size_per_gpu=1,
                      gradient_accumulation_steps=1, **cp2)  # fmt: skip
    assert code == 2 and "data-parallel size (4)" in out, out


@pytest.mark.parametrize(
    ("world", "config", "named"),
    [
        (2, {"tensor_parallel": {"size": 3}}, "tensor_parallel.size 3 does not divide the 2 processes"),
        (4, {"tensor_parallel": {"autotp_size": 3}}, "tensor_parallel.size 3 does not divide the 4 processes"),
        (4, {"sequence_parallel_size": 3}, "sequence_parallel_size 3 does not divide the 4 processes"),
        (4, {"sequence_parallel_size": 4, "tensor_parallel": {"size": 2}}, "sequence_parallel_size 4 does not"),
        (4, {"context_parallel_size": 3}, "context_parallel_size 3 does not divide the 4 processes"),
        (8, {"context_parallel_size": 2, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}},
         "zero_hpz_partition_size 3 does not divide the 8 ranks ZeRO shards over (data-parallel size 4 x "
         "context_parallel_size 2)"),
        (8, {"context_parallel_size": 4, "sequence_parallel_size": 4}, "context_parallel_size 4 does not divide"),
        (8, {"tensor_parallel": {"size": 2}, "zero_optimization": {"stage": 1, "mics_shard_size": 3}},
         "mics_shard_size 3 does not divide the 4 ranks"),
        (6, {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}},
         "zero_hpz_partition_size 4 does not divide the data-parallel size 6"),
        (8, {"tensor_parallel": {"size": 2}, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}},
         "with tensor parallelism (tensor_parallel.size 2) is not built"),
    ],
)  # fmt: skip
def test_an_impossible_layout_is_refused_by_name(tmp_path, capsys, world, config, named):
    code, out = check(tmp_path, capsys, world, **config)
    assert code == 2 and named in out and f"(world size {world})" in out, out


def test_graph_mode_with_sequence_parallelism_is_refused_without_a_world_size():
    with pytest.raises(ConfigError, match=r"graph\.enabled with sequence_parallel_size 2"):
        load_config({"sequence_parallel_size": 2, "graph": {"enabled": True}})


class _Laid(Exception):
    """init_topology got past its checks (the groups would be made next)."""


def _topology_verdict(monkeypatch, cfg, world: int) -> int | str:
    """dp, or the refusal, of what initialize does at ``world`` without a process group: the plan at the job's world
    size, then init_topology over its dimensions."""
    monkeypatch.setattr(mesh, "pick_device", lambda device: torch.device("cpu"))
    monkeypatch.setattr(mesh, "ensure_process_group", lambda timeout_s, device=None: False)
    monkeypatch.setattr(mesh.dist, "get_world_size", lambda group=None: world)

    def laid(device, world, tp, timeout_s, created, **axes):
        raise _Laid(axes)

    monkeypatch.setattr(mesh, "_make_mesh_groups", laid)
    try:
        mesh.init_topology(resolve_plan(cfg, mesh.join_world()).dims)
    except ConfigError as err:
        return str(err).split()[0]
    except _Laid:
        pass
    tp, sp = cfg.tensor_parallel.degree, cfg.sequence_parallel_size
    return world // (tp * sp)


def _layout_verdict(cfg, world: int) -> int | str:
    try:
        return check_layout(cfg, world)
    except ConfigError as err:
        return str(err).split()[0]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8])
def test_check_layout_agrees_with_init_topology(monkeypatch, world):
    agreed = 0
    for tp in (1, 2, 3):
        for sp in (1, 2, 4):
            for mics in (-1, 1, 2, 3):
                for hpz in (1, 2, 3):
                    z = {"stage": 3, "mics_shard_size": mics}
                    if mics == -1:
                        z["zero_hpz_partition_size"] = hpz
                    elif hpz != 1:
                        continue
                    cfg = load_config({"tensor_parallel": {"size": tp}, "sequence_parallel_size": sp,
                                       "zero_optimization": z})  # fmt: skip
                    expected = _topology_verdict(monkeypatch, cfg, world)
                    assert _layout_verdict(cfg, world) == expected, (world, tp, sp, mics, hpz)
                    agreed += 1
    assert agreed == 3 * 3 * (3 + 3)


def test_config_check_device_says_what_initialize_refuses_there(tmp_path, capsys):
    """Hugging Face's standard ZeRO-3 offload config: usable on a CPU-only machine and on CUDA (parameter offload
    is built there beside optimizer offload, [Note: parameter uploads]); parameter offload alone is refused on CUDA,
    as ``initialize`` would refuse it; without ``--device`` nothing is said of devices."""
    path = tmp_path / "ds.json"
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    path.write_text(json.dumps({"zero_optimization": zero, "train_micro_batch_size_per_gpu": 1}))
    assert main(["config", "check", str(path), "-q"]) == 0
    assert main(["config", "check", str(path), "-q", "--device", "cpu"]) == 0
    assert main(["config", "check", str(path), "-q", "--device", "cuda"]) == 0
    alone = tmp_path / "alone.json"
    zero = {"stage": 3, "offload_param": {"device": "cpu"}}
    alone.write_text(json.dumps({"zero_optimization": zero, "train_micro_batch_size_per_gpu": 1}))
    assert main(["config", "check", str(alone), "-q", "--device", "cpu"]) == 0
    capsys.readouterr()
    assert main(["config", "check", str(alone), "-q", "--device", "cuda"]) == 2
    out = capsys.readouterr().out
    assert "offload_param.device 'cpu' on CUDA is not built without offload_optimizer" in out
    assert "initialize refuses it" in out
