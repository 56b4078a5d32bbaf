"""Swap files are scratch and their failures are named: a missing or unusable ``nvme_path`` fails at
``initialize`` on every rank naming the rank and the path; a full disk during a step fails the step on every rank
naming the file, within seconds; swap directories are removed by ``close()`` and at exit; a directory left by a
killed run is cleared, never read."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import shardtrain
from shardtrain.distributed import failure
from shardtrain.offload import parameters as param_offload
from shardtrain.offload import swap as swap_module
from shardtrain.testing import DistributedFailure, run_distributed

NOSPACE = os.strerror(errno.ENOSPC)


def tiny_engine(nvme_path: str, stage: int = 2, fail: str | None = None, fail_rank: int = 1):
    """An engine on a tiny model with nvme optimizer offload; ``fail`` injects a fault on ``fail_rank``."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    if fail == "mkdir" and rank == fail_rank:

        def refuse(*args, **kwargs):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

        swap_module.tempfile.mkdtemp = refuse
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {
            "stage": stage,
            "sub_group_size": 64,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 2},
        },
    }
    return shardtrain.initialize(model, config, torch.optim.AdamW(model.parameters(), lr=1e-2))


def _step(engine) -> None:
    x = torch.randn(2, 8)
    engine.backward(engine(x).square().mean())
    engine.step()


def init_only(nvme_path: str, fail: str | None = None) -> str:
    engine = tiny_engine(nvme_path, fail=fail)
    scratch = str(engine._scratch["offload_optimizer"].path)
    engine.close()
    return scratch


def test_missing_nvme_path_fails_at_initialize_on_every_rank(tmp_path):
    missing = tmp_path / "no" / "such" / "dir"
    with pytest.raises(DistributedFailure) as err:
        run_distributed(init_only, 2, str(missing), timeout=60)
    text = str(err.value)
    for rank in (0, 1):
        assert f"rank {rank}: zero_optimization.offload_optimizer.nvme_path {str(missing)!r} does not exist" in text
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(DistributedFailure, match="is not a directory"):
        run_distributed(init_only, 2, str(a_file), timeout=60)


def test_unwritable_nvme_path_on_one_rank_fails_on_every_rank(tmp_path):
    start = time.monotonic()
    with pytest.raises(DistributedFailure) as err:
        run_distributed(init_only, 2, str(tmp_path), "mkdir", timeout=60)
    text = str(err.value)
    assert time.monotonic() - start < 30  # no rank waits for a collective timeout
    # both ranks raise, each naming rank 1 (the failing one), the path and the cause
    assert (
        text.count(
            f"rank 1: cannot create a swap directory in zero_optimization.offload_optimizer.nvme_path "
            f"{str(tmp_path)!r}: Permission denied"
        )
        >= 2
    ), text
    assert list(tmp_path.iterdir()) == []  # rank 0 removed the directory it had made


def full_disk_step(nvme_path: str, fail_rank: int | None, room: int) -> str:
    """Two good steps, then every write on ``fail_rank`` (None: every rank) fails with ENOSPC after ``room``
    more bytes; returns the error each rank raised."""
    import torch.distributed as dist

    engine = tiny_engine(nvme_path)
    _step(engine)
    _step(engine)
    rank = dist.get_rank()
    if fail_rank is None or rank == fail_rank:
        left = [room]
        real = swap_module._write_at

        def filling(fd, data, offset):
            if left[0] <= 0:
                raise OSError(errno.ENOSPC, NOSPACE)
            n = real(fd, data[: left[0]], offset)
            left[0] -= n
            return n

        swap_module._write_at = filling
    start = time.monotonic()
    try:
        _step(engine)
    except swap_module.OffloadError as err:
        return f"{time.monotonic() - start:.1f}s {err}"
    finally:
        engine.close()
    return "no error"


@pytest.mark.parametrize(("world", "fail_rank", "room"), [(2, 1, 0), (3, 2, 100), (2, None, 0)])
def test_full_disk_during_a_step_fails_on_every_rank_naming_the_file(world, fail_rank, room, tmp_path):
    outcomes = run_distributed(full_disk_step, world, str(tmp_path), fail_rank, room, timeout=90)
    failing = range(world) if fail_rank is None else [fail_rank]
    for out in outcomes:
        seconds, _, message = out.partition("s ")
        assert float(seconds) < 20, out
        assert message.startswith("offloaded optimizer step failed: "), out
        for r in failing:  # the step's first writes are the gradient shards (backward's), then the state
            wrote = [f"rank {r}: writing {what} to '{tmp_path}/" for what in ("gradients", "optimizer state")]
            assert any(w in message for w in wrote), out
        assert NOSPACE in message
    assert list(tmp_path.iterdir()) == []  # every rank removed its swap directories
    assert list(tmp_path.iterdir()) == []  # close() removed every rank's swap directory


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _fake_scratch(root: Path, name: str, record: dict | None, lock: bool = True) -> Path:
    """A scratch directory as another run makes it: an (unheld) lock file, ``owner.json`` when ``record``."""
    d = root / f"shardtrain-swap-{name}"
    d.mkdir()
    if lock:
        (d / "lock").touch()
    if record is not None:
        (d / "owner.json").write_text(json.dumps(record))
    return d


def test_stale_directory_of_a_killed_run_is_cleared_and_never_read(tmp_path):
    host = socket.gethostname().replace("-", "_")
    dead = _dead_pid()
    record = {**failure.process_record(), "pid": dead, "started": "1"}
    stale = _fake_scratch(tmp_path, f"{host}-{dead}-rank0-abc123", record)
    (stale / "0.exp_avg.bin").write_bytes(b"\x7f" * 4096)  # garbage that must never be read as state
    # killed between making the directory and locking it (no lock, no record): cleared once it is old
    no_marker = _fake_scratch(tmp_path, f"{host}-{dead}-rank1-def456", None, lock=False)
    old = time.time() - 2 * swap_module.GRACE_S
    os.utime(no_marker, (old, old))
    just_made = _fake_scratch(tmp_path, f"{host}-{dead}-rank2-ghi789", None)  # a run starting now, not locked yet
    # without a lock file (a file system without flock) the record decides: this live process's
    live = _fake_scratch(tmp_path, f"{host}-{os.getpid()}-rank0-live00", failure.process_record(), lock=False)
    other_host = _fake_scratch(tmp_path, f"elsewhere-{dead}-rank0-xyz789", {**record, "host": "elsewhere"})
    scratch = run_distributed(init_only, 1, str(tmp_path), timeout=60)[0]
    assert not stale.exists() and not no_marker.exists()
    assert live.exists() and other_host.exists() and just_made.exists()
    assert Path(scratch).parent == tmp_path and not Path(scratch).exists()


def dropped_engine(nvme_path: str) -> tuple[list[str], list[str]]:
    """An engine that trains a step and is dropped without close(): the swap directories before and after gc."""
    import gc

    engine = tiny_engine(nvme_path)
    _step(engine)
    before = os.listdir(nvme_path)
    del engine
    gc.collect()
    return before, os.listdir(nvme_path)


def test_an_engine_dropped_without_close_leaves_no_swap_directory(tmp_path):
    before, after = run_distributed(dropped_engine, 1, str(tmp_path), timeout=60)[0]
    assert len(before) == 1 and after == []


HOLDER = """
import fcntl, json, os, sys
d = sys.argv[1]
os.mkdir(d)
fd = os.open(os.path.join(d, "lock"), os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
with open(os.path.join(d, "owner.json"), "w") as f:
    f.write(sys.argv[2])
open(os.path.join(d, "0.exp_avg.bin"), "wb").write(bytes(4096))
print("locked", flush=True)
sys.stdin.read()  # hold the lock until the test closes our stdin
"""


def test_a_live_run_in_another_pid_namespace_keeps_its_directory(tmp_path):
    """Two containers sharing a host name (host networking) and a disk, each with its own pid namespace: the other
    run's pid does not exist here, its record names this host. It holds its lock, so it is alive and its swap
    directory stays; once it has exited (lock released) the next run clears the directory."""
    host = socket.gethostname().replace("-", "_")
    ghost = _dead_pid()  # a pid that does not exist in this namespace
    record = {
        "host": socket.gethostname(),
        "machine": socket.gethostname() + "|same-boot|pid:[4026599999]",  # another pid namespace
        "pid": ghost,
        "started": "12345",
    }
    theirs = tmp_path / f"shardtrain-swap-{host}-{ghost}-rank0-other1"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(theirs), json.dumps(record)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        for _ in range(2):  # our initialize (which clears stale directories) twice: theirs is untouched
            run_distributed(init_only, 1, str(tmp_path), timeout=60)
            assert (theirs / "0.exp_avg.bin").read_bytes() == bytes(4096)
        # the record alone would have judged it dead on this machine had it carried this namespace
        assert failure.process_alive({**record, "machine": failure._machine_id()}) is False
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    run_distributed(init_only, 1, str(tmp_path), timeout=60)  # its process ended: the lock is free, it is stale
    assert list(tmp_path.iterdir()) == []


def test_liveness_tells_another_pid_namespace_from_a_dead_process():
    """One liveness check for swap directories and the collective-failure survey: a pid of another machine or pid
    namespace cannot be judged here (None), a gone or reused pid here is dead, this process is alive."""
    me = failure.process_record()
    assert failure.process_alive(me) is True
    dead = {**me, "pid": _dead_pid()}
    assert failure.process_alive(dead) is False
    assert failure.process_alive({**me, "started": "1"}) is False  # the pid was reused by a later process
    other_namespace = {**dead, "machine": me["machine"] + "-other"}
    assert failure.process_alive(other_namespace) is None
    assert failure.process_alive({k: v for k, v in dead.items() if k != "machine"}) is None


def test_a_garbage_collected_scratch_directory_is_removed(tmp_path):
    import gc

    scratch = swap_module.ScratchDir(tmp_path, 0, "zero_optimization.offload_optimizer")
    path = scratch.path
    assert path.is_dir() and (path / "lock").exists()
    del scratch
    gc.collect()
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []


SCRIPT = """
import sys, torch, shardtrain
sys.path.insert(0, {tests!r})
from test_offload_safety import tiny_engine, _step
engine = tiny_engine({path!r})
_step(engine)
print(engine._scratch["offload_optimizer"].path, flush=True)
if {kill}:
    import os, signal
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("kill", [False, True])
def test_swap_directory_removed_at_exit_and_after_a_kill(kill, tmp_path):
    """A script that never calls close() leaves nothing at exit; a killed one leaves its directory, which the next
    run's initialize removes."""
    code = SCRIPT.format(tests=str(Path(__file__).parent), path=str(tmp_path), kill=kill)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    scratch = Path(run.stdout.strip().splitlines()[-1])
    assert scratch.parent == tmp_path
    if not kill:
        assert run.returncode == 0, run.stderr
        assert not scratch.exists()
        return
    assert run.returncode == -9 and scratch.exists() and any(scratch.glob("*.bin"))
    run_distributed(init_only, 1, str(tmp_path), timeout=60)
    assert list(tmp_path.iterdir()) == []


def param_files_fail(nvme_path: str, fail_rank: int) -> str:
    """Stage 3 with parameter offload; making the parameter swap files fails with ENOSPC on ``fail_rank``."""
    import torch.distributed as dist

    if dist.get_rank() == fail_rank:

        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, NOSPACE)

        param_offload.os.posix_fallocate = full
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    param = {"device": "nvme", "nvme_path": nvme_path, "max_in_cpu": 0}
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_param": param}
    try:
        shardtrain.initialize(model, {"zero_optimization": zero}, torch.optim.AdamW(model.parameters()))
    except swap_module.OffloadError as err:
        return str(err)
    return "no error"


def test_full_disk_making_parameter_swap_files_fails_on_every_rank(tmp_path):
    outcomes = run_distributed(param_files_fail, 2, str(tmp_path), 1, timeout=60)
    for message in outcomes:
        assert message.startswith(f"rank 1: cannot make the parameter swap file '{tmp_path}/"), message
        assert NOSPACE in message
    assert list(tmp_path.iterdir()) == []  # every rank removed its swap directories


MANY = """
import resource, sys, torch, shardtrain
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))  # ulimit -n 256


class Many(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ws = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(4)) for _ in range(3000)])

    def forward(self, x):
        return (x @ torch.stack(list(self.ws)).T).square().mean()


def run(zero):
    torch.manual_seed(0)
    model = Many()
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, **zero}}
    engine = shardtrain.initialize(model, config, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step in range(3):
        engine.backward(engine(torch.randn(2, 4, generator=torch.Generator().manual_seed(step))))
        engine.step()
    offload = engine._optimizer.offload
    swapped = (offload.files.bytes_read, offload.files.most_open) if offload is not None else None
    weights = engine.full_state_dict()
    engine.close()
    return weights, swapped


plain, _ = run({})
nvme = {"sub_group_size": 1000, "offload_optimizer": {"device": "nvme", "nvme_path": sys.argv[1]}}
offloaded, (bytes_read, most_open) = run(nvme)
assert all(torch.equal(offloaded[k], v) for k, v in plain.items()), "offloaded training differs"
print(len(plain), bytes_read, most_open)
"""


def test_nvme_swap_of_3000_parameters_runs_under_ulimit_n_256(tmp_path):
    """6000 swap files (3000 parameters x Adam's two moments) with at most 256 descriptors: training is bitwise
    the same as without offload, the state went through the files, and at most a few were open at once."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-c", MANY, str(tmp_path)], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    params, bytes_read, most_open = map(int, run.stdout.split())
    assert params == 3000
    assert bytes_read >= 2 * 3000 * 4 * 4 * 2  # two moments of every parameter read back at steps 2 and 3
    assert most_open <= 3  # one per thread that touches the files: two I/O threads and the training thread
    assert list(tmp_path.iterdir()) == []


def test_a_process_never_clears_its_own_live_directory_when_locks_are_per_process(tmp_path, monkeypatch):
    """On NFS ``flock`` is emulated with POSIX locks, which the process holding one can take again: the second
    swap directory of a run (parameter and optimizer offload share ``nvme_path``) must not clear the first."""
    monkeypatch.setattr(swap_module.fcntl, "flock", lambda fd, op: None)  # every lock "taken"
    first = swap_module.ScratchDir(tmp_path, 0, "zero_optimization.offload_param")
    second = swap_module.ScratchDir(tmp_path, 0, "zero_optimization.offload_optimizer")
    assert first.path.is_dir() and second.path.is_dir()
    first.remove()
    second.remove()
    assert list(tmp_path.iterdir()) == []
