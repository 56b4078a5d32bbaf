"""Attach :class:`Subscriber` objects to a model's modules with forward hooks, and number the steps.

Step numbering
    Steps count from 0. On a plain ``nn.Module`` the first forward of the root module is step 0 and the counter
    advances once per root forward. On an engine (anything that is not a module but has ``.module`` and
    ``.global_step``, such as :class:`shardtrain.Engine`), the step is ``engine.global_step`` read when the root
    forward starts, i.e. it advances once per *optimizer* step. With gradient accumulation the micro-steps of one
    optimizer step therefore share a step number; the StatisticsSubscriber writes them one after the other into
    that step's file and numbers repeated records with ``call`` (micro-step k gives call k). A gradient is
    reported with the step of the forward that produced it, whenever backward runs.

Cost outside the active window
    Only three hooks on the root module stay installed permanently. When a root forward starts at a step where no
    subscriber :meth:`~Subscriber.is_active`, the per-module hooks are removed (once) and that forward runs at
    almost the speed of an unsubscribed model; they are installed again at the next active step.

Graph mode
    Every hook, ``inspect_activation`` included, is wrapped in ``torch.compiler.disable``: under graph mode
    (:mod:`shardtrain.graph`) TorchDynamo does not trace them but splits the captured graph where they are called
    and runs them eagerly on the real activations, so statistics, replaced outputs and gradient hooks are those of
    eager mode. The split costs speed while subscribers are attached, not correctness; the split points are
    expected, so graph mode does not warn about them (:mod:`shardtrain.between_graphs`).

    At ZeRO stage 3 no split is possible; graph mode calls :func:`prepare_traced` before it computes a call's
    schema and runs the call inside :func:`traced_call`, and the hooks, traced into the graph, compute the
    subscribers' summaries there ([Note: statistics inside the graph] in :mod:`shardtrain.debug.traced`).

Hooks and parameters
    The hooks read inputs and outputs only. They never touch parameters and put no tensor hook on a parameter or
    any other leaf, so ZeRO's gradient reduction (parameter hooks) and stage-3 gathering (module hooks around the
    same forward) are not disturbed.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from shardtrain.between_graphs import between_graphs
from shardtrain.debug import traced
from shardtrain.debug.subscriber import Subscriber
from shardtrain.errors import GraphCaptureError
from shardtrain.tree import iter_tensors, map_tensors

# Attachments whose root forward is running, innermost last; inspect_activation reports to the innermost.
_RUNNING: list[_Attachment] = []
_SERIALS = itertools.count()


def _between_graphs(fn: Any) -> Any:
    """``fn`` run eagerly even inside a captured graph (see "Graph mode" above)."""
    return between_graphs("debug hook")(fn)


class SubscriberManager:
    """Subscribes lists of :class:`Subscriber` to root modules (or engines); see the module docstring for steps."""

    def __init__(self) -> None:
        self._attached: dict[int, _Attachment] = {}

    def subscribe(self, target: nn.Module | Any, subscribers: Subscriber | Sequence[Subscriber]) -> None:
        """Attach ``subscribers`` (called in list order) to ``target`` and all its submodules.

        Subscribing a target again replaces its subscribers; hooks never stack. The step counter of a plain module
        restarts at 0.
        """
        root, engine = _resolve(target)
        subs = [subscribers] if isinstance(subscribers, Subscriber) else list(subscribers)
        bad = [type(s).__name__ for s in subs if not isinstance(s, Subscriber)]
        if bad:
            raise TypeError(f"subscribers must be shardtrain.debug.Subscriber instances, got {', '.join(bad)}")
        if id(root) in self._attached:
            self._attached.pop(id(root)).detach()
        self._attached[id(root)] = _Attachment(root, engine, subs)

    def unsubscribe(self, target: nn.Module | Any) -> None:
        """Remove every hook this manager put on ``target`` and close its subscribers (flushing their files)."""
        root, _ = _resolve(target)
        attachment = self._attached.pop(id(root), None)
        if attachment is None:
            raise ValueError(f"{type(root).__name__} is not subscribed with this manager; call subscribe() first")
        attachment.detach()
        for sub in attachment.subscribers:
            close = getattr(sub, "close", None)
            if callable(close):
                close()

    def is_subscribed(self, target: nn.Module | Any) -> bool:
        return id(_resolve(target)[0]) in self._attached


def inspect_activation(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Report an intermediate ``tensor`` (and, in backward, its gradient) to the subscribers under ``name``.

    Call it inside any forward. Outside a subscribed root forward, or at a step where no subscriber is active, it
    returns ``tensor`` itself at the cost of a list lookup, so it can stay in production code. A subscriber may
    return a replacement, which is what this function then returns.
    """
    if not _RUNNING:
        return tensor
    if _RUNNING[-1].traced and torch.compiler.is_compiling():
        _check_inspected(name, tensor)
        return _RUNNING[-1].traced_outputs(name, tensor)
    return _inspect(name, tensor)


def _check_inspected(name: str, tensor: torch.Tensor) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"inspect_activation needs a non-empty string name, got {name!r}")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"inspect_activation({name!r}, ...) expects a tensor, got {type(tensor).__name__}")


@_between_graphs
def _inspect(name: str, tensor: torch.Tensor) -> torch.Tensor:
    _check_inspected(name, tensor)
    return _RUNNING[-1].inspect(name, tensor)


def _attachments(root: nn.Module) -> list[_Attachment]:
    return [a for a in list(traced.ATTACHMENTS.values()) if a.root is root]


def prepare_traced(root: nn.Module) -> None:
    """Graph mode at ZeRO stage 3, before a call's schema is taken: install (or remove) the per-module hooks for the
    coming step, as the root pre-hook does in eager mode, so that the schema holds the hooks the graph traces."""
    for attachment in _attachments(root):
        attachment.set_step()


@contextmanager
def traced_call(root: nn.Module) -> Iterator[None]:
    """Graph mode at ZeRO stage 3: the call of ``root`` inside, captured with its subscribers' hooks traced into the
    graph ([Note: statistics inside the graph]). A subscriber that cannot be traced is a ``GraphCaptureError``
    raised before anything runs."""
    attachments = _attachments(root)
    for attachment in attachments:
        attachment.begin_traced()
    done = False
    try:
        yield
        done = True
    finally:
        for attachment in attachments:
            attachment.end_traced(done)


def _resolve(target: Any) -> tuple[nn.Module, Any]:
    if isinstance(target, nn.Module):
        return target, None
    module = getattr(target, "module", None)
    if isinstance(module, nn.Module) and isinstance(getattr(target, "global_step", None), int):
        return module, target  # an engine: duck-typed so that debug does not import the engine layer
    raise TypeError(f"expected an nn.Module or an engine with .module and .global_step, got {type(target).__name__}")


class _Attachment:
    """The hooks and step state of one subscribed root module."""

    def __init__(self, root: nn.Module, engine: Any, subscribers: list[Subscriber]) -> None:
        self.root, self.engine, self.subscribers = root, engine, subscribers
        self.forwards = 0  # root forwards seen (the step of a plain module)
        self.step = -1
        self.active: list[Subscriber] = []
        # graph mode at ZeRO stage 3 (traced_call): the hooks are traced into the graph, see traced.py
        self.traced = False
        self.serial = next(_SERIALS)
        self.ticket = torch.zeros(2, dtype=torch.int64)  # [serial, step], a graph input (see the note)
        self.traced_subscribers: list[tuple[int, Subscriber]] = []  # (index in subscribers, subscriber)
        traced.ATTACHMENTS[self.serial] = self
        self._child_handles: list[RemovableHandle] = []
        self._root_handles = [
            root.register_forward_pre_hook(self._hook(self._root_pre, _nothing), with_kwargs=True, prepend=True),
            root.register_forward_hook(self._hook(self._root_post, self._traced_root_post)),
            # runs even when the forward raises, so inspect_activation never reports to a forward that is over
            root.register_forward_hook(self._hook(self._leave, _nothing), always_call=True),
        ]

    def _hook(self, eager: Callable[..., Any], traced_hook: Callable[..., Any]) -> Callable[..., Any]:
        """``eager`` run between graphs; ``traced_hook`` instead while a stage-3 graph is traced (traced_call)."""
        between = _between_graphs(eager)

        def hook(*args: Any, **kwargs: Any) -> Any:
            if self.traced and torch.compiler.is_compiling():
                return traced_hook(*args, **kwargs)
            return between(*args, **kwargs)

        return hook

    def detach(self) -> None:
        for handle in self._root_handles + self._child_handles:
            handle.remove()
        self._root_handles, self._child_handles = [], []
        traced.ATTACHMENTS.pop(self.serial, None)
        if self in _RUNNING:
            _RUNNING.remove(self)

    def set_step(self) -> int:
        """The step of the forward that starts; the active subscribers and the per-module hooks follow it."""
        step = self.engine.global_step if self.engine is not None else self.forwards
        self.step = step
        self.active = [s for s in self.subscribers if s.is_active(step)]
        if self.active and not self._child_handles:
            self._install_child_hooks()
        elif not self.active and self._child_handles:
            for handle in self._child_handles:
                handle.remove()
            self._child_handles = []
        return step

    # -- root hooks --------------------------------------------------------------------------------
    def _root_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self in _RUNNING:  # the previous forward raised before our post hook: forget it
            _RUNNING.remove(self)
        self.set_step()
        _RUNNING.append(self)
        return self._pre("", module, args, kwargs) if self.active else None

    def _root_post(self, module: nn.Module, args: tuple, outputs: Any) -> Any:
        try:
            if not self.active:
                return None
            result = outputs
            for sub in self.active:
                replaced = sub.post_forward(self.step, "", module, result)
                result = result if replaced is None else replaced
            for sub in self.active:
                replaced = sub.post_root_forward(self.step, "", module, result)
                result = result if replaced is None else replaced
            self._hook_grads("", result)
            return None if result is outputs else result
        finally:
            # torch calls this hook only after a forward completed: one that raises does not advance the step
            self.forwards += 1

    def _leave(self, module: nn.Module, args: tuple, outputs: Any) -> None:
        if self in _RUNNING:
            _RUNNING.remove(self)

    # -- per-module hooks (installed only while some subscriber is active) -------------------------
    def _install_child_hooks(self) -> None:
        for name, module in self.root.named_modules():
            if module is self.root:
                continue
            pre = self._hook(functools.partial(self._pre, name), _nothing)
            post = self._hook(functools.partial(self._post, name), functools.partial(self._traced_post, name))
            self._child_handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            self._child_handles.append(module.register_forward_hook(post))

    def _pre(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        changed = False
        for sub in self.active:
            replaced = sub.pre_forward(self.step, name, module, args, kwargs)
            if replaced is not None:
                args, kwargs = replaced
                changed = True
        return (args, kwargs) if changed else None

    def _post(self, name: str, module: nn.Module, args: tuple, outputs: Any) -> Any:
        result = outputs
        for sub in self.active:
            replaced = sub.post_forward(self.step, name, module, result)
            result = result if replaced is None else replaced
        self._hook_grads(name, result)
        return None if result is outputs else result

    def inspect(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        result = tensor
        for sub in self.active:
            replaced = sub.inspect(self.step, name, result)
            result = result if replaced is None else replaced
        if self.active:
            self._hook_grads(name, result)
        return result

    def _hook_grads(self, name: str, outputs: Any) -> None:
        """Report the gradient of each non-leaf output tensor to the subscribers active now, with this step."""
        step, subs = self.step, list(self.active)
        for path, tensor in iter_tensors(outputs):
            # leaves (parameters above all) are left alone: a hook there would change what ZeRO sees
            if tensor.requires_grad and tensor.grad_fn is not None:
                tensor.register_hook(functools.partial(_on_grad, subs, step, name, path))

    # -- graph mode at ZeRO stage 3 (see traced.py) ------------------------------------------------
    def begin_traced(self) -> None:
        """Before a traced call: the step, the ticket the graph reads it from, and the refusal of subscribers that
        cannot run inside a graph (before anything is traced or gathered)."""
        if self in _RUNNING:
            _RUNNING.remove(self)
        step = self.set_step()
        refused = [type(s).__name__ for s in self.active if not s.traceable()]
        if refused:
            raise GraphCaptureError(
                f"graph mode at ZeRO stage 3 cannot call the debug subscriber(s) {', '.join(refused)}: the forward "
                "runs as one graph with the units gathered inside it, so subscribers are called through "
                "Subscriber.summarize (torch operations, traced into the graph) and Subscriber.record_summary (on "
                "the host); define both (and no pre_forward or post_root_forward), use StatisticsSubscriber, or "
                "turn graph mode off (eager ZeRO-3 calls every subscriber callback)"
            )
        self.traced_subscribers = [(self.subscribers.index(s), s) for s in self.active]
        self.ticket = torch.tensor([self.serial, step], dtype=torch.int64)
        self.traced = True
        _RUNNING.append(self)

    def end_traced(self, done: bool) -> None:
        self.traced = False
        if self in _RUNNING:
            _RUNNING.remove(self)
        if done:  # as the eager root post-hook: a forward that raised does not advance the step
            self.forwards += 1

    def _traced_root_post(self, module: nn.Module, args: tuple, outputs: Any) -> Any:
        return self.traced_outputs("", outputs) if self.active else None

    def _traced_post(self, name: str, module: nn.Module, args: tuple, outputs: Any) -> Any:
        return self.traced_outputs(name, outputs)

    def traced_outputs(self, name: str, outputs: Any) -> Any:
        """Traced: the summaries of every tensor of ``outputs``, and each one that will get a gradient replaced by
        a view whose backward summarizes it (traced.observe)."""
        ticket = self.ticket
        return map_tensors(outputs, lambda path, t: traced.observe(self, ticket, name, path, t))

    def deliver(
        self,
        step: int,
        index: int,
        direction: str,
        name: str,
        path: str,
        shape: list[int],
        dtype: torch.dtype,
        summary: list[torch.Tensor],
    ) -> None:
        """On the host, from the graph: one subscriber's summary of one tensor (see traced.record)."""
        sub = self.subscribers[index]
        if sub.is_active(step):
            sub.record_summary(step, direction, name, path, shape, dtype, summary)


def _nothing(*args: Any, **kwargs: Any) -> None:
    """A hook that does nothing while a graph is traced (the step is taken on the host, in traced_call)."""
    return None


def _on_grad(subs: list[Subscriber], step: int, name: str, path: str, grad: torch.Tensor) -> torch.Tensor | None:
    result = grad
    for sub in subs:
        replaced = sub.output_grad(step, name, path, result)
        result = result if replaced is None else replaced
    return None if result is grad else result
