"""The offloaded host step in one pass ([Note: one pass over a sub-group] in shardtrain/offload/one_pass.py): every
byte of parameters, compute-dtype fragments and optimizer state equals the multi-pass step's, kept as the reference
(``OptimizerOffload.one_pass = False``), for the optimizer alone and for whole training runs (fp32, bf16, fp16 with
loss scaling, clipping on and off, weight decay on and off, ZeRO 1-3, worlds 1 and 3, a resume)."""

from __future__ import annotations

import pytest
import torch

import shardtrain
from shardtrain.offload.one_pass import OnePassStep, cut_blocks
from shardtrain.offload.optimizer_state import OptimizerOffload
from shardtrain.optim.adam import DeepSpeedAdam
from shardtrain.testing import run_distributed

from helpers.parity import Recipe, global_micro_batches, make_model, train_step

# sizes that leave every kind of tail: below a vector, across blocks, above ATen's grain size (the reference splits
# it over the intra-op threads), one element, none
SIZES = (1, 37, 1000, 70001, 0, 257)


def test_cut_blocks_splits_large_members_on_aligned_elements_and_packs_small_ones_of_one_param_group():
    blocks = cut_blocks([100, 20, 300, 0, 2], [0, 0, 0, 0, 1], block=128)
    assert blocks == [
        [(0, 0, 100), (1, 0, 20)],  # 8 elements left: member 2's piece would stop unaligned inside it
        [(2, 0, 128)],
        [(2, 128, 256)],
        [(2, 256, 300), (3, 0, 0)],
        [(4, 0, 2)],  # another param group starts a block
    ]
    for b in blocks:
        assert sum(hi - lo for _, lo, hi in b) <= 128
    with pytest.raises(ValueError, match="multiple of 64"):
        cut_blocks([10], [0], block=100)


def _tensors(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g) for n in SIZES]
    grads = [torch.randn(n, generator=g) * 3 for n in SIZES]
    return params, grads


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw-no-decay": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.0),
    "adam-l2-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.05, amsgrad=True, maximize=True),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adam-fused-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, amsgrad=True, fused=True),
    "two-groups": lambda ps: torch.optim.AdamW(
        [{"params": ps[:3]}, {"params": ps[3:], "lr": 3e-3, "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1
    ),
    "deepspeed-no-bias-correction": lambda ps: DeepSpeedAdam(ps, lr=1e-2, bias_correction=False, weight_decay=0.1),
    "deepspeed-l2": lambda ps: DeepSpeedAdam(ps, lr=1e-2, adam_w_mode=False, weight_decay=0.1),
}


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_one_pass_is_bitwise_the_optimizers_own_step(name, workers):
    """Blocks of 64 elements (so that members split and tails fall everywhere), factors (unscale then clip), a bf16
    copy-out: every byte of parameters, gradients, state and copies is the multi-pass step's, over three steps."""
    ref_params, ref_grads = _tensors(0)
    new_params, new_grads = _tensors(0)
    ref_opt, new_opt = OPTIMIZERS[name](ref_params), OPTIMIZERS[name](new_params)
    one_pass = OnePassStep(new_opt, block=64, workers=workers)
    factors = (0.125, torch.tensor(0.7312))
    for step in range(3):
        fresh = _tensors(step + 1)[1]
        for r, n, f in zip(ref_grads, new_grads, fresh):
            r.copy_(f)
            n.copy_(f)
        # reference: the multi-pass step (factors as the engine applies them, the optimizer, then the rounding)
        for f in factors:
            torch._foreach_mul_([g for g in ref_grads if g.numel()], f)
        for p, g in zip(ref_params, ref_grads):
            p.grad = g
        ref_opt.step()
        ref_out = [p.to(torch.bfloat16) for p in ref_params]
        # the first step makes the state: only the optimizer's own step does
        assert one_pass.ready(new_params) == (step > 0)
        new_out = [torch.full((p.numel(),), 7.0, dtype=torch.bfloat16) for p in new_params]
        if step == 0:
            for f in factors:
                torch._foreach_mul_([g for g in new_grads if g.numel()], f)
            for p, g in zip(new_params, new_grads):
                p.grad = g
            new_opt.step()
            for p in new_params:
                p.grad = None
            new_out = [p.to(torch.bfloat16) for p in new_params]
        else:
            one_pass.step(new_params, new_grads, new_out, [factors] * len(new_params))
        for r, n in zip(ref_params + ref_grads + ref_out, new_params + new_grads + new_out):
            assert torch.equal(r, n)
        for r, n in zip(ref_params, new_params):
            rs, ns = ref_opt.state[r], new_opt.state[n]
            assert rs.keys() == ns.keys()
            for k in rs:
                assert torch.equal(rs[k], ns[k]), k
    one_pass.close()


def test_one_pass_refuses_what_it_cannot_run_and_the_optimizer_steps_itself():
    ps = _tensors(0)[0]
    for opt in (
        torch.optim.SGD(ps, lr=0.1),
        torch.optim.NAdam(ps),
        torch.optim.AdamW(ps, differentiable=True),
    ):
        assert not OnePassStep.supports(opt)
    hooked = torch.optim.AdamW(ps)
    hooked.register_step_post_hook(lambda *_: None)  # hooks run once per sub-group: only step() runs them
    assert not OnePassStep.supports(hooked)
    assert OnePassStep.supports(torch.optim.AdamW(ps)) and OnePassStep.supports(DeepSpeedAdam(ps))


def test_a_failing_block_raises_after_every_worker_stopped_and_the_intra_op_threads_are_restored():
    params, grads = _tensors(0)
    opt = torch.optim.AdamW(params, lr=1e-2)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    one_pass = OnePassStep(opt, block=64, workers=3)
    threads = torch.get_num_threads()
    factors = [()] * len(params)
    factors[3] = (torch.ones(2),)  # cannot scale a piece of 64 elements: that member's blocks fail
    with pytest.raises(RuntimeError, match="must match the size"):
        one_pass.step(params, grads, [None] * len(params), factors)
    assert torch.get_num_threads() == threads
    one_pass.close()


# -- whole training runs ----------------------------------------------------------------------------


def train(recipe: Recipe, world: int, zero: dict, top: dict, one_pass: bool, resume: str | None, save: str | None):
    """Runs on every rank: losses, full weights and the full optimizer state, how many sub-groups took one pass."""
    import torch.distributed as dist

    OptimizerOffload.one_pass = one_pass
    rank = dist.get_rank()
    model = make_model(recipe)
    wd = top.pop("weight_decay", 0.1)
    config = {
        "train_micro_batch_size_per_gpu": recipe.micro,
        "gradient_accumulation_steps": recipe.gas,
        "gradient_clipping": recipe.clip,
        "zero_optimization": {"reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 0, **zero},
        **top,
    }
    engine = shardtrain.initialize(
        model, config=config, optimizer=torch.optim.AdamW(model.parameters(), 3e-3, weight_decay=wd)
    )
    first = 0
    if resume is not None:
        engine.load_checkpoint(resume)
        first = engine.global_step
    batches = global_micro_batches(recipe, world)
    offload = engine._optimizer.offload
    passes = []
    original = offload._one_pass_step.step

    def counted(tensors, *args):
        passes.append(len(tensors))
        return original(tensors, *args)

    offload._one_pass_step.step = counted
    losses = [train_step(engine, recipe, batches, step, rank) for step in range(first, recipe.steps)]
    if save is not None:
        engine.save_checkpoint(save, tag="t")
    state = engine._optimizer.state_of
    out = {
        "losses": losses,
        "norms": engine.get_global_grad_norm(),
        "params": engine.full_state_dict(),
        "fragments": [t.clone() for t in engine._optimizer.stepped_fragments()],
        "state": [{k: v.clone() for k, v in state(s).items()} for s in engine._optimizer.stepped_tensors()],
        "passes": len(passes),
    }
    engine.close()
    return out


def _same(a: list[dict], b: list[dict]) -> None:
    for ra, rb in zip(a, b):
        assert ra["losses"] == rb["losses"]
        assert torch.equal(torch.as_tensor(ra["norms"]), torch.as_tensor(rb["norms"]))
        for x, y in zip(ra["fragments"], rb["fragments"]):
            assert x.dtype == y.dtype and torch.equal(x, y)
        assert len(ra["state"]) == len(rb["state"])
        for sa, sb in zip(ra["state"], rb["state"]):
            assert sa.keys() == sb.keys()
            for k in sa:
                assert torch.equal(sa[k], sb[k]), k
    for k, v in a[0]["params"].items():
        assert torch.equal(v, b[0]["params"][k]), k


CASES = [  # (stage, world, precision, clip, weight decay)
    (1, 3, "fp32", 0.5, 0.1),
    (2, 3, "bf16", 0.5, 0.1),
    (3, 3, "fp16", 0.05, 0.0),
    (2, 1, "fp16", 0.0, 0.1),
    (3, 1, "bf16", 0.0, 0.0),
]


@pytest.mark.parametrize(("stage", "world", "precision", "clip", "wd"), CASES)
def test_training_with_the_one_pass_is_bitwise_the_multi_pass_step(stage, world, precision, clip, wd):
    """fp16 runs with a dynamic loss scale, so the unscale happens before the norm, and the clip factor in the pass."""
    recipe = Recipe(steps=3, clip=clip)
    zero = {"stage": stage, "sub_group_size": 700, "offload_optimizer": {"device": "cpu"}}
    top = {"weight_decay": wd}
    if precision == "bf16":
        top["bf16"] = {"enabled": True}
    if precision == "fp16":
        top["fp16"] = {"enabled": True, "initial_scale_power": 8}
    multi = run_distributed(train, world, recipe, world, zero, dict(top), False, None, None)
    one = run_distributed(train, world, recipe, world, zero, dict(top), True, None, None)
    _same(one, multi)
    assert multi[0]["passes"] == 0 and one[0]["passes"] >= 2  # the first step makes the state the usual way


def test_resume_with_the_one_pass_is_bitwise_the_multi_pass_step(tmp_path):
    """A checkpoint saved by the multi-pass step, resumed by the one pass (and by the multi-pass step)."""
    recipe = Recipe(steps=4)
    zero = {"stage": 2, "sub_group_size": 700, "offload_optimizer": {"device": "cpu"}}
    top = {"bf16": {"enabled": True}}
    run_distributed(train, 3, Recipe(steps=2), 3, zero, dict(top), False, None, str(tmp_path))
    multi = run_distributed(train, 3, recipe, 3, zero, dict(top), False, str(tmp_path), None)
    one = run_distributed(train, 3, recipe, 3, zero, dict(top), True, str(tmp_path), None)
    _same(one, multi)
    assert one[0]["passes"] >= 2  # the loaded state is ready: both resumed steps take one pass


def train_copies(one_pass: bool, stage: int, world: int, top: dict) -> dict:
    """Runs on every rank: training through the CPU fakes of CUDA's copy streams (``test_host_copies``), page-locking
    as CUDA's do with ``pin_memory`` (the plan of a CPU machine says no): the masters are not page-locked here, so
    every value goes back through a copy-back buffer the pass rounds into. How many sub-groups took the one pass."""
    import test_host_copies
    from shardtrain.engine import parallelize
    from shardtrain.offload import one_pass as one_pass_module

    test_host_copies.DeferredStreams.pins = True  # this worker process only
    sinks = parallelize.build_gradient_sinks
    parallelize.build_gradient_sinks = lambda *args, **kwargs: sinks(*args, **{**kwargs, "pin_memory": True})
    OptimizerOffload.one_pass = one_pass
    passes = []
    original = one_pass_module.OnePassStep.step

    def counted(self, tensors, *args):
        passes.append(len(tensors))
        return original(self, tensors, *args)

    one_pass_module.OnePassStep.step = counted
    out = test_host_copies.train_through_copies(Recipe(steps=3, clip=0.05), stage, world, top, True, False)
    out["passes"] = len(passes)
    return out


@pytest.mark.parametrize(
    ("stage", "world", "top"), [(2, 3, {"bf16": {"enabled": True}}), (3, 1, {"fp16": {"enabled": True}})]
)
def test_the_host_copies_path_with_the_one_pass_is_bitwise_the_multi_pass_step(stage, world, top):
    """CUDA's path on the CPU: the raw host copies unscaled and clipped in the pass, the update, the rounding into
    the copy-back buffers; every loss, norm and final weight as the multi-pass step's."""
    multi = run_distributed(train_copies, world, False, stage, world, top)
    one = run_distributed(train_copies, world, True, stage, world, top)
    for a, b in zip(one, multi):
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
        assert a["direct"] == 0 < a["members"]  # every member goes back through a buffer the pass rounds into
    for k, v in multi[0]["params"].items():
        assert torch.equal(one[0]["params"][k], v), k
    assert multi[0]["passes"] == 0 and one[0]["passes"] >= 2
