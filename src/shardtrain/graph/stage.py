"""Graph mode per pipeline stage: each stage module torch's schedule runs goes through graphs captured as graph mode
captures a model (:class:`~shardtrain.graph.captured.CapturedModule`).

[Note: graph mode per pipeline stage]
Under pipeline parallelism torch's ``PipelineStage`` calls each stage module, not the engine's runtime, so graph
mode cannot sit around the model: each stage module is wrapped instead, and its forward and (AOT autograd's)
backward run as captured graphs, one capture per input schema (a training and an evaluation step each capture
their own). The stage's parameters are plain tensors whenever it runs: whole at stages 0-2, and at stage 3 gathered
for the whole schedule ([Note: a stage gathered for its schedule] in ``pipeline_parallel/schedule.py``), so the
graphs hold no ZeRO-3 collectives ([Note: ZeRO-3 as graph operations] is for a model the runtime runs) and the
gradients accumulate into the parameters as in eager mode, where the reducer's hooks read them. So at stage 3 the
stage's guarded parameters ([Note: guarded parameters] in ``zero/guarded.py``) run the graphs unguarded: their guard
gathers on a touch and marks saved tensors for backward's gathers, neither of which a stage gathered for its whole
schedule needs, and Dynamo cannot trace it; each is guarded again when the call returns. torch's shape inference runs
the stage on meta tensors once, before the first step: that call runs eagerly, as a graph captured on meta tensors
would be of no use.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from shardtrain.graph.captured import CapturedModule
from shardtrain.zero.guarded import ShardedParameter, guard, guard_of, unguard


class CapturedStage(nn.Module):
    """``stage`` run through :class:`CapturedModule` ([Note: graph mode per pipeline stage]); ``captured``'s
    ``graph_stats()`` count its captures."""

    def __init__(
        self,
        stage: nn.Module,
        params: list[nn.Parameter],
        *,
        strict: bool,
        cache_size: int,
        compiler: str,
        dynamic_shapes: bool,
    ) -> None:
        """``params``: the parameters ``stage`` runs on (a stage module reads them from the model it was cut from,
        [Note: stages keep the model's names] in ``pipeline_parallel/cut.py``)."""
        super().__init__()
        self.stage = stage
        self._guarded = tuple(p for p in params if isinstance(p, ShardedParameter))  # not registered: the model's
        self.captured = CapturedModule(
            stage, strict=strict, cache_size=cache_size, compiler=compiler, dynamic_shapes=dynamic_shapes
        )

    def forward(self, *args: Any) -> Any:
        if any(torch.is_tensor(a) and a.is_meta for a in args):  # torch's shape inference
            return self.stage(*args)
        with _unguarded(self._guarded):
            return self.captured(*args)

    def __getattr__(self, name: str) -> Any:
        """What the schedule asks of a stage module (``carried_examples``: [Note: the router's loss across
        stages]) is the wrapped stage's."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.stage, name)


@contextmanager
def _unguarded(params: tuple[nn.Parameter, ...]) -> Iterator[None]:
    """Guarded ``params`` as plain ones while a stage runs ([Note: graph mode per pipeline stage])."""
    guards = [(p, guard_of(p)) for p in params]
    for p, _ in guards:
        unguard(p)
    try:
        yield
    finally:
        for p, g in guards:
            guard(p, g.name, g.unit)


__all__ = ["CapturedStage"]
