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

    def batches():                         # the global micro-batches, rows = micro x data-parallel ranks
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
``clip_grad_norm_`` at ``clip``, the optimizer's step. A loss must be a mean over the micro-batch's rows (or the recipe
says ``per_rank_loss``, see [Note: the layout a recipe describes]), and the rows must split evenly over the
data-parallel ranks. The callables must live in an importable module (not a notebook cell, not a lambda), and
``batches()`` must return the same tensors at every call: each rank calls it. Configs with tensor or sequence
parallelism are described too ([Note: the layout a recipe describes]). The parameters are compared within the bounds
of [Note: parity bounds]; the float64 run of the reference is what they fall back on.

[Note: the layout a recipe describes]
The reference is always the same model in one process, trained on the whole global micro-batches with the same
optimizer; the config's layout only changes which rows a rank gets and how its results map back:
- *Rows.* ``world = dp * sp * tp`` (hybrid sharding splits ``dp`` without changing it). A micro-batch's rows are split
  over the ``dp`` ranks in order (``engine.topology.dp_rank``); the ``sp * tp`` ranks of one data-parallel rank get
  the same whole rows: the engine cuts sequences (Ulysses) and weights (the recipe's ``tp_plan``) itself.
- *Losses.* Each rank returns its rows' whole-sequence loss, so the mean over ranks is the mean over data-parallel
  ranks, which :func:`assert_parity` compares with the reference's: the whole micro-batch's loss, which a mean over
  rows matches as the engine averages gradients over data-parallel ranks. With ``per_rank_loss`` the reference takes
  the mean of the data-parallel ranks' losses, as a mean over real tokens needs: ranks hold different numbers of
  them, so the mean of their means, which the engine trains on, is not the whole batch's mean.
- *Parameters.* ``engine.full_state_dict()`` joins tensor-parallel blocks (fused weights with their stride) and ZeRO
  fragments into the reference's names and shapes, on rank 0.
- *Precision.* With ``bf16`` the reference computes in bf16 and steps fp32 masters made from the fp32 initial weights,
  gradients summed in fp32 over micro-steps, as the engine (:func:`train_one_process_bf16`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import shardtrain

MicroLoss = Callable[[nn.Module, int], torch.Tensor]
"""``loss(model, i)``: the loss of micro-step ``i`` (counted from the start of the run) on ``model``, the one-process
model or an engine."""


Batch = tuple[torch.Tensor, ...] | Mapping[str, Any]
"""A micro-batch: a tuple of tensors, or the keyword inputs of a model; dimension 0 of every tensor is the rows (a
keyword's value that is not a tensor is given to every rank as it is)."""


@dataclass(frozen=True)
class Recipe:
    """One training run to prove: what :func:`check_parity` runs in one process and on every rank. The callables
    must be importable (defined at module level, or ``functools.partial`` of such): each rank is a fresh process."""

    make_model: Callable[[], nn.Module]
    """A new model, the same weights every call (seed inside)."""
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    batches: Callable[[], Sequence[Batch]]
    """The global micro-batches, ``steps * gas`` of them; dimension 0 of each tensor is the rows, split over the
    data-parallel ranks."""
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    """The mean loss of ``model`` (the one-process model, or an engine) on a micro-batch: the whole one in the
    reference, a data-parallel rank's rows on a rank."""
    gas: int = 1
    clip: float = 0.0
    config: dict[str, Any] = field(default_factory=dict)
    """The engine's config, without the batch sizes and the clipping, which the recipe sets. Its
    ``tensor_parallel.size`` and ``sequence_parallel_size`` say the layout ([Note: the layout a recipe
    describes])."""
    tp_plan: Any = None
    """``initialize``'s ``tp_plan`` under tensor parallelism (None: a transformers model's own plan)."""
    per_rank_loss: bool = False
    """The reference's loss of a micro-batch is the mean of the data-parallel ranks' losses on their rows instead of
    the whole micro-batch's ([Note: the layout a recipe describes])."""

    @property
    def steps(self) -> int:
        n = len(self.batches())
        if n % self.gas:
            raise ValueError(f"{n} micro-batches are not a whole number of steps of gas {self.gas}")
        return n // self.gas

    @property
    def rows(self) -> int:
        """The rows of a global micro-batch."""
        return _rows_in(self.batches()[0])

    def _sharing(self) -> tuple[int, int]:
        """``(tp, sp)``: the config's tensor-parallel size and the ranks sharing a sequence (sequence- times
        context-parallel size), whose ranks share rows."""
        tp = (self.config.get("tensor_parallel") or {}).get("size", 1)
        return tp, self.config.get("sequence_parallel_size", 1) * self.config.get("context_parallel_size", 1)

    def data_parallel(self, world: int) -> int:
        """The data-parallel ranks of ``world`` processes under the config's tensor and sequence parallelism."""
        tp, sp = self._sharing()
        if world % (tp * sp):
            raise ValueError(
                f"tensor_parallel.size {tp} x sequence_parallel_size {sp} does not divide the {world} ranks"
            )
        return world // (tp * sp)

    def engine_config(self, world: int) -> dict[str, Any]:
        """The engine's config at ``world`` processes. A layout that does not divide ``world`` is left for
        ``initialize`` to refuse by name (:meth:`data_parallel` refuses it here)."""
        tp, sp = self._sharing()
        dp = max(world // (tp * sp), 1)
        if self.rows % dp:
            of = f" (the data-parallel ranks of {world})" if dp != world else ""
            raise ValueError(f"a micro-batch of {self.rows} rows does not split over {dp} ranks{of}")
        return {
            **self.config,
            "train_micro_batch_size_per_gpu": self.rows // dp,
            "gradient_accumulation_steps": self.gas,
            "gradient_clipping": self.clip,
        }

    def rows_of(self, batch: Batch, dp_rank: int, dp: int) -> Batch:
        """Data-parallel rank ``dp_rank``'s rows of ``batch`` (of ``dp`` equal parts)."""
        n = _rows_in(batch) // dp
        part = slice(dp_rank * n, (dp_rank + 1) * n)
        if isinstance(batch, Mapping):
            return {k: v[part] if torch.is_tensor(v) else v for k, v in batch.items()}
        return tuple(t[part] for t in batch)

    def reference_loss(self, model: nn.Module, batch: Batch, dp: int) -> torch.Tensor:
        """The loss the reference backpropagates for ``batch`` when the engine has ``dp`` data-parallel ranks."""
        if not self.per_rank_loss:
            return self.loss(model, batch)
        return sum(self.loss(model, self.rows_of(batch, d, dp)) for d in range(dp)) / dp


def _rows_in(batch: Batch) -> int:
    tensors = [v for v in (batch.values() if isinstance(batch, Mapping) else batch) if torch.is_tensor(v)]
    return tensors[0].shape[0]


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


def train_one_process_bf16(
    model: nn.Module, optimizer: torch.optim.Optimizer, loss: MicroLoss, steps: int, gas: int, clip: float
) -> dict:
    """:func:`train_one_process` in mixed precision, as the engine's ``bf16`` does it: fp32 masters made from the fp32
    model, bf16 compute, each micro-step's gradients summed into the masters in fp32, clipping and the optimizer on
    the masters, then the bf16 parameters refreshed from them. ``model`` must be fp32; ``init`` is its fp32 state,
    ``params`` the final bf16 one."""
    init = {k: v.clone() for k, v in model.state_dict().items()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    masters = {p: p.detach().clone() for p in params}
    for g in optimizer.param_groups:
        g["params"] = [masters[p] for p in g["params"]]
    model.to(torch.bfloat16)
    losses, norms = [], []
    for step in range(steps):
        total = 0.0
        for m in range(gas):
            value = loss(model, step * gas + m)
            (value / gas).backward()
            for p in params:
                masters[p].grad = p.grad.float() + (masters[p].grad if masters[p].grad is not None else 0)
                p.grad = None
            total += value.item() / gas
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(masters.values()), clip if clip > 0 else float("inf"))))
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for p in params:
                p.copy_(masters[p])
        losses.append(total)
    return {"losses": losses, "norms": norms, "params": model.state_dict(), "init": init}


def reference_run(recipe: Recipe, dp: int = 1, bf16: bool = False, exact: bool = True) -> dict:
    """The recipe in one process on the whole global batches, for an engine of ``dp`` data-parallel ranks (which
    only ``per_rank_loss`` reads): fp32 losses, norms and parameters, and the float64 run's parameters (``exact``,
    see [Note: parity bounds]; ``exact=False`` skips that run). ``bf16``: the mixed-precision run of
    :func:`train_one_process_bf16` instead, without a float64 one."""
    batches = recipe.batches()

    def run(dtype: torch.dtype) -> dict:
        model = recipe.make_model().to(dtype)

        def loss(m: nn.Module, i: int) -> torch.Tensor:
            return recipe.reference_loss(m, _cast(batches[i], dtype), dp)

        return train_one_process(model, recipe.make_optimizer(model), loss, recipe.steps, recipe.gas, recipe.clip)

    if bf16:
        model = recipe.make_model()

        def mixed_loss(m: nn.Module, i: int) -> torch.Tensor:
            return recipe.reference_loss(m, batches[i], dp)

        return train_one_process_bf16(
            model, recipe.make_optimizer(model), mixed_loss, recipe.steps, recipe.gas, recipe.clip
        )
    ref = run(torch.float32)
    if exact:
        ref["exact"] = run(torch.float64)["params"]
    return ref


def _cast(batch: Batch, dtype: torch.dtype) -> Batch:
    """``batch``'s floating-point tensors in ``dtype`` (a float64 reference computes on float64 inputs)."""

    def cast(v: Any) -> Any:
        return v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v

    if isinstance(batch, Mapping):
        return {k: cast(v) for k, v in batch.items()}
    return tuple(cast(t) for t in batch)


def _world() -> int:
    """This job's processes; before ``initialize`` has made the process group, the launcher's ``WORLD_SIZE``."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def build_engine(recipe: Recipe) -> shardtrain.Engine:
    """The recipe's engine on this rank: its model, optimizer, ``tp_plan`` and config for this job's world size."""
    model = recipe.make_model()
    return shardtrain.initialize(
        model, config=recipe.engine_config(_world()), optimizer=recipe.make_optimizer(model), tp_plan=recipe.tp_plan
    )


def engine_run(recipe: Recipe, inspect: Callable[[shardtrain.Engine], dict] | None = None) -> dict:
    """The recipe on this rank (inside :func:`shardtrain.testing.run_distributed`): its data-parallel rank's rows of
    every micro-batch ([Note: the layout a recipe describes]). Returns its losses, the global norms, the full final
    parameters (rank 0; None elsewhere) and what ``inspect(engine)`` returns after training (counters, groups), then
    closes the engine."""
    engine = build_engine(recipe)
    out = train_rows(engine, recipe)
    out["params"] = engine.full_state_dict()
    if inspect is not None:
        out.update(inspect(engine))
    engine.close()
    return out


def train_rows(engine: shardtrain.Engine, recipe: Recipe, loss: Callable | None = None) -> dict:
    """:func:`train_engine` on this rank's rows of the recipe's batches; ``loss(engine, batch, i)`` instead of the
    recipe's where a rank does more than compute it (``i`` counts micro-steps from the start)."""
    topo, batches = engine.topology, recipe.batches()

    def micro(e: nn.Module, i: int) -> torch.Tensor:
        rows = recipe.rows_of(batches[i], topo.dp_rank, topo.dp)
        return recipe.loss(e, rows) if loss is None else loss(e, rows, i)

    return train_engine(engine, micro, recipe.steps, recipe.gas)


def check_parity(
    recipe: Recipe, worlds: Sequence[int] = (1, 2, 3), loss_rtol: float = 1e-5, norm_rtol: float = 1e-4
) -> dict[int, list[dict]]:
    """:func:`engine_run` at each world size against :func:`reference_run`, by :func:`assert_parity`. Returns the
    ranks' results by world size."""
    from shardtrain.testing import run_distributed

    dps = {world: recipe.data_parallel(world) for world in worlds}  # a layout that does not fit: before any rank
    refs: dict[int, dict] = {}
    results = {}
    for world in worlds:
        dp = dps[world] if recipe.per_rank_loss else 1  # the reference depends on dp only then
        if dp not in refs:
            refs[dp] = reference_run(recipe, dp)
        results[world] = run_distributed(engine_run, world, recipe)
        try:
            assert_parity(results[world], refs[dp], loss_rtol, norm_rtol)
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
