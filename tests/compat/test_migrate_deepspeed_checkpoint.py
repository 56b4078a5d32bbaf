"""DeepSpeed checkpoints in: real checkpoints written by DeepSpeed (CPU accelerator, gloo, world 2) load into
shardtrain engines of other world sizes and stages, and the training that follows equals DeepSpeed's own
continuation; the weights read are bitwise ``zero_to_fp32``'s; ``shardtrain checkpoint inspect|consolidate`` work
on them; files naming classes outside the allow-list are refused by name.

The checkpoints are written once per module (``ds_checkpoints``). Tolerance of the loss comparison: 1e-5 relative.
A shardtrain engine that loads the same weights with a fresh optimizer (``load_optimizer_states=False``) is off by
about 1e-2 on the second step after the resume (asserted below), so the comparison tells whether the moments,
step counts and the scheduler state were carried over.

fp16: a real DeepSpeed fp16 checkpoint (its CPU accelerator told fp16 is supported, in the writing ranks only);
the loss scale after every step of the resumed run equals DeepSpeed's continuation's.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from shardtrain.checkpoint.foreign.deepspeed_format import loss_scaler_from_deepspeed
from shardtrain.checkpoint.reader import open_checkpoint
from shardtrain.cli import main
from shardtrain.errors import CheckpointError, UnsafePickleError
from shardtrain.precision.loss_scaler import LossScaler
from shardtrain.testing import DistributedFailure, run_distributed

from helpers.ds import (
    CLIP,
    FP16,
    FP16_STEPS,
    LR,
    SAVE_AT,
    STEPS,
    TP_SAVE_AT,
    WD,
    case_name,
    llama_batches,
    resume,
    resume_fp16,
    resume_llama,
    tiny_llama,
    write_autotp_checkpoint,
    write_deepspeed_checkpoints,
    write_fp16_checkpoint,
    zero_to_fp32,
)

DEFAULT_CASES = [(1, "fp32"), (3, "fp32"), (2, "bf16")]
SOAK_CASES = [(0, "fp32"), (2, "fp32"), (1, "bf16"), (3, "bf16")]
RTOL = 1e-5


class Intruder:
    """A class no DeepSpeed checkpoint holds."""


def _write(root, cases):
    runs = run_distributed(write_deepspeed_checkpoints, 2, str(root), cases, timeout=400)
    return runs[0]


@pytest.fixture(scope="module")
def ds_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepspeed")
    return root, _write(root, DEFAULT_CASES)


@pytest.fixture(scope="module")
def ds_soak_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepspeed_soak")
    return root, _write(root, SOAK_CASES)


def _assert_bitwise_zero_to_fp32(path) -> None:
    ref = zero_to_fp32(str(path))
    reader = open_checkpoint(path)
    for name, want in ref.items():
        got = reader.read(f"model/{name}")
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).contiguous().view(torch.uint8)), name


@pytest.mark.parametrize("stage,dtype", DEFAULT_CASES)
def test_weights_are_bitwise_zero_to_fp32(ds_checkpoints, stage, dtype):
    root, _ = ds_checkpoints
    _assert_bitwise_zero_to_fp32(root / case_name(stage, dtype))


def test_reader_carries_everything_deepspeed_saved(ds_checkpoints):
    root, _ = ds_checkpoints
    reader = open_checkpoint(root / case_name(1, "fp32"))
    objects = reader.objects
    assert objects["engine/counters"]["global_step"] == SAVE_AT
    assert objects["engine/counters"]["global_samples"] == SAVE_AT * 6
    assert objects["engine/scheduler"]["last_epoch"] == SAVE_AT  # the torch LambdaLR's own state dict
    assert objects["client_state"]["epoch"] == 3 and objects["client_state"]["note"] == "hi"
    assert torch.equal(objects["client_state"]["ids"], torch.arange(4))
    assert "ds_config" not in objects["client_state"] and "module" not in objects["client_state"]
    # tied, frozen, buffer
    assert reader.manifest.resolve("model/head.weight").name == "model/embed.weight"
    assert "model/frozen" in reader.manifest.tensors and "optim/frozen/exp_avg" not in reader.manifest.tensors
    assert reader.read("model/mix").shape == (3, 8)
    assert reader.read("optim/fc.weight/step").item() == SAVE_AT
    assert objects["optimizer/state_kinds"] == {"exp_avg": "elementwise", "exp_avg_sq": "elementwise", "step": "scalar"}


@pytest.mark.parametrize(
    "stage,dtype,load_stage,world",
    [(1, "fp32", 2, 3), (3, "fp32", 3, 1), (1, "fp32", 0, 2)],
)
def test_resume_equals_deepspeed_continuation(ds_checkpoints, stage, dtype, load_stage, world):
    root, runs = ds_checkpoints
    name = case_name(stage, dtype)
    want = runs[name]["after"]
    results = run_distributed(resume, world, str(root), name, load_stage, dtype, timeout=300)
    got = results[0]["losses"]
    assert got == pytest.approx(want, rel=RTOL), (got, want)
    assert results[0]["global_step"] == STEPS and results[0]["client_state"]["epoch"] == 3
    assert torch.equal(results[0]["client_state"]["ids"], torch.arange(4))


@pytest.mark.soak
def test_resume_into_tensor_parallel_layout(ds_checkpoints):
    """A DeepSpeed ZeRO-3 checkpoint into tensor parallelism 2 x data parallelism 2 at ZeRO-1: each rank reads
    the ZeRO fragments of its tensor-parallel block of ``fc``."""
    root, runs = ds_checkpoints
    name = case_name(3, "fp32")
    got = run_distributed(resume, 4, str(root), name, 1, "fp32", True, 2, timeout=300)[0]["losses"]
    assert got == pytest.approx(runs[name]["after"], rel=RTOL)


def test_fresh_optimizer_fails_the_tolerance(ds_checkpoints):
    """The comparison above can tell: the same weights with a fresh optimizer miss it by far."""
    root, runs = ds_checkpoints
    name = case_name(1, "fp32")
    want = runs[name]["after"]
    fresh = run_distributed(resume, 2, str(root), name, 1, "fp32", False, timeout=300)[0]["losses"]
    assert fresh[0] == pytest.approx(want[0], rel=RTOL)  # the weights are right
    assert abs(fresh[1] - want[1]) / want[1] > 100 * RTOL, (fresh, want)


def test_bf16_resume_follows_deepspeed(ds_checkpoints):
    """bf16: the fp32 masters and moments come from the checkpoint, but the two systems compute the bf16 forward
    differently (DeepSpeed casts the whole module, LayerNorm and embedding included), so even the first loss after
    the resume, which no optimizer state touches, differs by about 1e-3. The tolerance is 2e-3: the resumed run
    meets it at every step and a fresh optimizer misses it by far on the second."""
    root, runs = ds_checkpoints
    name = case_name(2, "bf16")
    want = runs[name]["after"]
    got = run_distributed(resume, 3, str(root), name, 3, "bf16", timeout=300)[0]["losses"]
    assert got == pytest.approx(want, rel=2e-3), (got, want)
    fresh = run_distributed(resume, 2, str(root), name, 2, "bf16", False, timeout=300)[0]["losses"]
    assert abs(fresh[1] - want[1]) / want[1] > 5 * 2e-3, (fresh, want)


def test_unknown_class_is_refused_by_name(ds_checkpoints, tmp_path):
    root, _ = ds_checkpoints
    bad = tmp_path / "bad"
    shutil.copytree(root / case_name(1, "fp32"), bad)
    tag = (bad / "latest").read_text().strip()
    optim = bad / tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"payload": Intruder()}}, optim)
    with pytest.raises(UnsafePickleError, match="Intruder"):
        open_checkpoint(bad)
    # a truncated file: an error naming it, not a torch traceback
    optim.write_bytes((bad / tag / "mp_rank_00_model_states.pt").read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt.*damaged"):
        open_checkpoint(bad)


def test_deepspeed_scheduler_state_into_a_torch_scheduler_is_refused(ds_checkpoints, tmp_path):
    """DeepSpeed's own schedulers save ``{'last_batch_iteration': k}``; a torch scheduler would take that dict
    silently (``__dict__.update``) and keep its own position, so the load refuses it, naming what to do."""
    root, _ = ds_checkpoints
    ckpt = tmp_path / "warmup"
    shutil.copytree(root / case_name(1, "fp32"), ckpt)
    states = ckpt / (ckpt / "latest").read_text().strip() / "mp_rank_00_model_states.pt"
    data = torch.load(states, weights_only=False)  # our own test file: rewritten as a WarmupLR run would save it
    data["lr_scheduler"] = {"last_batch_iteration": SAVE_AT - 1}
    torch.save(data, states)
    with pytest.raises(DistributedFailure, match=r"saved by a DeepSpeed scheduler.*LambdaLR cannot take"):
        run_distributed(resume, 1, str(tmp_path), "warmup", 1, "fp32", timeout=300)


def test_cli_inspect_and_consolidate(ds_checkpoints, tmp_path, capsys):
    root, _ = ds_checkpoints
    src = tmp_path / "hf_run"
    shutil.copytree(root / case_name(3, "fp32"), src)
    config = {"model_type": "demo", "hidden_size": 8}
    (src / "config.json").write_text(json.dumps(config))  # where the HF Trainer writes it: next to `latest`
    assert main(["checkpoint", "inspect", str(src)]) == 0
    out = capsys.readouterr().out
    assert "model/embed.weight" in out and "optim/fc.weight/exp_avg" in out
    assert main(["checkpoint", "consolidate", str(src), str(tmp_path / "out"), "--no-progress"]) == 0
    written = load_file(tmp_path / "out" / "model.safetensors")
    ref = zero_to_fp32(str(src))
    tied = {"head.weight"}  # written once, under the name holding the data, as Hugging Face does
    assert set(written) == set(ref) - tied
    for name, t in written.items():
        assert torch.equal(t, ref[name].contiguous()), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["hidden_size"] == 8


@pytest.mark.soak
@pytest.mark.parametrize("stage,dtype", SOAK_CASES)
def test_soak_weights_are_bitwise_zero_to_fp32(ds_soak_checkpoints, stage, dtype):
    root, _ = ds_soak_checkpoints
    if stage == 0:  # zero_to_fp32 does not read stage 0; the weights are the module's
        reader = open_checkpoint(root / case_name(stage, dtype))
        assert reader.read("model/fc.weight").dtype == torch.float32
        return
    _assert_bitwise_zero_to_fp32(root / case_name(stage, dtype))


@pytest.mark.soak
@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.parametrize("load_stage,world", [(0, 1), (1, 3), (3, 2), (2, 3)])
def test_soak_resume_matrix(ds_soak_checkpoints, stage, load_stage, world):
    root, runs = ds_soak_checkpoints
    name = case_name(stage, "fp32")
    results = run_distributed(resume, world, str(root), name, load_stage, "fp32", timeout=300)
    assert results[0]["losses"] == pytest.approx(runs[name]["after"], rel=RTOL)


@pytest.fixture(scope="module")
def autotp_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("autotp")
    return root, run_distributed(write_autotp_checkpoint, 2, str(root), timeout=400)[0]


def test_tensor_parallel_checkpoint_reads_each_block(autotp_checkpoint):
    """DeepSpeed AutoTP (tensor parallel 2, mp_rank_00/01 files): each parameter is put together from the blocks
    its affine map names. Checked against an independent truth, the same model trained in one process with the
    same recipe (zero_to_fp32 does not read tensor-parallel checkpoints)."""
    root, _ = autotp_checkpoint
    reader = open_checkpoint(root)
    assert reader.objects["engine/topology"]["tp"] == 2
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for x in llama_batches()[:TP_SAVE_AT]:
        opt.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    for name, p in model.named_parameters():
        # tensor-parallel reductions sum in another order: Adam turns that into a few 1e-6 on elements with tiny
        # gradients; a misplaced block would be off by the weights' own size (about 2e-2)
        torch.testing.assert_close(reader.read(f"model/{name}"), p.detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(reader.read(f"optim/{name}/exp_avg"), opt.state[p]["exp_avg"], rtol=1e-4, atol=1e-8)
    split = reader.manifest.resolve("model/model.layers.0.self_attn.o_proj.weight").pieces
    assert {p.slice.block.dim for p in split} == {1}  # a row-parallel weight: blocks of columns


@pytest.mark.soak
def test_tensor_parallel_checkpoint_resumes(autotp_checkpoint):
    root, runs = autotp_checkpoint
    got = run_distributed(resume_llama, 2, str(root), 2, timeout=300)
    assert got[0] == pytest.approx(runs["after"], rel=RTOL)


# -- fp16 ---------------------------------------------------------------------------------------------------------
# fp16 losses: one fp16 rounding step (2**-11 relative); the two systems' fp16 forward passes differ by about 5e-5
FP16_RTOL = 2**-11


@pytest.fixture(scope="module")
def ds_fp16_checkpoint(tmp_path_factory):
    """A real DeepSpeed ZeRO-2 fp16 checkpoint (the CPU accelerator told fp16 is supported, in the writing ranks
    only) whose loss scaler has just used up its hysteresis allowance on an overflow, and DeepSpeed's continuation."""
    root = tmp_path_factory.mktemp("deepspeed_fp16") / "ds_stage2_fp16"
    run = run_distributed(write_fp16_checkpoint, 2, str(root), timeout=300)[0]
    # the recipe exercised the scaler before the save and after it: overflows, a growth, a halving
    before = [s for s, _ in run["scales_before"]]
    after = [s for s, _ in run["scales"]]
    assert run["scales_before"][-1][1] >= 2 and max(before) > before[0], run
    assert min(after) < before[-1] and after[-1] > min(after) and run["skipped"] < FP16_STEPS, run
    return root, run


def test_fp16_weights_are_bitwise_zero_to_fp32(ds_fp16_checkpoint):
    root, run = ds_fp16_checkpoint
    _assert_bitwise_zero_to_fp32(root)
    # the case where counting one clean step too many shows: saved on an overflow that used up the allowance
    scaler = open_checkpoint(root).objects["engine/scaler"]
    assert scaler["scale"] == run["scales_before"][-1][0]
    assert scaler["allowance"] < FP16["hysteresis"] and scaler["clean_steps"] == 0, scaler


@pytest.mark.parametrize("stage", [2, 1])
def test_fp16_resume_continues_deepspeed_loss_scale_and_losses(ds_fp16_checkpoint, stage):
    """At DeepSpeed's layout (world 2: whether a step overflows depends on each rank's fp16 gradients, so on the
    rows it holds), the loss scale after every step, the skipped steps and the losses equal DeepSpeed's own
    continuation; the growth after the save's overflow comes at the same step."""
    root, run = ds_fp16_checkpoint
    got = run_distributed(resume_fp16, 2, str(root), stage, timeout=300)[0]
    assert got["loaded_scale"] == run["scales_before"][-1][0]
    assert got["scales"] == run["scales"], (got["scales"], run["scales"])
    assert got["losses"] == pytest.approx(run["after"], rel=FP16_RTOL), (got["losses"], run["after"])


@pytest.mark.parametrize("window,hysteresis", [(FP16["loss_scale_window"], FP16["hysteresis"]), (3, 1), (1, 3)])
def test_loss_scaler_follows_deepspeed_and_resumes_from_any_state(monkeypatch, window, hysteresis):
    """Step by step against DeepSpeed's own ``DynamicLossScaler`` on a random overflow sequence; and at every
    step, DeepSpeed's state translated into a fresh ``LossScaler`` goes on exactly as DeepSpeed does."""
    from deepspeed.runtime.fp16 import loss_scaler

    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda *a, **k: 0)  # it only picks the rank that logs
    power = 40  # far from the minimum scale: the sequence below never reaches it

    def deepspeed_scaler():
        return loss_scaler.DynamicLossScaler(
            init_scale=2.0**power,
            scale_window=window,
            min_scale=1,
            delayed_shift=hysteresis,
            consecutive_hysteresis=False,
            raise_error_at_min_scale=True,
            dtype=torch.half,
        )

    def ours():
        return LossScaler(0, power, window, hysteresis, 1)

    g = torch.Generator().manual_seed(3)
    overflows = (torch.rand(60, generator=g) < 0.3).tolist()
    ds, st = deepspeed_scaler(), ours()
    for k, overflow in enumerate(overflows):
        ds.update_scale(overflow)
        st.update(overflow)
        assert st.scale == ds.cur_scale, k
        resumed, reference = ours(), deepspeed_scaler()
        resumed.load_state_dict(loss_scaler_from_deepspeed(vars(ds)))
        reference.__dict__.update(vars(ds))
        for j, later in enumerate(overflows[k + 1 : k + 12]):
            reference.update_scale(later)
            resumed.update(later)
            assert resumed.scale == reference.cur_scale, (k, j)
    assert ds.cur_scale != 2.0**power  # the sequence moved the scale
