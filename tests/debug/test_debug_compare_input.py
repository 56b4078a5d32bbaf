"""``shardtrain compare`` on damaged input: each kind is a named error (file, line, field) with exit 2, never a
traceback (exit 1 reads as "diverged" in CI) and never a verdict. Runs are written by hand: no training needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardtrain.cli import main


def record(seq: int = 0, name: str = "lin", **stats: object) -> dict:
    base = {"seq": seq, "dir": "forward", "name": name, "output": "", "call": 0, "shape": [2, 3], "dtype": "float32"}
    base.update(numel=6, min=-1.0, max=2.0, mean=0.5, std=0.9, norm=3.0, nan=0, inf=0, zero=0, pos=4, neg=2)
    base.update(stats)
    return base


def write_run(root: Path, steps: dict[int, list[str]]) -> Path:
    rank = root / "rank_0"
    rank.mkdir(parents=True)
    for step, lines in steps.items():
        (rank / f"step_{step:06d}.jsonl").write_text("".join(line + "\n" for line in lines))
    return root


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return write_run(tmp_path / "good", {0: [json.dumps(record(0)), json.dumps(record(1, "head"))]})


def compare(good: Path, other: Path, capsys) -> tuple[int, str]:
    code = main(["compare", str(good), str(other)])
    return code, capsys.readouterr().err


def test_the_hand_written_run_compares_clean(good, capsys):
    assert compare(good, good, capsys)[0] == 0


@pytest.mark.parametrize(
    ("line", "named"),
    [
        (b'{"seq": 0, "dir": "forward", "name": "lin", "output": "", "call": 0, "mean": "\xff"}', "not UTF-8"),
        (json.dumps(record(mean="0.5")).encode(), "field 'mean' must be a number or null, got '0.5'"),
        (json.dumps(record(norm=[3.0])).encode(), "field 'norm' must be a number or null, got [3.0]"),
        (json.dumps(record(nan=1.5)).encode(), "field 'nan' must be a whole number >= 0"),
        (json.dumps(record(numel=-6)).encode(), "field 'numel' must be a whole number >= 0"),
        (json.dumps(record(max=True)).encode(), "field 'max' must be a number or null, got true"),
        (json.dumps(record(min=2**70)).encode(), "field 'min' must be a number or null"),
        (json.dumps(record(std=float("nan"))).encode(), "field 'std' must be a number or null, got NaN"),
        (json.dumps(record(call="0")).encode(), "field 'call' must be a whole number >= 0"),
        (json.dumps(record(name=None)).encode(), "field 'name' must be a string"),
        (json.dumps(record(shape=[2, "3"])).encode(), "field 'shape' must be a list of whole numbers"),
        (json.dumps({k: v for k, v in record().items() if k != "seq"}).encode(), "no 'seq' field"),
        (b"[" * 100_000 + b"]" * 100_000, "not a statistics record"),
        (b'{"a": ' * 50_000 + b"1" + b"}" * 50_000, "not a statistics record"),
        (b"[1, 2]", "a JSON list, not an object"),
        (b'{"seq": 0, "dir": "forwa', "not a statistics record"),  # a torn line
    ],
    ids=lambda x: x[:30] if isinstance(x, str) else None,
)
def test_a_damaged_record_is_named_with_exit_2(good, tmp_path, capsys, line, named):
    bad = tmp_path / "bad" / "rank_0"
    bad.mkdir(parents=True)
    (bad / "step_000000.jsonl").write_bytes(json.dumps(record(0)).encode() + b"\n" + line + b"\n")
    code, err = compare(good, tmp_path / "bad", capsys)
    assert code == 2, err
    assert "step_000000.jsonl:2:" in err and named in err, err
    assert main(["compare", str(tmp_path / "bad"), str(good)]) == 2  # either side


def test_step_files_that_are_not_files_or_hold_nothing(good, tmp_path, capsys):
    rank = tmp_path / "run" / "rank_0"
    rank.mkdir(parents=True)
    (rank / "step_000000.jsonl").mkdir()
    code, err = compare(good, tmp_path / "run", capsys)
    assert code == 2 and "step_000000.jsonl' is a directory" in err, err

    (rank / "step_000000.jsonl").rmdir()
    os.mkfifo(rank / "step_000000.jsonl")  # opened without blocking and refused: no writer is needed
    code, err = compare(good, tmp_path / "run", capsys)
    assert code == 2 and "is not a regular file" in err, err

    (rank / "step_000000.jsonl").unlink()
    (rank / "step_000000.jsonl").write_text("")
    code, err = compare(good, tmp_path / "run", capsys)
    assert code == 2 and "step_000000.jsonl' holds no record" in err, err
    (rank / "step_000000.jsonl").write_text("\n \n")
    assert compare(good, tmp_path / "run", capsys)[0] == 2

    (rank / "step_000000.jsonl").unlink()
    (rank / "step_000000.jsonl").symlink_to("step_000000.jsonl")  # a symlink loop
    code, err = compare(good, tmp_path / "run", capsys)
    assert code == 2 and "cannot read step file" in err, err


def test_a_record_given_twice_names_both_places(good, tmp_path, capsys):
    line = json.dumps(record(0))
    write_run(tmp_path / "twice", {0: [line, json.dumps(record(1, "head")), line]})
    code, err = compare(good, tmp_path / "twice", capsys)
    assert code == 2 and "step_000000.jsonl:3: the record forward lin (step 0) is also at" in err, err
    assert "step_000000.jsonl:1" in err


def test_a_line_too_long_is_refused_without_reading_it_whole(good, tmp_path, capsys):
    long = json.dumps(record(0, name="x" * (1 << 21)))
    write_run(tmp_path / "long", {0: [long]})
    code, err = compare(good, tmp_path / "long", capsys)
    assert code == 2 and "line longer than" in err, err


def test_extreme_but_valid_values_get_a_verdict(good, tmp_path, capsys):
    """Infinite norms (float64 overflow), uint64 extremes and null statistics compare without a crash."""
    lines = [json.dumps(record(0, norm=float("inf"), max=2**64 - 1, min=0)), json.dumps(record(1, "head", mean=None))]
    write_run(tmp_path / "odd", {0: lines})
    assert compare(good, tmp_path / "odd", capsys)[0] == 1
    assert compare(tmp_path / "odd", tmp_path / "odd", capsys)[0] == 0


def test_bad_input_exits_2_from_the_command_line(tmp_path, good):
    bad = write_run(tmp_path / "bad", {0: ['{"seq": 0, "dir": "forward", "name": "lin", "output": "", "call": []}']})
    done = subprocess.run(
        [sys.executable, "-m", "shardtrain", "compare", str(good), str(bad)], capture_output=True, text=True
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "field 'call' must be a whole number >= 0, got []" in done.stderr
