"""Real DeepSpeed configs from public projects: `shardtrain config check` classifies each as documented."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardtrain.cli import main

CORPUS = Path(__file__).parents[1] / "data" / "ds_configs"


def _expected() -> dict[str, set[str] | None]:
    """file -> None when it must be ok, else the key paths of its problems (from SOURCES.md)."""
    rows = {}
    for line in (CORPUS / "SOURCES.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].endswith(".json`"):
            name, verdict = cells[0].strip("`"), cells[4]
            rows[name] = None if verdict == "ok" else set(re.findall(r"`([^`]+)`", verdict))
    return rows


EXPECTED = _expected()


def test_corpus_is_indexed():
    files = {p.name for p in CORPUS.glob("*.json")}
    assert files == set(EXPECTED), "every config file needs a row in SOURCES.md, and every row a file"
    assert len(files) >= 30


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_check_classifies_real_configs(name, capsys):
    status = main(["config", "check", str(CORPUS / name)])
    out = capsys.readouterr().out
    problems = {line.split()[1].rstrip(":") for line in out.splitlines() if line.startswith("  error  ")}
    expected = EXPECTED[name]
    if expected is None:
        assert status == 0, out
        assert out.splitlines()[0].endswith(": ok")
        assert not problems
    else:
        assert status == 2, out
        assert problems == expected, out
    assert "Traceback" not in out and "pydantic" not in out.lower() and "validation error" not in out


def test_cli_over_whole_corpus_reports_without_traceback():
    files = sorted(str(p) for p in CORPUS.glob("*.json"))
    src = str(Path(__file__).parents[2] / "src")
    run = subprocess.run(
        [sys.executable, "-m", "shardtrain", "config", "check", "--world-size", "2", *files],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert run.returncode == 2  # some are refused
    assert "Traceback" not in run.stdout + run.stderr
    oks = {Path(line.removesuffix(": ok")).name for line in run.stdout.splitlines() if line.endswith(": ok")}
    # usable on its own, but its tensor_parallel.size 4 does not fit 2 ranks
    assert "tensor_parallel.size 4 does not divide the 2 processes" in run.stdout
    assert oks == {name for name, v in EXPECTED.items() if v is None} - {"dsexamples__ds_config.json"}
