"""The engine's process groups ([Note: the engine's groups] in src/shardtrain/mesh.py): the agreement checks exchange
CPU tensors over host-side groups (gloo twins of the main groups under NCCL), and ``collective_timeout_s`` holds for
the engine's collectives even when the user created the process group with another timeout."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import shardtrain
from shardtrain.distributed import mesh
from shardtrain.distributed.communicator import Communicator
from shardtrain.errors import CollectiveTimeoutError, RankMismatchError
from shardtrain.tensor_parallel.batch_check import batch_digest
from shardtrain.testing import run_ranks

from helpers.tp_cases import Case, config_for, forward_engine, global_batches, make_model, make_optimizer, plan_for

CASE = Case(gas=2, micro=2)
ASLEEP_S = 25.0  # the most the stuck peer of the timeout test sleeps (it wakes once the other rank has its error)


class _Fake:
    """A process group made by the fake ``new_group`` of the selection test."""

    def __init__(self, ranks: list[int], backend: str | None) -> None:
        self.ranks, self.backend = ranks, backend


def _select(rank: int, world: int, tp: int, backend: str):
    made: list[_Fake] = []

    def new_group(ranks: list[int], backend: str | None) -> _Fake:
        made.append(_Fake(ranks, backend))
        return made[-1]

    whole = _Fake(list(range(world)), None)
    main, host = mesh.make_groups(rank, world, tp, backend, whole, new_group)
    return whole, main, host, made


def test_host_side_groups_are_gloo_twins_under_nccl_and_the_main_groups_under_gloo():
    # NCCL, world 4 = dp 2 x tp 2, rank 1 (dp 0, tp 1): a gloo group per group of every axis, and a gloo world
    whole, main, host, made = _select(1, 4, 2, "nccl")
    assert (main.world, main.dp.ranks, main.tp.ranks) == (whole, [1, 3], [0, 1])
    assert {g.backend for g in (main.dp, main.tp)} == {None}  # the default group's backend (NCCL)
    assert (host.world.ranks, host.dp.ranks, host.tp.ranks) == ([0, 1, 2, 3], [1, 3], [0, 1])
    assert {g.backend for g in (host.world, host.dp, host.tp)} == {"gloo"}
    assert not {id(host.world), id(host.dp), id(host.tp)} & {id(whole), id(main.dp), id(main.tp)}
    # every rank creates every group, in the same order: 2 dp + 2 tp groups, then the gloo world and its 2 + 2
    assert [(g.ranks, g.backend) for g in made] == [
        ([0, 2], None), ([1, 3], None), ([0, 1], None), ([2, 3], None),
        ([0, 1, 2, 3], "gloo"), ([0, 2], "gloo"), ([1, 3], "gloo"), ([0, 1], "gloo"), ([2, 3], "gloo"),
    ]  # fmt: skip
    # NCCL, tp 1: the dp axis is the world (its own group); the host side is one gloo world group
    whole, main, host, made = _select(0, 2, 1, "nccl")
    assert main.dp is whole and host.dp is host.world and host.world.backend == "gloo"
    # gloo, or a backend that exchanges CPU tensors with gloo: the main groups are the host-side ones
    for backend in ("gloo", "cpu:gloo,cuda:nccl"):
        whole, main, host, made = _select(1, 4, 2, backend)
        assert host is main and all(g.backend is None for g in made), backend


def _engine(stage: int, tp: int, timeout: float = 30):
    model = make_model(CASE)
    config = {**config_for(CASE, stage, tp), "collective_timeout_s": timeout}
    return shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, CASE.lr), tp_plan=plan_for(CASE))


def _micro(engine, i: int) -> None:
    x, y = global_batches(CASE, engine.topology.dp, steps=4)[i]
    lo, hi = engine.topology.dp_rank * CASE.micro, (engine.topology.dp_rank + 1) * CASE.micro
    engine.backward(forward_engine(engine, x[lo:hi], y[lo:hi]))
    engine.step()


def _checks_over_side_groups(stage: int, tp: int) -> dict:
    """Side groups as under NCCL (the main backend said not to exchange CPU tensors), then two micro-steps and a lone
    ``full_state_dict()`` on rank 0: where each check's exchange went, and the desync error."""
    mesh.exchanges_on_host = lambda backend: False  # make_groups builds gloo twins, as for NCCL
    seen: list[tuple[str, object, str]] = []
    all_gather, all_gather_object = Communicator.all_gather, Communicator.all_gather_object

    def spy_all_gather(self, out, inp, *, what, async_op=False, kind="all_gather"):
        seen.append((kind, self.group, inp.device.type))
        return all_gather(self, out, inp, what=what, async_op=async_op, kind=kind)

    def spy_all_gather_object(self, obj, *, what):
        seen.append((what, self.group, "object"))
        return all_gather_object(self, obj, what=what)

    Communicator.all_gather, Communicator.all_gather_object = spy_all_gather, spy_all_gather_object
    engine = _engine(stage, tp)
    topo = engine.topology
    host = [topo.host_world_group, topo.host_dp_group, topo.host_tp_group]
    main = [topo.world_group, topo.zero_group, topo.tp_group]
    _micro(engine, 0)
    _micro(engine, 1)
    try:
        if dist.get_rank() == 0:
            engine.full_state_dict()
        _micro(engine, 2)
        error = "no error"
    except RankMismatchError as err:
        error = str(err)
    checks = {"desync_check", "gather_check", "tensor-parallel batch check"}
    where = {
        (kind, any(g is h for h in host), any(g is m for m in main), device)
        for kind, g, device in seen
        if kind in checks
    }
    return {
        "where": sorted(where),
        "side_groups_apart": not any(h is m for h in host for m in main),
        "host_backends": {dist.get_backend(g) for g in host if dist.get_world_size(g) > 1},
        "error": error,
    }


def test_the_checks_exchange_cpu_tensors_over_the_host_side_groups():
    """ZeRO-3 (the desync and unit-order checks) and tensor parallelism (the desync and batch checks) at world 2, with
    side groups apart from the main ones as under NCCL: every check goes over a host-side group with CPU tensors, none
    over a main group, and a desync is still named on every rank."""
    for stage, tp, kinds in [(3, 1, {"desync_check", "gather_check"}), (1, 2, {"desync_check", "batch check"})]:
        outcomes = run_ranks(_checks_over_side_groups, 2, stage, tp, init_process_group=False, timeout=120)
        for o in outcomes:
            assert o.value is not None, o.error
            r = o.value
            assert r["side_groups_apart"] and r["host_backends"] == {"gloo"}, r
            found = {kind.removeprefix("tensor-parallel ") for kind, *_ in r["where"]}
            assert found == kinds, r["where"]
            for kind, on_host, on_main, device in r["where"]:
                assert on_host and not on_main, (stage, tp, kind)
                assert device in ("cpu", "object"), (stage, tp, kind, device)
            assert r["error"].startswith("ranks are at different points of training (desync): "), r["error"]
            assert "full_state_dict() is collective: rank 0" in r["error"], r["error"]


def _alone_in_a_user_group(timeout: float, woken: str) -> tuple[str, float]:
    """The harness created the process group (60 s timeout); the engine is configured with ``timeout``. Rank 1
    stops calling the engine (it sleeps); rank 0's next check must fail after ``timeout``, not after 60 s. Rank 1
    sleeps until rank 0 has its outcome (the file ``woken`` exists) or ``ASLEEP_S`` have passed, so its exit (which
    fails rank 0's wait too) never comes first."""
    engine = _engine(2, 1, timeout=timeout)
    _micro(engine, 0)
    if dist.get_rank() == 1:
        deadline = time.monotonic() + ASLEEP_S
        while not os.path.exists(woken) and time.monotonic() < deadline:
            time.sleep(0.05)
        return "asleep", 0.0
    started = time.monotonic()
    try:
        _micro(engine, 1)
    except CollectiveTimeoutError as err:
        return str(err), time.monotonic() - started
    finally:
        with open(woken, "w"):
            pass
    return "no error", time.monotonic() - started


def test_collective_timeout_holds_when_the_user_created_the_process_group(tmp_path):
    """``collective_timeout_s`` was ignored when the process group existed: the engine's collectives ran on the
    user's group and waited for its timeout. Now the engine's own groups carry it."""
    woken = str(tmp_path / "rank 0 has its outcome")
    outcomes = run_ranks(_alone_in_a_user_group, 2, 2.0, woken, init_process_group=True, timeout=50)
    message, seconds = outcomes[0].value or (outcomes[0].error, None)
    assert seconds is not None and seconds < ASLEEP_S / 2, (
        seconds,
        message,
    )  # measured: 2 s (was 25 s: the peer's exit)
    assert message.startswith("rank 0: desync_check of this rank's position"), message
    assert "(collective timeout 2s)" in message, message
    assert outcomes[1].value == ("asleep", 0.0), outcomes[1]


@pytest.mark.gpu  # inputs on two devices (the CPU and CUDA)
def test_batch_digest_of_inputs_on_two_devices():
    """Inputs on the CPU and on a GPU: one digest, each tensor's the same as on the CPU (the sums were stacked
    across devices, which raises)."""
    ids, mask = torch.arange(12).view(2, 6), torch.ones(2, 6, dtype=torch.bool)
    mixed = batch_digest((ids.cuda(),), {"mask": mask, "scale": torch.tensor([0.5, 1.5], device="cuda")})
    on_cpu = batch_digest((ids,), {"mask": mask, "scale": torch.tensor([0.5, 1.5])})
    assert mixed == on_cpu
