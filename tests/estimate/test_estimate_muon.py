"""The planner with DeepSpeed's Muon type ([Note: one owner per matrix] in zero/muon_owners.py): the optimizer state
of its split (Muon's momentum only, Adam's two moments and step) equals what the engine holds, and the owners'
extra bytes per step (an all-gather and a reduce-scatter of every bucket holding a Muon matrix) equal the engine's
counted ones: a Muon engine's collectives minus an AdamW engine's on the same model and layout."""

from __future__ import annotations

import pytest
import torch

import shardtrain
from shardtrain.estimate import estimate_memory
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.testing import run_distributed

VOCAB, SEQ, MICRO = 64, 16, 2
GATHER = "Muon updates to their owners (all-gather, fp32)"
SCATTER = "orthogonalized Muon updates back (reduce-scatter, fp32)"


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_layer=2, n_head=4))


def _config(stage: int, optimizer: str) -> dict:
    params = {"muon_lr": 0.02, "adam_lr": 1e-3} if optimizer == "Muon" else {"lr": 1e-3}
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 5000, "allgather_bucket_size": 5000},
        "optimizer": {"type": optimizer, "params": params},
    }


def _counted(stage: int) -> dict:
    """On each rank: bytes per collective kind of one step, and the state held after it, per optimizer type."""
    out = {}
    g = torch.Generator().manual_seed(1)
    for optimizer in ("AdamW", "Muon"):
        engine = shardtrain.initialize(tiny_gpt(), _config(stage, optimizer))
        x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        engine.backward(engine(x, torch.roll(x, -1, dims=1)))  # the first step: what later steps move too
        engine.comm.reset_stats()
        engine.step()
        out[optimizer] = {
            "bytes": {kind: s["bytes"] for kind, s in engine.comm.stats().items()},
            "state": engine.state_bytes(),
        }
        engine.close()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_the_planner_counts_muon_s_owners_and_state_as_the_engine(stage):
    counted = run_distributed(_counted, 2, stage)
    est = estimate_memory(tiny_gpt, _config(stage, "Muon"), world_size=2, seq_len=SEQ, device_type="cpu")
    adamw = estimate_memory(tiny_gpt, _config(stage, "AdamW"), world_size=2, seq_len=SEQ, device_type="cpu")
    assert est.traffic[GATHER] > 0 and GATHER not in adamw.traffic
    for rank, r in enumerate(counted):
        extra = {k: r["Muon"]["bytes"][k] - r["AdamW"]["bytes"].get(k, 0) for k in r["Muon"]["bytes"]}
        assert extra["all_gather"] == est.traffic[GATHER], (rank, extra)
        assert extra["reduce_scatter"] == est.traffic[SCATTER], (rank, extra)
        if rank == 0:  # the planner describes rank 0 (the most padding-free state)
            assert est.model_state() == r["Muon"]["state"], (est.model_state(), r["Muon"]["state"])
            assert adamw.model_state() == r["AdamW"]["state"]
    # Muon's matrices keep one state tensor, not Adam's two and a step: less optimizer state than AdamW
    assert est.model_state()["optimizer"] < adamw.model_state()["optimizer"]
    owners = [row for row in est.rows if row.component.startswith("Muon owners' gathered bucket")]
    assert len(owners) == 1 and owners[0].nbytes > 0


LAMB_SUMS = "LAMB's per-tensor squared sums (all-reduce, fp32)"


def _given(model: torch.nn.Module, optimizer: str) -> torch.optim.Optimizer:
    """The optimizer object a user passes to initialize: MuonWithAdamW with DeepSpeed's selection, Lamb, AdamW."""
    from shardtrain.optim.deepspeed_muon import is_deepspeed_muon_parameter
    from shardtrain.optim.lamb import Lamb
    from shardtrain.optim.muon import MuonWithAdamW

    if optimizer == "lamb":
        return Lamb(model.parameters(), lr=1e-3)
    if optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    named = list(model.named_parameters())
    muon = [p for n, p in named if is_deepspeed_muon_parameter(n, p.shape)]
    rest = [p for n, p in named if not is_deepspeed_muon_parameter(n, p.shape)]
    return MuonWithAdamW([dict(params=muon, use_muon=True, lr=0.02), dict(params=rest, use_muon=False, lr=1e-3)])


def _object_config(stage: int, offload: str) -> dict:
    config = _config(stage, "AdamW")
    del config["optimizer"]
    if offload != "none":
        config["zero_optimization"]["offload_optimizer"] = {"device": offload}
    return config


def _counted_objects(stage: int, offload: str) -> dict:
    """As :func:`_counted`, for optimizer objects passed to initialize."""
    out = {}
    g = torch.Generator().manual_seed(1)
    for optimizer in ("adamw", "muon-adamw", "lamb"):
        model = tiny_gpt()
        engine = shardtrain.initialize(model, _object_config(stage, offload), optimizer=_given(model, optimizer))
        x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        engine.backward(engine(x, torch.roll(x, -1, dims=1)))
        engine.comm.reset_stats()
        engine.step()
        out[optimizer] = {
            "bytes": {kind: s["bytes"] for kind, s in engine.comm.stats().items()},
            "state": engine.state_bytes(),
        }
        engine.close()
    return out


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_the_planner_counts_muon_with_adamw_and_lamb_passed_to_initialize(offload):
    """``optimizer="muon-adamw"`` / ``"lamb"``: the state and the extra bytes per step of MuonWithAdamW (its owners)
    and Lamb (its shard sums) passed to initialize, with and without optimizer offload (a CPU run: the owners' buffers
    where the optimizer steps)."""
    counted = run_distributed(_counted_objects, 2, 2, offload)
    config = _object_config(2, offload)
    plans = {
        o: estimate_memory(tiny_gpt, config, world_size=2, seq_len=SEQ, device_type="cpu", optimizer=o)
        for o in ("adamw", "muon-adamw", "lamb")
    }
    assert plans["muon-adamw"].traffic[GATHER] > 0 and plans["lamb"].traffic[LAMB_SUMS] > 0
    for rank, r in enumerate(counted):
        muon = {k: r["muon-adamw"]["bytes"][k] - r["adamw"]["bytes"].get(k, 0) for k in r["muon-adamw"]["bytes"]}
        assert muon["all_gather"] == plans["muon-adamw"].traffic[GATHER], (rank, muon)
        assert muon["reduce_scatter"] == plans["muon-adamw"].traffic[SCATTER], (rank, muon)
        lamb = r["lamb"]["bytes"]["all_reduce"] - r["adamw"]["bytes"]["all_reduce"]
        assert lamb == plans["lamb"].traffic[LAMB_SUMS], (rank, lamb)
        if rank == 0:
            for o in plans:
                assert plans[o].model_state() == r[o]["state"], (o, plans[o].model_state(), r[o]["state"])
    owners = [row for row in plans["muon-adamw"].rows if row.component.startswith("Muon owners' gathered bucket")]
    assert len(owners) == 1 and owners[0].nbytes > 0


def test_the_planner_plans_muon_under_offload_on_a_gpu_with_the_owners_buffers_on_the_device():
    """The host step's owners run their collectives on the device ([Note: the owners' collectives on the device]):
    planned, not refused, with the gathered bucket on the device."""
    plan = estimate_memory(tiny_gpt, _object_config(2, "cpu"), world_size=2, seq_len=SEQ, optimizer="muon-adamw")
    owners = [row for row in plan.rows if row.component.startswith("Muon owners' gathered bucket")]
    assert len(owners) == 1 and owners[0].where == "device" and owners[0].nbytes > 0
