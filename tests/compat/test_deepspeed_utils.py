"""``deepspeed.utils`` (the ``safe_get_full_*`` / ``safe_set_full_*`` functions, ``zero_to_fp32``), ``deepspeed.zero.
register_external_parameter`` and ``deepspeed.checkpoint.utils`` with DeepSpeed's meaning: the whole tensor on every
rank, the same at every world size and ZeRO stage as in one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardtrain.testing import run_distributed

GLOBAL_BATCH = 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))  # sizes that split unevenly over 2 and 3
    model[0].bias.requires_grad_(False)
    return model


def _run(stage: int, workdir: str) -> dict:
    import shardtrain.deepspeed as deepspeed
    from shardtrain.deepspeed.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
    )

    world, rank = dist.get_world_size(), dist.get_rank()
    config = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "steps_per_print": 10**6,
    }
    model = _model()
    deepspeed.zero.register_external_parameter(model[2], model[0].weight)  # accepted, nothing to do
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(GLOBAL_BATCH, 5, generator=torch.Generator().manual_seed(1))
    mine = x.chunk(world)[rank]
    engine.backward(engine(mine).square().mean())
    names = [n for n, _ in model.named_parameters()]
    out: dict = {"grad": {n: safe_get_full_grad(p) for n, p in model.named_parameters()}}
    engine.step()
    out["fp32"] = {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
    out["exp_avg"] = {n: safe_get_full_optimizer_state(p, "exp_avg") for n, p in model.named_parameters()}
    out["missing_key"] = safe_get_full_optimizer_state(model[2].weight, "no_such_state")
    w = model[2].weight
    shape = out["fp32"]["2.weight"].shape
    new = torch.arange(shape.numel(), dtype=torch.float32).reshape(shape) / 10
    safe_set_full_fp32_param(w, new)
    safe_set_full_optimizer_state(w, torch.full(shape, 0.25), "exp_avg_sq")
    out["set_fp32"] = safe_get_full_fp32_param(w)
    out["set_state"] = safe_get_full_optimizer_state(w, "exp_avg_sq")
    with deepspeed.zero.GatheredParameters([w]):
        out["gathered"] = w.detach().clone()
    engine.save_checkpoint(workdir)
    out["names"] = names
    return out


def _both(stage: int) -> dict:
    """One step of the same model and data with real DeepSpeed and with ``shardtrain.deepspeed``, read through the
    same ``deepspeed.utils`` calls (the trainable parameters: DeepSpeed's have no fp32 copy when frozen)."""
    import contextlib
    import importlib
    import io

    world, rank = dist.get_world_size(), dist.get_rank()
    x = torch.randn(GLOBAL_BATCH, 5, generator=torch.Generator().manual_seed(1)).chunk(world)[rank]
    out = {}
    for impl in ("deepspeed", "shardtrain.deepspeed"):
        deepspeed = importlib.import_module(impl)
        utils = importlib.import_module(f"{impl}.utils")
        config = {
            "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
            "steps_per_print": 10**6,
        }
        model = _model()
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        with contextlib.redirect_stdout(io.StringIO()):
            engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for _, p in trainable], config=config)
        engine.backward(engine(x).square().mean())
        r = {"grad": {n: utils.safe_get_full_grad(p).float().clone() for n, p in trainable}}
        engine.step()
        r["fp32"] = {n: utils.safe_get_full_fp32_param(p).clone() for n, p in trainable}
        for key in ("exp_avg", "exp_avg_sq"):
            r[key] = {n: utils.safe_get_full_optimizer_state(p, key).clone() for n, p in trainable}
        if stage < 3:  # DeepSpeed 0.19.8's stage-3 setters fail on a parameter its ranks split unevenly (21 over
            # 2: its last rank's slice of the value runs past the end); ours are compared with one process above
            w = model[2].weight
            utils.safe_set_full_fp32_param(w, torch.full((3, 7), 0.5))
            utils.safe_set_full_optimizer_state(w, torch.full((3, 7), 0.25), "exp_avg")
            r["set"] = (utils.safe_get_full_fp32_param(w).clone(), utils.safe_get_full_optimizer_state(w, "exp_avg"))
        out[impl] = r
        del engine
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_safe_get_full_matches_real_deepspeed(stage, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # inherited by the ranks: DeepSpeed's CPU accelerator
    for r in run_distributed(_both, 2, stage):
        ours, theirs = r["shardtrain.deepspeed"], r["deepspeed"]
        for what in ("grad", "fp32", "exp_avg", "exp_avg_sq"):
            assert ours[what].keys() == theirs[what].keys()
            for name in ours[what]:
                assert _close(ours[what][name], theirs[what][name]), (what, name)
        if stage < 3:
            assert torch.equal(theirs["set"][0], torch.full((3, 7), 0.5))
            assert torch.equal(ours["set"][0], theirs["set"][0]) and torch.equal(ours["set"][1], theirs["set"][1])


def _close(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == torch.float32 and a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("stage", "world"), [(3, 2), (3, 3), (2, 2), (0, 2)])
def test_safe_get_full_matches_one_process(stage, world, tmp_path):
    from shardtrain.deepspeed.utils.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
    )

    one = run_distributed(_run, 1, stage, str(tmp_path / "one"))[0]
    results = run_distributed(_run, world, stage, str(tmp_path / "many"))
    for r in results:
        for what in ("grad", "fp32", "exp_avg"):
            assert r[what].keys() == one[what].keys()
            for name in r[what]:
                assert _close(r[what][name], one[what][name]), (what, name)
        assert r["fp32"]["0.bias"] is None and r["grad"]["0.bias"] is None  # frozen: no fp32 copy, as in DeepSpeed
        assert r["missing_key"] is None
        expected = torch.arange(21, dtype=torch.float32).reshape(3, 7) / 10
        assert torch.equal(r["set_fp32"], expected) and torch.equal(r["gathered"], expected)
        assert torch.equal(r["set_state"], torch.full((3, 7), 0.25))
    # zero_to_fp32 on the checkpoint each wrote: the fp32 weights after the set, the same at both world sizes
    full = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "many")
    assert full.keys() == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert torch.equal(full["2.weight"], expected)
    alone = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "one")
    assert all(torch.allclose(full[k], alone[k], rtol=1e-5, atol=1e-6) for k in full)
    convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "many", tmp_path / "bin")
    saved = torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True)
    assert all(torch.equal(saved[k], full[k]) for k in full) and saved.keys() == full.keys()
    convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "many", tmp_path / "st", safe_serialization=True)
    model = load_state_dict_from_zero_checkpoint(_model(), tmp_path / "many")
    assert torch.equal(model[2].weight.detach(), expected)
    assert (tmp_path / "st" / "model.safetensors").is_file()


def test_utils_names_refused_and_clone_tensors_for_torch_save():
    import shardtrain.deepspeed as deepspeed
    from shardtrain.deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    from shardtrain.deepspeed.utils import RepeatingLoader, logger

    assert logger.name == "shardtrain"
    assert [next(it) for it in [iter(RepeatingLoader([1, 2]))] for _ in range(5)] == [1, 2, 1, 2, 1]
    base = torch.arange(10.0)
    cloned = clone_tensors_for_torch_save({"a": base[2:4], "b": [base[:1], 3], "c": (base,)})
    assert cloned["a"].untyped_storage().nbytes() == 8 and torch.equal(cloned["a"], base[2:4])
    assert cloned["b"][1] == 3 and isinstance(cloned["c"], tuple) and cloned["c"][0] is not base
    with pytest.raises(deepspeed.NotProvidedError, match=r"safe_get_local_fp32_param.*safe_get_full"):
        _ = deepspeed.utils.safe_get_local_fp32_param
    with pytest.raises(deepspeed.NotProvidedError, match=r"deepspeed\.utils\.groups.*topology"):
        _ = deepspeed.utils.groups


def _experts_run(stage: int, ep: int) -> dict:
    """A tiny Mixtral under expert parallelism read through ``safe_get_full_*`` beside the same model and global
    batch in one process (built in each rank): an expert parameter's whole tensor is this rank's experts', reduced
    over the ranks holding the same experts, never summed with other experts."""
    import transformers

    import shardtrain.deepspeed as deepspeed
    from shardtrain.deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state

    world, rank = dist.get_world_size(), dist.get_rank()

    def make():
        torch.manual_seed(0)
        cfg = transformers.MixtralConfig(
            vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16,
            attn_implementation="eager", initializer_range=0.2,
        )  # fmt: skip
        return transformers.MixtralForCausalLM(cfg)

    ids = torch.randint(0, 32, (world, 6), generator=torch.Generator().manual_seed(1))
    one = make()
    sum(one(input_ids=ids[r : r + 1], labels=ids[r : r + 1]).loss for r in range(world)).div(world).backward()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "expert_parallel_size": ep,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "steps_per_print": 10**6,
    }
    model = make()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.backward(engine(input_ids=ids[rank : rank + 1], labels=ids[rank : rank + 1]).loss)
    ep_rank, per = engine.shardtrain_engine.topology.ep_rank, 4 // ep
    grads = {}
    for (n, p), q in zip(model.named_parameters(), one.parameters(), strict=True):
        want = q.grad[ep_rank * per : (ep_rank + 1) * per] if ".experts." in n else q.grad
        grads[n] = (safe_get_full_grad(p), want)
    engine.step()
    after = {n: (safe_get_full_fp32_param(p), p.detach().clone()) for n, p in model.named_parameters()}
    moments = {n: safe_get_full_optimizer_state(p, "exp_avg") for n, p in model.named_parameters()}
    return {"grads": grads, "after": after, "moments": moments}


@pytest.mark.parametrize(
    ("stage", "world", "ep"), [(2, 2, 2), (1, 2, 2), pytest.param(2, 4, 2, marks=pytest.mark.soak)]
)
def test_safe_get_full_under_expert_parallelism(stage, world, ep):
    for r in run_distributed(_experts_run, world, stage, ep):
        assert any(".experts." in n for n in r["grads"])
        for n, (got, want) in r["grads"].items():
            assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-6), n
        for n, (got, param) in r["after"].items():
            assert torch.equal(got, param), n  # fp32 at stages 1-2: the master is the parameter after the step
            assert r["moments"][n].shape == param.shape, n
