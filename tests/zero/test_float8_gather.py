"""ZeRO-3's gather of float8 weights in float8 (issue 50, part 3: the primitive, [Note: gathering in float8]): the
bytes it moves, and numerics equal bit for bit to casting the whole weight gathered in bf16."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardtrain.distributed.communicator import Communicator
from shardtrain.plan.policies import Float8Policy
from shardtrain.precision.float8 import convert_to_float8
from shardtrain.testing import run_distributed
from shardtrain.zero.float8_gather import gather_in_float8, linear_with_precast_weight
from shardtrain.zero.layout import build_buckets


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 32))  # 3072 weights: not a multiple of 3 x 16
    convert_to_float8(model, Float8Policy(True, "tensorwise", True))
    return model.to(torch.bfloat16)


def _run(model: nn.Sequential, x: torch.Tensor, casts: list | None = None) -> tuple[torch.Tensor, ...]:
    """Output, input gradient and weight gradients; ``casts``: the pre-cast weights in place of the modules'."""
    x = x.detach().clone().requires_grad_()
    if casts is None:
        out = model(x)
    else:
        h = torch.nn.functional.gelu(linear_with_precast_weight(model[0], x, casts[0]))
        out = linear_with_precast_weight(model[2], h, casts[1])
    out.float().square().sum().backward()
    grads = (model[0].weight.grad.clone(), model[2].weight.grad.clone())
    model.zero_grad()
    return (out.detach(), x.grad, *grads)


def _gather_both_ways() -> dict:
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = Communicator(dist.group.WORLD, 60.0)
    model = _model()
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    whole = _run(model, x)  # torchao's Float8Linear on the whole bf16 weights: what the bf16 gather leads to
    e4m3 = model[0].config.cast_config_weight.target_dtype
    reference = [
        hp_tensor_to_float8_dynamic(m.weight.detach(), e4m3, m.linear_mm_config, gemm_input_role=GemmInputRole.WEIGHT)
        for m in (model[0], model[2])
    ]
    (bucket,) = build_buckets([[("0.weight", model[0].weight), ("2.weight", model[2].weight)]], world, rank, 0, True)
    comm.reset_stats()
    comm.all_gather(bucket.flat_param, bucket.shard, what="bf16")  # the gather without float8
    bf16 = comm.stats()
    with torch.no_grad():
        bucket.flat_param.zero_()  # the float8 gather reads the shard only: nothing else may leak in
    comm.reset_stats()
    gathered = gather_in_float8(bucket, {0: model[0], 1: model[2]}, comm)
    fp8 = comm.stats()
    casts = [gathered.weights[0], gathered.weights[1]]
    precast = _run(model, x, casts)
    return {
        "bytes": (bf16["all_gather"]["bytes"], fp8["all_gather"]["bytes"], fp8.get("all_reduce", {}).get("calls", 0)),
        "same_casts": all(
            torch.equal(c._data.view(torch.uint8), r._data.view(torch.uint8)) and torch.equal(c._scale, r._scale)
            for c, r in zip(casts, reference)
        ),
        "same_training": [torch.equal(a, b) for a, b in zip(whole, precast)],
        "weight_grad_moved": bool(precast[2].abs().sum() > 0),
        "numel": bucket.padded_numel,
    }


@pytest.mark.parametrize("world", [2, 3])
def test_the_float8_gather_moves_half_of_bf16s_bytes_and_trains_bit_for_bit_as_the_bf16_gather(world):
    for r in run_distributed(_gather_both_ways, world, timeout=120):
        bf16, fp8, amax_reductions = r["bytes"]
        assert bf16 == 2 * r["numel"] * (world - 1) // world  # the ring's convention: 2 bytes per element
        assert fp8 == bf16 // 2, r["bytes"]  # 1 byte per element
        assert r["same_casts"], "the float8 bytes or scales differ from casting the whole gathered weight"
        assert amax_reductions == 1  # one all-reduce of the amaxes per bucket
        # output, input gradient and both weight gradients: the same bits
        assert r["same_training"] == [True] * 4, r["same_training"]
        assert r["weight_grad_moved"]
