"""Fused experts under tensor parallelism (``moe_tp_experts``, [Note: experts under tensor parallelism]).

* Through the engine against one process (losses, global gradient norms, final parameters; SGD, so a wrongly
  scaled expert gradient shows): Mixtral, Qwen3-MoE and Qwen2-MoE (a shared expert, replicated by its plan) with their
  own plans at tp 2 (ZeRO stages 3, 1, 2) and tp 3 (stages 3 and 0); ``-m soak`` adds (dp 2, tp 2) at world 4.
* In one process, before anything changes: a plan that splits stacked gate/up halves with stride 1 (Inkling's own)
  is refused by name; an experts module the decorator did not describe is checked on a probe, which refuses a bias
  summed over ranks and a wrong stride, leaves the random stream alone, and accepts the right split; on ``meta`` an
  undescribed module is refused, a described one checked from its record.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from shardtrain.errors import LayoutError
from shardtrain.tensor_parallel import parallelize

from helpers.tp_arch_cases import build
from helpers.tp_hf_cases import outcomes


def _check(world: int, models: tuple[str, ...], dp: int = 1, layouts: tuple | None = None) -> None:
    got = {k: v for k, v in outcomes(world, dp, layouts).items() if k[0] in models}
    assert got, f"no layout of {models} at world {world}"
    failures = [
        f"{m} (dp {dp}, tp {tp}) stage {stage}: {problem}" for (m, stage, tp), problem in got.items() if problem
    ]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [2, 3])
def test_experts_match_one_process(world):
    _check(world, ("mixtral", "qwen3_moe", "qwen2_moe"))


@pytest.mark.soak
def test_experts_match_one_process_with_data_parallel_ranks():
    _check(4, ("mixtral", "qwen3_moe"), dp=2, layouts=(("mixtral", 3, 2), ("qwen3_moe", 2, 2)))


# -- in one process: what is refused before anything changes


def _comm(size: int = 2):
    return SimpleNamespace(rank=0, size=size)  # nothing below communicates


def _refusal(model: nn.Module, plan, size: int = 2) -> str:
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(LayoutError) as err:
        parallelize(model, plan, _comm(size), check_replicated_grads=False)
    for n, p in model.named_parameters():  # a meta tensor has its shape only
        assert p.shape == before[n].shape and (p.is_meta or torch.equal(p, before[n])), f"the refusal changed {n}"
    return str(err.value)


def test_inklings_own_plan_is_refused_for_its_stacked_gate_up():
    """Inkling's plan says ``colwise`` (stride 1) for a ``gate_up_proj`` whose forward chunks it into gate and up
    halves: rank 0 would hold gates only."""
    message = _refusal(build("inkling_text"), None)
    assert "(InklingExperts): style 'moe_tp_experts'" in message and "stride 1" in message, message
    assert "'packed_colwise'" in message, message


class _Experts(nn.Module):
    """A fused experts module of its own (no transformers decorator): stacked gate/up, optional bias."""

    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.num_experts, self.hidden_dim, inter = 3, 6, 4
        torch.manual_seed(0)
        self.gate_up_proj = nn.Parameter(torch.randn(3, 2 * inter, 6))
        self.down_proj = nn.Parameter(torch.randn(3, 6, inter))
        self.down_bias = nn.Parameter(torch.randn(3, 6)) if bias else None

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for slot in range(top_k_index.shape[-1]):
            e = top_k_index[:, slot]
            gate, up = torch.einsum("th,tih->ti", hidden_states, self.gate_up_proj[e]).chunk(2, dim=-1)
            y = torch.einsum("ti,thi->th", torch.nn.functional.silu(gate) * up, self.down_proj[e])
            if self.down_bias is not None:
                y = y + self.down_bias[e]
            out = out + y * top_k_weights[:, slot, None]
        return out


class _Block(nn.Module):
    def __init__(self, **kw) -> None:
        super().__init__()
        self.experts = _Experts(**kw)


PLAN = {"experts.gate_up_proj": "packed_colwise", "experts.down_proj": "rowwise", "experts": "moe_tp_experts"}


def test_the_probe_accepts_the_right_split_and_leaves_the_random_stream_alone():
    model = _Block()
    state = torch.get_rng_state()
    placements = parallelize(model, PLAN, _comm(), check_replicated_grads=False)
    assert torch.equal(torch.get_rng_state(), state), "the probe drew random numbers"
    assert model.experts.gate_up_proj.shape == (3, 4, 6) and model.experts.down_proj.shape == (3, 6, 2)
    assert (placements["experts.gate_up_proj"].dim, placements["experts.gate_up_proj"].stride) == (1, 2)


def test_the_probe_refuses_a_stride_that_pairs_other_features():
    message = _refusal(_Block(), {**PLAN, "experts.gate_up_proj": "colwise"})
    assert "experts (_Experts): style 'moe_tp_experts'" in message and "does not keep the experts' meaning" in message


def test_the_probe_refuses_a_bias_every_rank_would_add():
    message = _refusal(_Block(bias=True), PLAN)
    assert "does not keep the experts' meaning" in message and "down_bias replicated" in message, message


def test_experts_whose_plan_splits_nothing_are_refused():
    message = _refusal(_Block(), {"experts": "moe_tp_experts"})
    assert "splits none of its parameters" in message, message


def test_undescribed_experts_on_meta_are_refused_and_described_ones_checked():
    with torch.device("meta"):
        model = _Block()
    message = _refusal(model, PLAN)
    assert "does not record its weight layout" in message, message
    with torch.device("meta"):
        mixtral = build("mixtral")
    placements = parallelize(mixtral, None, _comm(3), check_replicated_grads=False)
    assert placements["model.layers.0.mlp.experts.gate_up_proj"].describe() == "split on dim 1 with stride 2"
    with torch.device("meta"):
        inkling = build("inkling_text")
    assert "stride 1" in _refusal(inkling, None)


def test_longcat_identity_experts_share_their_input_and_the_probe_needs_it():
    """LongCat-Flash's zero-computation experts return their input on every rank; ``moe_identity_expert`` divides it
    by the tp size so the region's sum restores it. Without that entry the probe measures the doubled identity."""
    from shardtrain.tensor_parallel import hf_tp_plan

    model = build("longcat_flash")
    plan = {k: v for k, v in hf_tp_plan(model).items() if "identity" not in k}
    message = _refusal(model, plan)  # leaves the model as it was
    assert "(LongcatFlashExperts): style 'moe_tp_experts'" in message and "does not keep" in message, message
    parallelize(model, None, _comm(), check_replicated_grads=False)
    identity = model.model.layers[0].mlp.experts.identity_expert
    x = torch.randn(2, 48)
    torch.testing.assert_close(identity(x), x / 2)


def test_an_identity_expert_outside_experts_is_refused():
    model = nn.Sequential(nn.Identity(), nn.Linear(4, 4))
    message = _refusal(model, {"0": "moe_identity_expert", "1": "colwise"})
    assert "0: style 'moe_identity_expert'" in message and "no enclosing module" in message, message


def test_experts_blocks_grouped_mm_cannot_run_are_refused_with_the_sizes_that_fit():
    """[Note: grouped_mm's alignment]: Qwen3-MoE's 12 intermediate features per expert over 2 ranks are 6 per rank,
    24 bytes in fp32, which ``torch._grouped_mm`` refuses deep inside torch at the first forward; the split is refused
    by name before anything changes. With 24 features (12 per rank) fp32 runs, bf16 (24 bytes) does not; the eager
    implementation has no such requirement."""
    from helpers.moe_cases import tiny_moe

    def refusal(model, size, dtype=None):
        with pytest.raises(LayoutError) as err:
            parallelize(model, None, _comm(size), check_replicated_grads=False, compute_dtype=dtype)
        return str(err.value)

    model = tiny_moe("qwen3_moe", 4)
    assert model.config._experts_implementation == "grouped_mm"
    message = refusal(model, 2)
    assert "each rank would hold 6 of the 12 intermediate features" in message, message
    assert "a multiple of 4 features in float32" in message and "from [1, 3]" in message, message
    assert "'batched_mm'" in message, message
    wider = dict(moe_intermediate_size=24)  # 12 features per rank: 48 bytes in fp32, 24 in bf16
    message = refusal(tiny_moe("qwen3_moe", 4, **wider), 2, torch.bfloat16)
    assert "12 of the 24" in message and "a multiple of 8 features in bfloat16" in message, message
    assert "from [1, 3]" in message, message
    placements = parallelize(tiny_moe("qwen3_moe", 4, **wider), None, _comm(2), check_replicated_grads=False)
    assert placements["model.layers.0.mlp.experts.down_proj"].local_shape(2)[2] == 12
    eager = tiny_moe("qwen3_moe", 4)
    eager.set_experts_implementation("eager")
    parallelize(eager, None, _comm(2), check_replicated_grads=False, compute_dtype=torch.bfloat16)
    assert eager.model.layers[0].mlp.experts.down_proj.shape[2] == 6
