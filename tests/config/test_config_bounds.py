"""Values ``config check`` accepts do not fail later inside torch ([Note: bounded config values]), and any file a
user can hand in gives a ``ConfigError`` naming it (``load_config``) or exit 2 (``config check``)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shardtrain.cli import main
from shardtrain.config.sections import MAX_TIMEOUT_S, MIN_TIMEOUT_S, inspect_config, load_config
from shardtrain.errors import ConfigError


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 1e30, 1e10, 1e-9, 0.0009, 0, -1])
def test_collective_timeout_outside_what_a_process_group_takes_is_refused(value):
    (problem,) = inspect_config({"collective_timeout_s": value}).problems
    assert problem.startswith("collective_timeout_s: ") and ("finite" in problem or "equal to" in problem), problem


def test_steps_per_print_is_a_whole_number_or_inf():
    """accelerate writes ``steps_per_print: inf`` into every DeepSpeed config it builds (DeepSpeed then never prints):
    the one infinite value taken, and only there; the logging itself is checked in test_config_keys.py."""
    assert load_config({"steps_per_print": math.inf}).steps_per_print is None  # never, as absent (DeepSpeed's default)
    assert load_config({"steps_per_print": 5.0}).steps_per_print == 5
    assert load_config(json.loads('{"steps_per_print": Infinity}')).steps_per_print is None
    for bad in (-math.inf, math.nan, 1.5, 0, -1, True, "10", 2**63):
        (problem,) = inspect_config({"steps_per_print": bad}).problems
        assert problem.startswith("steps_per_print: "), (bad, problem)
    with pytest.raises(ConfigError, match="reduce_bucket_size"):  # a size stays finite
        load_config({"zero_optimization": {"reduce_bucket_size": math.inf}})


def test_the_timeout_bounds_work_in_a_real_process_group():
    """A world-1 gloo group made with each bound runs a collective (torch overflows near 9.2e9 s and rounds
    below 1 ms to 0: see MAX_TIMEOUT_S)."""
    script = textwrap.dedent(
        f"""
        import datetime, torch, torch.distributed as dist
        for seconds in ({MIN_TIMEOUT_S!r}, {MAX_TIMEOUT_S!r}):
            # an in-process store: a TCP store's client gets the timeout to connect, and 1 ms is missed under load
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=seconds))
            t = torch.ones(1); dist.all_reduce(t); assert t.item() == 1.0
            dist.destroy_process_group()
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"gradient_clipping": math.inf}, "gradient_clipping"),
        ({"gradient_predivide_factor": math.nan}, "gradient_predivide_factor"),
        ({"fp16": {"loss_scale": math.inf}}, "fp16.loss_scale"),
        ({"zero_optimization": {"reduce_bucket_size": 1e30}}, "zero_optimization.reduce_bucket_size"),
        ({"train_batch_size": 2**63}, "train_batch_size"),
        ({"zero_optimization": {"stage": 1, "mics_shard_size": 2**64}}, "zero_optimization.mics_shard_size"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": math.inf}}}, "optimizer.params.lr"),
        ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, math.nan]}}}, "optimizer.params.betas"),
        ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": math.nan}}}, "optimizer.params"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": math.inf}}}, "scheduler.params.warmup_max_lr"),
    ],
)
def test_infinite_nan_and_out_of_range_values_are_refused_by_key(config, key):
    problems = inspect_config(config).problems
    assert problems and problems[0].startswith(key), problems


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("name", "data", "named"),
    [
        ("bad.json", b'{"train_batch_size": "\xff"}', "is not UTF-8 text"),
        ("bad.yaml", b"train_batch_size: \xfe\n", "is not UTF-8 text"),
        ("deep.json", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        ("deep2.json", b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "nested too deeply"),
        ("deep.yaml", b"a:\n" + b"".join(b" " * (i + 1) + b"- \n" for i in range(3000)), "nested too deeply"),
        ("list.json", b"[1, 2]", "must hold a mapping at the top, got list"),
        ("null.yaml", b"", "must hold a mapping at the top, got NoneType"),
        ("inf.json", b'{"collective_timeout_s": Infinity}', "collective_timeout_s"),
        ("inf.yaml", b"collective_timeout_s: .inf\n", "collective_timeout_s"),
        ("alias.yaml", b"a: *x\n", "is not valid YAML"),
        ("torn.json", b'{"train_batch_size": 8', "is not valid JSON"),
        ("conf.txt", b"{}", "unknown extension"),
    ],
)
def test_a_file_that_is_not_a_config_is_named(tmp_path, capsys, name, data, named):
    path = _write(tmp_path / name, data)
    with pytest.raises(ConfigError, match=r"(?s)" + named.replace(".", r"\.").replace("(", r"\(")) as err:
        load_config(path)
    if "collective_timeout_s" not in named:
        assert str(path) in str(err.value)
    assert main(["config", "check", str(path)]) == 2
    assert named in capsys.readouterr().out


def test_a_byte_order_mark_is_not_content(tmp_path):
    assert load_config(_write(tmp_path / "bom.json", b'\xef\xbb\xbf{"train_batch_size": 8}')).train_batch_size == 8


def test_directories_fifos_and_missing_files_are_named_without_blocking(tmp_path, capsys):
    (tmp_path / "dir.json").mkdir()
    os.mkfifo(tmp_path / "fifo.json")  # no writer: a blocking open would hang here
    (tmp_path / "loop.json").symlink_to("loop.json")
    for name, named in (("dir.json", "is not a regular file"), ("fifo.json", "is not a regular file"),
                        ("loop.json", "cannot be read"), ("missing.json", "does not exist")):  # fmt: skip
        with pytest.raises(ConfigError, match=named):
            load_config(tmp_path / name)
        assert main(["config", "check", str(tmp_path / name)]) == 2
        assert named in capsys.readouterr().out


def test_config_check_exits_2_for_an_unusable_file_from_the_command_line(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"collective_timeout_s": 1e30}))
    done = subprocess.run(
        [sys.executable, "-m", "shardtrain", "config", "check", str(path)], capture_output=True, text=True
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr and "collective_timeout_s" in done.stdout


def test_a_yaml_config_that_expands_is_refused_quickly_and_aliases_still_work(tmp_path):
    """The "billion laughs": twelve levels of nine aliases would be 9**12 nodes for every later walk of the config."""
    import time

    lines = ['a0: &a0 ["x"]'] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 13)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"bomb.yaml.*is not valid YAML: more than 100 aliases"):
        load_config(bomb)
    assert time.monotonic() - started < 5
    fine = tmp_path / "fine.yaml"
    fine.write_text("base: &z {stage: 2}\nzero_optimization: *z\ntrain_micro_batch_size_per_gpu: 1\n")
    with pytest.raises(ConfigError, match="base"):  # the alias resolves; the anchor's own key is unknown
        load_config(fine)
    fine.write_text("zero_optimization: &z {stage: 2}\ntrain_micro_batch_size_per_gpu: 1\n")
    assert load_config(fine).zero_optimization.stage == 2
