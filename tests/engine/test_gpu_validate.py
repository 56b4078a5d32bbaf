"""``bench/gpu_validate.py --tiny``: the one-GPU validation runs on the CPU (every variant, the loss check, the
counts), so that the command a GPU session runs first is known to work before device time is spent on it."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardtrain.distributed import communicator
from shardtrain.distributed.communicator import FORCE_ENV, Communicator
from shardtrain.testing import run_distributed

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "bench" / "gpu_validate.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_validate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


# suite time: Inductor compiling torchao's casts takes a minute on the CPU, the plain model's C++ kernels 8-13 s; the
# soak test below runs both (Inductor under graph-mode ZeRO-3 by default: tests/graph/test_graph_zero3.py's
# test_inductor_schedules_a_backward_compiled_lazily)
SOAK_VARIANTS = ("stage3:inductor", "stage3:inductor:fp8")


def test_the_tiny_run_trains_every_variant_to_plain_pytorchs_losses(tmp_path):
    out = tmp_path / "results.json"
    variants = [v for v in _module().VARIANTS if v not in SOAK_VARIANTS]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--in-process", "--json", str(out), "--variants", ",".join(variants)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(out.read_text())
    by_name = {r["variant"]: r for r in results["results"]}
    assert list(by_name) == variants
    assert results["problems"] == [] and "every variant within tolerance" in done.stdout
    assert results["flops"] > 0
    for name, r in by_name.items():
        assert len(r["losses"]) == 2 + 1 + 3 and all(torch.isfinite(torch.tensor(r["losses"])))
        assert r["step_s"] > 0 and r["cpu_per_wall"] > 0
        assert r["tokens_per_s"] == pytest.approx(2 * 32 / r["step_s"])  # micro-batch 2 x sequence 32 per step
        assert (r["syncs_per_step"] is None) == (":inductor" in name)  # no dispatch mode around a graph
        assert (r["estimate"] is None) == (name == "plain")
    for name, r in by_name.items():  # fused AdamW, clipping without reading the norm; the engine's step the same
        assert sum(r["sync_sites"].values()) == (r["syncs_per_step"] or 0)  # each named by the line that asked
        assert r["syncs_per_step"] in (0, None), (name, r["sync_sites"])
    assert "synchronizes at" not in done.stdout


@pytest.mark.soak
def test_the_tiny_run_compiles_the_fp8_model_with_inductor_within_the_loss_tolerance(tmp_path):
    out = tmp_path / "results.json"
    command = [sys.executable, str(SCRIPT), "--tiny", "--in-process", "--json", str(out)]
    variants = ["plain", "stage0", *SOAK_VARIANTS]
    done = subprocess.run([*command, "--variants", ",".join(variants)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(out.read_text())
    assert results["problems"] == [] and [r["variant"] for r in results["results"]] == variants
    for r in results["results"]:  # no dispatch mode around a graph
        assert (r["syncs_per_step"] is None) == (":inductor" in r["variant"]), r


@pytest.mark.soak  # suite time: every variant's numbers are checked in process by the test below
def test_each_variant_runs_in_a_process_of_its_own(tmp_path):
    out = tmp_path / "results.json"
    argv = ["--tiny", "--variants", "plain,stage3:nccl", "--steps", "1", "--warmup", "1", "--json", str(out)]
    done = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(out.read_text())
    assert [r["variant"] for r in results["results"]] == ["plain", "stage3:nccl"]
    assert results["plain_drift"] > 0 and results["device"] == "CPU" and results["problems"] == []
    assert "plain again at the end" in done.stdout


def test_without_plain_the_variants_run_and_report_tokens_per_second(tmp_path, capsys, monkeypatch):
    """``--no-plain`` (the 8B run, whose plain PyTorch reference cannot fit the card): no ``plain`` run, no ratios
    to it, the variant's step time and tokens/s."""
    out = tmp_path / "results.json"
    argv = ["--tiny", "--in-process", "--no-plain", "--variants", "stage3", "--steps", "1", "--warmup", "1"]
    monkeypatch.setenv("SHARDTRAIN_DEVICE", "cpu")  # main sets it for --tiny; restored after the test
    assert _module().main([*argv, "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())["results"]
    assert result["variant"] == "stage3" and result["tokens_per_s"] == pytest.approx(64 / result["step_s"])
    (row,) = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("stage3 ")]
    assert row[2] == "-" and float(row[3]) == pytest.approx(result["tokens_per_s"], rel=1e-2, abs=1)


def test_a_loss_that_leaves_the_tolerance_is_named_with_its_step():
    module = _module()
    args = module.argparse.Namespace(loss_rtol=1e-2, engine_rtol=1e-3)

    def result(name, losses):
        return module.Result(name, 1.0, 0.0, 0, 1.0, None, None, None, None, losses)

    results = {
        "plain": result("plain", [5.0, 4.0, 3.0]),
        "stage0": result("stage0", [5.0, 4.01, 3.0]),
        "stage3": result("stage3", [5.0, 4.01, 3.05]),
    }
    assert module.check_losses(results, args) == [
        "stage3: loss 3.05000 at step 2, plain 3.00000 (rtol 0.01)",
        "stage3: loss 3.05000 at step 2, stage0 3.00000 (rtol 0.001)",
    ]
    results["stage0"].losses[2] = float("nan")
    assert module.check_losses(results, args)[0].startswith("stage0: loss nan at step 2")


def _collectives_of_one(force: bool) -> tuple[int, list[float]]:
    """Calls that reach the backend from a group of one, and what an all-reduce and a reduce-scatter leave."""
    import os

    if force:
        os.environ[FORCE_ENV] = "1"
    calls = [0]
    for name in ("_all_gather_flat", "_reduce_scatter_flat"):
        original = getattr(communicator, name)

        def counted(*a, _original=original, **k):
            calls[0] += 1
            return _original(*a, **k)

        setattr(communicator, name, counted)
    comm = Communicator(dist.group.WORLD, 60.0)
    t = torch.arange(4.0)
    comm.all_reduce(t, what="test")
    out = torch.empty(4)
    comm.reduce_scatter(out, torch.arange(4.0) * 2, what="test", async_op=True).wait()
    gathered = torch.empty(4)
    comm.all_gather(gathered, torch.arange(4.0) + 1, what="test", async_op=True).wait()
    return calls[0], t.tolist() + out.tolist() + gathered.tolist()


@pytest.mark.parametrize("force", [False, True])
def test_a_group_of_one_issues_its_collectives_when_forced_with_the_same_results(force):
    ((calls, values),) = run_distributed(_collectives_of_one, 1, force)
    assert calls == (2 if force else 0)
    assert values == [0.0, 1.0, 2.0, 3.0] + [0.0, 2.0, 4.0, 6.0] + [1.0, 2.0, 3.0, 4.0]


def _device_command() -> str:
    """The command docs/benchmarks-gpu.md gives a session with a GPU: the line in the block after "device call"."""
    text = (ROOT / "docs" / "benchmarks-gpu.md").read_text()
    block = text.split("make one device call", 1)[1].split("```", 2)[1]
    (line,) = [line for line in block.splitlines() if line.strip()]
    return line


def _pytest_runs(command: str) -> list[tuple[list[str], int]]:
    """Each pytest run of ``command``: its arguments and the number of lines of its output the command keeps."""
    runs = []
    for part in command.split(";"):
        if "-m pytest" not in part:
            continue
        args = shlex.split(part.split("-m pytest", 1)[1].split("2>&1", 1)[0])
        runs.append((args, int(part.rsplit("tail -", 1)[1].split()[0])))
    return runs


def test_the_device_command_fits_the_run_tool_and_names_files_that_exist():
    command = _device_command()
    assert len(command) < 2000  # the device tool's limit on a command
    named = [w for w in shlex.split(command.replace(";", " ")) if w.startswith(("tests/", "bench/"))]
    assert named and all((ROOT / w).is_file() for w in named), named
    assert len(_pytest_runs(command)) == 2


def test_the_device_commands_test_runs_name_a_failure_in_the_lines_they_keep(pytester):
    """Each pytest run of the device command, with the suite's ``addopts``, on a small suite with one failure among
    slow passes: the lines the command keeps of its output name the failing test. An ``-r`` on the command line
    replaces ``addopts``' ``-ra``, and ``addopts``' 25 durations fill a tail of 25 lines."""
    (addopts,) = re.findall(r'^addopts = "(.*)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    pytester.makeini("[pytest]\nmarkers =\n    soak: long runs\n")  # addopts deselect it
    pytester.makepyfile(
        test_suite=textwrap.dedent(
            """
            import time
            import pytest

            def test_the_one_that_fails():
                assert False

            @pytest.mark.parametrize("i", range(30))
            def test_slow(i):
                time.sleep(0.01)
            """
        )
    )
    for args, kept in _pytest_runs(_device_command()):
        reporting, skip = [], False
        for arg in args:  # the options that shape the report; not its files, plugins nor marker expression
            if skip or arg in ("-p", "-m"):
                skip = not skip and arg in ("-p", "-m")
                continue
            if arg.startswith("-"):
                reporting.append(arg)
        result = pytester.runpytest_inprocess(*shlex.split(addopts), "-p", "no:cacheprovider", *reporting)
        assert result.ret == pytest.ExitCode.TESTS_FAILED
        tail = result.outlines[-kept:]
        assert any("test_the_one_that_fails" in line for line in tail), (reporting, tail)


def test_the_llama3_8b_shape_builds_on_the_meta_device_and_the_planner_estimates_its_fp8_variant():
    """The shape fp8's goal is measured on (docs/fp8.md) cannot run here: its model is built on the meta device with
    Llama-3-8B's dimensions, and ``estimate`` plans the device variant the command runs."""
    import argparse

    from shardtrain.estimate import estimate_memory
    from shardtrain.models.gpt import GPT, num_parameters

    module = _module()
    args = argparse.Namespace(tiny=False, shape="llama3-8b", layers=None, d_model=None, seq=None, micro_batch=None)
    cfg, micro_batch = module.shape(args)
    assert (cfg.d_model, cfg.n_head, cfg.vocab_size, cfg.seq_len, cfg.n_layer, micro_batch) == (
        4096, 32, 128256, 8192, 4, 1
    )  # fmt: skip
    model = module.build(cfg, torch.device("meta"))
    per_layer = 12 * 4096**2 + 13 * 4096  # qkv, proj, the MLP's two; their biases and two LayerNorms
    embeddings = 2 * 128256 * 4096 + 8192 * 4096  # tokens, the untied head, positions
    assert num_parameters(model) == 4 * per_layer + embeddings + 2 * 4096
    config = module.engine_config("stage3:inductor:fp8", micro_batch, torch.device("cuda"))
    assert config["fp8"] == {"enabled": True, "emulate": False} and config["graph"]["compiler"] == "inductor"
    est = estimate_memory(lambda: GPT(cfg), config, world_size=1, seq_len=cfg.seq_len, device_type="cuda")
    assert est.peak["device"] > 16 * num_parameters(model)  # fp32 masters and Adam, bf16 weights and gradients
    overridden = module.shape(argparse.Namespace(**{**vars(args), "layers": 1, "seq": 1024}))[0]
    assert (overridden.n_layer, overridden.seq_len, overridden.d_model) == (1, 1024, 4096)


# -- bench/longest_seq.py: the longest sequence each variant fits, [Note: the longest-sequence search] ----------

LONGEST = ROOT / "bench" / "longest_seq.py"


def _longest_module():
    spec = importlib.util.spec_from_file_location("longest_seq", LONGEST)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("start", [256, 512, 1024])
def test_the_search_finds_the_longest_fitting_length_for_every_boundary(start):
    """Against a scan: for every boundary from below the start to past many doublings, the search returns the
    longest multiple of the resolution that fits and the next one as the first that does not."""
    module = _longest_module()
    resolution = 256
    for boundary in range(0, 40 * 1024, 128):  # lengths up to ``boundary`` fit

        def probe(seq, boundary=boundary):
            return module.Probe(seq, seq <= boundary, "" if seq <= boundary else "out of memory")

        lo, hi, probes = module.longest_fitting(probe, start, resolution)
        expected = boundary // resolution * resolution
        if expected < start:
            assert lo is None and hi.seq == start and len(probes) == 1
            continue
        assert lo.seq == expected and hi.seq == expected + resolution, (boundary, [q.seq for q in probes])
        assert len({q.seq for q in probes}) == len(probes)  # no length probed twice


def test_the_search_stops_at_a_crash_and_at_the_cap_and_refuses_a_start_off_the_resolution():
    module = _longest_module()

    def crashing(seq):  # fits to 3000, crashes (not out of memory) from 4096: no boundary to bisect towards
        return module.Probe(seq, seq <= 3000, "" if seq <= 3000 else "failed (exit 1)")

    lo, hi, probes = module.longest_fitting(crashing, 1024, 256)
    assert (lo.seq, hi.seq, hi.conclusive, len(probes)) == (2048, 4096, False, 3)
    lo, hi, _ = module.longest_fitting(lambda seq: module.Probe(seq, True), 1024, 256, max_seq=8192)
    assert lo.seq == 8192 and hi is None
    with pytest.raises(ValueError, match="multiple of the resolution"):
        module.longest_fitting(lambda seq: module.Probe(seq, True), 1000, 256)


def test_the_tiny_search_under_a_memory_limit_finds_the_boundary_and_reports_it(tmp_path):
    """The tiny GPT on the CPU under a simulated 3 MiB device: the length reported fits under the limit, one
    resolution more ran out of memory (the probe's own ``torch.OutOfMemoryError``, not a crash), the peaks of the
    probes that fit grow with the length, and the JSON has the step time, tokens/s and ratio."""
    out = tmp_path / "longest.json"
    argv = ["--tiny", "--in-process", "--variants", "stage3", "--seq", "128", "--resolution", "32"]
    argv += ["--memory-limit-mib", "3", "--warmup", "0", "--steps", "1", "--max-seq", "1024", "--json", str(out)]
    done = subprocess.run([sys.executable, str(LONGEST), *argv], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    (found,) = json.loads(out.read_text())["variants"].values()
    longest, too_long = found["longest"], found["first_too_long"]
    assert found["limit"] == "out of memory above"
    assert too_long["seq"] == longest["seq"] + 32 and too_long["reason"] == "out of memory"
    assert 128 <= longest["seq"] < 1024 and longest["peak_bytes"] <= 3 * 2**20
    fitting = sorted((q["seq"], q["peak_bytes"]) for q in found["probes"] if q["fits"])
    assert [peak for _, peak in fitting] == sorted(peak for _, peak in fitting)
    assert found["length_ratio"] == 1.0 and found["tokens_per_s"] == pytest.approx(
        2 * longest["seq"] / longest["step_s"]
    )
    assert f"stage3 {longest['seq']:>8}"[:6] in done.stdout


def test_the_second_device_command_fits_one_call_with_each_run_under_its_own_timeout():
    """docs/benchmarks-gpu.md's second command (issue 51's 8B run and longest sequences): one line within the device
    tool's 2,000 characters; each script run under a ``timeout`` of its own, together within a call's 600 s; the
    scripts and the options it passes exist, and its variants are known."""
    text = (ROOT / "docs" / "benchmarks-gpu.md").read_text()
    block = text.split("## The second command", 1)[1].split("```", 2)[1]
    (command,) = [line for line in block.splitlines() if line.strip()]
    assert len(command) < 2000
    runs = [part.strip() for part in command.split(";") if "bench/" in part]
    assert [shlex.split(run)[3] for run in runs] == ["bench/gpu_validate.py", "bench/longest_seq.py"]
    timeouts = [int(shlex.split(run)[1]) for run in runs if run.startswith("timeout ")]
    assert len(timeouts) == len(runs) and sum(timeouts) <= 600 - 30  # 30 s for the install and nvidia-smi
    known = _module().VARIANTS
    for run in runs:
        words = shlex.split(run.split("2>&1", 1)[0])
        script = (ROOT / words[3]).read_text()
        for option in (w for w in words[4:] if w.startswith("--")):
            assert f'"{option}"' in script, (words[3], option)
        variants = words[words.index("--variants") + 1].split(",")
        assert set(variants) <= set(known), variants
        assert "--json" in words and words[words.index("--json") + 1].startswith("$OUT/")


@pytest.mark.soak  # suite time: a process per probe; the search itself is checked in process above
def test_the_search_runs_each_probe_in_a_process_of_its_own(tmp_path):
    out = tmp_path / "longest.json"
    argv = ["--tiny", "--variants", "stage3", "--seq", "128", "--resolution", "64", "--memory-limit-mib", "3"]
    argv += ["--warmup", "0", "--steps", "1", "--max-seq", "1024", "--probe-timeout", "120", "--json", str(out)]
    done = subprocess.run([sys.executable, str(LONGEST), *argv], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    (found,) = json.loads(out.read_text())["variants"].values()
    assert found["first_too_long"]["seq"] == found["longest"]["seq"] + 64
    assert found["first_too_long"]["reason"] == "out of memory"
