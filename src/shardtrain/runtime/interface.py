"""What the engine does around a step, as one interface with an eager and a graph implementation.

[Note: one runtime, two implementations]
Around every step the engine asks the same things, whatever the mode and ZeRO stage: ``prepare(args, kwargs)`` (what
all ranks must agree on before this forward: in graph mode at stage 3 the input schema, since gathers are collectives
inside the graph); ``forward(call)``; ``begin_backward()`` / ``end_backward()`` around ``loss.backward()`` (stage 3:
gather units as backward needs them, release them once their gradients are in), and ``backward_returned()`` between
``loss.backward()`` returning and the reducer launching what is left; ``gathered(params)`` (full parameters outside a
forward); ``release()`` (what a forward with no backward left gathered); ``close()``.
:class:`~shardtrain.runtime.eager.EagerRuntime` runs the module op by op with hooks around each unit ([Note: unit
lifecycle]); :class:`~shardtrain.graph.runtime.GraphRuntime` runs captured graphs in which gathers and reduce-scatters
are graph operations ([Note: ZeRO-3 as graph operations]). ``initialize`` picks one (``graph.enabled``); the engine
never asks which. The graph runtime keeps the eager one inside for what a graph cannot hold: a direct call of the
module (``engine.module(x)``, generation) runs through the eager unit hooks, inert while a graph is traced, and
``gathered`` is the same code in both modes. So a feature works in both modes, or ``initialize`` refuses the
combination with its reason (``resolve_plan`` in :mod:`shardtrain.config.plan`);
``tests/engine/test_runtime_modes.py`` runs one battery in both modes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

from shardtrain.zero.units import Unit


@dataclass
class Call:
    """One forward call as the runtime will run it.

    ``detail``: a fact every rank must agree on before the forward runs (0: none), and ``explain(comm)`` says how the
    ranks differ on it (collective over ``comm``); ``key``: what the runtime keeps of the call (a graph's schema)."""

    args: tuple
    kwargs: dict
    detail: int = 0
    explain: Callable[[Any], str] | None = None
    key: Any = None


class Runtime(ABC):
    """See [Note: one runtime, two implementations]."""

    mode: str  # "eager" or "graph"

    @property
    @abstractmethod
    def units(self) -> list[Unit]:
        """The ZeRO-3 units, in the layout's order (empty below stage 3)."""

    @property
    def forward_communicates(self) -> bool:
        """Whether a forward issues collectives of its own (ZeRO-3's gathers)."""
        return bool(self.units)

    def prepare(self, args: tuple, kwargs: dict) -> Call:
        return Call(args, kwargs)

    @abstractmethod
    def forward(self, call: Call) -> Any:
        """The module's forward on ``call``'s inputs."""

    def begin_backward(self) -> None:  # noqa: B027 - nothing to do below stage 3
        pass

    def backward_returned(self) -> None:  # noqa: B027 - nothing to check below stage 3
        """``loss.backward()`` returned; the gradient reducer has not yet launched the buckets left over. At stage 3 a
        backward that gathered fewer units than every rank was trusted to gather says so here, before those
        collectives ([Note: departures from a trusted order] in :mod:`shardtrain.zero.departure`)."""

    def end_backward(self) -> None:  # noqa: B027
        pass

    @abstractmethod
    def gathered(self, params: list[nn.Parameter]) -> AbstractContextManager[list[Unit]]:
        """Gather the units holding ``params`` for the block (collective), release them after; yields those units."""

    def release(self) -> None:  # noqa: B027 - nothing is kept below stage 3
        """Release every unit still gathered (a forward with gradients that no backward followed keeps some, see
        [Note: kept after forward]); the next forward would release them itself."""

    def collectives(self, call: str) -> AbstractContextManager[None]:
        """Around a forward or backward: turns a failure of a collective the runtime issued into the engine's
        error naming the ranks (the eager communicator does that itself)."""
        return _nothing()

    def graph_stats(self) -> dict[str, Any] | None:
        return None

    @abstractmethod
    def close(self) -> None:
        """Remove the hooks installed on the module (safe to call more than once)."""


@contextmanager
def _nothing() -> Iterator[None]:
    yield
