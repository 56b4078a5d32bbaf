"""A steady-state step reads nothing from the device (issue 33 item 2): the gradient norm, the order flag and the fp16
overflow stay on the device until they are asked for (see [Note: reading device values a step later]), and an fp16
overflow decided on the device skips exactly the step the host would have skipped."""

import pytest
import torch
import torch.distributed as dist

import shardtrain
from shardtrain.testing import run_distributed
from shardtrain.testing.syncs import count_host_syncs

from helpers.parity import Recipe, global_micro_batches, make_model

RECIPE = Recipe(steps=4, gas=2, micro=2, clip=0.5, lr=3e-3)
PRECISIONS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": True}}}


def _config(stage: int, precision: str, **extra) -> dict:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    return {
        "train_micro_batch_size_per_gpu": RECIPE.micro,
        "gradient_accumulation_steps": RECIPE.gas,
        "gradient_clipping": RECIPE.clip,
        "zero_optimization": zero,
        **PRECISIONS[precision],
        **extra,
    }


def _fused_adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=RECIPE.lr, weight_decay=0.1, fused=True)


def _warmup(step: int) -> float:
    return min(1.0, (step + 1) / 3)


def _syncs_per_step(cases: list[tuple[int, str]]) -> dict[str, str]:
    """Each case's synchronizing operations during its last step (forward, backward at every micro-step, step)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    found = {}
    for stage, precision in cases:
        model = make_model(RECIPE)
        engine = shardtrain.initialize(
            model,
            config=_config(stage, precision),
            optimizer=_fused_adamw,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _warmup),
        )
        batches = global_micro_batches(RECIPE, world)
        lo, hi = rank * RECIPE.micro, (rank + 1) * RECIPE.micro
        for step in range(RECIPE.steps):
            with count_host_syncs() as count:
                for m in range(RECIPE.gas):
                    x, y = batches[step * RECIPE.gas + m]
                    engine.backward(engine(x[lo:hi], y[lo:hi]))
                    engine.step()
        found[f"stage {stage} {precision}"] = count.describe()
        assert engine.get_global_grad_norm() > 0  # the norm was computed, only never read during the steps
        engine.close()
    return found


@pytest.mark.parametrize("world", [1, 2])
def test_a_steady_state_step_does_not_synchronize(world):
    cases = [(stage, precision) for stage in (0, 1, 2, 3) for precision in PRECISIONS]
    for found in run_distributed(_syncs_per_step, world, cases, timeout=600):
        assert found == {f"stage {s} {p}": "none" for s, p in cases}


def _overflows(stage: int, on_host: bool) -> dict:
    """fp16 with planted infs at two steps (hysteresis 2: the first uses the allowance, the second halves the scale):
    the overflow decided on the device, or on the host as for an optimizer that cannot skip in its kernel."""
    rank, world = dist.get_rank(), dist.get_world_size()
    recipe = Recipe(steps=7, gas=1, micro=2, lr=RECIPE.lr)
    model = make_model(recipe)
    fp16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 2}
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "fp16": fp16}
    config["zero_optimization"] = {"stage": stage}
    engine = shardtrain.initialize(
        model,
        config=config,
        optimizer=_fused_adamw,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _warmup),
    )
    if on_host:  # the path of optimizers without found_inf: the host reads the overflow before the update
        engine._optimizer.optimizer._step_supports_amp_scaling = False
    planted = {1, 2, 5}
    batches = global_micro_batches(recipe, world)
    lrs, scales = [], []
    for step in range(recipe.steps):
        x, y = batches[step]
        loss = engine(x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2])
        if step in planted and rank == world - 1:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        if step == 3:  # read mid-run, as a script logging every few steps does
            lrs.append(engine.get_lr()[0])
    lrs.append(engine.get_lr()[0])
    scales.append(engine.loss_scale)
    state = [v.clone() for st in engine.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    return {
        "params": engine.full_state_dict(),
        "state": state,
        "lrs": lrs,
        "scales": scales,
        "skipped": engine.skipped_steps,
        "skipped_at": [s for s in range(1, recipe.steps + 1) if engine.step_was_skipped(s)],
        "scheduler": engine.lr_scheduler.last_epoch,
    }


@pytest.mark.parametrize(("stage", "world"), [(0, 1), (2, 3), (3, 2)])
def test_an_overflow_decided_on_the_device_skips_what_the_host_would(stage, world):
    device = run_distributed(_overflows, world, stage, False)
    host = run_distributed(_overflows, world, stage, True)
    for d, h in zip(device, host):
        assert d["skipped_at"] == h["skipped_at"] == [2, 3, 6]
        assert d["skipped"] == h["skipped"] == 3
        # the scheduler stepped only for the 4 applied steps, as DeepSpeed's does: its state was put back
        assert d["scheduler"] == h["scheduler"] == 4
        assert d["lrs"] == h["lrs"] and d["scales"] == h["scales"]
        assert (d["params"] is None) == (h["params"] is None)  # rank 0 gathers them
        for k in h["params"] or {}:
            assert torch.equal(d["params"][k], h["params"][k]), k
        for a, b in zip(d["state"], h["state"]):
            assert torch.equal(a, b)


def _order_exchanges(stage: int) -> dict:
    """Gradients that complete in another order than the launch order: how often the ranks exchange orders."""
    rank, world = dist.get_rank(), dist.get_world_size()
    recipe = Recipe(steps=6, gas=1, micro=2)
    config = _config(stage, "fp32")
    config["zero_optimization"]["reduce_bucket_size"] = 2000  # several buckets
    config["gradient_accumulation_steps"] = 1
    engine = shardtrain.initialize(make_model(recipe), config=config, optimizer=_fused_adamw)
    reducer = engine._reducer
    assert len(reducer.launch_order) > 2
    reducer.launch_order.reverse()  # the same on every rank: safe, and not the order gradients complete in
    exchanges, departed = [], []
    exchange = reducer.order_comm.all_gather_object

    def counted(obj, what=""):
        exchanges.append(engine.global_step)
        return exchange(obj, what=what)

    reducer.order_comm.all_gather_object = counted
    batches = global_micro_batches(recipe, world)
    for step in range(recipe.steps):
        x, y = batches[step]
        engine.backward(engine(x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2]))
        departed.append(reducer.order_departed)  # this backward's observation, before the step settles it
        engine.step()
    return {"exchanges": exchanges, "departed": departed}


@pytest.mark.parametrize("stage", [2, 3])
def test_an_order_departure_is_exchanged_once(stage):
    for r in run_distributed(_order_exchanges, 2, stage):
        # step 1 departs from the layout's order; its flag is read at step 2, which exchanges the orders and adopts
        # them; step 2's flag, raised before that exchange, is dropped; from step 3 on the order holds
        assert r["exchanges"] == [1], r  # global_step is 1 while step 2 runs
        assert r["departed"] == [True, True, False, False, False, False], r
