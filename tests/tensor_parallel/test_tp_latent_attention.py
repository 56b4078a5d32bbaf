"""Multi-head latent attention under tensor parallelism (``mla_kv_a_proj``, [Note: the latent key/value projection]).

* Through the engine against one process (losses, global gradient norms, final parameters; SGD): DeepSeek-V2 with
  its own plan (latent query path ``q_a_proj -> q_b_proj``, and the plain ``q_proj`` one; its experts too) at tp 2
  (ZeRO stages 3 and 1) and tp 3 (stage 2), in the jobs of ``helpers.tp_hf_cases.outcomes``.
* In one process: the style's **f** sums the gradient of the rotary key columns only (a second **f** on the latent
  columns would count them twice, after ``kv_b_proj``'s own); a model that names no ``qk_rope_head_dim`` is refused
  by name.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from shardtrain.errors import LayoutError
from shardtrain.tensor_parallel import parallelize

from helpers.tp_hf_cases import MLA, make_model, outcomes


@pytest.mark.parametrize("world", [2, 3])
def test_deepseek_v2_matches_one_process(world):
    got = {k: v for k, v in outcomes(world).items() if k[0].startswith("deepseek_v2")}
    assert got and not any(got.values()), got


def test_only_the_rotary_key_columns_are_summed_over_ranks():
    model = make_model("deepseek_v2")
    proj = model.model.layers[0].self_attn.kv_a_proj_with_mqa
    weight = proj.weight.detach().clone()
    summed = []
    comm = SimpleNamespace(rank=0, size=2, all_reduce=lambda t, *a, **k: summed.append(t.shape) or t.mul_(2))
    parallelize(model, None, comm, check_replicated_grads=False)
    assert model.model.layers[0].self_attn.kv_a_proj_with_mqa is proj and torch.equal(proj.weight, weight)
    x = torch.randn(3, proj.in_features, requires_grad=True)
    proj(x).backward(torch.ones(3, proj.out_features))
    rope = MLA["qk_rope_head_dim"]
    upstream = torch.ones(3, proj.out_features)
    upstream[:, -rope:] = 2.0  # the rotary columns' gradient, summed over two ranks that computed the same
    torch.testing.assert_close(x.grad, upstream @ weight)
    assert summed == [torch.Size([3, rope])], summed


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.kv_a_proj_with_mqa = nn.Linear(8, 12)


def test_a_model_without_a_rotary_width_is_refused_by_name():
    with pytest.raises(LayoutError, match=r"kv_a_proj_with_mqa: style 'mla_kv_a_proj' needs .*qk_rope_head_dim"):
        parallelize(_Attention(), {"kv_a_proj_with_mqa": "mla_kv_a_proj"}, SimpleNamespace(rank=0, size=2))
