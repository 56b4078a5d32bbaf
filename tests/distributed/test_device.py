"""Choosing the device ([Note: choosing the device]): the config's ``device``, ``SHARDTRAIN_DEVICE``, ``LOCAL_RANK``
on a node's GPUs, the NCCL group's binding and the ranks that share a GPU. CUDA is faked where the choice is made:
these run on a machine without one."""

from __future__ import annotations

import os
import textwrap
import types
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import shardtrain
from shardtrain.distributed import mesh
from shardtrain.distributed.mesh import DEVICE_ENV, local_device_index, pick_device, shared_devices
from shardtrain.errors import LayoutError, ShardtrainError
from shardtrain.testing import run_distributed


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch):
    """A node whose processes each see ``n`` CUDA devices (``gpus(n)``), with no device setting in the environment."""

    def see(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    monkeypatch.delenv(DEVICE_ENV, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return see


def test_unset_is_cuda_when_available_and_the_cpu_otherwise(gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    gpus(0)
    assert pick_device() == torch.device("cpu")
    gpus(2)
    assert pick_device() == torch.device("cuda", 0)


def test_the_environment_decides_when_the_config_does_not(gpus, monkeypatch):
    gpus(2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert pick_device(None) == torch.device("cpu")
    assert pick_device("cuda") == torch.device("cuda", 1)  # the config's explicit value wins
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device(None) == torch.device("cuda", 1)


def test_unknown_settings_and_cuda_without_a_device_are_named(gpus, monkeypatch):
    gpus(0)
    monkeypatch.setenv(DEVICE_ENV, "gpu")
    with pytest.raises(ShardtrainError, match=r"SHARDTRAIN_DEVICE is 'gpu'; choose one of 'cpu', 'cuda'"):
        pick_device()
    with pytest.raises(ShardtrainError, match=r"the config's device is 'tpu'"):
        pick_device("tpu")
    monkeypatch.delenv(DEVICE_ENV)
    with pytest.raises(LayoutError, match=r"device is 'cuda' but this process sees no CUDA device"):
        pick_device("cuda")


def test_a_rank_takes_its_local_rank_or_the_only_device_it_sees(gpus, monkeypatch):
    gpus(4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    for local_rank in range(4):
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        assert local_device_index() == local_rank
    gpus(1)  # SLURM's --gpus-per-task=1: each process sees its own device as cuda:0
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert pick_device() == torch.device("cuda", 0)


def test_more_ranks_on_a_node_than_devices_fails_on_every_rank_before_any_collective(gpus, monkeypatch):
    gpus(2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    for local_rank in range(4):  # ranks 0 and 1 too: they would otherwise wait for the others in the first collective
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        with pytest.raises(LayoutError) as err:
            local_device_index()
        assert "runs 4 ranks (LOCAL_WORLD_SIZE) but each process sees 2 CUDA devices" in str(err.value)
        assert "CUDA_VISIBLE_DEVICES=0,1" in str(err.value) and "--nproc-per-node 2" in str(err.value)


def test_a_created_nccl_group_is_bound_to_the_device(monkeypatch):
    calls: dict = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.update(kw))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("current", d))
    monkeypatch.setattr(mesh.atexit, "register", lambda fn: None)
    for key, value in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert mesh.ensure_process_group(60.0, torch.device("cuda", 3))
    assert calls["backend"] == "nccl" and calls["device_id"] == torch.device("cuda", 3)
    assert calls["current"] == torch.device("cuda", 3)
    calls.clear()
    assert mesh.ensure_process_group(60.0, torch.device("cpu"))
    assert calls["backend"] == "gloo" and "device_id" not in calls and "current" not in calls


def _groups_on_cuda() -> str:
    with pytest.raises(LayoutError) as err:
        mesh._make_mesh_groups(torch.device("cuda", 0), 2, 1, 60.0, False)
    return str(err.value)


def test_a_users_gloo_group_with_a_cuda_device_names_the_setting_that_fixes_it():
    (message, _) = run_distributed(_groups_on_cuda, 2)
    assert "uses 'gloo' but this rank's device is cuda:0" in message
    assert "SHARDTRAIN_DEVICE=cpu" in message and '"device": "cpu"' in message


def test_shared_devices_are_the_records_of_more_than_one_rank():
    records = [("a", "u0"), ("a", "u1"), ("b", "u0"), ("a", "u1"), ("a", "u1")]
    assert shared_devices(records) == {("a", "u1"): [1, 3, 4]}  # same uuid on two hosts: two devices
    assert shared_devices([("a", "u0"), ("a", "u1")]) == {}


def _two_ranks_on(uuids: list[str]) -> str | None:
    uuid = uuids[dist.get_rank()]
    with mock.patch.object(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(uuid=uuid)):
        try:
            mesh._check_one_rank_per_device(torch.device("cuda", 0), dist.group.WORLD)
        except LayoutError as e:
            return str(e)
    return None


def test_ranks_that_share_a_gpu_are_named_on_every_rank():
    shared = run_distributed(_two_ranks_on, 3, ["GPU-1", "GPU-1", "GPU-2"])
    assert all(m is not None and "ranks [0, 1] run on one CUDA device (GPU-1" in m for m in shared)
    assert run_distributed(_two_ranks_on, 2, ["GPU-1", "GPU-2"]) == [None, None]


def _engine_where_the_config_says() -> tuple[str, str]:
    """In a worker (a process group made in the test process would leak its rendezvous variables into every process
    the later tests start): a machine that sees one GPU, no device setting in the environment."""
    import os

    model = torch.nn.Linear(4, 4)
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6, "device": "cpu"}
    with (
        mock.patch.dict(os.environ, {DEVICE_ENV: ""}),
        mock.patch.object(torch.cuda, "is_available", lambda: True),
        mock.patch.object(torch.cuda, "device_count", lambda: 1),
    ):
        engine = shardtrain.initialize(model, config=config, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
        loss = engine(torch.ones(1, 4)).sum()
        engine.backward(loss)
        engine.step()
    with pytest.raises(LayoutError) as err, mock.patch.object(torch.cuda, "is_available", lambda: False):
        shardtrain.initialize(model, config={**config, "device": "cuda"}, optimizer=lambda p: torch.optim.SGD(p))
    return str(engine.device), str(err.value)


def test_the_engine_trains_where_the_config_says():
    ((device, refused),) = run_distributed(_engine_where_the_config_says, 1)
    assert device == "cpu"  # a machine with a GPU: "cpu" keeps the engine there
    assert "sees no CUDA device" in refused


_CONFTEST = Path(__file__).parents[1] / "conftest.py"


def _suite_with_a_marked_test(pytester, name: str, marked: str, unmarked: str) -> None:
    """A small suite under the suite's own conftest: file ``name`` with ``test_marked`` (marked ``gpu``, first) and
    ``test_unmarked``, whose bodies are the given one-line statements."""
    pytester.makeconftest(_CONFTEST.read_text())
    pytester.makeini("[pytest]\nmarkers =\n    gpu: trains on a CUDA GPU\n")
    source = f"""
        import os
        import pytest

        @pytest.mark.gpu
        def test_marked():
            {marked}

        def test_unmarked():
            {unmarked}
        """
    pytester.makepyfile(**{name: textwrap.dedent(source)})


def test_the_suite_trains_on_the_cpu_beside_a_gpu_except_for_tests_marked_gpu(pytester, monkeypatch):
    """The suite's conftest: every test trains on the CPU (``SHARDTRAIN_DEVICE=cpu``) also where there is a GPU; a
    test marked ``gpu`` trains on the GPU (the setting is ``cuda`` for it and the ranks it starts) after every other
    test, and is skipped without one. Run on a small suite with the same conftest, with CUDA faked both ways."""
    _suite_with_a_marked_test(
        pytester,
        "test_marks",
        'assert os.environ["SHARDTRAIN_DEVICE"] == "cuda"',
        'assert os.environ["SHARDTRAIN_DEVICE"] == "cpu"',
    )
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    for available, outcome in ((False, {"passed": 1, "skipped": 1}), (True, {"passed": 2})):
        monkeypatch.setattr(torch.cuda, "is_available", lambda available=available: available)
        result = pytester.runpytest_inprocess("--strict-markers", "-p", "no:cacheprovider", "-rs", "-v")
        result.assert_outcomes(**outcome)
        if not available:
            result.stdout.fnmatch_lines(["*needs a CUDA GPU (marked gpu)*"])
        else:  # the marked test, first in its file, runs last
            result.stdout.fnmatch_lines(["*test_unmarked PASSED*", "*test_marked PASSED*"])
        assert os.environ[DEVICE_ENV] == "cpu"  # the marked test's setting ends with it


def test_tests_marked_gpu_run_last_also_when_failed_tests_run_first(pytester, monkeypatch):
    """``--ff`` (and ``--nf``) reorder the tests after the conftest's hook would have: a test marked ``gpu`` that
    failed last time must still run after every other test, on a machine with CUDA (faked)."""
    _suite_with_a_marked_test(pytester, "test_order", 'assert os.environ.get("SHARDTRAIN_FAIL_ONCE") != "1"', "pass")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("SHARDTRAIN_FAIL_ONCE", "1")
    pytester.runpytest_inprocess("--strict-markers").assert_outcomes(passed=1, failed=1)
    monkeypatch.delenv("SHARDTRAIN_FAIL_ONCE")
    result = pytester.runpytest_inprocess("--strict-markers", "--ff", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*test_unmarked PASSED*", "*test_marked PASSED*"])


def _device_setting() -> str | None:
    return os.environ.get(DEVICE_ENV)


def test_ranks_take_the_callers_device_setting_not_the_one_their_process_server_started_with(monkeypatch):
    """``run_distributed`` forks its ranks from a server started once, with the environment of that moment; each
    rank still gets the environment its caller has when it starts them, here the device setting (a test marked gpu
    after tests on the CPU)."""
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert run_distributed(_device_setting, 1, init_process_group=False) == ["cpu"]  # the server is running now
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    assert run_distributed(_device_setting, 1, init_process_group=False) == ["cuda"]
    monkeypatch.delenv(DEVICE_ENV)
    assert run_distributed(_device_setting, 1, init_process_group=False) == [None]
