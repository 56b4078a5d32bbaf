"""Muon's owners and LAMB's shard sums under optimizer offload on a GPU ([Note: the owners' collectives on the
device] in shardtrain/zero/owner_staging.py), driven on the CPU: the device is faked where each choice is made, the
offload's copy streams (``host_copies.copy_streams``, :class:`DeferredStreams`) and the owners' staging
(``owner_staging.device_staging``, :class:`FakeStaging`, whose copies down hold NaN until waited for). Training through
them is bitwise the CPU offload path (itself proven against one process in tests/zero/test_muon_owners.py and
test_lamb_shard_norms.py); dropping the host's wait for the owners' results puts NaN into the weights. On a GPU the
same runs on NCCL (the ``gpu`` test)."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
from torch import nn

from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.offload import host_copies
from shardtrain.optim.lamb import Lamb
from shardtrain.optim.muon import MuonWithAdamW
from shardtrain.testing import parity, run_distributed
from shardtrain.zero import owner_staging
from test_host_copies import DeferredStreams

VOCAB, SEQ = 64, 16


class FakeStaging:
    """:class:`~shardtrain.zero.owner_staging.OwnerStaging` on the CPU: ``up`` copies at once (as a copy from pageable
    memory returns once read); ``down`` hands back a NaN host tensor whose copy runs when its event is waited for;
    ``drop``: waiting does nothing (the test that the wait is needed)."""

    device = torch.device("cpu")

    def __init__(self, drop: bool = False) -> None:
        self.drop = drop
        self.pending: dict[int, object] = {}
        self.ups = self.downs = self.waits = 0
        self.staged: set[int] = set()  # the addresses of the "device" buffers copied up to

    def up(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)
        self.ups += 1
        self.staged.add(dst.data_ptr())

    def down(self, src: torch.Tensor) -> tuple[torch.Tensor, int]:
        host = torch.full_like(src, float("nan"))
        self.downs += 1
        self.pending[self.downs] = lambda: host.copy_(src)
        return host, self.downs

    def wait(self, event: int) -> None:
        self.waits += 1
        if not self.drop:
            self.pending.pop(event)()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_layer=2, n_head=4))


def _batches(steps: int = 3, gas: int = 2, rows: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    xs = [torch.randint(0, VOCAB, (rows, SEQ), generator=g) for _ in range(steps * gas)]
    return [(x, torch.roll(x, -1, dims=1)) for x in xs]


def _muon(model: nn.Module) -> torch.optim.Optimizer:
    """DeepSpeed's selection: the blocks' 2-D weights to Muon, the rest to AdamW."""
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and "blocks." in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "blocks." in n)]
    return MuonWithAdamW(
        [
            dict(params=hidden, use_muon=True, lr=0.02, weight_decay=0.1),
            dict(params=rest, use_muon=False, lr=3e-3, weight_decay=0.01),
        ]
    )


def _lamb(model: nn.Module) -> torch.optim.Optimizer:
    return Lamb(model.parameters(), lr=0.01, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.05)


def _loss(model, batch) -> torch.Tensor:
    return model(*batch)


def _recipe(make_optimizer, stage: int, precision: dict) -> parity.Recipe:
    """Sub-groups smaller than a bucket's chunk ([Note: sub-groups of whole buckets]): several host steps a step."""
    zero = {
        "stage": stage,
        "reduce_bucket_size": 3000,
        "allgather_bucket_size": 3000,
        "stage3_param_persistence_threshold": 0,
        "sub_group_size": 1200,
        "offload_optimizer": {"device": "cpu"},
    }
    return parity.Recipe(
        make_model=_model,
        make_optimizer=make_optimizer,
        batches=functools.partial(_batches, 3, 2),
        loss=_loss,
        gas=2,
        clip=0.5,
        config={"zero_optimization": zero, **precision},
    )


def train(recipe: parity.Recipe, fake: bool, drop: bool = False) -> dict:
    """Runs on every rank: the recipe on the CPU offload path, or (``fake``) on the GPU's host step with the device
    faked: host masters, overlapped copies and the owners' collectives staged."""
    staging = FakeStaging(drop)
    handed: list[tuple[str, int]] = []  # (what, address) of each owners' collective's tensor, checked after the step
    if fake:  # this worker process only
        host_copies.copy_streams = lambda device: DeferredStreams()
        owner_staging.device_staging = lambda device: staging
        _record_owner_tensors(handed, staging)
    engine = parity.build_engine(recipe)
    opt = engine._optimizer
    assert (opt.offload.copies is not None) == fake
    out = parity.train_rows(engine, recipe)
    out["params"] = engine.full_state_dict()
    out.update(groups=len(opt.offload.groups), ups=staging.ups, downs=staging.downs, waits=staging.waits)
    out["left"] = len(staging.pending)
    out["handed"] = len(handed)
    engine.close()
    return out


OWNERS = ("Muon updates to their owners", "orthogonalized Muon updates", "LAMB's per-tensor squared sums")


def _record_owner_tensors(handed: list, staging: FakeStaging) -> None:
    """Wrap the communicator's collectives and the fake's copy down: each owners' collective reads the buffer the
    copy up wrote (all-gather, all-reduce), and each copy down reads a buffer such a collective wrote, never a host
    step's own tensor (NCCL would raise)."""
    from shardtrain.distributed.communicator import Communicator

    collected: set[int] = set()

    def wrapped(name: str, read: int | None, written: int):
        plain = getattr(Communicator, name)

        def collective(self, *args, what: str, **kwargs):
            if what.startswith(OWNERS):
                handed.append(what)
                assert read is None or args[read].data_ptr() in staging.staged, what
                collected.add(args[written].data_ptr())
            return plain(self, *args, what=what, **kwargs)

        return collective

    # (out, inp) for all-gather and reduce-scatter; the reduce-scatter's input is the owners' zeroed result buffer
    Communicator.all_gather = wrapped("all_gather", 1, 0)
    Communicator.all_reduce = wrapped("all_reduce", 0, 0)
    Communicator.reduce_scatter = wrapped("reduce_scatter", None, 0)
    plain_down = staging.down

    def down(src: torch.Tensor):
        assert src.data_ptr() in collected
        return plain_down(src)

    staging.down = down


def _assert_bitwise(device: list[dict], cpu: list[dict]) -> None:
    for d, c in zip(device, cpu):
        assert d["losses"] == c["losses"]
        assert d["norms"] == c["norms"]
    for name, value in cpu[0]["params"].items():  # rank 0 holds the full state dict
        assert torch.equal(device[0]["params"][name], value), name


@pytest.mark.parametrize(("world", "stage", "precision"), [(2, 2, {}), (3, 3, {"bf16": {"enabled": True}}), (2, 1, {})])
def test_muon_on_the_gpu_host_step_is_bitwise_the_cpu_offload_path(world, stage, precision):
    """The owners' gather and scatter on staged device buffers, results copied down and waited for: losses, norms
    and final parameters bit for bit the CPU offload path's; every copy down was waited for, one per bucket holding
    Muon matrices per host step (a copy up for each)."""
    recipe = _recipe(_muon, stage, precision)
    cpu = run_distributed(train, world, recipe, False)
    device = run_distributed(train, world, recipe, True)
    _assert_bitwise(device, cpu)
    for d in device:
        assert d["groups"] > 1 and d["ups"] == d["downs"] == d["waits"] > 0 and d["left"] == 0
        assert d["handed"] == 2 * d["downs"]  # an all-gather and a reduce-scatter per bucket
        assert d["downs"] % recipe.steps == 0  # the same buckets every step


def test_muon_with_tensor_parallelism_on_the_gpu_host_step_is_bitwise_the_cpu_offload_path():
    """tp 2 (world 2): the owner's tensor-parallel gather reads the staged device bucket too."""
    from shardtrain.tensor_parallel import GPT_TP_PLAN

    recipe = _recipe(_muon, 2, {})
    recipe = dataclasses.replace(recipe, config={**recipe.config, "tensor_parallel": {"size": 2}}, tp_plan=GPT_TP_PLAN)
    cpu = run_distributed(train, 2, recipe, False)
    device = run_distributed(train, 2, recipe, True)
    _assert_bitwise(device, cpu)
    for d in device:
        assert d["ups"] == d["downs"] == d["waits"] > 0 and d["handed"] == 2 * d["downs"] and d["left"] == 0


@pytest.mark.parametrize(("world", "stage"), [(2, 2), (3, 3)])
def test_lamb_on_the_gpu_host_step_is_bitwise_the_cpu_offload_path(world, stage):
    """LAMB's per-tensor sums all-reduced on a staged device buffer: one copy up and one waited copy down per param
    group and host step."""
    recipe = _recipe(_lamb, stage, {})
    cpu = run_distributed(train, world, recipe, False)
    device = run_distributed(train, world, recipe, True)
    _assert_bitwise(device, cpu)
    for d in device:
        assert d["ups"] == d["downs"] == d["waits"] == d["groups"] * recipe.steps and d["left"] == 0
        assert d["handed"] == d["downs"]


def test_a_missing_wait_for_the_owners_results_breaks_the_weights():
    """The fake is strict: the host reading an owner's orthogonalized update before its copy down has landed reads
    NaN, and the Muon matrices go NaN."""
    (out,) = run_distributed(train, 1, _recipe(_muon, 2, {}), True, True)
    hidden = [v for k, v in out["params"].items() if "blocks." in k and v.ndim == 2]
    assert hidden and all(torch.isnan(v).any() for v in hidden)
    assert not math.isnan(out["losses"][0])  # the first step's loss is computed before any update


def _on_gpu(make_optimizer, offload: bool) -> dict:
    """Runs on every rank of a GPU job: the recipe on NCCL, with optimizer offload (host masters, CUDA copy streams,
    the owners' CUDA staging) or without (everything on the device)."""
    recipe = _recipe(make_optimizer, 2, {})
    if not offload:
        zero = {k: v for k, v in recipe.config["zero_optimization"].items() if k != "offload_optimizer"}
        recipe = dataclasses.replace(recipe, config={**recipe.config, "zero_optimization": zero})
    out = parity.engine_run(recipe)
    out["params"] = None if out["params"] is None else {k: v.cpu() for k, v in out["params"].items()}
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("make_optimizer", [_muon, _lamb])
def test_muon_and_lamb_offload_train_on_gpus_with_nccl(make_optimizer):
    """The real device path: the owners' collectives and LAMB's sums on NCCL through the CUDA staging (a host tensor
    handed to NCCL raises), losses and parameters close to the same run without offload (the host's arithmetic
    against the device's; Newton-Schulz on the device in both: [Note: the owners' collectives on the device])."""
    world = min(2, torch.cuda.device_count())
    offloaded = run_distributed(_on_gpu, world, make_optimizer, True)
    in_memory = run_distributed(_on_gpu, world, make_optimizer, False)
    for a, b in zip(offloaded, in_memory):
        assert abs(a["losses"][0] - b["losses"][0]) <= 1e-5 * abs(b["losses"][0])  # no update yet
        for x, y in zip(a["losses"], b["losses"]):
            assert math.isfinite(x) and abs(x - y) <= 1e-3 * abs(y)
    initial = _model().state_dict()
    for name, value in in_memory[0]["params"].items():
        # the host's arithmetic against the device's is rounding; Newton-Schulz's bf16 spreads it to a few % of the
        # distance moved ([Note: Muon's rounding spread] in tests/zero/test_muon_owners.py: 6-9% measured)
        moved = (value - initial[name]).norm()
        assert (offloaded[0]["params"][name] - value).norm() <= 0.2 * moved + 1e-6, name
