"""What the engine starts, ``close()`` stops, once; an engine nobody closed is closed at interpreter exit ([Note: what
the engine starts and who joins it] in ``shardtrain/engine/shutdown.py``). The Trainer's exits are in
tests/compat/test_hf_trainer_exit.py."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import shardtrain
from shardtrain.distributed.gloo_threads import gloo_workers, settle_gloo_workers
from shardtrain.distributed.mesh import ensure_process_group
from shardtrain.engine import shutdown
from shardtrain.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]


def _config(swap: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        # swap files: the offload I/O pool runs; stage 3 with every module a unit: gathers and their checks run
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": "nvme", "nvme_path": swap},
        },
    }


def _started_workers() -> int:
    """The gloo workers, once each has named itself (a thread takes its name a moment after it starts; a group
    has two)."""
    deadline = time.monotonic() + 10
    while (n := len(gloo_workers())) % 2 or n == 0:
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    return n


def _close_stops_everything(tmp: str) -> dict:
    before = set(threading.enumerate())
    ensure_process_group(60.0, torch.device("cpu"))
    dist.barrier()  # the default group's backend starts its workers on its first collective
    workers_before = _started_workers()  # the default group's
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    engine = shardtrain.initialize(model, _config(tmp))
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 8)).square().mean())
        engine.step()
    engine.save_checkpoint(f"{tmp}/ckpt", async_save=True)  # a background thread and a checkpoint group
    started = sorted(t.name for t in set(threading.enumerate()) - before)
    own = engine.topology.own_groups
    saver_group = engine._async_saver._comm.group
    refs = [weakref.ref(g) for g in (*own, saver_group)]
    workers_open = len(gloo_workers())
    settled = settle_gloo_workers()  # the last exit hook's wait: every worker idle, the GIL released meanwhile
    engine.close()
    engine.close()  # a second call does nothing
    pg_map = dist.distributed_c10d._world.pg_map
    own_destroyed = all(g not in pg_map for g in own) and saver_group not in pg_map
    n_own = len(own)
    del own, saver_group
    gc.collect()
    try:
        engine.comm.all_reduce(torch.ones(1), what="after close")
        refused = ""
    except shardtrain.ShardtrainError as err:
        refused = str(err)
    return {
        "started": started,
        "left": sorted(t.name for t in set(threading.enumerate()) - before if t.is_alive()),
        "own": n_own,
        "own_destroyed": own_destroyed,
        # freed while the engine object is still alive: no reference left, so their gloo workers were joined
        "alive": sum(r() is not None for r in refs),
        "workers": (workers_before, workers_open, len(gloo_workers())),
        "refused": refused,
        "settled": settled,
        "open": engine in shutdown._open,
        "latest": (Path(tmp) / "ckpt" / "latest").read_text().strip(),
    }


def test_close_joins_the_threads_and_destroys_the_groups_the_engine_started(tmp_path):
    for r in run_distributed(_close_stops_everything, 2, str(tmp_path)):
        assert any(n.startswith("shardtrain-swap") for n in r["started"]), r  # the test saw them run
        assert r["left"] == [], r  # no thread the engine started survives close()
        assert r["own"] > 0 and r["own_destroyed"], r
        assert r["alive"] == 0, r  # every group the engine created is freed by close()
        before, opened, after = r["workers"]
        assert opened > before and after == before, r  # their worker threads are joined
        assert "released by engine.close()" in r["refused"], r
        assert r["settled"], r
        assert not r["open"] and r["latest"] == "global_step2", r


SCRIPT = """
import atexit, gc, sys, threading, torch, torch.distributed as dist
import shardtrain
from shardtrain.distributed.gloo_threads import gloo_workers
from shardtrain.engine import shutdown

seen = {}

def report():  # registered before shardtrain's exit hooks, so it runs after them
    pg_map = dist.distributed_c10d._world.pg_map if dist.is_initialized() else {}
    left = [t.name for t in threading.enumerate() if t.name.startswith("shardtrain")]
    destroyed = all(g not in pg_map for g in seen["own"])
    print(f"at exit: open={len(shutdown._open)} threads={left} destroyed={destroyed} pg={dist.is_initialized()}")
    seen.clear()
    gc.collect()
    print(f"at exit: gloo workers {len(gloo_workers())}")  # every group freed, the default one too

atexit.register(report)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
engine = shardtrain.initialize(model, CONFIG)
for _ in range(2):
    engine.backward(engine(torch.randn(2, 8)).square().mean())
    engine.step()  # the last step's gathers are left in flight
engine.save_checkpoint(sys.argv[1] + "/ckpt", async_save=True)  # not waited for by the script
seen["own"] = engine.topology.own_groups + (engine._async_saver._comm.group,)
print("own groups", len(seen["own"]), flush=True)
"""


def test_an_engine_nobody_closed_is_closed_at_exit(tmp_path):
    """The script ends with an asynchronous save in flight, without ``close()`` or ``destroy_process_group``:
    shardtrain created the default group, so every group is gone at exit, with the engine's threads."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT).replace("CONFIG", repr(_config(str(tmp_path)))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        env["MASTER_PORT"] = str(s.getsockname()[1])
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path)],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0 and "terminate called" not in out, out[-3000:]
        assert "at exit: open=0 threads=[] destroyed=True pg=False" in out, out[-3000:]
        assert "at exit: gloo workers 0" in out, out[-3000:]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step2"
