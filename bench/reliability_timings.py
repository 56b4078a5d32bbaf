"""How long each fault takes to surface, for docs/reliability.md: run ``PYTHONPATH=src:tests python
bench/reliability_timings.py`` (a few minutes; uses the tests' fault injection) and paste its output.

For a killed rank: seconds from the killed process's exit to each survivor's exit (the harness polls every 50 ms),
and the time the failing collective took, from the survivor's own message. For disk faults: seconds from the call to
the CheckpointError on every rank. For a rank that hangs: the collective timeout plus the survey's wait."""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# the tests' helpers, and the test modules whose scenarios this times
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "reliability"))

from shardtrain.testing import run_distributed, run_ranks
from test_engine_api import _rank_takes_extra_backward
from test_reliability_disk import _disk_faults
from test_reliability_elastic import ROOT, torchrun_env
from test_reliability_rank_death import _train_until_killed
from test_reliability_save_crash import _save_killed

from helpers.reliability import check_rank_death


def _rank_death(world: int, stage: int, point: str, victim: int, save: bool) -> tuple[float, float]:
    """(slowest survivor's exit after the killed rank's, slowest failing collective in the messages)."""
    with tempfile.TemporaryDirectory() as root:
        if save:
            outcomes = run_ranks(_save_killed, world, stage, victim, point, root, timeout=60)
        else:
            outcomes = run_ranks(_train_until_killed, world, stage, victim, point, root, timeout=60)
    survivors = check_rank_death(outcomes, victim)
    took = [float(re.search(r"failed after ([0-9.]+) s", m).group(1)) for _, m in survivors.values()]
    return max(s for s, _ in survivors.values()), max(took)


def main() -> None:
    print(f"# {platform.node()}: {os.cpu_count()} CPUs, torch {torch.__version__}, python {platform.python_version()}")
    print(f"# load average at start: {os.getloadavg()}")
    print("\n| fault | world | ZeRO stage | killed rank | survivors exit after (s) | failing collective took (s) |")
    print("|---|---|---|---|---|---|")
    rows = []
    for stage in range(4):
        for point in ("forward", "backward", "step"):
            for world in (2, 3):
                victim = (stage + world) % world
                exit_s, took = _rank_death(world, stage, point, victim, save=False)
                exit_s = max(0.0, exit_s)  # both exits seen in the same 50 ms poll
                rows.append(exit_s)
                print(f"| SIGKILL in {point} | {world} | {stage} | {victim} | {exit_s:.2f} | {took:.2f} |")
    for point, victim in (("start", 1), ("tensor_file_written", 1), ("manifest_written", 0), ("done", 0)):
        for world in (2, 3):
            exit_s, took = _rank_death(world, 2, point, victim, save=True)
            exit_s = max(0.0, exit_s)
            rows.append(exit_s)
            print(f"| SIGKILL in save at `{point}` | {world} | 2 | {victim} | {exit_s:.2f} | {took:.2f} |")
    print(f"\nsurvivors' exit after the killed rank: median {statistics.median(rows):.2f} s, max {max(rows):.2f} s")

    print("\n| disk fault (world 3, stage 2) | seconds to CheckpointError on every rank (slowest rank) |")
    print("|---|---|")
    root = Path(tempfile.mkdtemp(prefix="shardtrain-disk-"))
    root.chmod(0o755)
    try:
        results = run_distributed(_disk_faults, 3, str(root), 2, timeout=120)
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    for name in (
        "one rank's tensor file",
        "every rank's files",
        "fsync on one rank",
        "the manifest",
        "the latest file",
        "unwritable",
        "removed",
        "truncated",
    ):
        print(f"| {name} | {max(r[name][1] for r in results):.3f} |")

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "losses.jsonl"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1"]
        cmd += ["--monitor-interval=0.1", str(ROOT / "examples" / "elastic_train.py"), "--ckpt-dir", f"{tmp}/ck"]
        cmd += ["--steps", "8", "--save-every", "3", "--kill-rank", "1", "--kill-at-step", "5", "--loss-log", str(log)]
        t0 = time.time()
        subprocess.run(cmd, env=torchrun_env(), check=True, capture_output=True)
        total = time.time() - t0
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        killed = max(r["time"] for r in lines if r["attempt"] == 0)
        resumed = min(r["time"] for r in lines if r["attempt"] == 1)
    print(
        f"\nelastic restart (torchrun --max-restarts=1, world 2, rank 1 killed after step 5): first step after the "
        f"restart {resumed - killed:.1f} s after the last step before it (new processes, imports, rendezvous, load); "
        f"whole 8-step job {total:.1f} s"
    )

    t0 = time.monotonic()
    message = run_distributed(_rank_takes_extra_backward, 2, init_process_group=False, timeout=60)[0]
    print(
        f"\na rank that never joins (collective_timeout_s = 3): error after {time.monotonic() - t0:.1f} s "
        f"(process start included): {message[:160]}..."
    )


if __name__ == "__main__":
    main()
