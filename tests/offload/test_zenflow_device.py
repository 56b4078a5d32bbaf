"""ZenFlow on a GPU ([Note: ZenFlow on the device] in shardtrain/offload/zenflow_device.py), driven on the CPU: the
device's choice of streams is replaced where it is made (``zenflow_device.zenflow_streams``) by a fake whose copies
run only when an event after them is waited for, on the host or by the compute stream, as a CUDA stream would have
run them by then; a copy's destination holds NaN until it has run, so a reader that did not wait changes the
numbers. Training through the fake is bitwise the CPU path of the same rule, at worlds 1 and 3, with and without
``overlap_step``, in bf16 and fp32; after warm-up the training thread never waits for a copy; dropping either kind
of wait breaks parity."""

from __future__ import annotations

import threading

import pytest
import torch

import shardtrain
from shardtrain.offload import zenflow_device
from shardtrain.testing import run_distributed
from test_zenflow import RECIPE, RULE, zenflow_config

from helpers.parity import Recipe, global_micro_batches, make_model, make_optimizer, train_step

STEPS = 8  # warm-up 2; selections at u = 1 and 5; host updates at u = 2, 4, 6


class FakeStreams:
    """:class:`~shardtrain.offload.zenflow_device.ZenFlowStreams` on the CPU. ``log``: ("copy", stream, n) as a
    copy is queued, ("ran", stream, n) as it runs, ("wait" | "device_wait", stream, n, thread name, phase) for each
    wait; ``drop``: the kind of wait that does nothing (the test that a missing wait is caught); ``phase``: set by
    the test (the step being trained)."""

    pins = False

    def __init__(self, drop: str | None = None) -> None:
        self.drop, self.phase = drop, -1
        self.log: list[tuple] = []
        self.pending: dict[str, list] = {"d2h": [], "h2d": []}
        self.issued = {"d2h": 0, "h2d": 0}
        self.ran = {"d2h": 0, "h2d": 0}
        self.lock = threading.RLock()  # the accumulating and host-update threads wait too

    def mark(self) -> tuple[str, int]:
        return ("compute", 0)

    def _queue(self, stream: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self.lock:
            dst.fill_(float("nan"))  # not written until the copy has run
            self.pending[stream].append(lambda: dst.copy_(src))
            self.issued[stream] += 1
            self.log.append(("copy", stream, self.issued[stream]))

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, after) -> None:
        self._queue("d2h", dst, src)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, after) -> None:
        self._queue("h2d", dst, src)

    def record(self, stream: str) -> tuple[str, int]:
        with self.lock:
            return (stream, self.issued[stream])

    def _wait(self, kind: str, event: tuple[str, int]) -> None:
        stream, upto = event
        with self.lock:
            self.log.append((kind, stream, upto, threading.current_thread().name, self.phase))
            if kind == self.drop or stream == "compute":
                return
            while self.ran[stream] < upto:
                self.pending[stream].pop(0)()
                self.ran[stream] += 1
                self.log.append(("ran", stream, self.ran[stream]))

    def wait(self, event) -> None:
        self._wait("wait", event)

    def device_wait(self, event) -> None:
        self._wait("device_wait", event)


def train(rule: dict, precision: dict, fake: bool, drop: str | None = None) -> dict:
    """Runs on every rank: ZenFlow at stage 2 with the device path through the fake (``fake``), else the CPU path."""
    import torch.distributed as dist

    rank = dist.get_rank()
    streams = FakeStreams(drop) if fake else None
    if fake:
        zenflow_device.zenflow_streams = lambda device: streams  # this worker process only
    recipe = Recipe(steps=STEPS, gas=1, micro=RECIPE.micro, clip=RECIPE.clip, lr=RECIPE.lr)
    model = make_model(recipe)
    config = {**zenflow_config(rule), **precision}
    engine = shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, recipe))
    step = engine._optimizer.zenflow
    assert isinstance(step, zenflow_device.DeviceZenFlowStep) == fake
    batches = global_micro_batches(recipe, dist.get_world_size())
    losses = []
    for t in range(STEPS):
        if streams is not None:
            streams.phase = t
        losses.append(train_step(engine, recipe, batches, t, rank))
    out = {"losses": losses, "params": engine.full_state_dict()}
    # closed first: the accumulating thread may still be adding the last step's gradients (their copies down wait
    # on it), and close() lets it finish; read before, a loaded machine showed copies not yet run
    engine.close()
    if streams is not None:
        out["log"] = streams.log
        out["left"] = {s: streams.issued[s] - streams.ran[s] for s in streams.issued}
    return out


def both_paths(rule: dict, precision: dict) -> tuple[dict, dict]:
    """Runs on every rank: the CPU path, then the device path through the fake (one process start for both)."""
    return train(rule, precision, False), train(rule, precision, True)


def _check_waits(log: list, warm_up: int) -> None:
    """Every copy ran before the run ended, each because a wait after it asked for it; the training thread waited
    for a copy only in warm-up steps (plain offload)."""
    copies = [e for e in log if e[0] == "copy"]
    ran = {(e[1], e[2]) for e in log if e[0] == "ran"}
    assert copies and all((e[1], e[2]) in ran for e in copies), "a copy never ran"
    waits = [e for e in log if e[0] in ("wait", "device_wait")]
    assert {e[1] for e in waits if e[0] == "wait"} == {"d2h", "h2d"}  # gradients down; landings before H rewritten
    assert any(e[0] == "device_wait" and e[1] == "h2d" for e in waits)  # landings before the compute stream reads
    training = [e for e in waits if e[0] == "wait" and e[3] == threading.main_thread().name]
    assert training and all(e[4] < warm_up for e in training), training
    assert any(e[0] == "wait" and e[3].startswith("zenflow-accumulate") for e in waits)


@pytest.mark.parametrize(
    ("world", "overlap", "precision"),
    [(1, True, {}), (1, False, {"bf16": {"enabled": True}}), (3, True, {"bf16": {"enabled": True}})],
)
def test_the_device_path_is_bitwise_the_cpu_path(world, overlap, precision):
    """Losses and parameters after 8 steps (warm-up, two selections, three host updates) equal the CPU path's bit
    for bit; every copy's wait is recorded, and after warm-up only the side threads wait for copies."""
    rule = {**RULE, "overlap_step": overlap}
    cpu, device = zip(*run_distributed(both_paths, world, rule, precision))
    for name, value in cpu[0]["params"].items():  # rank 0 holds the full state dict
        assert torch.equal(device[0]["params"][name], value), name
    for c, d in zip(cpu, device):
        assert d["losses"] == c["losses"]
        assert d["left"] == {"d2h": 0, "h2d": 0}
        _check_waits(d["log"], RULE["full_warm_up_rounds"])


@pytest.mark.parametrize("drop", ["wait", "device_wait"])
def test_a_missing_wait_breaks_parity(drop):
    """The fake is strict: the accumulating thread reading its staging buffer without waiting for the copy
    (``wait``), or the compute stream using a landing's buffer without waiting for it (``device_wait``), puts NaN
    into the weights."""
    rule = {**RULE, "overlap_step": True}
    (out,) = run_distributed(train, 1, rule, {}, True, drop)
    assert not all(torch.isfinite(v).all() for v in out["params"].values())


def test_update_interval_auto_on_the_device_path_is_bitwise_the_cpu_path():
    """``update_interval: "auto"`` through the fake gives the CPU path's weights ([Note: update_interval "auto"])."""
    rule = {**RULE, "update_interval": "auto", "topk_ratio": 0.1, "select_interval": 8, "overlap_step": True}
    cpu, device = zip(*run_distributed(both_paths, 1, rule, {}))
    assert device[0]["losses"] == cpu[0]["losses"]
    for name, value in cpu[0]["params"].items():
        assert torch.equal(device[0]["params"][name], value), name


@pytest.mark.gpu
def test_on_a_gpu_the_device_path_trains_as_the_cpu_path(monkeypatch):
    """On a real GPU (CUDA streams, events, page-locked host buffers): ZenFlow at world 1 against the CPU path of
    the same rule, each weight within 1% of what training moved it (the GPU's matmuls and Adam round otherwise);
    the selected columns and their moments on the GPU, the host masters page-locked."""
    gpu = run_distributed(_train_on, 1, "cuda", init_process_group=False, timeout=300)[0]
    monkeypatch.setenv("SHARDTRAIN_DEVICE", "cpu")  # the reference on the CPU
    cpu = run_distributed(_train_on, 1, "cpu", init_process_group=False, timeout=300)[0]
    assert gpu["where"] == {"picked": {"cuda"}, "masters": {"cpu"}, "pinned": True}
    assert all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(gpu["losses"], cpu["losses"])), (gpu, cpu)
    for name, value in cpu["params"].items():
        moved = (value - cpu["initial"][name]).norm()
        assert (gpu["params"][name] - value).norm() <= 1e-2 * moved + 1e-6, name


def _train_on(device: str) -> dict:
    from shardtrain.distributed.mesh import ensure_process_group

    ensure_process_group(300.0)
    recipe = Recipe(steps=STEPS, gas=1, micro=RECIPE.micro, clip=RECIPE.clip, lr=RECIPE.lr)
    model = make_model(recipe)
    initial = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    config = {**zenflow_config({**RULE, "overlap_step": True}), "device": device}
    engine = shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, recipe))
    zf = engine._optimizer.zenflow
    assert isinstance(zf, zenflow_device.DeviceZenFlowStep) == (device == "cuda")
    losses = []
    for step in range(STEPS):
        x, y = global_micro_batches(recipe, 1)[step]
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    where = {
        "picked": {t.device.type for t in zf.picked},
        "masters": {t.device.type for t in zf.masters},
        "pinned": all(t.is_pinned() for t in zf.masters if t.numel()),
    }
    params = {k: v.detach().float().cpu() for k, v in engine.full_state_dict().items()}
    engine.close()
    return {"losses": losses, "params": params, "initial": initial, "where": where}


def _held(rule: dict) -> dict:
    """Runs on one rank: the bytes the device path holds after a few steps, by where they live."""
    import torch.distributed as dist

    zenflow_device.zenflow_streams = lambda device: FakeStreams()
    recipe = Recipe(steps=3, gas=1, micro=RECIPE.micro, clip=RECIPE.clip, lr=RECIPE.lr)
    model = make_model(recipe)
    config = {**zenflow_config(rule), "bf16": {"enabled": True}}
    engine = shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, recipe))
    batches = global_micro_batches(recipe, dist.get_world_size())
    for t in range(recipe.steps):
        train_step(engine, recipe, batches, t, 0)
    zf = engine._optimizer.zenflow
    zf.settle(land=False)

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    def state(twin) -> list[torch.Tensor]:
        return [v for st in twin.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]

    out = {
        "selected": nbytes(zf.picked) + nbytes(state(zf.device)),
        "host_state": nbytes(zf.masters) + nbytes(state(zf.host)),
        "host_grads": nbytes(zf.accum + zf.spare) + sum(nbytes(s) for s in zf._staging if s is not None),
        "masters": nbytes(engine._optimizer.stepped_tensors()),
    }
    engine.close()
    return out


def test_the_planner_counts_the_buffers_the_device_path_holds():
    """``shardtrain estimate`` for a ZenFlow config on CUDA ([Note: ZenFlow in the estimate]): the selected columns
    and their moments on the device, the host masters and moments, the accumulators and staging buffers on the host
    equal, byte for byte, what the engine holds after three steps (world 1: the rank holds whole weights, so the
    selected elements are exact); S, the fp32 masters, stays on the device."""
    from shardtrain.estimate import estimate_memory

    rule = {**RULE, "full_warm_up_rounds": 0, "overlap_step": True}
    (held,) = run_distributed(_held, 1, rule)
    config = {**zenflow_config(rule), "bf16": {"enabled": True}}
    recipe = Recipe(steps=3, gas=1, micro=RECIPE.micro, clip=RECIPE.clip, lr=RECIPE.lr)
    est = estimate_memory(lambda: make_model(recipe), config, world_size=1, device_type="cuda", activations=False)
    assert {k: est.state.zenflow[k] for k in ("selected", "host_state", "host_grads")} == {
        k: held[k] for k in ("selected", "host_state", "host_grads")
    }
    assert est.state.optimizer["device"] == held["masters"]
    rows = {r.component: (r.where, r.nbytes) for r in est.rows}
    assert rows["ZenFlow: selected columns (fp32 + moments)"] == ("device", held["selected"])
    assert rows["ZenFlow: gradient accumulators (double-buffered) + staging"] == ("host", held["host_grads"])
    assert "gradients (fp32 host copies for the host step)" not in rows  # plain offload's copies are not made


def _resumable(rule: dict, steps: int, save: str | None = None, load: str | None = None) -> dict:
    """Runs on every rank: the device path through the fake, optionally loading a checkpoint first and saving one
    after ``steps`` steps."""
    import torch.distributed as dist

    zenflow_device.zenflow_streams = lambda device: FakeStreams()
    recipe = Recipe(steps=9, gas=1, micro=RECIPE.micro, clip=RECIPE.clip, lr=RECIPE.lr)
    model = make_model(Recipe(seed=RECIPE.seed + 7) if load else recipe)  # a loaded run's values come from the file
    engine = shardtrain.initialize(model, config=zenflow_config(rule), optimizer=make_optimizer(model, recipe))
    if load:
        engine.load_checkpoint(load)
    batches = global_micro_batches(recipe, dist.get_world_size())
    losses = [train_step(engine, recipe, batches, engine.global_step, dist.get_rank()) for _ in range(steps)]
    if save:
        engine.save_checkpoint(save, tag="t")
    out = {"losses": losses, "params": engine.full_state_dict()}
    engine.close()
    return out


def test_a_checkpoint_on_the_device_path_resumes_bitwise(tmp_path):
    """Saved after step 5 at world 2 with a host update in flight, the accumulator holding a step and the selected
    columns' moments on the device: the resumed run's losses and weights are the straight run's, bit for bit."""
    rule = {**RULE, "overlap_step": True}
    straight = run_distributed(_resumable, 2, rule, 9)
    run_distributed(_resumable, 2, rule, 5, str(tmp_path / "c"))
    resumed = run_distributed(_resumable, 2, rule, 4, None, str(tmp_path / "c"))
    for r, s in zip(resumed, straight):
        assert r["losses"] == s["losses"][5:]
    for name, value in straight[0]["params"].items():
        assert torch.equal(resumed[0]["params"][name], value), name
