"""The graph runtime: the engine's forward runs through captured graphs (see [Note: one runtime, two
implementations] in :mod:`shardtrain.runtime.interface`).

At ZeRO stages 0-2 it is a :class:`~shardtrain.graph.captured.CapturedModule` of the module. At stage 3 the units'
shards are inputs of the graph, which gathers them and reduce-scatters their gradients itself ([Note: ZeRO-3 as graph
operations]); the gradient reducer is told, before each backward, which buckets arrive reduced that way. The eager
runtime stays inside for everything a graph does not hold: its unit hooks stay on the module, inert while a graph is
traced, so a direct call of the module (``engine.module(x)``) gathers unit by unit as in eager mode, and a backward
that follows only such calls is run by the eager runtime and reduced by the reducer's hooks, as in eager mode;
``gathered()`` is the eager runtime's. While the one-time check of replicated gradients with tensor parallelism waits
on unit parameters ([Note: replicated gradients across tensor-parallel ranks]), the training forward runs eagerly too:
the check hooks the parameters, and the graph's backward reaches none of the units'.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn

from shardtrain.between_graphs import one_graph
from shardtrain.distributed import failure
from shardtrain.distributed.communicator import Communicator
from shardtrain.graph.captured import CapturedModule
from shardtrain.graph.schema import Schema, differences
from shardtrain.graph.sharded import UnitInputs
from shardtrain.graph.swapped import SwappedShards
from shardtrain.offload.parameters import ParamOffload
from shardtrain.runtime.eager import EagerRuntime
from shardtrain.runtime.interface import Call, Runtime
from shardtrain.tensor_parallel.grad_check import unchecked
from shardtrain.zero.reducer import GradientReducer
from shardtrain.zero.units import Unit


class GraphRuntime(Runtime):
    """The module run through graphs captured per input schema; at stage 3 ZeRO-3 inside them."""

    mode = "graph"

    def __init__(
        self,
        module: nn.Module,
        eager: EagerRuntime,
        comm: Communicator,
        reducer: GradientReducer,
        *,
        strict: bool,
        cache_size: int,
        compiler: str,
        wire_dtype: torch.dtype | None,
        dynamic_shapes: bool = True,
        tp_partial: tuple[Communicator, frozenset[int]] | None = None,
        param_offload: ParamOffload | None = None,
    ) -> None:
        """``eager``: the eager runtime over the same units (kept for direct calls of the module and for
        ``gathered``); ``wire_dtype``: the dtype gradients are reduced in (None: each bucket's own); ``tp_partial``:
        with tensor parallelism, its communicator and the ids of the parameters whose gradients it sums;
        ``param_offload``: the units' shards in swap files, which the graphs read (see [Note: swapped shards in
        graphs])."""
        self.eager, self.comm, self.reducer = eager, comm, reducer
        self.inputs: UnitInputs | None = None
        self.swapped = SwappedShards(param_offload, eager.units) if param_offload is not None else None
        self._graph_buckets = [b for u in eager.units for b in u.buckets if b.requires_grad]
        if eager.units:
            if not eager.gather_check:
                warnings.warn(
                    "zero_optimization.stage3_gather_check: false has no effect in graph mode: the captured graph "
                    "issues its gathers without a per-gather check, and the ranks' unit order is checked once per "
                    "forward by the desync check, which compares the input schemas (desync_check)",
                    stacklevel=4,
                )
            self.inputs = UnitInputs(
                module,
                eager.units,
                comm,
                lambda b: wire_dtype or b.dtype,
                reducer.shard_grad,
                eager.prefetch,
                reducer.overlap,
                predivide=reducer.predivide,
                tp_partial=tp_partial,
                swapped=self.swapped.bucket_indices if self.swapped is not None else frozenset(),
            )
            reducer.hand_over(self._graph_buckets)
        self.captured = CapturedModule(
            module,
            strict=strict,
            cache_size=cache_size,
            compiler=compiler,
            dynamic_shapes=dynamic_shapes,
            units=self.inputs,
            own_hooks=eager.hook_ids,  # a user's hook is part of the schema; these never change
        )
        self._captured_with_grad = False  # a captured forward recorded gradients since the last backward
        self._eager_backward = False
        # the same on every rank (the check hooks the same parameters everywhere): graph and eager collectives differ
        self._check_eagerly = bool(self.inputs is not None and unchecked(self._unit_params()))

    @property
    def units(self) -> list[Unit]:
        return self.eager.units

    def _unit_params(self) -> list[nn.Parameter]:
        return [s.param for u in self.eager.units for b in u.buckets for s in b.slots]

    def prepare(self, args: tuple, kwargs: dict) -> Call:
        schema = self.captured.schema(args, kwargs)
        if self.inputs is None:
            return Call(args, kwargs, key=schema)
        # the gathers are collectives inside the graph: every rank must run the same graph, so the desync check of
        # this forward compares the schemas too (hooks included: a subscriber on one rank only splits its graph)
        return Call(
            args, kwargs, schema.fingerprint(), lambda comm, *where: self._explain(schema, comm, *where), schema
        )

    @staticmethod
    def _explain(schema: Schema, comm: Communicator, global_step: int, micro_steps: int) -> str:
        everyone = comm.all_gather_object(schema.portable(), what="graph-mode input schemas")
        ranks = "; ".join(
            f"rank {r} differs from rank 0: {', '.join(differences(everyone[0], s))}"
            for r, s in enumerate(everyone)
            if s != everyone[0]
        )
        return (
            f"ranks entered forward() at global step {global_step}, micro step {micro_steps} with "
            f"different inputs for graph mode: {ranks}. At ZeRO stage 3 the captured graph's gathers and "
            "reduce-scatters are collectives, so every rank must run the same graph: call the engine with inputs "
            "of the same structure, and attach hooks (subscribers) on every rank or on none."
        )

    def forward(self, call: Call) -> Any:
        if self.inputs is not None:
            # eagerly: bitwise the graph's numbers (tests/graph/test_graph_tp.py)
            if self._check_eagerly and torch.is_grad_enabled():
                return self.eager.forward(call)
            self.eager.release()  # units an eager call of the module left gathered: the graph reads the shards
            self._captured_with_grad |= torch.is_grad_enabled()
            with one_graph():  # tensor-parallel collectives traced into the one graph ([Note: one graph, no splits])
                return self.captured.run(call.key, call.args, call.kwargs)
        return self.captured.run(call.key, call.args, call.kwargs)

    def begin_backward(self) -> None:
        if self.inputs is None:
            return
        if self._captured_with_grad:  # the graph reduces the units' gradients, the reducer the others
            self.reducer.hand_over(self._graph_buckets)
        else:  # only direct calls of the module since the last backward: eager ZeRO-3's backward
            self.reducer.hand_over([])
            self.eager.begin_backward()
            self._eager_backward = True

    def backward_returned(self) -> None:
        if self._eager_backward:
            self.eager.backward_returned()

    def end_backward(self) -> None:
        if self._eager_backward:
            self.eager.end_backward()
        if self._check_eagerly and self._eager_backward:  # checked what got a gradient; the graph checks nothing
            self._check_eagerly = False
            if names := unchecked(self._unit_params()):
                warnings.warn(
                    f"the replicated parameters {names} got no gradient in the first backward, which graph mode ran "
                    "eagerly to compare the replicated parameters' gradients across the tensor-parallel ranks: they "
                    "are not checked (the graph's backward reaches no hook on them), so a missing "
                    "'replicated_with_grad_allreduce' on them in the tensor-parallel plan would go unnoticed. Check "
                    "the plan with a run in eager mode (graph.enabled: false) that trains them.",
                    stacklevel=2,
                )
        self._captured_with_grad = self._eager_backward = False

    def release(self) -> None:
        self.eager.release()

    def gathered(self, params: list[nn.Parameter]) -> AbstractContextManager[list[Unit]]:
        return self.eager.gathered(params)

    @contextmanager
    def collectives(self, call: str) -> Iterator[None]:
        """A collective of the captured graph that fails (a peer gone, the process group's timeout) raises the error
        eager collectives raise, naming the ranks, instead of the backend's."""
        if self.inputs is None:
            yield
            return
        started = time.monotonic()
        try:
            yield
        except RuntimeError as err:
            if not failure.backend_error(err):
                raise
            what = f"ZeRO-3 units in the captured {call} graph"
            raise self.comm.describe_failure("a gather or reduce-scatter", what, err, started=started) from err

    def graph_stats(self) -> dict[str, Any]:
        return self.captured.graph_stats()

    def close(self) -> None:
        self.eager.close()
