"""A mixture-of-experts model's load-balancing (auxiliary) loss when its layers are on different pipeline stages.

[Note: the router's loss across stages]
transformers' MoE causal LMs (Mixtral, Qwen2-MoE, Qwen3-MoE, ...) with ``output_router_logits`` add
``router_aux_loss_coef * load_balancing_loss_func(router logits of every layer, E, top_k)`` to the loss:
``E * sum_e (C_e / R) * (P_e / R)``, with ``C_e`` the top-k picks of expert ``e`` and ``P_e`` the sum of its routing
probabilities over every layer's rows, ``R`` the rows of all layers. It is not a sum of per-layer terms (the counts
of one layer weigh the probabilities of every other), so no stage can add "its share" alone. But ``C`` and ``P`` are
running sums over the layers, and transformers' function computes them so (``tokens_per_expert_sum``,
``router_prob_sum``, layer after layer), finishing once. Under pipeline parallelism each stage continues the two sums
over its layers' routers (recorded by forward hooks on the class transformers records ``router_logits`` from,
``_can_record_outputs``) and sends them to the next stage beside its hidden states, one ``[2, E]`` fp32 tensor
(counts, probabilities); the last stage finishes the function (``R``: the micro-batch's rows times the model's
router layers) and adds ``coef *`` it to the micro-batch's loss. The backward of that tensor brings each earlier
stage its layers' gradient, ``coef * E * C_e / R^2`` per probability with ``C`` the whole model's counts: one
process's. The layers are added in the model's order (a stage's layers are consecutive, the stages run in order), so
the value is one process's to the bit. Without ``output_router_logits`` (read at the cut) nothing is carried, as
transformers adds nothing. The arithmetic is checked at the cut against the model module's own function on random
logits: a model whose function differs (another formula, a z-loss) is refused by name, never trained silently apart.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from shardtrain.errors import ConfigError


def _accumulate(state: torch.Tensor, layer_logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """``state`` (counts, probabilities) continued over ``layer_logits``: the body of transformers'
    ``load_balancing_loss_func`` without an attention mask, layer by layer in the same order."""
    num_experts = state.shape[1]
    counts, probs = state.unbind(0)
    for logits in layer_logits:
        # GPU histc wants integers for determinism, the CPU floats (transformers' choice, kept for the same values)
        histc_dtype = torch.float32 if logits.device.type in ("cpu", "mps") else torch.int32
        weights = torch.nn.functional.softmax(logits, dim=-1)
        _, selected = torch.topk(weights, top_k, dim=-1)
        picks = torch.histc(selected.reshape(-1).to(histc_dtype), bins=num_experts, min=0, max=num_experts)
        counts = counts + picks
        probs = probs + weights.float().sum(dim=0)
    return torch.stack([counts, probs])


def _finish(state: torch.Tensor, rows: float) -> torch.Tensor:
    """The loss from the whole model's sums: transformers' last lines, ``rows`` all layers' rows."""
    counts, probs = state.unbind(0)
    return torch.sum((counts / rows) * (probs / rows).unsqueeze(0)) * state.shape[1]


class StageRouters:
    """The routers of one stage's layers: their logits recorded during the stage's forward, and the running sums
    continued over them ([Note: the router's loss across stages])."""

    def __init__(self, routers: list[nn.Module], index: int, num_experts: int, top_k: int) -> None:
        self.index, self.num_experts, self.top_k = index, num_experts, top_k
        self._recorded: list[torch.Tensor] | None = None  # a list only during the stage's forward
        for router in routers:
            router.register_forward_hook(self._record)

    def _record(self, _module: nn.Module, _args: tuple, output: tuple) -> None:
        # a recomputation in backward (activation checkpointing) runs outside the stage's forward: not recorded
        if self._recorded is not None:
            self._recorded.append(output[self.index])

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        self._recorded = []
        try:
            yield self._recorded
        finally:
            self._recorded = None

    def start(self, device: torch.device) -> torch.Tensor:
        """The sums before the model's first layer (the first stage's)."""
        return torch.zeros(2, self.num_experts, dtype=torch.float32, device=device)

    def continued(self, state: torch.Tensor, layer_logits: list[torch.Tensor]) -> torch.Tensor:
        return _accumulate(state, layer_logits, self.top_k)


class RouterLoss:
    """The last stage's end of the load-balancing loss: ``coef * load_balancing_loss_func`` from the sums the stages
    carried ([Note: the router's loss across stages])."""

    def __init__(self, model: nn.Module, router_layers: int) -> None:
        self._model, self.router_layers = model, router_layers

    def __call__(self, state: torch.Tensor, rows_per_layer: int) -> torch.Tensor:
        # read when called, as transformers' forward reads its attribute
        return self._model.router_aux_loss_coef * _finish(state, float(rows_per_layer * self.router_layers))


def _model_function(model: nn.Module):
    return getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)


def _refuse(model: nn.Module, why: str) -> ConfigError:
    return ConfigError(
        f"{type(model).__name__} with output_router_logits under pipeline parallelism: {why}, so its load-balancing "
        "loss cannot be served across stages; set model.config.output_router_logits = False (no load-balancing loss) "
        "or pipeline_parallel_size 1"
    )


def router_recorder(model: nn.Module) -> tuple[type[nn.Module], int] | None:
    """The router class and the index of its logits in the router's output, where ``model`` adds a load-balancing
    loss (``config.output_router_logits``) that :class:`RouterLoss` serves; None where it adds none. Refuses by
    name a model whose loss is not transformers' (checked on random logits: [Note: the router's loss across
    stages])."""
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        return None
    recorder = getattr(type(model), "_can_record_outputs", None) or {}
    recorder = recorder.get("router_logits")
    target = getattr(recorder, "target_class", None)
    if target is None:
        raise _refuse(model, "transformers records no router_logits of it (_can_record_outputs)")
    missing = [a for a in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef") if not hasattr(model, a)]
    function = _model_function(model)
    if missing or function is None:
        what = f"it has no {', '.join(missing)}" if missing else "its module has no load_balancing_loss_func"
        raise _refuse(model, what)
    if not _same_function(function, int(model.num_experts), int(model.num_experts_per_tok)):
        raise _refuse(model, f"{function.__module__}.load_balancing_loss_func is not the function served here")
    return target, int(getattr(recorder, "index", 0) or 0)


@functools.cache
def _same_function(function: Callable, experts: int, top_k: int) -> bool:
    """Whether the sums carried over a cut, finished, give ``function``'s value on random logits of three layers."""
    # real tensors also where the model is fake (the planner cuts a fake model, estimate/planner.py)
    with unset_fake_temporarily(), torch.no_grad():
        logits = torch.randn(3, 5, experts, generator=torch.Generator().manual_seed(0))
        layers = list(logits.unbind(0))
        staged = _accumulate(_accumulate(torch.zeros(2, experts), layers[:1], top_k), layers[1:], top_k)
        theirs = function(tuple(layers), experts, top_k, None)
        return torch.is_tensor(theirs) and torch.allclose(_finish(staged, 15.0), theirs.float(), rtol=1e-5, atol=0)


__all__ = ["RouterLoss", "StageRouters", "router_recorder"]
