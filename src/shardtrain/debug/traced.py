"""Subscribers inside a captured graph: what graph mode at ZeRO stage 3 runs instead of the hooks' eager splits.

[Note: statistics inside the graph]
At ZeRO stage 3 graph mode gathers the units inside the captured graph, which cannot be split ([Note: no split at
ZeRO stage 3] in :mod:`shardtrain.graph.sharded`): an eager hook would make TorchDynamo run the whole forward
eagerly, every unit gathered at once. But a statistics subscriber computes a reduction of a tensor, which can be a
graph operation like any other. So while such a graph is traced (the manager's ``traced_call``) each hook traces:

1. every subscriber's :meth:`~shardtrain.debug.Subscriber.summarize` of each output tensor (torch operations only);
2. :func:`record`, an operator of ours declared side-effectful (so no pass removes it), whose kernel, run where the
   graph runs it, hands those tensors to the host: :meth:`~shardtrain.debug.Subscriber.record_summary`;
3. for each output that will receive a gradient, :class:`_Observe`, the identity in forward, whose backward (traced
   into the backward graph) summarizes the gradient and calls :func:`record`.

The step is not a constant of the graph: each call passes a *ticket*, an int64 tensor ``[attachment serial, step]``
read as a graph input, and a backward keeps its forward's, so a gradient is reported with its forward's step, as in
eager mode. The statistics read activations and gradients, never a parameter: the graph's own gather schedule stands.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

# The manager's live attachments by serial: where the kernel of ``record`` delivers (an attachment removed since is
# skipped). Typed Any: an attachment has ``deliver(...)`` and ``traced_subscribers``, and this module does not import
# the manager, which imports it.
ATTACHMENTS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


@torch.library.custom_op("shardtrain::debug_record", mutates_args=())
def record(
    ticket: torch.Tensor,
    values: list[torch.Tensor],
    shape: list[int],
    subscriber: int,
    direction: str,
    name: str,
    path: str,
    dtype: torch.dtype,
) -> None:
    """Hand a subscriber's summary of one tensor to the host (see the note above)."""
    serial, step = (int(v) for v in ticket.tolist())
    attachment = ATTACHMENTS.get(serial)
    if attachment is not None:
        attachment.deliver(step, subscriber, direction, name, path, list(shape), dtype, values)


@record.register_fake
def _(ticket, values, shape, subscriber, direction, name, path, dtype) -> None:
    return None


# no output and no mutated input: without this, dead-code elimination would drop every call
torch.fx.node.has_side_effect(torch.ops.shardtrain.debug_record.default)


def summarize_all(attachment: Any, ticket: torch.Tensor, direction: str, name: str, path: str, t: torch.Tensor):
    """Step 1 and 2 of the note for one tensor (traced)."""
    for index, sub in attachment.traced_subscribers:
        torch.ops.shardtrain.debug_record(ticket, sub.summarize(t), t.shape, index, direction, name, path, t.dtype)


class _Observe(torch.autograd.Function):
    """Forward: the identity (a view). Backward: the subscribers' summaries of the gradient, recorded; the gradient
    flows on unchanged (step 3 of the note)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ticket: torch.Tensor, attachment: Any, name: str, path: str):
        ctx.save_for_backward(ticket)
        ctx.attachment, ctx.name, ctx.path = attachment, name, path
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (ticket,) = ctx.saved_tensors
        summarize_all(ctx.attachment, ticket, "backward", ctx.name, ctx.path, grad)
        return grad, None, None, None, None


def observe(attachment: Any, ticket: torch.Tensor, name: str, path: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` summarized now and, if it will receive a gradient, replaced by a view whose backward summarizes it."""
    summarize_all(attachment, ticket, "forward", name, path, t)
    # as the eager hooks: leaves (parameters above all) are left alone. (grad_fn cannot be traced; a tensor that
    # requires grad has one unless it is a leaf)
    if t.requires_grad and not t.is_leaf:
        return _Observe.apply(t, ticket, attachment, name, path)
    return t
