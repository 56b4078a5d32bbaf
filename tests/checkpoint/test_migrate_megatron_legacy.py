"""Legacy Megatron-LM checkpoints (``mp_rank_XX[_YYY]/model_optim_rng.pt``, ``--ckpt-format torch``) are consolidated
and loaded into any shardtrain layout (issue 54, item 3).

The fixtures are written by Megatron-LM's own ``save_checkpoint`` (its ``core_v0.16.1`` source, on the installed
megatron-core, CPU/gloo; ``helpers/megatron_legacy_fixture.py`` says which two CUDA calls were given their CPU
meaning) and committed under ``tests/data/megatron_legacy`` (its README says the commit and command): the
Llama-style GPT of ``helpers/megatron_fixture.py`` at tp 2 x pp 2, and a tp 1 x pp 1 run of Megatron's Adam saved
after step 2. Megatron computed the logits of the saved model and the losses of its continuation.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from shardtrain.checkpoint.consolidate import consolidate
from shardtrain.checkpoint.foreign.megatron_legacy import LegacyMegatronReader
from shardtrain.checkpoint.reader import open_checkpoint
from shardtrain.errors import CheckpointError, UnsafePickleError
from shardtrain.testing import run_distributed

from helpers import megatron_fixture as mf
from helpers import megatron_legacy_fixture as lf

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LOGITS_ATOL = 1e-5  # fp32; Megatron's and transformers' kernels sum in other orders (measured: 2.4e-7)
LOSS_RTOL = 1e-5


@pytest.fixture(scope="module")
def expected() -> dict:
    return lf.expected_values()


def _consolidated(tmp_path: Path) -> Path:
    out = tmp_path / "hf"
    consolidate(open_checkpoint(lf.DATA / "dense"), out, progress=False)
    return out


def test_consolidated_llama_equals_megatrons_model(expected, tmp_path):
    """tp 2 x pp 2 stitched (fused QKV by query group, SwiGLU [gate_r; up_r] per rank, row-parallel columns,
    layers offset by stage): the transformers model gives the logits Megatron computed."""
    from transformers import AutoModelForCausalLM

    reader = open_checkpoint(lf.DATA / "dense")
    assert isinstance(reader, LegacyMegatronReader) and (reader.tp, reader.pp) == (lf.SAVE_TP, lf.SAVE_PP)
    model = AutoModelForCausalLM.from_pretrained(_consolidated(tmp_path), dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        logits = model(expected["dense"]["tokens"]).logits
    torch.testing.assert_close(logits, expected["dense"]["logits"], atol=LOGITS_ATOL, rtol=0)
    assert expected["dense"]["logits"].std() > 0.1  # a mis-stitched gate/up or QKV would be far off


def test_every_tensor_equals_megatron_cores_save_of_the_same_run():
    """The same Megatron training run saved in both formats (``megatron_core/trained`` is megatron-core's
    ``torch_dist`` save of it): every weight, ``exp_avg``, ``exp_avg_sq`` and step count read from the legacy
    files equals the ``torch_dist`` one exactly, so the optimizer's positions are matched to the right tensors."""
    legacy, dist = open_checkpoint(lf.DATA / "trained"), open_checkpoint(mf.DATA / "trained")
    assert legacy.manifest.tensors.keys() == dist.manifest.tensors.keys()
    assert any(n.endswith("/exp_avg_sq") for n in legacy.manifest.tensors)
    for name in dist.manifest.tensors:
        torch.testing.assert_close(legacy.read(name), dist.read(name), atol=0, rtol=0, msg=name)
    assert legacy.objects["optimizer/param_groups"] == dist.objects["optimizer/param_groups"]
    assert legacy.objects["engine/counters"] == {"global_step": mf.TRAIN_SAVE_AT}


def test_reads_stitch_one_whole_tensor_at_a_time(monkeypatch, tmp_path):
    """Streaming: consolidation stitches each Megatron tensor once (q, k and v share one) and never holds more
    than one whole-model tensor of one layer."""
    stitched: list[str] = []
    original = LegacyMegatronReader._stitch

    def counting(self, key):
        stitched.append(key)
        return original(self, key)

    monkeypatch.setattr(LegacyMegatronReader, "_stitch", counting)
    _consolidated(tmp_path)
    assert len(stitched) == len(set(stitched))  # each once: the last one is kept for the next read
    reader = open_checkpoint(lf.DATA / "dense")
    sizes = {k: torch.Size(s.global_shape).numel() for k, s in reader._sources.items()}
    assert max(sizes.values()) < sum(sizes.values()) / 4


@pytest.mark.parametrize(("world", "stage", "tp"), [(2, 3, 1), (3, 1, 1)], ids=["world2-zero3", "world3-zero1"])
def test_load_into_another_layout(expected, tmp_path, world, stage, tp):
    """An engine loads the tp 2 x pp 2 checkpoint exactly, gives Megatron's logits, and trains on as one process
    does from the consolidated model."""
    import safetensors.torch

    hf_dir = _consolidated(tmp_path)
    config = json.loads((hf_dir / "config.json").read_text())
    config.pop("dtype", None)
    text = json.dumps(config)
    model = mf.hf_model(text, seed=2)
    weights = safetensors.torch.load_file(hf_dir / "model.safetensors")
    model.load_state_dict(weights)
    ref_losses = mf.train(model, mf.train_batches(), opt=torch.optim.AdamW(model.parameters(), lr=mf.LR))
    tokens = expected["dense"]["tokens"]
    results = run_distributed(mf.engine_load_body, world, str(lf.DATA / "dense"), text, stage, tp, tokens)
    for name, value in weights.items():
        torch.testing.assert_close(results[0]["state"][name], value, atol=0, rtol=0, msg=name)
    for r in results:
        torch.testing.assert_close(r["logits"], expected["dense"]["logits"], atol=LOGITS_ATOL, rtol=0)
        assert r["step"] == 1  # Megatron's iteration
    got = [sum(s) / world for s in zip(*(r["losses"] for r in results))]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0)


def test_expert_parallel_mixtral_equals_megatrons_model(expected, tmp_path):
    """pp 2 x ep 2 (``mp_rank_00_<pp>_<ep>``): each expert rank's local experts stitched at their global index;
    the transformers Mixtral gives Megatron's logits, and every tensor equals megatron-core's ``torch_dist`` save of
    the same model (``megatron_core/moe``: same seed and layout), so no expert lands at another's index."""
    from transformers import AutoModelForCausalLM

    reader = open_checkpoint(lf.DATA / "moe")
    assert isinstance(reader, LegacyMegatronReader)
    assert (reader.tp, reader.pp, reader.ep) == (lf.MOE_TP, lf.MOE_PP, lf.MOE_EP)
    dist = open_checkpoint(mf.DATA / "moe")
    assert reader.manifest.tensors.keys() == dist.manifest.tensors.keys()
    for name in dist.manifest.tensors:
        torch.testing.assert_close(reader.read(name), dist.read(name), atol=0, rtol=0, msg=name)
    out = tmp_path / "hf"
    consolidate(reader, out, progress=False)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model).__name__ == "MixtralForCausalLM"
    with torch.no_grad():
        logits = model(expected["moe"]["tokens"]).logits
    torch.testing.assert_close(logits, expected["moe"]["logits"], atol=LOGITS_ATOL, rtol=0)
    assert expected["moe"]["logits"].std() > 0.1


@pytest.mark.parametrize(("world", "stage", "ep"), [(2, 3, 2), (3, 1, 1)], ids=["world2-zero3-ep2", "world3-zero1"])
def test_expert_parallel_checkpoint_loads_into_another_layout(expected, tmp_path, world, stage, ep):
    """The pp 2 x ep 2 checkpoint loaded by an engine at another layout: exactly the consolidated weights,
    Megatron's logits, and training on equal to one process from the consolidated Mixtral."""
    import safetensors.torch

    hf_dir = tmp_path / "hf"
    consolidate(open_checkpoint(lf.DATA / "moe"), hf_dir, progress=False)
    config = json.loads((hf_dir / "config.json").read_text())
    config.pop("dtype", None)
    text = json.dumps(config)
    model = mf.hf_model(text, seed=2)
    weights = safetensors.torch.load_file(hf_dir / "model.safetensors")
    model.load_state_dict(weights)
    ref_losses = mf.train(model, mf.train_batches(), opt=torch.optim.AdamW(model.parameters(), lr=mf.LR))
    tokens = expected["moe"]["tokens"]
    results = run_distributed(mf.engine_load_body, world, str(lf.DATA / "moe"), text, stage, 1, tokens, ep)
    for name, value in weights.items():
        torch.testing.assert_close(results[0]["state"][name], value, atol=0, rtol=0, msg=name)
    for r in results:
        torch.testing.assert_close(r["logits"], expected["moe"]["logits"], atol=LOGITS_ATOL, rtol=0)
        assert r["step"] == 1
    got = [sum(s) / world for s in zip(*(r["losses"] for r in results))]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0)


@pytest.mark.parametrize(("world", "stage"), [(2, 3), (3, 2)], ids=["world2-zero3", "world3-zero2"])
def test_resume_continues_megatrons_training(expected, world, stage):
    """Loss parity with Megatron's own steps 3-4 after resuming its legacy save: weights, Adam moments and step
    counts carried over (without them the losses part ways: test_migrate_megatron's control)."""
    config = open_checkpoint(lf.DATA / "trained").objects["hf/config"]
    results = run_distributed(mf.engine_resume_body, world, str(lf.DATA / "trained"), config, stage, 1, True)
    assert all(r["step"] == mf.TRAIN_STEPS for r in results)
    got = [sum(s) / world for s in zip(*(r["losses"] for r in results))]
    want = expected["trained"]["losses"][mf.TRAIN_SAVE_AT :]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=LOSS_RTOL, atol=0)


# -- damage and refusals ---------------------------------------------------------------------------------------------
def _copy(tmp_path: Path, kind: str = "dense") -> Path:
    out = tmp_path / kind
    shutil.copytree(lf.DATA / kind, out)
    return out / ("iter_0000002" if kind == "trained" else "iter_0000001")


def test_rank_directory_and_save_directory_open_the_iteration(tmp_path):
    ckpt = _copy(tmp_path)
    for path in (ckpt.parent, ckpt, ckpt / "mp_rank_01_001"):
        reader = open_checkpoint(path)
        assert isinstance(reader, LegacyMegatronReader) and reader.path == ckpt


def test_truncated_rank_file_is_named(tmp_path):
    ckpt = _copy(tmp_path)
    victim = ckpt / "mp_rank_01_000" / "model_optim_rng.pt"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"mp_rank_01_000/model_optim_rng\.pt: not a readable torch\.save file"):
        open_checkpoint(ckpt)


def test_corrupted_pickle_is_named(tmp_path):
    ckpt = _copy(tmp_path)
    victim = ckpt / "mp_rank_00_001" / "model_optim_rng.pt"
    with zipfile.ZipFile(victim) as z:
        members = {n: z.read(n) for n in z.namelist()}
    pickle_name = next(n for n in members if n.endswith("data.pkl"))
    members[pickle_name] = members[pickle_name][:40] + b"\xff" * 16 + members[pickle_name][56:]
    with zipfile.ZipFile(victim, "w", zipfile.ZIP_STORED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    with pytest.raises(CheckpointError, match=r"mp_rank_00_001/model_optim_rng\.pt"):
        open_checkpoint(ckpt)


def test_missing_rank_directory_is_named(tmp_path):
    ckpt = _copy(tmp_path)
    shutil.rmtree(ckpt / "mp_rank_01_001")
    with pytest.raises(CheckpointError, match=r"rank directories \['mp_rank_01_001'\] missing for tp 2 x pp 2"):
        open_checkpoint(ckpt)


def test_missing_expert_rank_directory_is_named(tmp_path):
    ckpt = _copy(tmp_path, "moe")
    shutil.rmtree(ckpt / "mp_rank_00_001_001")
    with pytest.raises(
        CheckpointError, match=r"rank directories \['mp_rank_00_001_001'\] missing for tp 1 x pp 2 x ep 2"
    ):
        open_checkpoint(ckpt)


def test_expert_rank_directory_the_args_do_not_name_is_refused(tmp_path):
    """A third number on a dense checkpoint's rank directory (expert parallelism its args do not have)."""
    ckpt = _copy(tmp_path)
    (ckpt / "mp_rank_00_000").rename(ckpt / "mp_rank_00_000_001")
    with pytest.raises(CheckpointError, match=r"rank directory mp_rank_00_000_001 does not fit the args"):
        open_checkpoint(ckpt)


def test_empty_rank_file_is_named_from_every_path(tmp_path):
    """A rank file that is no torch.save file is named, whichever of the save, iteration or rank directory is
    given (what the former refusal of the legacy layout covered)."""
    iteration = tmp_path / "iter_0000005"
    (iteration / "mp_rank_00").mkdir(parents=True)
    (iteration / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    for path in (tmp_path, iteration, iteration / "mp_rank_00"):
        with pytest.raises(CheckpointError, match=r"model_optim_rng\.pt: not a readable torch\.save file"):
            open_checkpoint(path)


def test_opens_in_a_process_whose_safe_globals_hold_numpys_real_classes():
    """megatron-core's import adds numpy's ``_reconstruct`` and ``ndarray`` to torch's process-wide safe globals;
    the RNG state's arrays must still load as inert records ([Note: process-wide safe globals shadow the inert
    ones]), and nothing is dropped from the process's list."""
    import numpy as np

    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals([np._core.multiarray._reconstruct, np.ndarray, np.dtype])
    try:
        with_numpy = torch.serialization.get_safe_globals()
        reader = open_checkpoint(lf.DATA / "moe")
        assert reader.ep == lf.MOE_EP
        assert set(map(repr, torch.serialization.get_safe_globals())) >= set(map(repr, with_numpy))
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/shardtrain-megatron-legacy-pwned",))


def test_code_in_a_rank_file_is_refused_before_anything_runs(tmp_path):
    ckpt = _copy(tmp_path)
    torch.save({"args": _Payload(), "iteration": 1}, ckpt / "mp_rank_00_000" / "model_optim_rng.pt")
    with pytest.raises(UnsafePickleError, match=r"refused to unpickle 'posix.system'"):
        open_checkpoint(ckpt)
    assert not Path("/tmp/shardtrain-megatron-legacy-pwned").exists()


def test_optimizer_grouping_other_than_megatrons_default_is_refused():
    """The saved param groups list positions only; a grouping that is not megatron's default is named, not
    matched to the wrong tensors (the file's own groups, with one weight moved into the no-decay group)."""
    import copy

    reader = open_checkpoint(lf.DATA / "trained")
    saved = copy.deepcopy(reader._loaded[(0, 0, 0)]["optimizer"])
    assert len(reader._positions(saved, 0, 0)) == len(saved["state"])  # the file as saved: every position matched
    groups = saved["param_groups"]
    groups[1]["params"].append(groups[0]["params"].pop())
    with pytest.raises(CheckpointError, match=r"a param group of 9 parameters, where megatron's default grouping"):
        reader._positions(saved, 0, 0)


@pytest.mark.soak
def test_committed_fixtures_are_what_megatron_lm_writes(tmp_path):
    """Megatron-LM's legacy save writes the committed data again (where its source is present: MEGATRON_LM, see
    tests/data/megatron_legacy/README.md): the same tensors, logits and losses."""
    pytest.importorskip("megatron.core")
    if lf.megatron_lm_path() is None:
        pytest.skip("MEGATRON_LM does not name a Megatron-LM source tree (tests/data/megatron_legacy/README.md)")
    fresh = lf.regenerate(tmp_path)
    committed = json.loads((lf.DATA / "expected.json").read_text())
    assert fresh["dense"]["tokens"] == committed["dense"]["tokens"]
    torch.testing.assert_close(
        torch.tensor(fresh["dense"]["logits"]), torch.tensor(committed["dense"]["logits"]), atol=1e-6, rtol=0
    )
    assert fresh["trained"]["losses"] == pytest.approx(committed["trained"]["losses"], rel=1e-6)
    assert fresh["moe"]["tokens"] == committed["moe"]["tokens"]
    torch.testing.assert_close(
        torch.tensor(fresh["moe"]["logits"]), torch.tensor(committed["moe"]["logits"]), atol=1e-6, rtol=0
    )
    for kind in ("dense", "moe", "trained"):
        now, then = open_checkpoint(tmp_path / kind), open_checkpoint(lf.DATA / kind)
        assert now.manifest.tensors.keys() == then.manifest.tensors.keys()
        for name in then.manifest.tensors:
            torch.testing.assert_close(now.read(name), then.read(name), atol=1e-6, rtol=1e-6, msg=f"{kind}: {name}")
