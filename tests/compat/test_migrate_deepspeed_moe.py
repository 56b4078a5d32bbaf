"""DeepSpeed MoE checkpoints in ([Note: DeepSpeed AutoEP checkpoints] in ``checkpoint/foreign/deepspeed_moe.py``): a
real DeepSpeed AutoEP checkpoint of a tiny random Mixtral (``tests/data/deepspeed_autoep``: world 4, ``autoep_size``
2, ZeRO stage 2, written by ``tests/helpers/ds_moe.py``) reads as transformers' fused experts, bitwise what
DeepSpeed's per-expert files and optimizer partitions hold, and a shardtrain engine that loads it at another layout
trains on as DeepSpeed's own continuation did (soak: it runs DeepSpeed too). DeepSpeed's own MoE layer and the AutoEP
layouts not read are refused by name."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import torch.distributed as dist

from shardtrain.checkpoint import open_checkpoint
from shardtrain.checkpoint.foreign.deepspeed_pickle import load_deepspeed_file
from shardtrain.errors import CheckpointError
from shardtrain.testing import run_distributed

from helpers.ds_moe import DATA, LR, ROWS, SAVE_AT, STEPS, batches, tiny_mixtral, write_autoep_checkpoint

TAG = DATA / "t"
EP, WORLD = 2, 4


def _layer(i: int) -> str:
    return f"model.layers.{i}.mlp.experts"


def test_autoep_experts_read_as_transformers_fused_experts():
    reader = open_checkpoint(DATA)
    module = load_deepspeed_file(TAG / "mp_rank_00_model_states.pt")["module"]
    for layer in range(2):
        p = _layer(layer)
        files = [load_deepspeed_file(TAG / f"layer_{layer}_expert_{g}_mp_rank_00_model_states.pt") for g in range(4)]
        gate_up = torch.stack([torch.cat([f[f"{p}.w1.{g}"], f[f"{p}.w3.{g}"]]) for g, f in enumerate(files)])
        down = torch.stack([f[f"{p}.w2.{g}"] for g, f in enumerate(files)])
        assert torch.equal(reader.read(f"model/{p}.gate_up_proj"), gate_up)
        assert torch.equal(reader.read(f"model/{p}.down_proj"), down)
        router = module[f"model.layers.{layer}.mlp.router.gate.weight"]
        assert torch.equal(reader.read(f"model/model.layers.{layer}.mlp.gate.weight"), router)
    names = {n.removeprefix("model/") for n in reader.manifest.tensors if n.startswith("model/")}
    assert names == set(tiny_mixtral().state_dict())  # every tensor under transformers' name, nothing else
    assert reader.objects["engine/topology"]["ep"] == EP


def _expert_state(key: str) -> dict[str, torch.Tensor]:
    """The oracle: expert group ``e``'s flat state is its partitions (the files of ranks ``e``, ``e + 2``) end to
    end; cut into the local w1, w2, w3 in ``param_shapes`` order, stacked by global expert."""
    shapes = load_deepspeed_file(TAG / "mp_rank_00_model_states.pt")["param_shapes"][1]
    local: dict[str, list[torch.Tensor]] = {}
    for e in range(EP):
        parts = []
        for r in range(e, WORLD, EP):
            osd = load_deepspeed_file(TAG / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
            assert osd["partition_count"][1] == WORLD // EP
            parts.append(osd["base_optimizer_state"]["state"][1][key])
        flat, at = torch.cat(parts), 0
        for name, shape in shapes.items():
            n = math.prod(shape)
            local.setdefault(name, []).append(flat[at : at + n].view(shape))
            at += n
    out = {}
    for layer in range(2):
        p = _layer(layer)
        w1, w2, w3 = (torch.cat(local[f"{p}.{w}"]) for w in ("w1", "w2", "w3"))
        out[f"{p}.gate_up_proj"], out[f"{p}.down_proj"] = torch.cat([w1, w3], dim=1), w2
    return out


def test_the_experts_optimizer_state_is_deepspeed_s_partitions():
    reader = open_checkpoint(DATA)
    for key in ("exp_avg", "exp_avg_sq"):
        for name, want in _expert_state(key).items():
            assert torch.equal(reader.read(f"optim/{name}/{key}"), want), (name, key)
    assert float(reader.read(f"optim/{_layer(0)}.down_proj/step")) == SAVE_AT
    groups = reader.objects["optimizer/param_groups"]
    assert groups[1]["params"] == [f"{_layer(i)}.{w}" for i in range(2) for w in ("gate_up_proj", "down_proj")]


def _copy(tmp_path, drop=(), module_extra=None, main_drop=()):
    d = tmp_path / "ck"
    shutil.copytree(DATA, d)
    for pattern in drop:
        for f in (d / "t").glob(pattern):
            f.unlink()
    if module_extra or main_drop:
        main = load_deepspeed_file(TAG / "mp_rank_00_model_states.pt")  # memory-mapped: not the file rewritten
        main = {k: v for k, v in main.items() if k not in main_drop}
        main["module"] = {**main["module"], **(module_extra or {})}
        torch.save(main, d / "t" / "mp_rank_00_model_states.pt")
    return d


@pytest.mark.parametrize(
    "damage, words",
    [
        (
            {"module_extra": {"model.layers.0.mlp.deepspeed_moe.experts.deepspeed_experts.0.w1.weight": torch.ones(2)}},
            "DeepSpeed's MoE layer (deepspeed.moe.layer.MoE",
        ),
        ({"main_drop": ("ds_autoep_layers",)}, "with no 'ds_autoep_layers'"),
        ({"drop": ("*optim_states.pt",)}, "AutoEP checkpoint at ZeRO stage 0"),
        ({"drop": ("zero_pp_rank_3_*",)}, "partitioned over 4 ranks but 3 optimizer files are present"),
    ],
)
def test_moe_layouts_not_read_are_refused_by_name(tmp_path, damage, words):
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(_copy(tmp_path, **damage))
    assert words in str(err.value)


def resume(load_dir: str, ep: int, stage: int) -> list[float]:
    """A shardtrain engine (another seed; the optimizer's two param groups as DeepSpeed's: dense, experts) loads the
    DeepSpeed checkpoint and trains the steps after the save; the mean over ranks of each step's loss."""
    import warnings

    import shardtrain

    model = tiny_mixtral(seed=5)
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    dense = [p for n, p in model.named_parameters() if ".experts." not in n]
    opt = torch.optim.AdamW([{"params": dense}, {"params": experts}], lr=LR, weight_decay=0.0)
    world, rank = dist.get_world_size(), dist.get_rank()
    config = {
        "train_micro_batch_size_per_gpu": ROWS // world,
        "zero_optimization": {"stage": stage},
        "expert_parallel_size": ep,
        "collective_timeout_s": 120.0,
    }
    engine = shardtrain.initialize(model, config=config, optimizer=opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # per-rank RNG states: DeepSpeed saved none here
        engine.load_checkpoint(load_dir)
    losses, rows = [], ROWS // world
    for ids in batches()[SAVE_AT:STEPS]:
        ids = ids[rank * rows : (rank + 1) * rows]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        t = loss.detach().double()
        dist.all_reduce(t)
        losses.append(float(t) / world)
    engine.close()
    return losses


def _assert_continues(losses: list[float], after: list[float]) -> None:
    for a, b in zip(losses, after, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (losses, after)


@pytest.mark.soak
@pytest.mark.parametrize("world, ep, stage", [(2, 2, 1), (2, 2, 3), (1, 1, 0)])
def test_a_shardtrain_engine_trains_on_from_the_deepspeed_autoep_checkpoint(world, ep, stage):
    after = json.loads((DATA / "losses.json").read_text())["after"]
    _assert_continues(run_distributed(resume, world, str(DATA), ep, stage, timeout=300)[0], after)


@pytest.mark.soak
def test_a_fresh_deepspeed_autoep_run_loads_and_trains_on(tmp_path):
    # DeepSpeed run now (world 2, ep 2, stage 1), loaded at ep 2 x stage 2
    written = run_distributed(write_autoep_checkpoint, 2, str(tmp_path), 2, 1, timeout=300)[0]
    _assert_continues(run_distributed(resume, 2, str(tmp_path), 2, 2, timeout=300)[0], written["after"])
