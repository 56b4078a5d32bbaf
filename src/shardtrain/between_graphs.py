"""Functions that graph mode runs eagerly on purpose, between the pieces of a captured graph.

Some of shardtrain's own code must not be traced into a captured graph: the debug subscribers' hooks (they write
files and read values), and the tensor-parallel collectives and RNG forks (c10d work handles and generator states,
which TorchDynamo cannot hold in a graph). :func:`between_graphs` wraps such a function in
``torch.compiler.disable`` with a reason ending in :data:`SPLIT_BY_DESIGN`: TorchDynamo splits the graph at each
call and runs the function on the real tensors, which keeps eager semantics exactly, and graph mode does not warn
about these intended splits. Outside a capture the wrapper costs one ``torch.compiler.is_compiling()`` check.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

SPLIT_BY_DESIGN = "(split by design)"
"""The end of the ``torch.compiler.disable`` reason of every function wrapped by :func:`between_graphs`."""


def between_graphs(what: str) -> Callable[[F], F]:
    """Decorator: inside a captured graph, split the graph at the function and run it on the real tensors; ``what``
    names it in TorchDynamo's reason."""

    def wrap(fn: F) -> F:
        disabled = torch.compiler.disable(fn, reason=f"shardtrain {what} {SPLIT_BY_DESIGN}")

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            return disabled(*args, **kwargs) if torch.compiler.is_compiling() else fn(*args, **kwargs)

        return run  # type: ignore[return-value]

    return wrap
