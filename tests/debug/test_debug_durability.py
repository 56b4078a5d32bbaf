"""Debug records are never lost: every record is on disk when a run ends, however it ends.

The runs are the walkthrough's ``train.py`` taken verbatim from docs/debugging.md and run as a user runs it (a fresh
interpreter): as shown; without its ``unsubscribe`` line and ending with the last recorded step (nothing runs after
the window that could flush it); raising an exception after step 4; killed with SIGKILL after step 4.
``shardtrain compare`` must find each of them identical to the run as shown, wherever both ran.
"""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from shardtrain.cli import main
from shardtrain.debug import StatisticsSubscriber, SubscriberManager

from helpers.debug_models import Net

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "debugging.md"
UNSUBSCRIBE = "manager.unsubscribe(model)"
PRINT = '    print(f"step {step}: loss {loss.item():.6f}")\n'
RECORDED_STEPS = range(8)  # the walkthrough records steps 0-7 of 10


def _walkthrough() -> str:
    blocks = re.findall(r"```python\n(# train\.py.*?)```", DOCS.read_text(encoding="utf-8"), flags=re.DOTALL)
    assert len(blocks) == 1, "docs/debugging.md should show exactly one train.py"
    source = blocks[0]
    assert source.count(PRINT) == 1 and source.count(UNSUBSCRIBE) == 1
    assert "end_step=8" in source and source.count("range(10)") == 1
    return source


def _variants(source: str) -> dict[str, str]:
    after_step_4 = "    if step == 4:\n        {}\n"
    return {
        "shown": source,
        "no_unsubscribe": "".join(line for line in source.splitlines(True) if UNSUBSCRIBE not in line).replace(
            "range(10)", "range(8)"
        ),
        "raises": source.replace(PRINT, PRINT + after_step_4.format('raise RuntimeError("planted failure")')),
        "killed": source.replace(
            PRINT, PRINT + after_step_4.format("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
        ),
    }


def _keys(step_file: Path) -> list[tuple]:
    records = [json.loads(line) for line in step_file.read_text(encoding="utf-8").splitlines()]
    return [(r["dir"], r["name"], r["output"], r["call"]) for r in records]


def test_walkthrough_records_are_all_on_disk_however_the_run_ends(tmp_path, capsys):
    scripts = {}
    for name, source in _variants(_walkthrough()).items():
        scripts[name] = tmp_path / f"{name}.py"
        scripts[name].write_text(source, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}  # rank_0, as a user's run
    runs = {name: (scripts[name], [str(tmp_path / name)]) for name in scripts}
    runs["buggy"] = (scripts["shown"], [str(tmp_path / "buggy"), "--bug"])
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(script), *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for name, (script, args) in runs.items()
    }
    done = {name: (proc.wait(timeout=300), proc.communicate()[1].decode()) for name, proc in procs.items()}
    for name in ("shown", "no_unsubscribe", "buggy"):
        assert done[name][0] == 0, done[name][1]
    assert done["raises"][0] == 1 and "RuntimeError: planted failure" in done["raises"][1]
    assert done["killed"][0] == -9, done["killed"][1]

    # the reference: each recorded step has the same records, forward and backward, down to the embeddings' grads
    shown = tmp_path / "shown" / "rank_0"
    assert sorted(p.name for p in shown.iterdir()) == [f"step_{s:06d}.jsonl" for s in RECORDED_STEPS]
    step0 = _keys(shown / "step_000000.jsonl")
    assert ("backward", "tok", "", 0) in step0 and [k[0] for k in step0].count("backward") > 20
    for step in RECORDED_STEPS:
        assert _keys(shown / f"step_{step:06d}.jsonl") == step0, step

    # never unsubscribed: every record of every step, the last step's backward included
    assert main(["compare", str(tmp_path / "shown"), str(tmp_path / "no_unsubscribe")]) == 0
    out = capsys.readouterr().out
    assert "no divergence" in out and "only in" not in out, out
    # an exception or SIGKILL after step 4: steps 0-4 complete, the rest never ran
    for name in ("raises", "killed"):
        assert main(["compare", str(tmp_path / "shown"), str(tmp_path / name)]) == 0, name
        out = capsys.readouterr().out
        assert "records compared: 260 over 5 step(s)" in out and "steps only in A (not compared): 5-7" in out, out
        assert "only in A:" not in out and "no divergence" in out, out

    # and the walkthrough's planted bug is found where the docs say
    assert main(["compare", str(tmp_path / "shown"), str(tmp_path / "buggy")]) == 1
    out = capsys.readouterr().out
    assert (
        "FIRST DIVERGENCE at step 3" in out
        and "first diverging activation (execution order): forward blocks.1.ln2\n" in out
    )


def _step_keys(run, step):
    return _keys(run / "rank_0" / f"step_{step:06d}.jsonl")


def test_each_step_is_on_disk_when_its_backward_ends(tmp_path):
    """Read back from the same process, while the subscriber is still attached: nothing waits in a buffer."""
    model, run = Net(), tmp_path / "run"
    SubscriberManager().subscribe(model, StatisticsSubscriber(run))
    torch.manual_seed(0)
    for step in range(3):
        out = model(torch.randn(3, 4))
        forward = _step_keys(run, step)
        assert [k[0] for k in forward] == ["forward"] * 9  # 8 called modules + 1 inspected, no backward yet
        out.backward()
        keys = _step_keys(run, step)
        assert keys[:9] == forward and [k[0] for k in keys[9:]] == ["backward"] * 9, step
        assert keys[-1] == ("backward", "blocks.0.fc1", "", 0)  # the last gradient of the step


def test_a_subscriber_never_unsubscribed_closes_its_file_when_collected(tmp_path):
    model, run = Net(), tmp_path / "run"
    SubscriberManager().subscribe(model, StatisticsSubscriber(run))
    model(torch.randn(3, 4)).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del model  # the manager, the hooks and the subscriber go with it (a cycle: the collector frees them)
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]
    assert len(_step_keys(run, 0)) == 18
