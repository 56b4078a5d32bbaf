"""DeepSpeed pipeline checkpoints in ([Note: DeepSpeed pipeline checkpoints]): a real ``PipelineEngine`` (pp 2,
world 2, ZeRO 0 and 1, CPU accelerator, gloo) saves after two steps and trains two more; its checkpoint loads into
the shim's ``PipelineModule`` at pp 2 and pp 1 and into a plain ``nn.Sequential`` of the same layers at world 2, and
the two steps that follow equal DeepSpeed's continuation (losses within 1e-5 relative, the moments and step counts
carried: a fresh optimizer misses it), the weights read equal DeepSpeed's; a missing layer file is refused by name.

The checkpoints are written once per module (``ds_pipeline_checkpoints``). Without gradient clipping: DeepSpeed's
pipeline engine clips by the first stage's norm only (see test_deepspeed_pipe.py)."""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported anywhere in this process

import shutil

import pytest
import torch
from torch import nn

import shardtrain
import shardtrain.deepspeed as deepspeed
import test_deepspeed_pipe_tied as tied
from shardtrain.checkpoint.reader import open_checkpoint
from shardtrain.cli import main
from shardtrain.deepspeed.pipe import PipelineModule
from shardtrain.errors import CheckpointError
from shardtrain.testing import run_distributed
from test_deepspeed_pipe import BETAS, CLASSES, EPS, GAS, LR, MICRO, WD, WIDTH, Block, Head, layers, loss_fn
from test_deepspeed_pipe import _deepspeed_specs as deepspeed_specs

SAVE_AT, STEPS = 2, 4
STAGES = (0, 1)  # the ZeRO stages DeepSpeed's pipeline engine supports
OPTIMIZER = {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD,
                                         "torch_adam": True}}  # fmt: skip


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [
        (torch.randn(MICRO, WIDTH, generator=g), torch.randint(0, CLASSES, (MICRO,), generator=g))
        for _ in range(STEPS * GAS)
    ]


def _train_saving(real, net, stage: int, data: list, path: str) -> dict:
    """DeepSpeed's pipeline engine over ``net`` at ZeRO ``stage``: saved to ``path`` after SAVE_AT steps, then its
    continuation's losses and weights."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        engine, _, _, _ = real.initialize(model=net, model_parameters=list(net.parameters()), config=_config(stage))
        losses = []
        for s in range(STEPS):
            if s == SAVE_AT:
                engine.save_checkpoint(path, tag="saved")
            losses.append(float(engine.train_batch(iter(data[s * GAS : (s + 1) * GAS]))))
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()}}


def _write(root: str) -> dict:
    """DeepSpeed's own run per ZeRO stage: saved after SAVE_AT steps, then its continuation's losses and weights."""
    import deepspeed as real

    from shardtrain.compat.deepspeed.runtime.pipe.module import set_random_seed

    real.init_distributed(dist_backend="gloo")
    data = batches()
    out = {}
    for stage in STAGES:
        net = real.pipe.PipelineModule(
            deepspeed_specs(layers()), num_stages=2, loss_fn=loss_fn, seed_layers=True,
            seed_fn=lambda seed: set_random_seed(int(seed)), partition_method="parameters",
        )  # fmt: skip
        out[stage] = _train_saving(real, net, stage, data, f"{root}/zero{stage}")
    data = tied_batches()
    for stage in STAGES:  # the tied embedding (GPT-2's tie, through forward_fn)
        net = real.pipe.PipelineModule(deepspeed_tied_layers(), num_stages=2, loss_fn=tied.loss_fn, seed_layers=True,
                                       seed_fn=lambda seed: set_random_seed(int(seed)))  # fmt: skip
        out[f"tied{stage}"] = _train_saving(real, net, stage, data, f"{root}/tied{stage}")
    return out


def tied_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(13)
    out = []
    for _ in range(STEPS * GAS):
        x = torch.randint(0, tied.VOCAB, (MICRO, tied.SEQ), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def deepspeed_tied_layers() -> list:
    """test_deepspeed_pipe_tied's layers with DeepSpeed's own specs."""
    from deepspeed.runtime.pipe.module import LayerSpec as DSLayerSpec
    from deepspeed.runtime.pipe.module import TiedLayerSpec as DSTiedLayerSpec

    return [
        DSTiedLayerSpec("embed", nn.Embedding, tied.VOCAB, tied.WIDTH),
        *[DSLayerSpec(tied.Block, tied.WIDTH) for _ in range(4)],
        DSLayerSpec(nn.LayerNorm, tied.WIDTH),
        DSTiedLayerSpec("embed", nn.Embedding, tied.VOCAB, tied.WIDTH, forward_fn=tied.head, tied_weight_attr="weight"),
    ]


@pytest.fixture(scope="module")
def ds_pipeline_checkpoints(tmp_path_factory):
    pytest.importorskip("deepspeed.runtime.pipe.engine")
    root = tmp_path_factory.mktemp("deepspeed_pipeline")
    full = run_distributed(_write, 2, str(root), timeout=400)
    # each stage's parameters from its rank (a tie's on both: equal, DeepSpeed keeps them so)
    cases = [*STAGES, *(f"tied{stage}" for stage in STAGES)]
    params = {case: {k: v for r in full for k, v in r[case]["params"].items()} for case in cases}
    return root, {case: {"losses": full[0][case]["losses"], "params": params[case]} for case in cases}


class Half(nn.Module):
    """``lambda x: x * 0.5`` as a module, so that an ``nn.Sequential`` holds the same layers at the same indices."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5


def plain_model() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), Block(2 * WIDTH), Block(2 * WIDTH), Half(),
        Block(2 * WIDTH), Block(2 * WIDTH), Head(2 * WIDTH, CLASSES),
    )  # fmt: skip


def _config(stage: int, micro: int = MICRO) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": GAS,
        "optimizer": OPTIMIZER,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**6,
    }


def _resume_pipeline(path: str, pp: int, stage: int, load_optimizer: bool = True) -> dict:
    """The shim's PipelineModule at ``pp`` stages (world ``pp``) loads DeepSpeed's checkpoint and trains on."""
    torch.manual_seed(5)  # other initial weights than DeepSpeed's: everything must come from the checkpoint
    net = PipelineModule(layers(), num_stages=pp, loss_fn=loss_fn)
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=_config(stage))
    engine.load_checkpoint(path, tag="saved", load_optimizer_states=load_optimizer)
    loaded = engine.shardtrain_engine.full_state_dict()
    data = batches()
    losses = [float(engine.train_batch(iter(data[s * GAS : (s + 1) * GAS]))) for s in range(SAVE_AT, STEPS)]
    out = {"losses": losses, "loaded": loaded, "final": engine.shardtrain_engine.full_state_dict()}
    engine.destroy()
    return out


def _resume_plain(path: str, stage: int, sequential: bool) -> dict:
    """One pipeline stage: a plain ``nn.Sequential`` of the same layers, or the shim's ``PipelineModule`` with
    ``num_stages=1`` (which the shim trains as a plain module), at data parallelism = world size, each rank its
    share of each micro-batch."""
    torch.manual_seed(5)
    model = plain_model() if sequential else PipelineModule(layers(), num_stages=1, loss_fn=loss_fn)
    micro = MICRO // torch.distributed.get_world_size()
    engine = shardtrain.initialize(model, _config(stage, micro))
    engine.load_checkpoint(path, tag="saved")
    loaded = engine.full_state_dict()
    rows = slice(engine.topology.dp_rank * micro, (engine.topology.dp_rank + 1) * micro)
    data, losses = batches(), []
    for s in range(SAVE_AT, STEPS):
        total = torch.zeros(())
        for x, y in data[s * GAS : (s + 1) * GAS]:
            loss = loss_fn(engine(x[rows]), y[rows])
            engine.backward(loss)
            engine.step()
            total += loss.detach() / GAS
        torch.distributed.all_reduce(total)
        losses.append(float(total) / engine.topology.dp)
    out = {"losses": losses, "loaded": loaded, "final": engine.full_state_dict()}
    engine.close()
    return out


def _assert_continues_as_deepspeed(got: dict, want: dict, saved_weights: dict) -> None:
    assert got["losses"] == pytest.approx(want["losses"][SAVE_AT:], rel=1e-5), (got["losses"], want["losses"])
    assert got["loaded"].keys() == want["params"].keys()
    for name, value in saved_weights.items():
        assert torch.equal(got["loaded"][name], value), name
    for name, value in want["params"].items():
        torch.testing.assert_close(got["final"][name], value, rtol=1e-5, atol=1e-6)


def _saved_weights(path) -> dict:
    reader = open_checkpoint(path, "saved")
    return {
        n.removeprefix("model/"): reader.read(n).detach() for n in reader.manifest.tensors if n.startswith("model/")
    }


@pytest.mark.parametrize("stage", STAGES)
def test_pp2_checkpoint_continues_as_deepspeed_at_pp2_pp1_and_plain(ds_pipeline_checkpoints, stage):
    root, runs = ds_pipeline_checkpoints
    path = str(root / f"zero{stage}")
    saved = _saved_weights(path)
    # the layer files hold what DeepSpeed's stages held: layer i's key k is the module's "<i>.<k>"
    assert torch.equal(saved["7.bias"], torch.load(f"{path}/saved/layer_07-model_states.pt")["bias"])
    got = run_distributed(_resume_pipeline, 2, path, 2, stage, timeout=300)[0]
    _assert_continues_as_deepspeed(got, runs[stage], saved)
    # pp 1: the PipelineModule at world 1, and an nn.Sequential at world 1 and 2 (data parallel)
    for world, sequential in ((1, False), (1, True), (2, True)):
        got = run_distributed(_resume_plain, world, path, stage, sequential, timeout=300)[0]
        _assert_continues_as_deepspeed(got, runs[stage], saved)


def test_fresh_optimizer_misses_the_continuation(ds_pipeline_checkpoints):
    """The comparison above can tell whether the moments and step counts were carried over."""
    root, runs = ds_pipeline_checkpoints
    got = run_distributed(_resume_pipeline, 2, str(root / "zero1"), 2, 1, False, timeout=300)[0]
    assert got["losses"] != pytest.approx(runs[1]["losses"][SAVE_AT:], rel=1e-3)


def test_inspect_names_the_pipeline_layout(ds_pipeline_checkpoints, capsys):
    root, _ = ds_pipeline_checkpoints
    assert main(["checkpoint", "inspect", str(root / "zero1"), "--tag", "saved", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "2 pipeline stage(s)" in out and "model/5.fc.weight" in out, out


@pytest.mark.parametrize("stage", STAGES)
def test_missing_layer_file_is_refused_by_name(ds_pipeline_checkpoints, tmp_path, stage):
    root, _ = ds_pipeline_checkpoints
    damaged = tmp_path / "damaged"
    shutil.copytree(root / f"zero{stage}", damaged)
    (damaged / "saved" / "layer_05-model_states.pt").unlink()
    with pytest.raises(CheckpointError, match="layer_05-model_states.pt" if stage else "a layer file is missing"):
        open_checkpoint(damaged, "saved")


def _resume_tied(path: str, pp: int) -> dict:
    """The shim's PipelineModule with the tie, at ``pp`` stages (world ``pp``; pp 1 trained as a plain module)."""
    torch.manual_seed(5)
    net = PipelineModule(tied.layers(), num_stages=pp, loss_fn=tied.loss_fn)
    data = tied_batches()[SAVE_AT * GAS :]
    if pp == 1:
        engine = shardtrain.initialize(net, _config(1))
        engine.load_checkpoint(path, tag="saved")
        loaded, losses = engine.full_state_dict(), []
        for s in range(STEPS - SAVE_AT):
            total = 0.0
            for x, y in data[s * GAS : (s + 1) * GAS]:
                loss = tied.loss_fn(engine(x), y)
                engine.backward(loss)
                engine.step()
                total += float(loss) / GAS
            losses.append(total)
        out = {"losses": losses, "loaded": loaded, "final": engine.full_state_dict()}
        engine.close()
        return out
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=_config(1))
    engine.load_checkpoint(path, tag="saved")
    loaded = engine.shardtrain_engine.full_state_dict()
    losses = [float(engine.train_batch(iter(data[s * GAS : (s + 1) * GAS]))) for s in range(STEPS - SAVE_AT)]
    out = {"losses": losses, "loaded": loaded, "final": engine.shardtrain_engine.full_state_dict()}
    engine.destroy()
    return out


def test_tied_layers_at_zero1_continue_as_deepspeed(ds_pipeline_checkpoints):
    """``tied_modules.embed.weight``: on both of DeepSpeed's stages, in the first stage's layer file (layer 0) only
    (the last stage's use is a function); read once, loaded on both of the shim's stages at pp 2 and once at pp 1."""
    root, runs = ds_pipeline_checkpoints
    path = str(root / "tied1")
    saved = _saved_weights(path)
    assert tied.TIED in saved and "0.weight" not in saved
    for pp in (2, 1):
        got = run_distributed(_resume_tied, pp, path, pp, timeout=300)[0]
        _assert_continues_as_deepspeed(got, runs["tied1"], saved)


def test_tied_layers_at_zero0_are_refused_by_name(ds_pipeline_checkpoints):
    """ZeRO 0 saves no parameter names: the tie's copy on the last stage cannot be told from a layer's."""
    root, _ = ds_pipeline_checkpoints
    with pytest.raises(CheckpointError, match="TiedLayerSpec was saved at ZeRO stage 0"):
        open_checkpoint(root / "tied0", "saved")
