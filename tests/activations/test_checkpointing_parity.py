"""``activation_checkpointing.policy`` and ``cpu_checkpointing`` under the engine: each policy trains bit for bit as
no checkpointing does (fp32 on the CPU, where the recompute is deterministic), at parity with one process, at
world 1 and under ZeRO-3 at worlds 2 and 3, for the project's GPT and a Hugging Face Llama; and it keeps fewer
bytes alive between forward and backward."""

import functools

import pytest

from shardtrain.testing import run_distributed

from helpers.activation_cases import SECTIONS, assert_bitwise, policy_runs, reference
from helpers.model_cases import assert_parity

ALL = list(SECTIONS)


@functools.cache
def ref(case: str, world: int) -> dict:
    return reference(case, world)


def _check(results: list[dict], case: str, world: int) -> None:
    for rank_runs in results:
        base = rank_runs["none"]
        for name in ALL[1:]:
            assert_bitwise(rank_runs[name], base, f"{case} {name} vs none")
    assert_parity([r["none"] for r in results], ref(case, world))
    for rank_runs in results:
        for name in ("full+cpu", "selective+cpu"):
            counts = rank_runs[name]["offloaded"]
            # every step, one saved input per block went to the host (and came back: host_bytes 0 after backward)
            assert counts and all(host > 0 for host, _ in counts), counts
            assert rank_runs[name]["peak_host_bytes"] > 0
        for name in ("none", "full", "selective"):
            assert not rank_runs[name]["offloaded"]


@pytest.mark.parametrize("case", ["gpt", "llama"])
def test_policies_at_world_1(case):
    """Failed before: the section was accepted with no effect (``full``/``selective`` kept as many bytes as
    ``none``), so the memory ordering below did not hold."""
    if case == "llama":
        pytest.importorskip("transformers")
    (runs,) = run_distributed(policy_runs, 1, case, 0, ALL)
    _check([runs], case, 1)
    kept = {name: runs[name]["kept_bytes"] for name in ALL}
    assert kept["full"] < kept["selective"] < kept["none"], kept


@pytest.mark.parametrize(
    ("case", "world"),
    [("gpt", 2), ("gpt", 3), ("llama", 2), pytest.param("llama", 3, marks=pytest.mark.soak)],
)
def test_policies_under_zero3(case, world):
    """Stage 3: the recompute in backward gathers its unit again ([Note: the order of a checkpointed block's
    hooks]); losses, norms and final parameters equal the run without checkpointing bit for bit."""
    if case == "llama":
        pytest.importorskip("transformers")
    results = run_distributed(policy_runs, world, case, 3, ALL)
    _check(results, case, world)
    for r in results:
        assert r["full"]["kept_bytes"] < r["none"]["kept_bytes"], {n: r[n]["kept_bytes"] for n in ALL}


@pytest.mark.parametrize("stage", [0, 3])
def test_policies_under_tensor_parallelism(stage):
    """(dp 1, tp 2): the recompute runs the tensor-parallel collectives again in backward, on every tp rank in the
    same order; bitwise as no checkpointing."""
    results = run_distributed(policy_runs, 2, "gpt", stage, ["none", "full", "selective", "full+cpu"], tp=2)
    for r in results:
        for name in ("full", "selective", "full+cpu"):
            assert_bitwise(r[name], r["none"], f"tp 2 {name} vs none")
    assert_parity([results[0]["none"]], ref("gpt", 1))


def test_policies_under_ulysses():
    """(dp 1, sp 2) at stage 3, Llama: the recompute runs Ulysses' all-to-alls again in backward; bitwise as no
    checkpointing, which is at parity with one process."""
    pytest.importorskip("transformers")
    results = run_distributed(policy_runs, 2, "llama", 3, ["none", "full", "selective", "full+cpu"], sp=2)
    for r in results:
        for name in ("full", "selective", "full+cpu"):
            assert_bitwise(r[name], r["none"], f"sp 2 {name} vs none")
        assert r["full"]["kept_bytes"] < r["selective"]["kept_bytes"] < r["none"]["kept_bytes"]
    assert_parity([results[0]["none"]], ref("llama", 1))


@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.soak), 3])
def test_partitioned_inputs_under_tensor_parallelism(stage):
    """``partition_activations`` at tp 2 ([Note: partitioned block inputs]): each rank keeps half of every
    checkpointed block's input and all-gathers it before the recompute; bitwise as no checkpointing and as whole
    inputs, with fewer bytes kept than ``full``. Failed before: refused as not built."""
    partitioned = {"policy": "full", "partition_activations": True}
    sections = {"none": {}, "full": {"policy": "full"}, "full+partition": partitioned}
    results = run_distributed(policy_runs, 2, "gpt", stage, list(sections), tp=2, sections=sections)
    for r in results:
        assert_bitwise(r["full+partition"], r["none"], f"tp 2 stage {stage}: partitioned vs none")
        assert r["full+partition"]["partitioned"] == 3 * 3  # one input of each of 3 blocks, each of 3 steps
        assert r["full"]["partitioned"] == 0
        assert r["full+partition"]["kept_bytes"] < r["full"]["kept_bytes"], r
