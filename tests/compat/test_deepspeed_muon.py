"""DeepSpeed's ``"optimizer": {"type": "Muon"}`` runs as DeepSpeed 0.19.8 runs it ([Note: DeepSpeed's Muon is not
torch's] in optim/deepspeed_muon.py).

By default: shardtrain's DeepSpeedMuon against DeepSpeed's own single-device class (its ``muon_update`` and Adam
update) in one process, both Newton-Schulz methods; DeepSpeed's parameter split; the refusals. Under ``-m soak`` (about
a minute per world): real DeepSpeed and ``shardtrain.deepspeed`` train the same script and config in the same
processes (tests/helpers/ds_muon.py) at ZeRO 0-3, world 2 and 1; losses within 1e-5, parameters within 1e-5.
"""

from __future__ import annotations

import os

import pytest
import torch

import shardtrain
from shardtrain.config.sections import OptimizerConfig, optimizer_class_and_kwargs
from shardtrain.errors import ConfigError
from shardtrain.optim.deepspeed_muon import DeepSpeedMuon, deepspeed_orthogonalize
from shardtrain.optim.muon import MuonWithAdamW
from shardtrain.testing import run_distributed

from helpers import ds_muon

os.environ.setdefault("DS_ACCELERATOR", "cpu")
MUON_NAMES = {"square.weight", "up.weight", "down.weight", "head.weight"}


def _groups_by_kind(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict[bool, set[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[bool, set[str]] = {True: set(), False: set()}
    for g in optimizer.param_groups:
        out[g["use_muon"]] |= {names[id(p)] for p in g["params"]}
    return out


def test_deepspeed_split_by_name_and_shape_with_its_keys():
    model = ds_muon.MuonNet()
    params = {k: v for k, v in ds_muon.MUON.items() if k != "torch_adam"}
    opt = DeepSpeedMuon.from_config(model, None, params)
    kinds = _groups_by_kind(opt, model)
    assert kinds[True] == MUON_NAMES  # the head is Muon's: its name is not lm_head
    assert kinds[False] == {"embed.weight", "square.bias", "down.bias", "norm.weight", "norm.bias", "gain"}
    muon, adam = (next(g for g in opt.param_groups if g["use_muon"] is k) for k in (True, False))
    assert (muon["lr"], muon["momentum"], muon["weight_decay"], muon["ns_method"]) == (0.03, 0.9, 0.1, "gram")
    assert (adam["lr"], adam["betas"], adam["eps"], adam["weight_decay"]) == (3e-3, (0.9, 0.95), 1e-10, 0.1)
    assert adam["decoupled_weight_decay"] is True
    # DeepSpeed's defaults, and "lm_head" / "embed" anywhere in a name (any case) keep a matrix out of Muon
    model.lm_HEAD = torch.nn.Linear(4, 4)
    defaults = DeepSpeedMuon.from_config(model, None, {"adam_w_mode": False})
    muon, adam = (next(g for g in defaults.param_groups if g["use_muon"] is k) for k in (True, False))
    assert (muon["lr"], muon["momentum"], muon["weight_decay"]) == (0.02, 0.95, 0.0)
    assert (adam["lr"], adam["betas"], adam["eps"], adam["weight_decay"]) == (3e-4, (0.9, 0.95), 1e-10, 0.0)
    assert adam["decoupled_weight_decay"] is False
    assert "lm_HEAD.weight" in _groups_by_kind(defaults, model)[False]


def test_a_param_groups_own_keys_win_over_the_config():
    model = ds_muon.MuonNet()
    groups = [
        {"params": [model.square.weight, model.square.bias], "weight_decay": 0.0, "lr": 0.5},
        {"params": [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith("square.")]},
    ]
    opt = DeepSpeedMuon.from_config(model, groups, {"lr": 0.01, "adam_lr": 0.002, "weight_decay": 0.3})
    first = opt.param_groups[:2]
    assert [(g["use_muon"], g["lr"], g["weight_decay"]) for g in first] == [(True, 0.5, 0.0), (False, 0.5, 0.0)]
    rest = opt.param_groups[2:]
    assert [(g["use_muon"], g["lr"], g["weight_decay"]) for g in rest] == [(True, 0.01, 0.3), (False, 0.002, 0.3)]


def _deepspeed_single_device(groups: list[dict]) -> torch.optim.Optimizer:
    from deepspeed.runtime.zero.muon.original_muon import SingleDeviceMuonWithAuxAdam

    return SingleDeviceMuonWithAuxAdam(groups)


@pytest.mark.parametrize("ns_method", ["gram", "standard"])
def test_one_process_step_is_deepspeeds_muon_update_and_adam(ns_method):
    params = {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.1, "adam_lr": 3e-3, "ns_method": ns_method}
    ours_model, theirs_model = ds_muon.MuonNet(), ds_muon.MuonNet()
    ours = DeepSpeedMuon.from_config(ours_model, None, params)
    # DeepSpeed's class with the groups its engine builds: the same split, by the twin model's parameters
    twins = dict(zip([id(p) for p in ours_model.parameters()], theirs_model.parameters()))
    theirs_groups = [
        {k: v for k, v in g.items() if k in ("use_muon", "lr", "momentum", "weight_decay", "ns_method", "betas", "eps")}
        | {"params": [twins[id(p)] for p in g["params"]]}
        for g in ours.param_groups
    ]
    theirs = _deepspeed_single_device(theirs_groups)
    torch_muon = MuonWithAdamW([{k: v for k, v in g.items() if k != "ns_method"} for g in theirs_groups])
    torch_model = ds_muon.MuonNet()
    torch_twins = dict(zip([id(p) for p in theirs_model.parameters()], torch_model.parameters()))
    for g in torch_muon.param_groups:
        g["params"] = [torch_twins[id(p)] for p in g["params"]]
    with torch.compiler.set_stance("force_eager"):  # DeepSpeed compiles muon_update: eager, the same operations
        for x, y in ds_muon.batches():
            for model, opt in ((ours_model, ours), (theirs_model, theirs), (torch_model, torch_muon)):
                opt.zero_grad()
                model(x, y).backward()
                opt.step()
    theirs_params = dict(theirs_model.named_parameters())
    torch_params = dict(torch_model.named_parameters())
    apart = {}
    for name, p in ours_model.named_parameters():
        torch.testing.assert_close(p, theirs_params[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        apart[name] = (torch_params[name] - theirs_params[name]).abs().max().item()
    # torch's Muon (bf16 Newton-Schulz, lr scaling, its Adam defaults) is another optimizer: building it from this
    # config would have been silently wrong
    assert max(apart[n] for n in MUON_NAMES) > 1e-3, apart


def test_the_gram_iteration_is_the_quintic_one_rearranged():
    """The Gram form (fp32 here: this CPU has no mkldnn fp16) against the textbook quintic in float64."""
    a, b, c = 3.4445, -4.775, 2.0315
    g = torch.Generator().manual_seed(0)
    for shape in [(8, 20), (20, 8), (8, 8)]:
        update = torch.randn(shape, generator=g, dtype=torch.float64)
        x = update if shape[0] <= shape[1] else update.T
        x = x / (x.norm() + 1e-7)
        for _ in range(5):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        expected = (x if shape[0] <= shape[1] else x.T) * max(1.0, (shape[0] / shape[1]) ** 0.5)
        got = deepspeed_orthogonalize(update, "gram")
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_deepspeed_muon_config_refusals():
    def check(params: dict) -> None:
        cls, _ = optimizer_class_and_kwargs(OptimizerConfig(type="Muon", params=params))
        assert cls is DeepSpeedMuon

    check({"muon_lr": 0.01, "ns_method": "standard", "torch_adam": True})
    with pytest.raises(ConfigError, match=r"optimizer.params.nesterov"):
        check({"nesterov": False})
    with pytest.raises(ConfigError, match=r"per_head_muon: DeepSpeed's per-head orthogonalization .* not served"):
        check({"per_head_muon": True})
    with pytest.raises(ConfigError, match=r"ns_method: expected one of \['gram', 'standard'\]"):
        check({"ns_method": "svd"})
    with pytest.raises(ConfigError, match=r"betas: expected two numbers"):
        check({"betas": [0.9]})


def _initialize_says(stage: int, clipping: float | None) -> str:
    config = ds_muon.config(stage, {"lr": 0.02}, 1)
    if clipping is None:
        del config["gradient_clipping"]
    else:
        config["gradient_clipping"] = clipping
    try:
        engine = shardtrain.initialize(ds_muon.MuonNet(), config=config)
    except ConfigError as err:
        return str(err)
    said = type(engine.optimizer).__name__
    engine.close()
    return said


def test_deepspeed_muon_with_clipping_is_refused_at_zero_1_to_3_by_name():
    said = run_distributed(_initialize_says, 1, 2, None)[0]  # DeepSpeed's default gradient_clipping is 1.0
    assert "DeepSpeed's Muon optimizer type at ZeRO stage 2 with gradient_clipping 1.0" in said, said
    assert '"gradient_clipping": 0' in said
    assert run_distributed(_initialize_says, 1, 0, None)[0] != said  # stage 0 clips the gradients, as DeepSpeed


def _assert_same(out: dict, stages: list[int]) -> None:
    for stage in stages:
        theirs, ours = out[("deepspeed", stage)], out[("shardtrain.deepspeed", stage)]
        torch.testing.assert_close(
            torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=1e-5, atol=0,
            msg=lambda m, s=stage: f"stage {s} losses: {m}",
        )  # fmt: skip
        assert ours["params"].keys() == theirs["params"].keys()
        for name, value in theirs["params"].items():
            torch.testing.assert_close(
                ours["params"][name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name, s=stage: f"{s} {n}: {m}"
            )
        moved = max((theirs["params"][n] - ds_muon.MuonNet().state_dict()[n]).abs().max().item() for n in MUON_NAMES)
        assert moved > 1e-2  # trained: the comparison is not of untouched weights


@pytest.mark.soak
@pytest.mark.parametrize("world", [2, 1])
def test_real_deepspeed_and_the_shim_train_the_same_muon_config(world):
    stages = [0, 1, 2, 3]
    out = run_distributed(ds_muon.both, world, stages, ds_muon.MUON, timeout=600)
    for rank_out in out:
        _assert_same(rank_out, stages)


@pytest.mark.soak
def test_real_deepspeed_and_the_shim_agree_with_the_standard_newton_schulz_in_bf16_iterations():
    params = {**ds_muon.MUON, "ns_method": "standard", "adam_w_mode": False}
    out = run_distributed(ds_muon.both, 2, [2], params, timeout=600)
    _assert_same(out[0], [2])


@pytest.mark.soak
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_checkpoint_deepspeed_wrote_with_its_muon_continues_as_deepspeed_does(tmp_path, stage):
    """Real DeepSpeed trains 2 steps at world 2, saves, continues 2; the shim loads that checkpoint into a model from
    another seed and continues the same 2 steps. DeepSpeed's Muon momentum at ZeRO 1-2 is each touching parameter's
    whole momentum per rank ([Note: DeepSpeed's Muon momentum at ZeRO 1-2]); read as a partition (before), the second
    step's loss was 2.81566 against DeepSpeed's 2.81154. Measured now: equal losses, parameters within 1e-7. At ZeRO 3
    DeepSpeed keeps the momentum partitioned like the fp32 partition, read as any partitioned state (measured: equal
    losses, parameters within 3e-7)."""
    out = run_distributed(ds_muon.resume_deepspeeds_checkpoint, 2, stage, ds_muon.MUON, str(tmp_path), timeout=600)
    theirs, ours = out[0]["deepspeed"], out[0]["shardtrain.deepspeed"]
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=1e-5, atol=0)
    for name, value in theirs["params"].items():
        torch.testing.assert_close(ours["params"][name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
