"""Elastic restart: under ``torchrun --max-restarts=1`` a rank is killed with SIGKILL mid-run; torchrun restarts the
job, which resumes from the last complete checkpoint, and every loss after the restart equals the uninterrupted
run's (examples/elastic_train.py, the recipe in README.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from shardtrain.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # the reference run imports the example's train()

import elastic_train  # noqa: E402

STEPS, SAVE_EVERY, KILL_AT = 8, 3, 5  # checkpoints at steps 3 and 6; rank 1 dies after step 5


def torchrun_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env["OMP_NUM_THREADS"] = "1"
    # torchrun shares its rendezvous store with the workers by default, and restarted gloo workers may then read the
    # previous attempt's addresses and fail to connect (pytorch/pytorch#135712); README.md gives the same advice
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def _uninterrupted(ckpt_dir: str) -> list[tuple[int, float]]:
    return elastic_train.train(ckpt_dir, STEPS, SAVE_EVERY)


def test_a_killed_rank_is_restarted_and_training_resumes_exactly(tmp_path):
    log = tmp_path / "losses.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1"]
    cmd += ["--monitor-interval=0.1", str(ROOT / "examples" / "elastic_train.py"), "--ckpt-dir", str(tmp_path / "ck")]
    cmd += ["--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--kill-rank", "1", "--kill-at-step", str(KILL_AT)]
    cmd += ["--loss-log", str(log)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=torchrun_env(), timeout=240)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]

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
