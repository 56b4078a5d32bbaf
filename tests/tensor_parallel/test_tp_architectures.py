"""A plan keeps a module's meaning: every transformers architecture with a tensor-parallel plan, trained with that
plan against one process, and the modules a plan cannot split without changing them, refused by name.

* The default run trains a slice (``tp_arch_cases.DEFAULT_SLICE``: Gemma 2 and 3, whose scaled embeddings the plan
  used to replace by plain ones, a normed embedding, Llama, Mixtral's fused experts) at worlds 2 and 3: losses and final
  parameters must match one process (``tp_arch_cases.arch_mismatches``). ``-m soak`` runs every architecture that
  declares a plan (``planned_architectures``): none may mismatch; refusals and loud failures are listed in
  docs/tensor-parallel.md.
* In one process (no communication happens before a refusal, or in a split's setup): a linear subclass with a
  forward of its own is refused by name; an embedding whose forward mixes the columns is refused for a hidden
  split and kept for a vocabulary split; hooks on a plain embedding keep it, on a plain linear refuse it; the probe
  leaves the random stream alone; a kept module is not split twice.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardtrain.errors import LayoutError
from shardtrain.tensor_parallel import parallelize

from helpers.tp_arch_cases import DEFAULT_SLICE, build, planned_architectures, run_architectures

EXPECTED: dict[str, str] = {}  # model type -> outcome other than "match"


@functools.cache
def _outcomes(world: int, model_types: tuple[str, ...]) -> dict:
    from shardtrain.testing import run_distributed

    # every planned architecture too takes well under run_distributed's 240 s, inside the suite's 300 s per test
    results = run_distributed(run_architectures, world, list(model_types))
    for other in results[1:]:  # every rank saw the same outcome
        assert {k: v[0] for k, v in other.items()} == {k: v[0] for k, v in results[0].items()}
    return results[0]


@pytest.mark.parametrize("model_type", DEFAULT_SLICE)
@pytest.mark.parametrize("world", [2, 3])
def test_planned_architecture_matches_one_process(world, model_type):
    status, detail = _outcomes(world, DEFAULT_SLICE)[model_type]
    assert status == EXPECTED.get(model_type, "match"), (status, detail)
    assert detail["split"], "the plan split nothing"


def test_gemma_embedding_is_kept_and_split():
    status, detail = _outcomes(2, DEFAULT_SLICE)["gemma2"]
    assert status == "match" and "model.embed_tokens.weight" in detail["split"], (status, detail)


@pytest.mark.soak
@pytest.mark.parametrize("world", [2, 3])
def test_every_planned_architecture(world):
    outcomes = _outcomes(world, tuple(planned_architectures()))
    mismatched = {k: v[1] for k, v in outcomes.items() if v[0] == "mismatch"}
    assert not mismatched, mismatched
    assert sum(v[0] == "match" for v in outcomes.values()) >= 78, {k: v[0] for k, v in outcomes.items()}


# -- in one process: what is refused, what is kept


def _comm(size: int = 2):
    return SimpleNamespace(rank=0, size=size)  # nothing below communicates


class _ScaledLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2.0


class _RowNormedEmbedding(nn.Embedding):
    def forward(self, ids):
        out = super().forward(ids)
        return out / out.norm(dim=-1, keepdim=True)


class _Net(nn.Module):
    def __init__(self, linear=nn.Linear, embedding=nn.Embedding) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = embedding(8, 4)
        self.up = linear(4, 6)

    def forward(self, ids):
        return self.up(self.emb(ids))


@pytest.mark.parametrize(
    ("model_type", "reason"),
    [("doge", "dt_proj rowwise"), ("esmc", "a norm over all heads cannot be computed")],
)
def test_own_plans_that_change_their_model_are_refused_by_name(model_type, reason):
    """Doge and ESMC pass every check of ``parallelize`` and then fail inside torch with a shape error: they are
    refused by name before anything changes ([Note: plans that change their model])."""
    message = _refusal(build(model_type), None)
    assert f"({model_type}): its own tensor-parallel plan cannot keep" in message and reason in message, message


def _refusal(model: nn.Module, plan: dict | None) -> str:
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(LayoutError) as err:
        parallelize(model, plan, _comm(), check_replicated_grads=False)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "a refused plan changed the model"
    return str(err.value)


def test_linear_with_a_forward_of_its_own_is_refused_by_name():
    message = _refusal(_Net(linear=_ScaledLinear), {"up": "colwise"})
    assert "up (_ScaledLinear)" in message and "overrides Linear.forward" in message, message


def test_hooks_on_a_plain_linear_are_refused():
    model = _Net()
    model.up.register_forward_hook(lambda _m, _a, out: out * 3)
    message = _refusal(model, {"up": "colwise"})
    assert "forward hooks are registered on it" in message, message


def test_an_embedding_forward_mixing_columns_is_refused_for_a_hidden_split():
    message = _refusal(_Net(embedding=_RowNormedEmbedding), {"emb": "embedding_colwise"})
    assert "emb (_RowNormedEmbedding)" in message and "does not commute" in message, message


def test_an_embedding_of_its_own_is_kept_for_a_vocabulary_split():
    model = _Net(embedding=_RowNormedEmbedding)
    emb = model.emb
    state = torch.get_rng_state()
    placements = parallelize(model, {"emb": "embedding_rowwise"}, _comm(), check_replicated_grads=False)
    assert torch.equal(torch.get_rng_state(), state), "the probe drew random numbers"
    assert model.emb is emb and type(emb) is _RowNormedEmbedding and emb.weight.shape == (4, 4)
    assert placements["emb.weight"].dim == 0
    with pytest.raises(LayoutError, match="already tensor-parallel"):
        parallelize(model, {"emb": "embedding_rowwise"}, _comm(), check_replicated_grads=False)


def test_hooks_on_a_plain_embedding_keep_it():
    model = _Net()
    model.emb.register_forward_hook(lambda _m, _a, out: F.relu(out))
    emb = model.emb
    parallelize(model, {"emb": "embedding_rowwise"}, _comm(), check_replicated_grads=False)
    assert model.emb is emb and emb.weight.shape == (4, 4)
