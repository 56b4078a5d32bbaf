"""Optimizers whose step needs whole tensors ([Note: optimizers that need the whole tensor] in zero/elementwise.py):
what stepping ZeRO's fragments or tensor-parallel blocks does to them (with the element-wise check skipped, as
``zero_allow_untested_optimizer`` let them through before), and that ``initialize`` now refuses them by name."""

from __future__ import annotations

import functools
import importlib

import pytest
import torch
from torch import nn

import shardtrain
from shardtrain.config.sections import load_config
from shardtrain.engine.optimizers import build_optimizer
from shardtrain.errors import OptimizerError
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.tensor_parallel import GPT_TP_PLAN
from shardtrain.testing import parity, run_distributed
from shardtrain.zero.elementwise import NOT_ELEMENTWISE, known_not_elementwise, slice_mismatch
from shardtrain.zero.optimizer import ELEMENTWISE_OPTIMIZERS

VOCAB, SEQ = 64, 16


def _gpt(only_matrices: bool = False) -> nn.Module:
    """The project's tiny GPT; ``only_matrices``: its 1-D parameters frozen (torch's Muon takes 2-D ones only)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_layer=2, n_head=4))
    for p in model.parameters():
        p.requires_grad_(p.dim() == 2 or not only_matrices)
    return model


def _batches(rows: int = 4, steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    xs = [torch.randint(0, VOCAB, (rows, SEQ), generator=g) for _ in range(steps * 2)]
    return [(x, torch.roll(x, -1, dims=1)) for x in xs]


def _loss(model, batch) -> torch.Tensor:
    return model(*batch)


def _adafactor(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adafactor(model.parameters(), lr=1e-2)


def _muon(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Muon([p for p in model.parameters() if p.requires_grad], lr=0.02)


def _recipe(optimizer, only_matrices: bool, stage: int, tp: int = 1) -> parity.Recipe:
    return parity.Recipe(
        make_model=functools.partial(_gpt, only_matrices),
        make_optimizer=optimizer,
        batches=_batches,
        loss=_loss,
        gas=2,
        clip=0.5,
        config={
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, "allgather_bucket_size": 2000},
            "tensor_parallel": {"size": tp},
            "zero_allow_untested_optimizer": True,
        },
        tp_plan=GPT_TP_PLAN if tp > 1 else None,
    )


def _unchecked_then_checked(recipe: parity.Recipe) -> dict:
    """On every rank: the recipe trained with the element-wise check skipped (what the key allowed before), then what
    ``initialize`` says with the check in place."""
    import shardtrain.engine.engine as engine_module

    check = engine_module.check_optimizer
    # the element-wise check is the one run at stage > 0 or tp > 1: the rest (coverage, fresh state) still runs
    engine_module.check_optimizer = lambda opt, model, stage, allow, tp=1: check(opt, model, 0, allow, tp=1)
    out: dict = {}
    try:
        out.update(parity.engine_run(recipe))
    except Exception as err:
        out["failed"] = f"{type(err).__name__}: {err}"
    finally:
        engine_module.check_optimizer = check
    try:
        parity.build_engine(recipe)
    except OptimizerError as err:
        out["refused"] = str(err)
    return out


def _largest_relative_error(got: dict, ref: dict) -> float:
    """The largest error of a tensor relative to the distance the reference moved it."""
    out = 0.0
    for k, want in ref["params"].items():
        moved = (want - ref["init"][k]).norm().item()
        if moved > 0:
            out = max(out, (got[k] - want).norm().item() / moved)
    return out


class _LayerwiseTrustSGD(torch.optim.Optimizer):
    """LAMB/LARS's per-tensor trust ratio on SGD: an optimizer no table knows, that only the probe can catch."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    trust = p.norm() / p.grad.norm().clamp_min(1e-12)
                    p.add_(p.grad, alpha=-group["lr"] * float(trust))


def _layerwise_trust_sgd(model: nn.Module) -> torch.optim.Optimizer:
    return _LayerwiseTrustSGD(model.parameters(), lr=0.05)


def test_a_per_tensor_norm_optimizer_on_zero_fragments_is_silently_another_algorithm_and_now_refused():
    recipe = _recipe(_layerwise_trust_sgd, only_matrices=False, stage=1)
    ranks = run_distributed(_unchecked_then_checked, 2, recipe)
    # the slice step ran without a word (each fragment's own norms), and landed far from one process's steps
    assert "failed" not in ranks[0], ranks[0]
    error = _largest_relative_error(ranks[0]["params"], parity.reference_run(recipe, exact=False))
    assert error > 0.05, error  # parity's bound is 1e-3 of the distance moved
    for r in ranks:  # no table names it: the probe at initialize caught it, the config key notwithstanding
        assert "_LayerwiseTrustSGD cannot be used at ZeRO stage 1: its step is not element-wise" in r["refused"]
        assert "zero_allow_untested_optimizer does not lift this" in r["refused"]


@pytest.mark.parametrize(
    ("optimizer", "stage", "failure", "why"),
    [
        (_muon, 2, "ValueError: Param gradient must be a 2D matrix", "orthogonalizes each 2-D matrix"),
        (_adafactor, 1, "ZeroDivisionError", "factors each matrix's second moment"),  # on an empty fragment
    ],
    ids=["Muon", "Adafactor"],
)
def test_matrix_optimizers_on_zero_fragments_failed_deep_in_torch_and_are_now_refused_at_initialize(
    optimizer, stage, failure, why
):
    recipe = _recipe(optimizer, only_matrices=optimizer is _muon, stage=stage)
    ranks = run_distributed(_unchecked_then_checked, 2, recipe)
    for r in ranks:
        # before: initialize "succeeded" and a step raised torch's own error on a fragment
        assert r["failed"].startswith(failure), r
        assert why in r["refused"] and f"ZeRO stage {stage}" in r["refused"], r["refused"]
        assert "ZeRO stage 0" in r["refused"] and "zero_allow_untested_optimizer does not lift this" in r["refused"]


def test_muon_on_tensor_parallel_blocks_is_silently_another_algorithm_and_now_refused():
    recipe = _recipe(_muon, only_matrices=True, stage=0, tp=2)
    ranks = run_distributed(_unchecked_then_checked, 2, recipe)
    # each rank orthogonalized its block of the split matrices: no error, another result
    assert "failed" not in ranks[0], ranks[0]
    error = _largest_relative_error(ranks[0]["params"], parity.reference_run(recipe, exact=False))
    assert error > 0.05, error
    for r in ranks:
        assert "tensor parallel size 2" in r["refused"] and "torch.optim._muon.Muon" in r["refused"], r["refused"]


def _initialize_says(stage: int) -> str:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    config = {"zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    try:
        shardtrain.initialize(model, config=config, optimizer=_LayerwiseTrustSGD(model.parameters()))
    except OptimizerError as err:
        return str(err)
    return "ok"


def test_the_probe_refuses_an_unknown_per_tensor_norm_optimizer_whatever_the_config_key_says():
    said = run_distributed(_initialize_says, 1, 1)[0]
    assert "_LayerwiseTrustSGD cannot be used at ZeRO stage 1: its step is not element-wise" in said, said
    assert "flat 1-D fragments" in said and "away from the same steps on the whole tensor" in said
    # at stage 0 it steps whole tensors: accepted
    assert run_distributed(_initialize_says, 1, 0)[0] == "ok"


@pytest.mark.parametrize("cls", ELEMENTWISE_OPTIMIZERS, ids=lambda c: c.__name__)
def test_the_probe_finds_the_elementwise_optimizers_elementwise(cls):
    params = [nn.Parameter(torch.randn(3, 3))]
    kwargs = {"lr": 0.1} if cls is torch.optim.SGD else {}
    assert slice_mismatch(cls(params, **kwargs), tp=2) is None


def test_the_probe_finds_what_the_table_declares():
    params = [nn.Parameter(torch.randn(3, 3))]
    assert "fails on flat 1-D fragments (ValueError" in slice_mismatch(torch.optim.Muon(params))
    assert "tensor-parallel row blocks" in slice_mismatch(torch.optim.Muon(params), tp=2, flat=False)
    assert "flat 1-D fragments" in slice_mismatch(torch.optim.Adafactor(params))


def test_every_class_the_table_names_exists_where_its_library_is_installed():
    found = 0
    for name in NOT_ELEMENTWISE:
        module, _, qualname = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), qualname)
        except ModuleNotFoundError:
            continue  # the library is not installed here (torch_optimizer)
        assert known_not_elementwise(cls) == (name, NOT_ELEMENTWISE[name])
        found += 1
    assert found >= 7, found  # torch's four, transformers' Adafactor, DeepSpeed's Lamb and Muons


def test_deepspeeds_muon_config_type_builds_deepspeeds_split():
    """Served now (tests/compat/test_deepspeed_muon.py holds it against DeepSpeed): no longer refused."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0,
        "optimizer": {"type": "Muon", "params": {"muon_lr": 0.02}},
    }
    opt = build_optimizer(model, load_config(config), None)
    assert type(opt).__name__ == "DeepSpeedMuon"
    assert [len(g["params"]) for g in opt.param_groups if g["use_muon"]] == [2]  # the two weights
