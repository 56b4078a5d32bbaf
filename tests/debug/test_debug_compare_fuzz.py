"""Fuzz (issue 35, What 6): generated and mutated statistics records through ``shardtrain compare``. Property: a
damaged line is a named error with exit 2 (file and line in the message), a valid one gets a verdict (0 or 1); never
a traceback. A bounded example count by default (a few seconds); ``-m soak`` runs many more."""

from __future__ import annotations

import contextlib
import io
import json
import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardtrain.cli import main


def _settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


GOOD = {"seq": 0, "dir": "forward", "name": "lin", "output": "", "call": 0, "shape": [2, 3], "dtype": "float32",
        "numel": 6, "min": -1.0, "max": 2.0, "mean": 0.5, "std": 0.9, "norm": 3.0, "nan": 0, "inf": 0, "zero": 0,
        "pos": 4, "neg": 2}  # fmt: skip
STRINGS, COUNTS, VALUES = ("dir", "name", "output"), ("seq", "call", "numel", "nan", "inf", "zero", "pos", "neg"), (
    "min", "max", "mean", "std", "norm")  # fmt: skip

json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=5),
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)),
    max_leaves=5,
)


def _valid(field: str, value: object) -> bool:
    """The rule of [Note: what a record may hold] for one field."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if field in STRINGS or field == "dtype":
        return isinstance(value, str)
    if field in COUNTS:
        return is_int and 0 <= value < 2**64
    if field in VALUES:
        if value is None or (is_int and abs(value) <= 2**64):
            return True
        return isinstance(value, float) and not math.isnan(value)
    if field == "shape":
        return isinstance(value, list) and all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**64
                                               for n in value)  # fmt: skip
    return True  # a field compare does not read


def _compare(a_lines: list[bytes], b_lines: list[bytes]) -> tuple[int, str]:
    with tempfile.TemporaryDirectory() as tmp:
        for run, lines in (("a", a_lines), ("b", b_lines)):
            rank = Path(tmp) / run / "rank_0"
            rank.mkdir(parents=True)
            (rank / "step_000000.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = main(["compare", f"{tmp}/a", f"{tmp}/b"])
        return code, err.getvalue()


def _line(record: dict) -> bytes:
    return json.dumps(record).encode()


def _check_field(field: str, value: object, drop: bool) -> None:
    record = dict(GOOD)
    if drop:
        record.pop(field, None)
    else:
        record[field] = value
    code, err = _compare([_line(GOOD)], [_line(record)])
    if drop:
        valid = field not in (*STRINGS, "seq", "call")
    else:
        valid = _valid(field, value)
    if valid:
        assert code in (0, 1), err
    else:
        assert code == 2 and "step_000000.jsonl:1: " in err, (field, value, err)


def _check_bytes(data: bytes) -> None:
    code, err = _compare([_line(GOOD)], [data])
    assert code in (0, 1, 2), err
    try:
        json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        if data.strip():
            assert code == 2 and "step_000000.jsonl" in err, (data, err)
        else:
            assert code == 2 and "holds no record" in err, (data, err)


@st.composite
def _mutated(draw) -> bytes:
    text = _line(GOOD)
    cut = draw(st.integers(0, len(text)))
    noise = draw(st.binary(max_size=6).filter(lambda b: b"\n" not in b))
    return text[:cut] + noise + text[cut + draw(st.integers(0, 6)) :]


FIELDS = st.sampled_from([*GOOD, "extra"])


@_settings(250)
@given(FIELDS, json_values, st.booleans())
def test_a_field_of_any_value_gets_a_verdict_or_a_named_error(field, value, drop):
    _check_field(field, value, drop)


@_settings(150)
@given(_mutated())
def test_mutated_lines_get_a_verdict_or_a_named_error(data):
    _check_bytes(data)


@pytest.mark.soak
@_settings(5000)
@given(FIELDS, json_values, st.booleans())
def test_a_field_of_any_value_gets_a_verdict_or_a_named_error_soak(field, value, drop):
    _check_field(field, value, drop)


@pytest.mark.soak
@_settings(5000)
@given(_mutated())
def test_mutated_lines_get_a_verdict_or_a_named_error_soak(data):
    _check_bytes(data)
