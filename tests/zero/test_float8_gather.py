"""ZeRO-3's gather of float8 weights in float8 (issue 50, part 3, [Note: gathering in float8]): the bytes it moves,
and numerics equal bit for bit to casting the whole weight gathered in the compute dtype, for one bucket and for the
engine's training at stage 3."""

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
        "bytes": (
            bf16["all_gather"]["bytes"],
            fp8["all_gather_float8"]["bytes"],
            fp8.get("all_reduce", {}).get("calls", 0),
        ),
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


# -- in the engine: ZeRO-3's units gather their converted weights in float8 ------------------------------------------


def _engine_run(gather_in_float8: bool, bf16: bool) -> dict:
    import shardtrain
    from shardtrain.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=2, n_head=4))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "fp8": {"enabled": True, "emulate": True, "gather_in_float8": gather_in_float8},
    }
    engine = shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3))
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    losses = []
    for _ in range(3):
        engine.comm.reset_stats()
        for _ in range(2):
            x = torch.randint(0, 64, (2, 16), generator=g)
            loss = engine(x, torch.roll(x, -1, dims=1))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    stats = engine.comm.stats()  # the last step's
    params = engine.full_state_dict()
    engine.close()
    return {"losses": losses, "stats": stats, "params": params}


def _both_ways(bf16: bool) -> tuple[dict, dict]:
    return _engine_run(True, bf16), _engine_run(False, bf16)


@pytest.mark.parametrize(("world", "bf16"), [(2, False), (3, True)])
def test_zero3_gathers_converted_weights_in_float8_for_half_the_bytes_with_the_same_numerics(world, bf16):
    for rank, (fp8, plain) in enumerate(run_distributed(_both_ways, world, bf16, timeout=200)):
        # the same casts either way (tensorwise: the whole weight's scale), so the same bits
        assert fp8["losses"] == plain["losses"]
        if rank == 0:
            assert fp8["params"].keys() == plain["params"].keys()
            assert all(torch.equal(fp8["params"][k], plain["params"][k]) for k in fp8["params"])
        in_float8 = fp8["stats"]["all_gather_float8"]["bytes"]
        converted_in_compute_dtype = plain["stats"]["all_gather"]["bytes"] - fp8["stats"]["all_gather"]["bytes"]
        assert in_float8 > 0 and "all_gather_float8" not in plain["stats"]
        # per step: 1 byte per element against bf16's 2 (fp32's 4)
        assert in_float8 * (2 if bf16 else 4) == converted_in_compute_dtype, (in_float8, converted_in_compute_dtype)
