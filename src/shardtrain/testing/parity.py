"""Parity with one process: the harness the test suite proves every parallel feature with, for your model too.

A parity check trains the same model twice from the same initial weights on the same global batches: once in one
process with plain PyTorch (the *reference*), once with the engine on several ranks, each rank given its rows of each
global micro-batch. Then it compares each step's mean loss, each step's global gradient norm, and the final
parameters::

    from shardtrain.testing.parity import Recipe, check_parity

    def make_model():                      # module level: the ranks are fresh processes
        torch.manual_seed(0)
        return MyModel()

    def make_optimizer(model):
        return torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batches():                         # the global micro-batches, rows = micro x world
        g = torch.Generator().manual_seed(1)
        return [(torch.randn(12, 16, generator=g), torch.randn(12, 4, generator=g)) for _ in range(8)]

    def loss(model, batch):                # a model's loss on (this rank's part of) one micro-batch
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    if __name__ == "__main__":            # the ranks import this file: start them from the main module only
        recipe = Recipe(make_model, make_optimizer, batches, loss, gas=2, clip=1.0,
                        config={"zero_optimization": {"stage": 3}})
        check_parity(recipe, worlds=(1, 2, 3))  # raises AssertionError naming the step or the tensor that differs

The reference follows the recipe the engine must reproduce: ``gas`` micro-steps each backpropagating ``loss / gas``,
``clip_grad_norm_`` at ``clip``, the optimizer's step. A loss must be a mean over the micro-batch's rows, and the rows
must split evenly over the ranks (``rows = micro x world``). The callables must live in an importable module (not a
notebook cell, not a lambda), and ``batches()`` must return the same tensors at every call: each rank calls it. The
harness splits rows over data-parallel ranks only: configs with tensor or sequence parallelism, whose ranks share
rows, are refused (the suite's own tests cover those). The parameters are compared within the bounds of [Note:
parity bounds]; the float64 run of the reference is what they fall back on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import shardtrain

MicroLoss = Callable[[nn.Module, int], torch.Tensor]
"""``loss(model, i)``: the loss of micro-step ``i`` (counted from the start of the run) on ``model``, the one-process
model or an engine."""


@dataclass(frozen=True)
class Recipe:
    """One training run to prove: what :func:`check_parity` runs in one process and on every rank. The callables
    must be importable (defined at module level): each rank is a fresh process."""

    make_model: Callable[[], nn.Module]
    """A new model, the same weights every call (seed inside)."""
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    batches: Callable[[], Sequence[tuple[torch.Tensor, ...]]]
    """The global micro-batches, ``steps * gas`` of them; dimension 0 of each tensor is the rows, split over ranks."""
    loss: Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]
    """The mean loss of ``model`` on a micro-batch (the whole one in the reference, a rank's rows on a rank)."""
    gas: int = 1
    clip: float = 0.0
    config: dict[str, Any] = field(default_factory=dict)
    """The engine's config, without the batch sizes and the clipping, which the recipe sets."""

    @property
    def steps(self) -> int:
        n = len(self.batches())
        if n % self.gas:
            raise ValueError(f"{n} micro-batches are not a whole number of steps of gas {self.gas}")
        return n // self.gas

    def engine_config(self, world: int) -> dict[str, Any]:
        shared = [k for k in ("tensor_parallel", "sequence_parallel_size") if k in self.config]
        if shared:
            raise ValueError(
                f"the parity harness splits rows over data-parallel ranks only; {shared} in the config make ranks "
                "share rows (the suite's tests/tp_cases.py and tests/sequence_parallel/ check those)"
            )
        rows = self.batches()[0][0].shape[0]
        if rows % world:
            raise ValueError(f"a micro-batch of {rows} rows does not split over {world} ranks")
        return {
            **self.config,
            "train_micro_batch_size_per_gpu": rows // world,
            "gradient_accumulation_steps": self.gas,
            "gradient_clipping": self.clip,
        }


def train_one_process(
    model: nn.Module, optimizer: torch.optim.Optimizer, loss: MicroLoss, steps: int, gas: int, clip: float
) -> dict:
    """The recipe every engine run must reproduce, in one process: ``steps`` optimizer steps of ``gas`` micro-steps
    each backpropagating ``loss / gas``, then ``clip_grad_norm_`` at ``clip`` (0: the norm only), the step and
    ``zero_grad``. Returns each step's mean loss and gradient norm, the final state dict (``params``) and the initial
    one (``init``)."""
    init = {k: v.clone() for k, v in model.state_dict().items()}
    losses, norms = [], []
    for step in range(steps):
        total = 0.0
        for m in range(gas):
            value = loss(model, step * gas + m)
            (value / gas).backward()
            total += value.item() / gas
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return {"losses": losses, "norms": norms, "params": model.state_dict(), "init": init}


def train_engine(engine: shardtrain.Engine, loss: MicroLoss, steps: int, gas: int) -> dict:
    """The engine's side of :func:`train_one_process` on this rank: ``loss(engine, i)``, ``engine.backward`` and
    ``engine.step`` every micro-step. Returns this rank's mean loss and the global gradient norm of each step."""
    losses, norms = [], []
    for step in range(steps):
        total = 0.0
        for m in range(gas):
            value = loss(engine, step * gas + m)
            engine.backward(value)
            engine.step()
            total += value.item() / gas
        losses.append(total)
        norms.append(engine.get_global_grad_norm())
    return {"losses": losses, "norms": norms}


def reference_run(recipe: Recipe) -> dict:
    """The recipe in one process on the whole global batches: fp32 losses, norms and parameters, and the float64
    run's parameters (``exact``, see [Note: parity bounds])."""
    batches = recipe.batches()

    def run(dtype: torch.dtype) -> dict:
        model = recipe.make_model().to(dtype)

        def loss(m: nn.Module, i: int) -> torch.Tensor:
            return recipe.loss(m, tuple(t.to(dtype) if t.is_floating_point() else t for t in batches[i]))

        return train_one_process(model, recipe.make_optimizer(model), loss, recipe.steps, recipe.gas, recipe.clip)

    ref = run(torch.float32)
    ref["exact"] = run(torch.float64)["params"]
    return ref


def engine_run(recipe: Recipe) -> dict:
    """The recipe on this rank (inside :func:`shardtrain.testing.run_distributed`): its rows of every micro-batch.
    Returns its losses, the global norms and the full final parameters."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model = recipe.make_model()
    engine = shardtrain.initialize(model, config=recipe.engine_config(world), optimizer=recipe.make_optimizer(model))
    batches = recipe.batches()

    def loss(e: nn.Module, i: int) -> torch.Tensor:
        rows = batches[i][0].shape[0] // world
        return recipe.loss(e, tuple(t[rank * rows : (rank + 1) * rows] for t in batches[i]))

    out = train_engine(engine, loss, recipe.steps, recipe.gas)
    out["params"] = engine.full_state_dict()
    return out


def check_parity(
    recipe: Recipe, worlds: Sequence[int] = (1, 2, 3), loss_rtol: float = 1e-5, norm_rtol: float = 1e-4
) -> dict[int, list[dict]]:
    """:func:`engine_run` at each world size against one :func:`reference_run`, by :func:`assert_parity`. Returns
    the ranks' results by world size."""
    from shardtrain.testing import run_distributed

    ref = reference_run(recipe)
    results = {}
    for world in worlds:
        results[world] = run_distributed(engine_run, world, recipe)
        try:
            assert_parity(results[world], ref, loss_rtol, norm_rtol)
        except AssertionError as err:
            raise AssertionError(f"world {world}: {err}") from None
    return results


def assert_parity(results: list[dict], ref: dict, loss_rtol: float = 1e-5, norm_rtol: float = 1e-4) -> None:
    """The ranks' ``results`` (losses, norms, and ``params`` on rank 0) against the reference: the mean over ranks of
    each step's loss, each rank's global norm, and the final parameters (:func:`assert_params_near`)."""
    world = len(results)
    losses = [sum(r["losses"][s] for r in results) / world for s in range(len(ref["losses"]))]
    for s, (a, b) in enumerate(zip(losses, ref["losses"])):
        assert abs(a - b) <= loss_rtol * abs(b), f"step {s}: loss {a} vs reference {b}"
    for r in results:  # the norm is global: identical on every rank
        for s, (a, b) in enumerate(zip(r["norms"], ref["norms"])):
            assert abs(a - b) <= norm_rtol * abs(b), f"step {s}: grad norm {a} vs reference {b}"
    assert_params_near(results[0]["params"], ref["params"], ref["init"], exact=ref.get("exact"))


PARAM_TOL = 1e-3
EXACT_FACTOR = 4.0
"""[Note: parity bounds] A distributed run sums gradients in another order than one process, so fp32 results differ
by rounding, and an adaptive optimizer (Adam's ``m / sqrt(v)``) turns the rounding of a gradient that is zero in exact
arithmetic (the key bias of attention: softmax ignores a constant added to every score) into full-size steps in a
direction rounding chose. How far such a tensor lands from the reference is one machine's summation order (BLAS
kernels, thread count), not the numerics: a bound on the largest element failed on another machine of the same kind.
So each tensor passes if either
- its error is at most ``PARAM_TOL`` of the L2 distance the reference moved it (every tensor whose gradient carries
  signal), or
- it is no farther from the exact result (the same training in float64) than ``EXACT_FACTOR`` times the one-process
  fp32 reference is: the run is as accurate as single-process training, whatever rounding did.
A wrongly scaled or missing gradient contribution moves a tensor away from both by a fraction of its distance moved
comparable to 1, hundreds of times either bound (the SGD cases, which do not normalise gradients, show it best)."""


def assert_params_near(
    got: dict,
    want: dict,
    init: dict,
    tol: float = PARAM_TOL,
    exact: dict | None = None,
    what: str = "",
    require_moved: bool = False,
) -> None:
    """Every tensor of ``want`` (the fp32 reference) is in ``got``, within the bounds of [Note: parity bounds]
    (``exact``: the float64 reference's tensors; without it only the first bound applies)."""
    assert got.keys() == want.keys(), (sorted(got.keys() ^ want.keys()), what)
    for k, w in want.items():
        w, g = w.double(), got[k].double()
        moved = (w - init[k].double()).norm().item()
        assert moved > 0 or not require_moved, f"{what}{k} did not move in the reference: the check proves nothing"
        err = (g - w).norm().item()
        if err <= tol * moved + 1e-7:
            continue
        assert exact is not None, f"{what}{k}: error {err:.3g} vs distance moved {moved:.3g} (L2)"
        fp32_err = (w - exact[k]).norm().item()
        got_err = (g - exact[k]).norm().item()
        assert got_err <= EXACT_FACTOR * fp32_err, (
            f"{what}{k}: error {err:.3g} vs distance moved {moved:.3g} (L2), and {got_err:.3g} from the float64 run "
            f"where one fp32 process is {fp32_err:.3g} from it"
        )
