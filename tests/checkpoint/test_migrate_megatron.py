"""Megatron-Core ``torch_dist`` checkpoints are consolidated and loaded into any shardtrain layout (issue 54, item 3).

The fixtures are written by real megatron-core (its PyPI package, on CPU/gloo; ``helpers/megatron_fixture.py`` says
which CUDA calls are given their CPU meaning) and committed under ``tests/data/megatron_core`` (its README says which
version and command): a Llama-style GPT saved at tp 2 x pp 2 (world 4), its MoE version (4 experts, top-2) at
pp 2 x ep 2, and a tp 1 x pp 1 training run saved with its Adam state. Megatron itself loaded each saved model at
tp 1 x pp 1 and computed the logits of one batch (``expected.json``): the consolidated transformers model and every
shardtrain layout must give the same logits, and training on from the loaded weights must give the losses of
single-process training from the consolidated model. The soak test regenerates the data with megatron-core and
checks that it still holds what the default tests compare against.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from shardtrain.checkpoint.consolidate import consolidate
from shardtrain.checkpoint.reader import open_checkpoint
from shardtrain.errors import CheckpointError, UnsafePickleError
from shardtrain.testing import run_distributed

from helpers import megatron_fixture as mf

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LOGITS_ATOL = 1e-5  # fp32; Megatron's and transformers' kernels sum in other orders (measured: 2.4e-7)
LOSS_RTOL = 1e-5


@pytest.fixture(scope="module")
def expected() -> dict:
    return mf.expected_values()


@pytest.fixture(scope="module")
def dense(expected) -> dict:
    """A Llama-style GPT written by megatron-core at tp 2 x pp 2 (world 4)."""
    return {"dir": mf.DATA / "dense", "ref": expected["dense"]}


@pytest.fixture(scope="module")
def moe(expected) -> dict:
    """Its MoE version at pp 2 x ep 2 (world 4, experts numbered across the expert-parallel ranks)."""
    return {"dir": mf.DATA / "moe", "ref": expected["moe"]}


@pytest.fixture(scope="module")
def trained(expected) -> dict:
    """Megatron trained the dense model 4 steps with its Adam (tp 1 x pp 1: see [Note: megatron-core on CPU]),
    saving model and optimizer state after step 2; the losses of all 4 steps."""
    return {"dir": mf.DATA / "trained", "losses": expected["trained"]["losses"]}


def _consolidated_logits(case: dict, out: Path) -> tuple[torch.Tensor, object]:
    from transformers import AutoModelForCausalLM

    consolidate(open_checkpoint(case["dir"]), out, progress=False)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(case["ref"]["tokens"]).logits, model


def test_consolidated_llama_equals_megatrons_model(dense, tmp_path):
    logits, model = _consolidated_logits(dense, tmp_path / "hf")
    assert type(model).__name__ == "LlamaForCausalLM"
    torch.testing.assert_close(logits, dense["ref"]["logits"], atol=LOGITS_ATOL, rtol=0)
    # the un-fusing is what makes them equal: q and k swapped by group would give other logits
    assert dense["ref"]["logits"].std() > 0.1


def test_consolidation_reads_one_layer_slab_at_a_time(dense, tmp_path):
    """Streaming: no read during consolidation is larger than one layer of the largest Megatron tensor (the
    stacked tensors hold all layers; reading one whole would grow with the model)."""
    reader = open_checkpoint(dense["dir"])
    chunks = reader._chunks
    largest_slab = max(
        math.prod(s.global_shape[1:]) if s.key.startswith("decoder.layers.") else math.prod(s.global_shape)
        for s in reader._sources.values()
    )
    sizes = []
    plain_read = chunks._read

    def counting_read(entry, flat_range, dtype):
        sizes.append(entry.numel if flat_range is None else flat_range[1] - flat_range[0])
        return plain_read(entry, flat_range, dtype)

    chunks._read = counting_read
    consolidate(reader, tmp_path / "hf", progress=False)
    assert len(sizes) >= len(reader.manifest.tensors)
    assert max(sizes) <= largest_slab
    stacked = max(math.prod(s.global_shape) for s in reader._sources.values())
    assert max(sizes) * mf.LAYERS <= stacked  # what a whole-tensor read would have cost


def test_consolidated_mixtral_equals_megatrons_model(moe, tmp_path):
    logits, model = _consolidated_logits(moe, tmp_path / "hf")
    assert type(model).__name__ == "MixtralForCausalLM"
    torch.testing.assert_close(logits, moe["ref"]["logits"], atol=LOGITS_ATOL, rtol=0)


def _single_process(case: dict, hf_dir: Path) -> dict:
    """The consolidated model's weights and its losses trained alone (the parity reference)."""
    config = json.loads((hf_dir / "config.json").read_text())
    config.pop("dtype", None)
    text = json.dumps(config)
    model = mf.hf_model(text, seed=2)
    weights = safetensors.torch.load_file(hf_dir / "model.safetensors")
    model.load_state_dict(weights)
    losses = mf.train(model, mf.train_batches(), opt=torch.optim.AdamW(model.parameters(), lr=mf.LR))
    return {"config": text, "weights": weights, "losses": losses}


@pytest.mark.parametrize(
    ("world", "stage", "tp"),
    [(2, 3, 1), (3, 1, 1), (2, 1, 2)],
    ids=["world2-zero3", "world3-zero1", "world2-tp2"],
)
def test_load_into_another_layout(dense, tmp_path, world, stage, tp):
    consolidate(open_checkpoint(dense["dir"]), tmp_path / "hf", progress=False)
    ref = _single_process(dense, tmp_path / "hf")
    results = run_distributed(
        mf.engine_load_body, world, str(dense["dir"]), ref["config"], stage, tp, dense["ref"]["tokens"]
    )
    state = results[0]["state"]
    assert set(state) >= set(ref["weights"])
    for name, value in ref["weights"].items():
        torch.testing.assert_close(state[name], value, atol=0, rtol=0, msg=name)
    for r in results:
        torch.testing.assert_close(r["logits"], dense["ref"]["logits"], atol=LOGITS_ATOL, rtol=0)
        assert r["step"] == 1  # Megatron's iteration
    dp = world // tp
    mine = [r["losses"] for r in results[::tp]][:dp]
    got = [sum(s) / dp for s in zip(*mine)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref["losses"]), rtol=LOSS_RTOL, atol=0)


def test_moe_loads_into_zero3(moe, tmp_path):
    consolidate(open_checkpoint(moe["dir"]), tmp_path / "hf", progress=False)
    ref = _single_process(moe, tmp_path / "hf")
    results = run_distributed(mf.engine_load_body, 2, str(moe["dir"]), ref["config"], 3, 1, moe["ref"]["tokens"])
    for name, value in ref["weights"].items():
        torch.testing.assert_close(results[0]["state"][name], value, atol=0, rtol=0, msg=name)
    torch.testing.assert_close(results[0]["logits"], moe["ref"]["logits"], atol=LOGITS_ATOL, rtol=0)
    got = [sum(s) / 2 for s in zip(*(r["losses"] for r in results))]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref["losses"]), rtol=LOSS_RTOL, atol=0)


def test_loading_the_optimizer_state_is_refused_by_name(dense):
    config = open_checkpoint(dense["dir"]).objects["hf/config"]
    said = run_distributed(mf.engine_default_load_body, 1, str(dense["dir"]), config)[0]
    assert "holds no optimizer state in model space" in said
    assert "load_optimizer_states=False" in said


@pytest.mark.parametrize(("world", "stage", "tp"), [(2, 3, 1), (3, 2, 1)], ids=["world2-zero3", "world3-zero2"])
def test_resume_continues_megatrons_training(trained, world, stage, tp):
    """Loss parity with Megatron's own continuation: weights, moments and step counts carried over."""
    config = open_checkpoint(trained["dir"]).objects["hf/config"]
    results = run_distributed(mf.engine_resume_body, world, str(trained["dir"]), config, stage, tp, True)
    assert all(r["step"] == mf.TRAIN_STEPS for r in results)  # Megatron's iteration 2, then 2 steps
    dp = world // tp
    got = [sum(s) / dp for s in zip(*(r["losses"] for r in results if r["tp_rank"] == 0))]
    want = trained["losses"][mf.TRAIN_SAVE_AT :]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=LOSS_RTOL, atol=0)


def test_resume_without_the_optimizer_state_parts_ways(trained):
    """The control: the same resume with a fresh optimizer is far outside the tolerance, so the check above sees
    the moments and step counts."""
    config = open_checkpoint(trained["dir"]).objects["hf/config"]
    got = run_distributed(mf.engine_resume_body, 1, str(trained["dir"]), config, 0, 1, False)[0]["losses"]
    want = trained["losses"][mf.TRAIN_SAVE_AT :]
    assert abs(got[-1] - want[-1]) > 100 * LOSS_RTOL * abs(want[-1])


def _copy(case: dict, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(case["dir"], out)
    return out / "iter_0000001"


def test_truncated_data_file_names_the_tensor(dense, tmp_path):
    ckpt = _copy(dense, tmp_path)
    victim = ckpt / "__1_0.distcp"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 3])
    reader = open_checkpoint(ckpt.parent)
    problems = reader.verify()
    assert problems and all("damaged" in p or "missing" in p for p in problems)
    with pytest.raises(CheckpointError, match=r"cannot read tensor .*the file is damaged"):
        for name in reader.manifest.tensors:
            reader.read(name)


def test_missing_or_damaged_files_are_named(dense, tmp_path):
    ckpt = _copy(dense, tmp_path)
    (ckpt / ".metadata").write_bytes((ckpt / ".metadata").read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"\.metadata"):
        open_checkpoint(ckpt.parent)
    shutil.copy(dense["dir"] / "iter_0000001" / ".metadata", ckpt / ".metadata")
    (ckpt / "common.pt").unlink()
    with pytest.raises(CheckpointError, match=r"common\.pt: missing"):
        open_checkpoint(ckpt)
    (ckpt / "metadata.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"metadata\.json: not readable JSON"):
        open_checkpoint(ckpt)


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/shardtrain-megatron-pwned",))


def test_code_in_common_state_is_refused_before_anything_runs(dense, tmp_path):
    ckpt = _copy(dense, tmp_path)
    torch.save({"args": _Payload(), "iteration": 1}, ckpt / "common.pt")
    with pytest.raises(UnsafePickleError, match=r"refused to unpickle 'posix.system'"):
        open_checkpoint(ckpt)


def test_args_outside_llama_are_refused_by_name(dense, tmp_path):
    pytest.importorskip("megatron.core")  # to edit the args, common.pt is unpickled with megatron's own enums
    ckpt = _copy(dense, tmp_path)
    common = torch.load(ckpt / "common.pt", weights_only=False)
    common["args"].normalization = "LayerNorm"
    common["args"].qk_layernorm = True
    torch.save(common, ckpt / "common.pt")
    with pytest.raises(CheckpointError, match=r"normalization='LayerNorm', qk_layernorm; shardtrain reads Llama"):
        open_checkpoint(ckpt)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    reader = open_checkpoint(path)
    return {name: reader.read(name) for name in reader.manifest.tensors}


@pytest.mark.soak
def test_committed_fixtures_are_what_megatron_core_writes(tmp_path):
    """megatron-core writes the committed data again: the same tensors under the same names, the same logits
    and losses. A megatron-core that saved or computed otherwise fails here, not silently in the tests above."""
    pytest.importorskip("megatron.core")
    fresh = mf.regenerate(tmp_path)
    committed = json.loads((mf.DATA / "expected.json").read_text())
    assert fresh["megatron_core"] == committed["megatron_core"]
    for kind in mf.FIXTURES:
        assert fresh[kind]["tokens"] == committed[kind]["tokens"]
        torch.testing.assert_close(
            torch.tensor(fresh[kind]["logits"]), torch.tensor(committed[kind]["logits"]), atol=1e-6, rtol=0
        )
    torch.testing.assert_close(
        torch.tensor(fresh["trained"]["losses"]), torch.tensor(committed["trained"]["losses"]), rtol=1e-6, atol=0
    )
    for kind in (*mf.FIXTURES, "trained"):
        now, then = _tensors(tmp_path / kind), _tensors(mf.DATA / kind)
        assert now.keys() == then.keys()
        for name, value in then.items():
            torch.testing.assert_close(now[name], value, atol=1e-6, rtol=1e-6, msg=f"{kind}: {name}")
