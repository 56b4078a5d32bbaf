"""A clean exit (issue 37 item 4): a ``ShardtrainTrainer`` script that trains, saves and ends without ``end()`` exits
with status 0 on every rank, never with ``terminate called without an active exception`` (SIGABRT after the work was
done, which torchrun reports as a failed job; seen in 3 of 14 GPT-2 runs at world 2). The cause and what joins what:
[Note: what the engine starts and who joins it] in ``shardtrain/engine/shutdown.py``.

The default run exits the case that aborted (GPT-2, world 2, no ``end()``). The soak exits ``SHARDTRAIN_EXIT_SOAK``
times (default 250) per world (2, 3) and model (GPT-2 without ``end()``, Llama with it), 1,000 exits in all::

    SHARDTRAIN_EXIT_SOAK=250 PYTHONPATH=src python -m pytest -m soak -s tests/compat/test_hf_trainer_exit.py
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "helpers" / "trainer_exit_script.py"
ABORT = "terminate called"
SOAK_EXITS = int(os.environ.get("SHARDTRAIN_EXIT_SOAK", "250"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_once(kind: str, world: int, out: Path, *extra: str) -> list[tuple[int, str]]:
    """Run the script on ``world`` ranks (one process each, torchrun's variables); each rank's status and output."""
    port = _free_port()
    base = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    base.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world))
    base.update(LOCAL_WORLD_SIZE=str(world))
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), kind, str(out), *extra],
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    results = []
    for p in procs:
        try:
            output, _ = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            p.kill()
            output, _ = p.communicate()
        results.append((p.returncode, output))
    return results


def bad_exits(results: list[tuple[int, str]]) -> list[str]:
    return [f"rank {r}: status {rc}\n{out[-3000:]}" for r, (rc, out) in enumerate(results) if rc != 0 or ABORT in out]


def clean_exit_problems(results: list[tuple[int, str]]) -> list[str]:
    """What went wrong in one exit: a rank that aborted or failed, or an engine group still alive after the exit
    hooks (its gloo workers would reach the interpreter's finalization: the cause of the abort)."""
    problems = bad_exits(results)
    for r, (_, out) in enumerate(results):
        freed = re.search(r"at exit: engine groups alive 0 of (\d+)", out)
        if freed is None or int(freed.group(1)) == 0:
            problems.append(f"rank {r}: engine groups not all freed at exit\n{out[-3000:]}")
    return problems


def test_the_aborting_trainer_script_exits_cleanly(tmp_path):
    """The case that aborted: GPT-2, world 2, the script ends without ``end()`` (the exit hooks close). Beside the
    exit status, which the race made wrong only now and then, what the abort needs is checked on every run: no group
    the engine created may be alive when the interpreter finalizes."""
    results = exit_once("gpt2", 2, tmp_path)
    problems = clean_exit_problems(results)
    assert not problems, "\n".join(problems)
    assert "trained 3 steps" in results[0][1]
    for _, out in results:  # closed and destroyed by shardtrain's exit hooks, though the script called neither
        assert "at exit: open engines 0, process group False" in out, out[-3000:]
    assert (tmp_path / "checkpoint-2" / "latest").is_file()
    assert (tmp_path / "final" / "config.json").is_file()


@pytest.mark.soak
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_soak_trainer_exits(kind, world, tmp_path):
    """``SOAK_EXITS`` exits in a row; every rank of every one must exit with 0 and without an abort."""
    failures, t0 = [], time.monotonic()
    for i in range(SOAK_EXITS):
        out = tmp_path / str(i)
        extra = ("end",) if kind == "llama" else ()  # Llama's scripts end with trainer.end(), GPT-2's without
        failures += [f"exit {i}, {f}" for f in clean_exit_problems(exit_once(kind, world, out, *extra))]
        shutil.rmtree(out, ignore_errors=True)
    took = time.monotonic() - t0
    print(f"{kind} world {world}: {SOAK_EXITS} exits x {world} ranks, {len(failures)} bad, {took:.0f} s")
    assert not failures, f"{len(failures)} of {SOAK_EXITS * world} rank exits failed:\n" + "\n".join(failures[:3])
