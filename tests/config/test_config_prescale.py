"""``prescale_gradients`` and ``gradient_predivide_factor``: the gradient reductions divide before they sum.

DeepSpeed's ``allreduce_bucket``: with ``prescale_gradients`` each bucket is multiplied by 1/N and summed; with a
``gradient_predivide_factor`` f it is multiplied by 1/f, summed, then by f/N. The result is the average up to rounding,
so training keeps its parity with one process; what changes is what goes on the wire, checked here bucket by bucket.

``initialize`` passes the reducer ``predivide=gradient_predivide(cfg, topology.dp)``; :func:`_recorded` records what
each gradient-bucket reduction sends.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from shardtrain.config.sections import gradient_predivide, load_config
from shardtrain.testing import run_distributed

from helpers.parity import Recipe, assert_parity, engine_run, reference_run

RECIPE = Recipe(optimizer="sgd", steps=2, gas=2)


def _recorded(keys: dict, world: int) -> dict:
    """The factor ``keys`` ask for, and what each gradient bucket reduction sends (filled as training runs)."""
    from shardtrain.distributed.communicator import Communicator

    factor = gradient_predivide(load_config(keys), world)
    sent: list[tuple[str, torch.Tensor]] = []  # (op, input) of each gradient-bucket collective, in order

    def spy(name: str) -> None:
        inner = getattr(Communicator, name)
        signature = inspect.signature(inner)

        def recording(self, *args, **kwargs):
            call = signature.bind(self, *args, **kwargs)
            call.apply_defaults()
            if call.arguments["what"].startswith("gradient bucket"):  # cloned before the collective changes it
                sent.append((call.arguments["op"], call.arguments["t" if name == "all_reduce" else "inp"].clone()))
            return inner(self, *args, **kwargs)

        setattr(Communicator, name, recording)

    spy("all_reduce")
    spy("reduce_scatter")
    return {"factor": factor, "sent": sent}


def _run(keys: dict, stage: int, world: int) -> dict:
    record = _recorded(keys, world)
    out = engine_run(RECIPE, stage, world, extra=keys)
    first = [t for _, t in record["sent"][:2]]  # the first micro-step's first buckets: before any update
    return {**out, "ops": {op for op, _ in record["sent"]}, "first": first, "factor": record["factor"]}


def test_gradient_predivide_follows_deepspeed():
    assert gradient_predivide(load_config({}), 4) is None  # the default averages during the reduction
    assert gradient_predivide(load_config({"prescale_gradients": True}), 4) == 4.0
    assert gradient_predivide(load_config({"gradient_predivide_factor": 2.0}), 4) == 2.0
    # DeepSpeed ignores the factor when prescaling
    keys = {"prescale_gradients": True, "gradient_predivide_factor": 2.0}
    assert gradient_predivide(load_config(keys), 3) == 3.0


@pytest.mark.parametrize(
    ("world", "stage", "keys"),
    [
        (2, 0, {"prescale_gradients": True}),  # all-reduce of the full buffers
        (3, 1, {"prescale_gradients": True}),  # reduce-scatter of the full buffers
        (3, 2, {"gradient_predivide_factor": 2.0}),  # staged reduce-scatter, divided again after
        (2, 3, {"prescale_gradients": True}),  # units' buckets
    ],
)
def test_prescaled_reductions_keep_parity_and_divide_before_summing(world, stage, keys):
    plain = run_distributed(_run, world, {}, stage, world, timeout=200)
    scaled = run_distributed(_run, world, keys, stage, world, timeout=200)
    ref = reference_run(RECIPE, world)
    assert_parity(scaled, ref)
    assert_parity(plain, ref)
    factor = scaled[0]["factor"]
    for rank in range(world):
        assert plain[rank]["ops"] == {"avg"}
        assert scaled[rank]["ops"] == {"sum"}  # the division happened before: the collective sums
        # what each rank sends is its local gradient divided by the factor (the same model and batch as the plain run)
        assert len(scaled[rank]["first"]) == len(plain[rank]["first"]) > 0
        for sent, local in zip(scaled[rank]["first"], plain[rank]["first"]):
            assert local.abs().max() > 0
            torch.testing.assert_close(sent, local * (1.0 / factor), rtol=1e-6, atol=0)
