"""Real DeepSpeed configs from public projects: `shardtrain config check` classifies each as documented."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardtrain.cli import main
from shardtrain.cli.config_check import check_file

CORPUS = Path(__file__).parents[1] / "data" / "ds_configs"


def _rows() -> list[list[str]]:
    lines = (CORPUS / "SOURCES.md").read_text().splitlines()
    cells = ([c.strip() for c in line.strip().strip("|").split("|")] for line in lines)
    return [row for row in cells if len(row) == 6 and row[0].endswith(".json`")]


def _expected() -> dict[str, set[str] | None]:
    """file -> None when it must be ok, else the key paths of its problems (from SOURCES.md)."""
    rows = {}
    for row in _rows():
        name, verdict = row[0].strip("`"), row[4]
        rows[name] = None if verdict == "ok" else set(re.findall(r"`([^`]+)`", verdict))
    return rows


def _deepspeed_expected() -> dict[str, int | None]:
    """file -> the world size DeepSpeed 0.19.8 accepts it at, None where it refuses it (SOURCES.md's last column)."""
    rows = {}
    for row in _rows():
        accepts = re.fullmatch(r"accepts \(world (\d+)\)", row[5])
        assert accepts or row[5].startswith("refuses: "), row
        rows[row[0].strip("`")] = int(accepts.group(1)) if accepts else None
    return rows


EXPECTED = _expected()
DEEPSPEED = _deepspeed_expected()


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


def _ranks_per_replica(config: dict) -> int:
    """Processes per data-parallel rank: sequence- and tensor-parallel sizes (1 where not given)."""
    tp = config.get("tensor_parallel", {})
    tp_size = tp.get("autotp_size", tp.get("size", 1)) if isinstance(tp, dict) else 1
    return config.get("sequence_parallel_size", 1) * tp_size


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_what_deepspeed_accepts_is_usable_here(name):
    """Real DeepSpeed 0.19.8's parser, at the world size the file implies (helpers/ds_config_reference.py): it accepts
    or refuses each file as SOURCES.md says, and every file it accepts is usable here at that size, unless SOURCES.md
    lists it as refused for a feature not built here."""
    from helpers.ds_config_reference import deepspeed_verdict

    config = json.loads((CORPUS / name).read_text())
    world, accepted, error = deepspeed_verdict(config)
    expected_world = DEEPSPEED[name]
    assert accepted == (expected_world is not None), f"DeepSpeed: {error or 'accepted'}"
    if not accepted:
        return
    assert world == expected_world
    ok, lines = check_file(str(CORPUS / name), world_size=world * _ranks_per_replica(config))
    if EXPECTED[name] is None:
        assert ok, "\n".join(lines)
    else:
        assert not ok  # a feature not built here: the key paths are checked above


def test_corpus_numbers():
    """The counts SOURCES.md states."""
    accepted = {n for n, w in DEEPSPEED.items() if w is not None}
    usable = {n for n, v in EXPECTED.items() if v is None}
    assert (len(EXPECTED), len(usable), len(accepted), len(accepted - usable)) == (83, 74, 75, 3)


def test_real_parameter_offload_configs_pass_the_cuda_check():
    """Every stage-3 config of the corpus with ``offload_param`` passes ``config check --device cuda`` (parameter
    offload is built on CUDA beside optimizer offload), but those without ``offload_optimizer``, refused by name."""
    passed, refused = set(), set()
    for path in sorted(CORPUS.glob("*.json")):
        zero = json.loads(path.read_text()).get("zero_optimization") or {}
        device = (zero.get("offload_param") or {}).get("device", "none")
        if zero.get("stage") != 3 or device in ("none", None) or EXPECTED[path.name] is not None:
            continue
        ok, lines = check_file(str(path), 2, "cuda")
        if ok:
            passed.add(path.name)
        else:
            assert (zero.get("offload_optimizer") or {}).get("device", "none") == "none", lines
            assert any("on CUDA is not built without offload_optimizer" in line for line in lines), lines
            refused.add(path.name)
    assert "transformers__ds_config_zero3.json" in passed and "llava__zero3_offload.json" in passed
    assert (len(passed), len(refused)) == (8, 2)
