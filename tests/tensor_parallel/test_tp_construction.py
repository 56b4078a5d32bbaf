"""Sharded construction under tensor parallelism: ``zero.Init(config)`` with ``tensor_parallel.size`` > 1, models
built on ``meta``, and ``from_pretrained`` reading only each rank's blocks (docs/sharded-construction.md).

Memory is measured as live tensor bytes (:class:`~shardtrain.testing.live_bytes.LiveBytes`): the peak of the
tensor storages a rank held at once during the measured calls.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardtrain
from shardtrain.errors import ConfigError
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.tensor_parallel import GPT_TP_PLAN
from shardtrain.testing import run_distributed
from shardtrain.testing.live_bytes import LiveBytes
from shardtrain.testing.parity import reference_run

from helpers import tp_cases
from helpers.tp_cases import Case, assert_parity, config_for, train


def _bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


# -- the project's GPT at dp 2 x tp 2, ZeRO-3, built under zero.Init(config) ------------------------------------

# large enough that a layer (3 MB) dwarfs the constant temporaries of materialization and the engine's small
# tensors, small enough to build in a second
MEMORY_GPT = GPTConfig(vocab_size=256, seq_len=16, d_model=256, n_layer=4, n_head=4)


def _gpt_parity_and_memory(case: Case) -> dict:
    cfg = config_for(case, stage=3, tp=2)
    # parity: the tp_cases GPT, built sharded
    torch.manual_seed(0)
    with shardtrain.zero.Init(cfg):
        model = tp_cases.make_model(case)
    assert all(p.is_meta for p in model.parameters())  # nothing built yet
    engine = shardtrain.initialize(model, cfg, lambda ps: make_optimizer_of(ps, case), tp_plan=GPT_TP_PLAN)
    init = engine.full_state_dict()
    losses, norms = train(engine, case, tp_cases.global_batches(case, engine.topology.dp), range(case.steps))
    out = {"losses": losses, "norms": norms, "params": engine.full_state_dict(), "init": init}
    engine.close()

    # memory: a larger GPT, built sharded, then built normally (the path without deferred construction)
    whole = GPT(MEMORY_GPT)
    out["model_bytes"], out["layer_bytes"] = _bytes(whole), _bytes(whole.blocks[0])
    del whole
    for how in ("deferred", "normal"):
        with LiveBytes() as seen:
            torch.manual_seed(1)
            with shardtrain.zero.Init(cfg) if how == "deferred" else nullcontext():
                model = GPT(MEMORY_GPT)
            built = seen._sample()
            engine = shardtrain.initialize(model, cfg, lambda ps: torch.optim.AdamW(ps), tp_plan=GPT_TP_PLAN)
        state = engine.state_bytes()
        out[how] = {"built": built, "peak": seen.peak, "params": state["params"], "grads": state["grads"]}
        engine.close()
        del engine, model
    return out


def make_optimizer_of(params, case: Case) -> torch.optim.Optimizer:
    """tp_cases.make_optimizer's two param groups (weight decay for matrices only), over the parameters
    initialize() hands to an optimizer factory (a model built deferred has none to give an optimizer before)."""
    params = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.SGD(groups, lr=case.lr) if case.optimizer == "sgd" else torch.optim.AdamW(groups, lr=case.lr)


def _reference_from(case: Case, init: dict, dp: int, build=None) -> dict:
    """tp_cases' single-process reference (the parity harness's), started from ``init`` (the engine's initial
    weights)."""

    def from_init() -> nn.Module:
        model = build() if build is not None else tp_cases.make_model(case)
        model.load_state_dict(init)
        return model

    recipe = dataclasses.replace(tp_cases.recipe(case, dp), make_model=from_init)
    return reference_run(recipe, bf16=case.dtype == "bf16", exact=False)


def test_zero3_with_tp_built_sharded_trains_at_parity_in_a_fraction_of_the_memory():
    """World 4 = dp 2 x tp 2, ZeRO-3, the model built under ``zero.Init(config)``: training matches one process
    started from the same weights, and no rank's live tensor bytes ever exceed its own shards (parameters, and the
    gradient shard ZeRO-3 allocates at initialize) plus one transformer block; building the model normally does."""
    case = Case(steps=3)
    results = run_distributed(_gpt_parity_and_memory, 4, case)
    r0 = results[0]
    ref = _reference_from(case, r0["init"], dp=2)
    assert_parity(r0, ref, "gpt zero3 dp2 x tp2 built sharded")

    model, layer = r0["model_bytes"], r0["layer_bytes"]
    for rank, r in enumerate(results):
        deferred, normal = r["deferred"], r["normal"]
        assert deferred["built"] == 0, f"rank {rank}: construction allocated {deferred['built']} bytes"
        # this rank keeps 1/(dp*tp) of the parameters (norms, biases and positions are split over dp only)
        assert deferred["params"] <= 1.02 * model / 4, (rank, deferred["params"], model / 4)
        bound = deferred["params"] + deferred["grads"] + layer
        assert deferred["peak"] <= bound, f"rank {rank}: peak {deferred['peak']} > shards + one layer {bound}"
        # the measurement sees a whole model: the normal build holds it all before the split
        assert normal["peak"] >= model > bound, (rank, normal["peak"], model, bound)


# -- an odd world: tp 3, a model built on meta (no Init), and refusals ----------------------------------------------

ODD_GPT = GPTConfig(vocab_size=66, seq_len=16, d_model=48, n_layer=2, n_head=6)


def _odd(case: Case) -> dict:
    cfg = config_for(case, stage=1, tp=3)
    torch.manual_seed(0)
    with torch.device("meta"):  # plain meta: initialize records each module's reset_parameters()
        model = GPT(ODD_GPT)
    engine = shardtrain.initialize(model, cfg, lambda ps: make_optimizer_of(ps, case), tp_plan=GPT_TP_PLAN)
    init = engine.full_state_dict()
    losses, norms = train(engine, case, tp_cases.global_batches(case, engine.topology.dp), range(case.steps))
    out = {"losses": losses, "norms": norms, "params": engine.full_state_dict(), "init": init}
    engine.close()

    # the same model deferred under Init(config) at tp 3 gets the values a one-process deferred build gets
    torch.manual_seed(5)
    with shardtrain.zero.Init(cfg):
        model = GPT(ODD_GPT)
    engine = shardtrain.initialize(model, cfg, lambda ps: torch.optim.AdamW(ps), tp_plan=GPT_TP_PLAN)
    out["deferred_init"] = engine.full_state_dict()
    engine.close()
    if dist.get_rank() == 0:
        out["one_process"] = _one_process_values(lambda: GPT(ODD_GPT), seed=5)

    # an initialization that cannot be computed chunk by chunk is refused by name, on every rank alike
    class Orthogonal(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)
            nn.init.orthogonal_(self.lin.weight)

    with shardtrain.zero.Init(cfg):
        bad = Orthogonal()
    try:
        shardtrain.initialize(bad, cfg, lambda ps: torch.optim.AdamW(ps), tp_plan={"lin": "colwise"})
    except ConfigError as e:
        out["refusal"] = str(e)
    # a model sharded over the world as it was built (Init without the config) cannot be cut into blocks
    with shardtrain.zero.Init():
        sharded = GPT(ODD_GPT)
    try:
        shardtrain.initialize(sharded, cfg, lambda ps: torch.optim.AdamW(ps), tp_plan=GPT_TP_PLAN)
    except ConfigError as e:
        out["eager_refusal"] = str(e)
    return out


def _one_process_values(build, seed: int) -> dict:
    """What a one-process deferred build materializes: every element from its position in the whole tensor."""
    from shardtrain.construction.sharded_init import _RECIPES, chunk_values

    torch.manual_seed(seed)
    with shardtrain.zero.Init(deferred=True):
        model = build()
    return {
        n: chunk_values(_RECIPES[p], n, None, 0, 1, 0, p.numel(), p.dtype, torch.device("cpu")).view(p.shape)
        for n, p in model.named_parameters()
    }


def test_odd_world_tp3_from_meta_trains_at_parity_and_init_is_layout_independent():
    case = Case(steps=3)
    results = run_distributed(_odd, 3, case)
    r0 = results[0]
    ref = _reference_from(case, r0["init"], dp=1, build=lambda: GPT(ODD_GPT))
    assert_parity(r0, ref, "gpt tp3 from meta")
    # reset_parameters() was recorded: nn.Linear's kaiming-uniform bound, LayerNorm's ones
    w = r0["init"]["blocks.0.mlp.0.weight"]
    bound = 1 / 48**0.5
    assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound and w.std() > 0.4 * bound
    assert torch.equal(r0["init"]["blocks.0.ln1.weight"], torch.ones(48))
    for name, want in r0["one_process"].items():
        assert torch.equal(r0["deferred_init"][name], want), name
    assert r0["deferred_init"]["tok.weight"].std().item() == pytest.approx(0.02, rel=0.1)  # GPT's own normal_(0.02)
    for r in results:
        assert "lin.weight (nn.init.orthogonal_ has no chunk-wise form)" in r["refusal"], r["refusal"]
        assert "shardtrain.zero.Init(config)" in r["eager_refusal"], r["eager_refusal"]


def test_init_refuses_eager_sharding_with_tensor_parallelism():
    with pytest.raises(ConfigError, match="deferred"):
        shardtrain.zero.Init({"tensor_parallel": {"size": 2}}, deferred=False)
    with pytest.raises(ConfigError, match="not both"):
        shardtrain.zero.Init({}, config_dict_or_path={})
    assert shardtrain.zero.Init(config_dict_or_path={"tensor_parallel": {"size": 2}}).deferred


# -- recipes and block positions, in one process ---------------------------------------------------------------------


def test_global_flat_index_inverts_shard_block():
    from shardtrain.distributed.placement import TPPlacement, global_flat_index, shard_block

    for shape, dim, stride, size in [((12, 6), 0, 3, 2), ((4, 12, 3), 1, 2, 3), ((8,), 0, 1, 4), ((6, 8), 1, 2, 2)]:
        whole = torch.arange(torch.Size(shape).numel()).view(shape)
        placement = TPPlacement(dim, stride, shape)
        for rank in range(size):
            block = shard_block(whole, placement, rank, size)
            got = global_flat_index(placement, rank, size, torch.arange(block.numel()))
            assert torch.equal(got, block.reshape(-1)), (shape, dim, stride, size, rank)


def test_recorded_initializations_replay_on_blocks():
    """What Init(deferred) records is replayed with the distributions asked for, and a block computed on its own
    (a fused weight split with stride 3 over 3 ranks) equals that block of the whole tensor."""
    from shardtrain.construction.sharded_init import _RECIPES, chunk_values
    from shardtrain.distributed.placement import TPPlacement, shard_block

    class Inits(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(64, 3 * 96)  # kaiming-uniform weight, uniform bias
            nn.init.trunc_normal_(self.qkv.weight, std=0.5, a=-0.3, b=0.6)
            self.low = nn.Linear(32, 32).to(torch.bfloat16)  # a cast keeps the recipe
            self.scale = nn.Parameter(torch.full((8,), 0.5))
            self.emb = nn.Parameter(torch.empty(500, 40).normal_(1.0, 2.0))

    torch.manual_seed(7)
    with shardtrain.zero.Init(deferred=True):
        m = Inits()
    assert all(p.is_meta for p in m.parameters())
    cpu = torch.device("cpu")

    def whole(name, p):
        return chunk_values(_RECIPES[p], name, None, 0, 1, 0, p.numel(), p.dtype, cpu).view(p.shape)

    w = whole("qkv.weight", m.qkv.weight)
    assert w.min() >= -0.3 and w.max() <= 0.6 and abs(w.mean() - 0.111) < 0.01 and abs(w.std() - 0.244) < 0.01
    bias = whole("qkv.bias", m.qkv.bias)
    assert bias.abs().max() <= 1 / 8 and bias.abs().max() > 0.1
    assert whole("low.weight", m.low.weight).dtype == torch.bfloat16
    assert torch.equal(whole("scale", m.scale), torch.full((8,), 0.5))
    e = whole("emb", m.emb)
    assert abs(e.mean() - 1.0) < 0.03 and abs(e.std() - 2.0) < 0.03
    assert not torch.equal(e[0], e[1])
    placement = TPPlacement(0, 3, (288, 64))
    for rank in range(3):
        n = 288 * 64 // 3
        block = chunk_values(_RECIPES[m.qkv.weight], "qkv.weight", placement, rank, 3, 0, n, torch.float32, cpu)
        assert torch.equal(block.view(96, 64), shard_block(w, placement, rank, 3)), rank


# -- from_pretrained under tensor parallelism -----------------------------------------------------------------------


def _pretrained(path: str, case: Case) -> dict:
    from transformers import LlamaForCausalLM

    import shardtrain.weights.loading as weights

    cfg = config_for(case, stage=3, tp=2)
    reads = []
    original = weights._read_block
    seen = LiveBytes()

    def counting(part, block):
        values = original(part, block)
        seen.register(values)
        seen._sample()
        reads.append((tuple(part.get_shape()), tuple(values.shape)))
        return values

    weights._read_block = counting
    with seen:
        engine = shardtrain.from_pretrained(
            LlamaForCausalLM, path, cfg, optimizer=lambda ps: make_optimizer_of(ps, case)
        )
    weights._read_block = original
    state = engine.state_bytes()
    layer = _bytes(engine.module.model.layers[0]) * 2  # this rank's block of one layer, x tp: the whole layer
    out = {"peak": seen.peak, "param_bytes": state["params"], "grad_bytes": state["grads"], "layer": layer}
    out["reads"] = reads
    out["init"] = engine.full_state_dict()
    losses, norms = train(engine, case, tp_cases.global_batches(case, engine.topology.dp), range(case.steps))
    out.update(losses=losses, norms=norms, params=engine.full_state_dict())
    engine.close()
    return out


def test_from_pretrained_under_tp_reads_only_each_ranks_blocks(tmp_path):
    """A tiny Llama saved with save_pretrained, loaded at tp 2 (ZeRO-3): every split weight is read as this rank's
    block only, the loaded weights are the saved ones exactly, memory stays within the rank's shards plus one
    layer, and training matches one process loading the same directory."""
    transformers = pytest.importorskip("transformers")
    case = Case(model="llama", steps=3)
    saved = tp_cases.make_model(case, seed=3)
    saved.save_pretrained(str(tmp_path))
    want = {k: v.clone() for k, v in saved.state_dict().items()}
    results = run_distributed(_pretrained, 2, str(tmp_path), case)
    r0 = results[0]
    assert r0["init"].keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(r0["init"][k], v), k
    ref = _reference_from(case, want, dp=1, build=lambda: transformers.LlamaForCausalLM.from_pretrained(str(tmp_path)))
    assert_parity(r0, ref, "llama from_pretrained tp2 zero3")
    for rank, r in enumerate(results):
        assert r["reads"], "no tensor-parallel block was read"
        for whole, block in r["reads"]:
            assert torch.Size(block).numel() * 2 == torch.Size(whole).numel(), (rank, whole, block)
        bound = r["param_bytes"] + r["grad_bytes"] + r["layer"]
        assert r["peak"] <= bound, f"rank {rank}: peak {r['peak']} > shards + one layer {bound}"


# -- wider: Hugging Face models built sharded at other stages (soak) -------------------------------------------------


def _hf_built_sharded(case: Case, stage: int, tp: int) -> dict:
    cfg = config_for(case, stage=stage, tp=tp)
    torch.manual_seed(0)
    with shardtrain.zero.Init(cfg):
        model = tp_cases.make_model(case)
    engine = shardtrain.initialize(model, cfg, lambda ps: make_optimizer_of(ps, case), tp_plan=tp_cases.plan_for(case))
    init = engine.full_state_dict()
    losses, norms = train(engine, case, tp_cases.global_batches(case, engine.topology.dp), range(case.steps))
    out = {"losses": losses, "norms": norms, "params": engine.full_state_dict(), "init": init}
    engine.close()
    return out


@pytest.mark.soak
@pytest.mark.parametrize(("model", "stage"), [("gpt2", 0), ("gpt2", 3), ("qwen3", 2), ("llama", 1)])
def test_hf_models_built_sharded_at_dp2_tp2(model, stage):
    """GPT-2 (Conv1D, fused c_attn split with stride 3), Qwen3 (per-head norms with tp-partial gradients) and Llama,
    built under zero.Init(config) at world 4 = dp 2 x tp 2, train at parity with one process from the same weights."""
    pytest.importorskip("transformers")
    case = Case(model=model, steps=3)
    r0 = run_distributed(_hf_built_sharded, 4, case, stage, 2)[0]
    assert_parity(r0, _reference_from(case, r0["init"], dp=2), f"{model} stage {stage} dp2 x tp2 built sharded")
