"""A process group that ``initialize`` makes without a launcher: it lives in this process and leaves the environment as
it was, so that the processes this one starts later do not inherit a rendezvous port that is taken."""

import os
import subprocess
import sys
import textwrap

import pytest

from shardtrain.distributed import mesh
from shardtrain.errors import LayoutError

_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")

_SCRIPT = textwrap.dedent(
    """
    import os, subprocess, sys
    import torch, torch.distributed as dist
    import shardtrain

    names = {names!r}
    engine = shardtrain.initialize(
        torch.nn.Linear(4, 4),
        config={{"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6}},
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
    )
    loss = engine(torch.ones(1, 4)).sum()
    engine.backward(loss)
    engine.step()
    assert dist.is_initialized() and dist.get_world_size() == 1
    print("left in the environment:", sorted(k for k in names if k in os.environ))
    # a process started now rendezvouses on its own: a launcher-less engine in it trains as well
    child = subprocess.run([sys.executable, "-c", {child!r}], capture_output=True, text=True, timeout=120)
    print("child:", child.returncode, child.stderr[-2000:])
    """
)

_CHILD = (
    "import torch, shardtrain; e = shardtrain.initialize(torch.nn.Linear(2, 2), config={'train_micro_batch_size_per_gpu"
    "': 1, 'steps_per_print': 10**6}, optimizer=lambda p: torch.optim.SGD(p, lr=0.1)); e.backward(e(torch.ones(1, 2))."
    "sum()); e.step()"
)


def test_a_run_without_a_launcher_leaves_the_environment_as_it_was():
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    env["SHARDTRAIN_DEVICE"] = "cpu"
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT.format(names=_RENDEZVOUS, child=_CHILD)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "left in the environment: []" in done.stdout
    assert "child: 0 " in done.stdout, done.stdout


@pytest.mark.parametrize(("present", "missing"), [({"RANK": "1"}, "WORLD_SIZE"), ({"WORLD_SIZE": "2"}, "RANK")])
def test_a_launch_that_sets_only_one_of_rank_and_world_size_is_named(monkeypatch, present, missing):
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in present.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(mesh.dist, "is_initialized", lambda: False)
    with pytest.raises(LayoutError) as err:
        mesh.ensure_process_group(10.0, mesh.torch.device("cpu"))
    assert f"but not {missing}" in str(err.value) and f"set {missing}" in str(err.value)
