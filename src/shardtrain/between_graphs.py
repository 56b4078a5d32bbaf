"""Functions that graph mode runs eagerly on purpose, between the pieces of a captured graph.

Some of shardtrain's own code must not be traced into a captured graph: the debug subscribers' hooks (they write
files and read values), and the tensor-parallel collectives and RNG forks (c10d work handles and generator states,
which TorchDynamo cannot hold in a graph). :func:`between_graphs` wraps such a function in
``torch.compiler.disable`` with a reason ending in :data:`SPLIT_BY_DESIGN`: TorchDynamo splits the graph at each
call and runs the function on the real tensors, which keeps eager semantics exactly, and graph mode does not warn
about these intended splits. Outside a capture the wrapper costs one ``torch.compiler.is_compiling()`` check.

[Note: one graph, no splits]
At ZeRO stage 3 graph mode captures the forward as one graph (``fullgraph``: a split there would run the whole
forward eagerly, every unit gathered), so a split is an error. The functions marked ``traced_in_one_graph`` (the
tensor-parallel collectives and RNG forks) have a traceable form for that case (functional collectives, see [Note:
collectives in graphs] in :mod:`shardtrain.distributed.communicator`): while :func:`one_graph` is active (the graph
runtime enters it around a stage-3 call), they are traced into the graph instead of splitting it; they pick their
traceable form with ``torch.compiler.is_compiling()``. Debug hooks are traced differently there ([Note: statistics
inside the graph] in :mod:`shardtrain.debug.traced`); a subscriber that cannot be traced is refused at stage 3.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

SPLIT_BY_DESIGN = "(split by design)"
"""The end of the ``torch.compiler.disable`` reason of every function wrapped by :func:`between_graphs`."""


_one_graph = False  # see [Note: one graph, no splits]; read while tracing (TorchDynamo guards on its value)


@contextmanager
def one_graph() -> Iterator[None]:
    """While active, functions marked ``traced_in_one_graph`` are traced into the captured graph instead of
    splitting it ([Note: one graph, no splits])."""
    global _one_graph
    before, _one_graph = _one_graph, True
    try:
        yield
    finally:
        _one_graph = before


def between_graphs(what: str, *, traced_in_one_graph: bool = False) -> Callable[[F], F]:
    """Decorator: inside a captured graph, split the graph at the function and run it on the real tensors; ``what``
    names it in TorchDynamo's reason. ``traced_in_one_graph``: the function is traceable, and traced instead while
    :func:`one_graph` is active."""

    def wrap(fn: F) -> F:
        disabled = torch.compiler.disable(fn, reason=f"shardtrain {what} {SPLIT_BY_DESIGN}")

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if not torch.compiler.is_compiling() or (traced_in_one_graph and _one_graph):
                return fn(*args, **kwargs)
            return disabled(*args, **kwargs)

        return run  # type: ignore[return-value]

    return wrap
