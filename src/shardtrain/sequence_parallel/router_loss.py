"""A mixture of experts' load-balancing (auxiliary) loss under sequence parallelism: the whole sequence's.

[Note: the router's loss under Ulysses]
transformers' MoE causal LMs compute the load-balancing loss ``E * sum_e f_e * P_e`` over the batch's tokens with their
module's ``load_balancing_loss_func(gate_logits, num_experts, top_k, attention_mask)``: a product of means, which on a
slice is another number. During an engine forward that function (a module global, looked up per call) gets each layer's
router logits gathered over the group into one process's ``[b * S, E]`` and the engine's 2-D padding mask, so every rank
adds one process's term. The weighting ``sum_r n_r / N = 1`` ([Note: the loss over a sequence-parallel group] in
:mod:`shardtrain.sequence_parallel.inputs`) keeps it whole, and the gather's backward sends each slice one process's
gradient. Elsewhere the function is the model's own; one of another signature is refused under Ulysses.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardtrain.distributed.communicator import Communicator
from shardtrain.errors import ConfigError
from shardtrain.sequence_parallel.all_to_all import gather_over_group

_NAME = "load_balancing_loss_func"
_active: contextvars.ContextVar[WholeSequenceRouterLoss | None] = contextvars.ContextVar(
    "shardtrain_sequence_parallel_router_loss", default=None
)


class WholeSequenceRouterLoss:
    """The state one forward's load-balancing loss needs: the batch's ``(rows, S)`` and its 2-D padding mask,
    recorded by the engine's split (:meth:`record`), read by the module's function during the forward."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.shape: tuple[int, int] | None = None
        self.mask: torch.Tensor | None = None

    def record(self, shape: tuple[int, int], mask: Any) -> None:
        self.shape, self.mask = shape, mask if torch.is_tensor(mask) else None

    def __call__(self, original: Callable, args: tuple, kwargs: dict[str, Any]) -> Any:
        params = list(inspect.signature(original).parameters)
        if params[:1] != ["gate_logits"] or "attention_mask" not in params:
            raise ConfigError(
                f"{original.__module__}.{_NAME}{inspect.signature(original)} under sequence parallelism: only "
                "transformers' (gate_logits, num_experts, top_k, attention_mask) form is computed over the whole "
                "sequence; pass output_router_logits=False (no load-balancing loss) or train without "
                "sequence_parallel_size"
            )
        bound = inspect.signature(original).bind(*args, **kwargs)
        gate = bound.arguments["gate_logits"]
        if not isinstance(gate, tuple) or not gate or self.shape is None:
            return original(*args, **kwargs)  # no router logits: the model's own answer (0)
        rows, length = self.shape
        local = length // self.comm.size
        layers = torch.stack([g.reshape(rows, local, g.shape[-1]) for g in gate])  # [L, b, S/P, E]
        whole = gather_over_group(layers, self.comm, 2, "the router logits of a sequence-parallel group")  # [L,b,S,E]
        bound.arguments["gate_logits"] = tuple(whole.flatten(1, 2).unbind(0))  # L x [b * S, E], one process's rows
        bound.arguments["attention_mask"] = self.mask
        return original(*bound.args, **bound.kwargs)


def _dispatch(original: Callable) -> Callable:
    @functools.wraps(original)
    def load_balancing_loss_func(*args: Any, **kwargs: Any) -> Any:
        active = _active.get()
        return original(*args, **kwargs) if active is None else active(original, args, kwargs)

    load_balancing_loss_func.__shardtrain_original__ = original
    return load_balancing_loss_func


def install(model: nn.Module, inner: nn.Module, comm: Communicator) -> WholeSequenceRouterLoss | None:
    """Make the load-balancing loss of ``inner`` (the transformers model, ``model`` or inside its wrapper) the whole
    sequence's during ``model``'s forwards (see [Note: the router's loss under Ulysses]); None when its module has
    no such loss."""
    module = importlib.import_module(type(inner).__module__)
    original = getattr(module, _NAME, None)
    if not callable(original):
        return None
    if not hasattr(original, "__shardtrain_original__"):  # once per module: other models of it pass through
        setattr(module, _NAME, _dispatch(original))
    state = WholeSequenceRouterLoss(comm)
    tokens: list[contextvars.Token] = []

    def enter(_module, _args):
        tokens.append(_active.set(state))

    def leave(_module, _args, _output):
        if tokens:
            _active.reset(tokens.pop())

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
    return state
