"""Fuzz (issue 35, What 6): generated configs through ``config check`` (files, ``--world-size``) and the checks
``initialize`` makes before touching a model. Property: exit 0 and every such check passes, or a named error with
exit 2; never a traceback, and never a value accepted that torch would fail on later ([Note: bounded config
values]). A bounded example count by default (a few seconds); ``-m soak`` runs many more."""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardtrain.cli import main
from shardtrain.config.plan import check_layout
from shardtrain.config.sections import (
    INT64_MAX,
    inspect_config,
    load_config,
    optimizer_class_and_kwargs,
    resolve_batch_sizes,
    scheduler_params,
)
from shardtrain.errors import ConfigError

from helpers.config_strategies import configs


def _settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )


def _numbers(value: object) -> list[object]:
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in _numbers(v)]
    return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def _accepted_config_holds(raw: dict, world: int) -> None:
    """A config ``config check`` accepts passes what initialize checks from the config alone."""
    cfg = load_config(raw)
    assert all(math.isfinite(n) and abs(n) <= INT64_MAX for n in _numbers(cfg.model_dump())), cfg
    timeout = datetime.timedelta(seconds=cfg.collective_timeout_s)  # what the process group is made with
    assert 1 <= timeout // datetime.timedelta(milliseconds=1) < 2**63 // 10**6
    if cfg.optimizer is not None:
        optimizer_class_and_kwargs(cfg.optimizer, allow_auto=True)
    if cfg.scheduler is not None:
        scheduler_params(cfg.scheduler, allow_auto=True)
    dp = check_layout(cfg, world)
    assert world % dp == 0
    report = inspect_config(raw)
    batch = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    if not any(k in report.autos for k in batch):
        tb, mb, gas = resolve_batch_sizes(cfg, dp)
        assert tb == mb * gas * dp


def _check_one(raw: dict, world: int, suffix: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"ds{suffix}"
        path.write_text(json.dumps(raw))  # JSON writes Infinity/NaN as JSON5 does, as json.loads reads them
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                code = main(["config", "check", "-q", "--world-size", str(world), str(path)])
        except SystemExit as err:  # argparse only
            pytest.fail(f"config check exited {err.code}")
        assert code in (0, 2)
        if code == 0:
            _accepted_config_holds(raw, world)
        else:
            with pytest.raises(ConfigError):  # what check refuses at this world, load or initialize refuses too
                _accepted_config_holds(raw, world)


@st.composite
def _raw_bytes(draw) -> bytes:
    text = json.dumps(draw(configs())).encode()
    cut = draw(st.integers(0, len(text)))
    noise = draw(st.binary(max_size=8))
    return text[:cut] + noise + text[cut + len(noise) :]


def _check_bytes(data: bytes, suffix: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"ds{suffix}"
        path.write_bytes(data)
        with contextlib.suppress(ConfigError):
            load_config(path)
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["config", "check", "-q", str(path)]) in (0, 2)


WORLDS = st.sampled_from([1, 2, 3, 4, 6, 8])


@_settings(300)
@given(configs(), WORLDS)
def test_config_check_agrees_with_what_initialize_checks(raw, world):
    _check_one(raw, world, ".json")


@_settings(150)
@given(_raw_bytes(), st.sampled_from([".json", ".yaml"]))
def test_damaged_config_files_are_named(data, suffix):
    _check_bytes(data, suffix)


@pytest.mark.soak
@_settings(3000)
@given(configs(), WORLDS)
def test_config_check_agrees_with_what_initialize_checks_soak(raw, world):
    _check_one(raw, world, ".json")


@pytest.mark.soak
@_settings(3000)
@given(_raw_bytes(), st.sampled_from([".json", ".yaml"]))
def test_damaged_config_files_are_named_soak(data, suffix):
    _check_bytes(data, suffix)
