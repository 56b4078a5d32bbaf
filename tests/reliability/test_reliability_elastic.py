"""Elastic restart: under ``torchrun --max-restarts=1`` a rank is killed with SIGKILL mid-run, by its own hand or from
outside the process; torchrun restarts the job, which resumes from the last complete checkpoint, and every loss after
the restart equals the uninterrupted run's (examples/elastic_train.py, the recipe in README.md). The command line is
the one a user copies: no environment variable ([Note: restarts under torchrun] in src/shardtrain/mesh.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardtrain.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))  # the reference run imports the example's train()

import elastic_train  # noqa: E402

STEPS, SAVE_EVERY, KILL_AT = 8, 3, 5  # checkpoints at steps 3 and 6; rank 1 dies after step 5
TIMEOUT_S = 240


def torchrun_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env["OMP_NUM_THREADS"] = "1"
    # what a user's shell has: torchrun's own defaults (it shares its store with the workers)
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    return env


def _uninterrupted(ckpt_dir: str) -> list[tuple[int, float]]:
    return elastic_train.train(ckpt_dir, STEPS, SAVE_EVERY)


@pytest.mark.parametrize("killer", [pytest.param("itself", marks=pytest.mark.soak), "outside"])  # suite time
def test_a_killed_rank_is_restarted_and_training_resumes_exactly(tmp_path, killer):
    """``itself``: rank 1 sends itself SIGKILL after step 5. ``outside``: it waits after step 5 and this test sends
    it SIGKILL (``os.kill`` on the pid it published), as the OOM killer or an operator would."""
    log, pid_file = tmp_path / "losses.jsonl", tmp_path / "rank1.pid"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1"]
    cmd += ["--monitor-interval=0.1", str(ROOT / "examples" / "elastic_train.py"), "--ckpt-dir", str(tmp_path / "ck")]
    cmd += ["--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--loss-log", str(log)]
    if killer == "itself":
        cmd += ["--kill-rank", "1", "--kill-at-step", str(KILL_AT)]
    else:
        cmd += ["--hold-rank", "1", "--hold-at-step", str(KILL_AT), "--pid-file", str(pid_file)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=torchrun_env())
    try:
        if killer == "outside":
            deadline = time.monotonic() + TIMEOUT_S
            while not pid_file.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert pid_file.exists(), f"rank 1 never reached step {KILL_AT}: {proc.communicate()[0][-6000:]}"
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, output[-6000:]
    assert "connectFullMesh" not in output, output[-6000:]  # the restarted attempt read no stale address

    lines = [json.loads(line) for line in log.read_text().splitlines()]
    first = {r["step"]: r["loss"] for r in lines if r["attempt"] == 0}
    second = {r["step"]: r["loss"] for r in lines if r["attempt"] == 1}
    assert sorted(first) == list(range(1, KILL_AT + 1))  # rank 1 died after step 5
    assert sorted(second) == list(range(4, STEPS + 1))  # resumed from global_step3, the last complete checkpoint
    assert "attempt 1: resumed from" in output and "at step 3" in output
    # the survivor said which rank vanished (when torchrun let it print before stopping the job)
    if "PeerLostError" in output:
        assert "rank 1 (pid " in output and " is gone: killed" in output

    straight = dict(run_distributed(_uninterrupted, 2, str(tmp_path / "straight"), timeout=120)[0])
    assert first == {s: straight[s] for s in first}
    assert second == {s: straight[s] for s in second}  # bitwise: the restart changed nothing


def test_the_process_group_shardtrain_created_is_destroyed_at_exit(tmp_path):
    """A script that ends without ``destroy_process_group`` (like the example) must not leave a gloo group to the
    interpreter's finalization, where freeing its work objects can abort the process after training finished
    (seen once in CI: "terminate called without an active exception", SIGABRT, and torchrun failed the job)."""
    script = tmp_path / "script.py"
    script.write_text(
        "import atexit, torch, torch.distributed as dist, shardtrain\n"
        # registered before shardtrain's handler, so it runs after it (atexit runs last-in first-out)
        "atexit.register(lambda: print('initialized at exit:', dist.is_initialized(), flush=True))\n"
        "engine = shardtrain.initialize(torch.nn.Linear(2, 2), config={'train_micro_batch_size_per_gpu': 1,\n"
        "    'optimizer': {'type': 'SGD', 'params': {'lr': 0.1}}})\n"
        "engine.backward(engine(torch.ones(1, 2)).sum())\n"
        "engine.step()\n"
        "print('trained; initialized:', dist.is_initialized(), flush=True)\n"
    )
    env = {k: v for k, v in torchrun_env().items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trained; initialized: True" in proc.stdout
    assert "initialized at exit: False" in proc.stdout
