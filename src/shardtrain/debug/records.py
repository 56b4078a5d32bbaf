"""Read the statistics files of a run and align two runs record by record.

A record is identified by ``(rank, step, dir, name, output, call)`` (see :mod:`shardtrain.debug.statistics`).

Relative difference of one statistic, with ``a`` from run A and ``b`` from run B::

    rel = |a - b| / max(|a|, |b|, s)

where ``s`` is a scale that keeps numbers near zero from looking infinitely different: the tensor's RMS over finite
values (``norm / sqrt(finite count)``, the larger of the two runs) for ``min``, ``max``, ``mean``, ``std`` and
``norm``, and ``numel`` for the ``nan`` and ``inf`` counts (so a count difference reads as a fraction of the
elements). The sign counts ``zero``, ``pos`` and ``neg`` are not compared (see ``COMPARED``). A statistic is
*above tolerance* when ``|a - b| > atol + rtol * max(|a|, |b|, s)``, i.e. ``rel > rtol`` when ``atol`` is 0.
A value missing in one run (``null``: no finite element) against a number counts as infinitely different.

A record present in only one run at a step both runs recorded is a divergence of its own (``stat`` ``"missing"``);
steps recorded by only one run (one run was longer) are reported but do not diverge.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from stat import S_ISDIR, S_ISREG
from typing import Any

from shardtrain.debug.tensor_summary import STAT_FIELDS

# zero/pos/neg are recorded for reading but not compared: any value within rounding noise of 0 flips them, so two
# runs that agree to 1e-7 can differ there by a fraction of a percent (causal attention gradients are full of such)
COMPARED = ("numel", *(s for s in STAT_FIELDS if s not in ("zero", "pos", "neg")))
_VALUE_STATS = {"min", "max", "mean", "std", "norm"}
_RANK_DIR = re.compile(r"rank_(\d+)$")
_STEP_FILE = re.compile(r"step_(\d+)\.jsonl$")

Key = tuple[int, int, str, str, str, int]  # rank, step, dir, name, output, call


class CompareError(ValueError):
    """A run directory cannot be compared (missing, empty, unreadable, damaged); the message says which and why."""


@dataclass(frozen=True)
class Record:
    key: Key
    seq: int
    data: dict[str, Any]

    @property
    def rank(self) -> int:
        return self.key[0]

    @property
    def step(self) -> int:
        return self.key[1]

    def label(self) -> str:
        return describe_key(self.key)


def describe_key(key: Key) -> str:
    rank, _, direction, name, output, call = key
    text = f"{direction} {name or '(root)'}{output}"
    if call:
        text += f" (call {call})"
    return text + (f" [rank {rank}]" if rank else "")


def load_run(path: str | Path) -> dict[Key, Record]:
    """All records under ``path``: a StatisticsSubscriber output directory (``rank_<r>`` inside) or one rank_ dir.

    Every damaged input is a :class:`CompareError` naming the file (and the line and field where there is one): a
    step file that is not a regular file (a directory, a FIFO: refused before it is read, so nothing blocks), an
    empty one, bytes that are not UTF-8, a line that is not a JSON object, a field of the wrong type or range, a
    record given twice. See [Note: what a record may hold]."""
    root = Path(path)
    try:
        return _load_run(root)
    except OSError as err:  # an unreadable directory, a symlink loop, a file that vanished
        raise CompareError(f"cannot read {str(root)!r}: {err}") from err


def _load_run(root: Path) -> dict[Key, Record]:
    if not root.exists():
        raise CompareError(f"run directory {str(root)!r} does not exist")
    if not root.is_dir():
        raise CompareError(f"{str(root)!r} is not a directory; pass the output_dir of a StatisticsSubscriber")
    rank_dirs = {int(m.group(1)): p for p in root.iterdir() if p.is_dir() and (m := _RANK_DIR.match(p.name))}
    if not rank_dirs and any(_STEP_FILE.match(p.name) for p in root.iterdir()):
        m = _RANK_DIR.match(root.name)
        rank_dirs = {int(m.group(1)) if m else 0: root}
    records: dict[Key, Record] = {}
    where: dict[Key, str] = {}  # key -> "file:line" of its first record, to name both places of a duplicate
    for rank, rank_dir in sorted(rank_dirs.items()):
        for file in sorted(rank_dir.iterdir()):
            m = _STEP_FILE.match(file.name)
            if m:
                _read_step_file(file, rank, int(m.group(1)), records, where)
    if not records:
        raise CompareError(
            f"no statistics records under {str(root)!r}: expected rank_<r>/step_<n>.jsonl files written by "
            "StatisticsSubscriber (was the step window [start_step, end_step) ever reached?)"
        )
    return records


# [Note: what a record may hold]
# A record line is a JSON object written by StatisticsSubscriber: "dir", "name", "output" strings; "seq", "call"
# and "numel" whole numbers >= 0; the statistics numbers (a whole number or a float; null for the five value
# statistics of a tensor without finite elements, see shardtrain.debug.tensor_summary), the counts whole numbers >= 0;
# "shape" a list of whole numbers >= 0 and "dtype" a string when present. Whole numbers are bounded by 2**64
# (uint64's extremes are the largest a tensor holds) so that the arithmetic of the comparison stays in floats, and
# value statistics are never NaN (NaN elements are counted, not averaged). Anything else is damage (a torn copy,
# an edited file, another tool's output) and is refused by file, line and field: exit 2, never a verdict.
_MAX_LINE = 1 << 20  # bytes; a record is a few hundred
_MAX_INT = 1 << 64
_STRINGS = ("dir", "name", "output")
_COUNTS = ("seq", "call", "numel", "nan", "inf", "zero", "pos", "neg")


def _read_step_file(file: Path, rank: int, step: int, into: dict[Key, Record], where: dict[Key, str]) -> None:
    try:
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO opens at once, refused below
    except OSError as err:  # a symlink loop, no permission
        raise CompareError(f"cannot read step file {str(file)!r}: {err.strerror}") from err
    mode = os.fstat(fd).st_mode
    if not S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if S_ISDIR(mode) else "not a regular file"
        raise CompareError(f"step file {str(file)!r} is {kind}; a step file is a StatisticsSubscriber's .jsonl")
    with os.fdopen(fd, "rb") as f:
        count = 0
        for lineno, raw in enumerate(iter(lambda: f.readline(_MAX_LINE + 1), b""), 1):
            if len(raw) > _MAX_LINE:
                raise CompareError(f"{file}:{lineno}: line longer than {_MAX_LINE} bytes; not a statistics record")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise CompareError(f"{file}:{lineno}: not UTF-8 text ({err.reason} at byte {err.start})") from None
            if not line.strip():
                continue
            record = _parse_record(line, rank, step, f"{file}:{lineno}")
            if record.key in into:
                raise CompareError(
                    f"{file}:{lineno}: the record {describe_key(record.key)} (step {step}) is also at "
                    f"{where[record.key]}; a run records each once (two copies of one run in one directory?)"
                )
            into[record.key] = record
            where[record.key] = f"{file}:{lineno}"
            count += 1
    if not count:
        raise CompareError(
            f"step file {str(file)!r} holds no record: a step file is written with its first record, so an empty "
            "one is damaged (truncated or made by hand)"
        )


def _parse_record(line: str, rank: int, step: int, at: str) -> Record:
    try:
        data = json.loads(line)
    except RecursionError:
        raise CompareError(f"{at}: not a statistics record (JSON nested too deeply)") from None
    except ValueError as err:
        raise CompareError(f"{at}: not a statistics record ({err})") from None
    if not isinstance(data, dict):
        raise CompareError(f"{at}: not a statistics record (a JSON {type(data).__name__}, not an object)")
    for name in (*_STRINGS, "seq", "call"):
        if name not in data:
            raise CompareError(f"{at}: not a statistics record (no {name!r} field)")
    for name in _STRINGS:
        if not isinstance(data[name], str):
            raise CompareError(f"{at}: field {name!r} must be a string, got {_shown(data[name])}")
    for name in _COUNTS:
        if name in data and not _is_count(data[name]):
            raise CompareError(f"{at}: field {name!r} must be a whole number >= 0, got {_shown(data[name])}")
    for name in _VALUE_STATS:
        value = data.get(name)
        if value is not None and not _is_value(value):
            raise CompareError(f"{at}: field {name!r} must be a number or null, got {_shown(value)}")
    shape = data.get("shape")
    if "shape" in data and not (isinstance(shape, list) and all(_is_count(n) for n in shape)):
        raise CompareError(f"{at}: field 'shape' must be a list of whole numbers >= 0, got {_shown(shape)}")
    if "dtype" in data and not isinstance(data["dtype"], str):
        raise CompareError(f"{at}: field 'dtype' must be a string, got {_shown(data['dtype'])}")
    key = (rank, step, data["dir"], data["name"], data["output"], data["call"])
    return Record(key, data["seq"], data)


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < _MAX_INT


def _is_value(x: Any) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, int):
        return -_MAX_INT <= x <= _MAX_INT
    return isinstance(x, float) and not math.isnan(x)


def _shown(x: Any) -> str:
    text = json.dumps(x) if not isinstance(x, str) else repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class StatDiff:
    stat: str
    a: Any
    b: Any
    rel: float
    above: bool


@dataclass
class RecordDiff:
    key: Key
    seq: int  # execution order within (rank, step), from the run that has the record (A when both do)
    stats: list[StatDiff]
    a: Record | None
    b: Record | None

    @property
    def step(self) -> int:
        return self.key[1]

    @property
    def worst(self) -> StatDiff:
        return max(self.stats, key=lambda d: d.rel)

    @property
    def above(self) -> bool:
        return any(d.above for d in self.stats)

    def order(self) -> tuple[int, int]:
        return (self.seq, self.key[0])


@dataclass
class Comparison:
    rtol: float
    atol: float
    diffs: list[RecordDiff]  # every record of the steps both runs have, in (step, execution order)
    steps_only_in_a: list[int]
    steps_only_in_b: list[int]
    dtype_mismatches: dict[tuple[str, str], int] = field(default_factory=dict)
    shape_mismatches: int = 0

    @property
    def missing(self) -> list[RecordDiff]:
        return [d for d in self.diffs if d.a is None or d.b is None]

    @property
    def first_step(self) -> int | None:
        steps = [d.step for d in self.diffs if d.above]
        return min(steps) if steps else None

    def at_step(self, step: int) -> list[RecordDiff]:
        return [d for d in self.diffs if d.step == step]

    def first_divergence(self) -> RecordDiff | None:
        """The earliest record above tolerance in execution order at the first diverging step."""
        step = self.first_step
        if step is None:
            return None
        return min((d for d in self.at_step(step) if d.above), key=RecordDiff.order)

    def per_step(self) -> dict[int, RecordDiff]:
        """For each step, the record with the largest relative difference."""
        worst: dict[int, RecordDiff] = {}
        for d in self.diffs:
            if d.step not in worst or d.worst.rel > worst[d.step].worst.rel:
                worst[d.step] = d
        return dict(sorted(worst.items()))


def compare_runs(a: dict[Key, Record], b: dict[Key, Record], rtol: float, atol: float) -> Comparison:
    steps_a, steps_b = {k[1] for k in a}, {k[1] for k in b}
    common = steps_a & steps_b
    diffs: list[RecordDiff] = []
    dtypes: dict[tuple[str, str], int] = defaultdict(int)
    shapes = 0
    for key in sorted({k for k in (a.keys() | b.keys()) if k[1] in common}, key=lambda k: k[1]):
        ra, rb = a.get(key), b.get(key)
        if ra is None or rb is None:
            present = ra or rb
            diffs.append(
                RecordDiff(
                    key, present.seq, [StatDiff("missing", ra is not None, rb is not None, math.inf, True)], ra, rb
                )
            )
            continue
        if ra.data.get("dtype") != rb.data.get("dtype"):
            dtypes[(str(ra.data.get("dtype")), str(rb.data.get("dtype")))] += 1
        shapes += ra.data.get("shape") != rb.data.get("shape")
        diffs.append(RecordDiff(key, ra.seq, _stat_diffs(ra.data, rb.data, rtol, atol), ra, rb))
    diffs.sort(key=lambda d: (d.step, *d.order()))
    return Comparison(rtol, atol, diffs, sorted(steps_a - steps_b), sorted(steps_b - steps_a), dict(dtypes), shapes)


def _stat_diffs(a: dict[str, Any], b: dict[str, Any], rtol: float, atol: float) -> list[StatDiff]:
    rms = max(_rms(a), _rms(b))
    numel = max(a.get("numel") or 0, b.get("numel") or 0)
    out = []
    for stat in COMPARED:
        if stat not in a and stat not in b:
            continue  # e.g. complex tensors carry no statistics
        floor = rms if stat in _VALUE_STATS else (numel if stat != "numel" else 0.0)
        out.append(_diff(stat, a.get(stat), b.get(stat), floor, rtol, atol))
    return out


def _rms(data: dict[str, Any]) -> float:
    finite = (data.get("numel") or 0) - (data.get("nan") or 0) - (data.get("inf") or 0)
    norm = data.get("norm")
    return norm / math.sqrt(finite) if norm is not None and finite > 0 and math.isfinite(norm) else 0.0


def _diff(stat: str, a: Any, b: Any, floor: float, rtol: float, atol: float) -> StatDiff:
    if a == b:
        return StatDiff(stat, a, b, 0.0, False)
    if a is None or b is None:
        return StatDiff(stat, a, b, math.inf, True)
    delta = abs(a - b)
    scale = max(abs(a), abs(b), floor)
    if not math.isfinite(delta) or not math.isfinite(scale):
        return StatDiff(stat, a, b, math.inf, True)
    return StatDiff(stat, a, b, delta / scale, delta > atol + rtol * scale)
