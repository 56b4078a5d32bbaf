"""Capture a module's forward and backward into graphs, one per input schema.

[Note: graph mode runs on torch.compile, with a backend of ours]
We capture with ``torch.compile`` and a backend of ours, not ``torch.export`` (a whole-program forward graph: the
backward must be derived by hand with AOT autograd, every unsupported construct is a hard error, and nested
inputs/outputs, hooks and buffer mutation each need their own handling). With ``torch.compile``:

* the backward comes from AOT autograd, so gradients and the reducer's gradient hooks (on the parameters'
  accumulation, outside the graph) behave as in eager;
* what cannot be captured runs eagerly between graphs (the fallback the user is told about); ``strict`` makes every
  split an error but the intended ones of :mod:`shardtrain.between_graphs` (debug hooks, tensor-parallel collectives);
* the backend sees every graph (``GraphModule`` + example inputs) before it runs: the place for our passes;
* Dynamo traces through nested inputs and outputs (dicts, dataclasses, namedtuples, ``ModelOutput``), so outputs
  keep the module's structure.

Dynamo's guards stay on (they cover facts the schema does not hold, such as a global flag ``forward`` reads); the
schema (:mod:`shardtrain.graph.schema`) is the cache key on top, so each re-capture has a stated reason and the cache
a size limit we control. Each cache entry compiles its own copy of a small trampoline (a distinct code object, since
Dynamo keeps compiled code per code object), so entries never share compiled code and dropping one drops its graphs.
Inner compiler: ``"aot_eager"`` (default: exact eager numerics, no C++ compiler) or ``"inductor"`` (fused kernels;
needs a C++ compiler on a CPU; rounds differently, so results agree within fp32 noise, not bitwise).
"""

from __future__ import annotations

import logging
import re
import types
import warnings
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch._dynamo
from torch import nn

from shardtrain.between_graphs import SPLIT_BY_DESIGN
from shardtrain.debug.manager import prepare_traced, traced_call
from shardtrain.distributed.communicator import GraphTraffic
from shardtrain.errors import GraphCaptureError
from shardtrain.graph.schema import Schema, differences, schema_of
from shardtrain.graph.sharded import (
    InductorPasses,
    Scheduled,
    UnitInputs,
    call_on_gathered,
    recompute_gathers,
    schedule,
)

log = logging.getLogger("shardtrain.graph")

COMPILERS = ("aot_eager", "inductor")


def call_module(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """The function graph mode captures (a fresh copy of its code per cache entry, see the note above)."""
    return module(*args, **kwargs)


@dataclass
class GraphStats:
    """What the cache did: ``captures`` (a new schema), ``reuses``, ``evictions``, ``guard_recaptures`` (Dynamo
    re-traced inside an entry because a fact outside the schema changed), ``fallbacks`` (what ran eagerly) and the
    count of every reason logged."""

    captures: int = 0
    reuses: int = 0
    most_gathered: int = 0
    """ZeRO-3: the most units gathered at once in any captured graph's schedule (current + prefetched)."""
    collectives: Counter[str] = field(default_factory=Counter)
    """ZeRO-3: the collectives in the captured graphs (``forward all-gathers``, ``backward all-gathers``,
    ``backward reduce-scatters``), summed over captures."""
    overlapped: Counter[str] = field(default_factory=Counter)
    """ZeRO-3: of those, the all-gathers issued ahead of the compute before their wait (prefetched, see
    ``stage3_prefetch_bucket_size``) and the reduce-scatters with compute between issue and wait (``overlap_comm``)."""
    evictions: int = 0
    guard_recaptures: int = 0
    fallbacks: list[str] = field(default_factory=list)
    reasons: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {
            "captures": self.captures,
            "reuses": self.reuses,
            "evictions": self.evictions,
            "guard_recaptures": self.guard_recaptures,
            "most_gathered": self.most_gathered,
            "collectives": dict(self.collectives),
            "overlapped": dict(self.overlapped),
            "fallbacks": list(self.fallbacks),
            "reasons": dict(self.reasons),
        }


@dataclass
class _Entry:
    schema: Schema
    run: Callable[..., Any]
    compiled_graphs: int = 0
    graphs: list[tuple[str, torch.fx.GraphModule]] = field(default_factory=list)
    """("forward" or "backward", graph module) as they run, after our passes (``aot_eager``; for inspection)."""
    traffic: GraphTraffic | None = None  # ZeRO-3: the graphs' collectives, counted in comm_stats() as they run


class CapturedModule:
    """``module`` run through graphs captured per input schema; call it like the module.

    ``cache_size`` graphs are kept (least recently used evicted); ``strict`` makes anything that cannot be captured
    an error instead of a warning and an eager fallback (with ``units``, always an error: see [Note: no split at
    ZeRO stage 3]); ``compiler`` is ``"aot_eager"`` or ``"inductor"``; ``dynamic_shapes``: graphs generic in the
    inputs' sizes (the default), or specialized on them, one per set of sizes (see [Note: static shapes]);
    ``units`` (the engine's, at ZeRO stage 3) runs the module on parameters gathered inside the graph (see
    [Note: ZeRO-3 as graph operations]); ``own_hooks``: handle ids of the engine's own module hooks, left out of
    the schema (see :func:`~shardtrain.graph.schema.schema_of`).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        strict: bool = False,
        cache_size: int = 8,
        compiler: str = "aot_eager",
        dynamic_shapes: bool = True,
        units: UnitInputs | None = None,
        own_hooks: frozenset[int] = frozenset(),
    ):
        if compiler not in COMPILERS:
            raise ValueError(f"graph compiler must be one of {', '.join(COMPILERS)}, got {compiler!r}")
        if cache_size < 1:
            raise ValueError(f"graph cache_size must be at least 1, got {cache_size}")
        self.module, self.strict, self.cache_size, self.compiler = module, strict, cache_size, compiler
        self.dynamic_shapes = dynamic_shapes
        self.units, self.own_hooks = units, own_hooks
        self._function = call_module if units is None else call_on_gathered  # what each entry compiles a copy of
        self.name = type(module).__name__
        self._entries: OrderedDict[Schema, _Entry] = OrderedDict()
        self._last: Schema | None = None
        self.stats = GraphStats()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(self.schema(args, kwargs), args, kwargs)

    def schema(self, args: tuple, kwargs: dict) -> Schema:
        """The schema of a call (what :meth:`run` takes)."""
        if self.units is not None:  # subscribers' per-module hooks for this step first: the schema holds them
            prepare_traced(self.module)
        if self.own_hooks or not self.dynamic_shapes:
            return schema_of(self.module, args, kwargs, self.own_hooks, sizes=not self.dynamic_shapes)
        return schema_of(self.module, args, kwargs)

    def run(self, schema: Schema, args: tuple, kwargs: dict) -> Any:
        """Call the module with ``schema``, the schema of this very call (see :meth:`schema`)."""
        entry = self._entries.get(schema)
        if entry is None:
            entry = self._capture(schema)
        else:
            self._entries.move_to_end(schema)
            self.stats.reuses += 1
        self._last = schema
        return self._run(entry, args, kwargs)

    def graph_stats(self) -> dict[str, Any]:
        return self.stats.as_dict()

    def graphs(self) -> list[tuple[str, torch.fx.GraphModule]]:
        """The graphs of the last call's schema as they run (``aot_eager``): ("forward" or "backward", module)."""
        entry = self._entries.get(self._last) if self._last is not None else None
        return list(entry.graphs) if entry is not None else []

    # -- capture -------------------------------------------------------------------------------------------
    def _capture(self, schema: Schema) -> _Entry:
        reasons = ["first call"] if self._last is None else differences(self._last, schema)
        if not reasons:  # equal to the last call's schema but evicted since, or an older schema back again
            reasons = ["schema seen before but evicted from the cache"]
        self.stats.captures += 1
        self.stats.reasons.update(reasons)
        log.info("capturing %s (graph %d): %s", self.name, self.stats.captures, "; ".join(reasons))
        entry = _Entry(schema, run=lambda *a: None)
        if self.units is not None:
            entry.traffic = GraphTraffic(*self.units.comms)
        function = self._function
        fn = types.FunctionType(function.__code__.replace(), function.__globals__, "captured_" + self.name)
        # not fullgraph=True even when strict: shardtrain.between_graphs' intended splits must stay allowed; strict is
        # enforced in _run on the splits Dynamo reports. At ZeRO stage 3 every split is refused before anything
        # runs (see [Note: no split at ZeRO stage 3])
        # [Note: static shapes] With graph.dynamic_shapes: false the sizes are in the schema, so a new size is a new
        # entry (a capture with its reason) and its graph is traced with static sizes: no symbolic shape environment,
        # sympy reasoning or runtime asserts (less RSS: docs/graph-memory.md, "Stop 30: graph.dynamic_shapes: false"),
        # and Dynamo never re-traces an entry for a size, since its sizes cannot change
        entry.run = torch.compile(
            fn, backend=self._backend(entry), dynamic=self.dynamic_shapes, fullgraph=self.units is not None
        )
        self._entries[schema] = entry
        while len(self._entries) > self.cache_size:
            self._entries.popitem(last=False)
            self.stats.evictions += 1
        return entry

    def _backend(self, entry: _Entry) -> Callable:
        from torch._dynamo.backends.common import aot_autograd
        from torch.fx.graph import _BoxedCodeGen

        def report(which: str, done: Scheduled, graph: torch.fx.Graph) -> None:
            entry.traffic.compiled(which, graph)
            self.stats.most_gathered = max(self.stats.most_gathered, done.most_gathered)
            self.stats.collectives.update(
                {f"{which} all-gathers": done.all_gathers, f"{which} reduce-scatters": done.reduce_scatters}
            )
            self.stats.overlapped.update(
                {
                    f"{which} prefetched all-gathers": done.prefetched,
                    f"{which} overlapped reduce-scatters": done.overlapped,
                }
            )

        def run_as_captured(gm: torch.fx.GraphModule, example_inputs: list, which: str = "forward") -> Callable:
            # The boxed calling convention as torch's own aot_eager has it: the generated code takes AOT autograd's
            # argument list and empties it, so each input is freed after its last use. A wrapper that unpacks the
            # list (make_boxed_func) keeps it whole until the graph returns: every tensor saved for backward alive
            # until the backward ends, where eager autograd frees each after the node that uses it
            gm.graph.set_codegen(_BoxedCodeGen())
            if self.units is not None:  # prefetch, release and reduction order (step 2 of the note)
                report(which, schedule(gm, self.units.settings), gm.graph)  # recompiles gm
            else:
                gm.recompile()
            entry.graphs.append((which, gm))
            forward = gm.forward

            def run(args: list) -> Any:
                return forward(args)

            run._boxed_call = True  # AOT autograd hands it the list and lets it be emptied
            return run

        def partition(joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
            from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

            if self.units is None:
                return default_partition(joint, joint_inputs, **kwargs)
            recompute_gathers(joint.graph, self.units.settings)  # step 1 of the note
            # Without the min-cut partitioner's common-subexpression pass: it imports Inductor's pattern matcher
            # and its lowerings (182 modules, 25 MiB of RSS per rank that nothing else in aot_eager needs, see
            # docs/graph-memory.md). What it would merge, a computation the model repeats, eager runs twice too:
            # the graphs compute what the model's code does, as eager ZeRO-3 and default_partition (stages 0-2)
            # do; on the GPT models it merged nothing (the same 549 forward and 942 backward nodes either way)
            with torch._functorch.config.patch(cse=False):
                return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

        aot = aot_autograd(
            fw_compiler=run_as_captured,
            bw_compiler=partial(run_as_captured, which="backward"),
            inference_compiler=run_as_captured,
            partition_fn=partition,
        )

        def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
            entry.compiled_graphs += 1  # Dynamo may call this more than once per trace (it restarts an analysis)
            if self.compiler == "inductor":
                from torch._inductor.compile_fx import compile_fx

                if self.units is None:
                    return compile_fx(gm, example_inputs)
                # config_patches, not a config.patch block around the call: AOT autograd compiles a backward that
                # saves no symbolic size lazily, at its first run, outside any block here; compile_fx patches its
                # inner compiler too, so that backward gets the passes as well
                return compile_fx(gm, example_inputs, config_patches=InductorPasses(report, self.units.settings).config)
            return aot(gm, example_inputs)

        return backend

    def _run(self, entry: _Entry, args: tuple, kwargs: dict) -> Any:
        before = entry.compiled_graphs
        breaks = _graph_breaks()
        try:
            out = self._call(entry.run, args, kwargs)
        except torch._dynamo.exc.TorchDynamoException as err:  # tracing refused the forward as a whole
            if self.units is not None:
                self._entries.pop(entry.schema, None)
                if isinstance(getattr(err, "inner_exception", None), GraphCaptureError):  # a pass of ours refused it
                    raise err.inner_exception from None
                raise GraphCaptureError(self._sharded_message(_construct(err))) from None
            if self.strict:
                self._entries.pop(entry.schema, None)
                raise GraphCaptureError(self._strict_message(_construct(err))) from None
            self._fall_back(f"{_construct(err)}; this input schema runs eagerly")
            entry.run = self._function  # eager from now on, for this schema (an eager error is the model's own)
            return self._call(entry.run, args, kwargs)
        if entry.traffic is not None:
            entry.traffic.forward_ran(out)
        # Dynamo split the graph and ran a part eagerly; shardtrain.between_graphs' splits (debug hooks, tensor-parallel
        # collectives) are intended
        new = sorted(_graph_breaks() - breaks)
        unexpected = [_condensed(r) for r in new if SPLIT_BY_DESIGN not in r]
        if unexpected and self.strict:
            self._entries.pop(entry.schema, None)
            raise GraphCaptureError(self._strict_message("; ".join(unexpected)))
        for reason in unexpected:
            self._fall_back(reason)
        if before and entry.compiled_graphs > before:  # Dynamo re-traced inside an entry: a guard of its own failed
            self.stats.guard_recaptures += 1
            log.info("re-capturing %s: a fact outside the input schema changed (a TorchDynamo guard)", self.name)
        return out

    def _call(self, run: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self.units is None:
            return run(self.module, args, kwargs)
        shards, sinks = self.units.inputs()
        # debug subscribers' hooks are traced into the graph ([Note: statistics inside the graph] in debug/traced.py)
        with traced_call(self.module), self.units.detached():
            return run(self.module, self.units, shards, sinks, args, kwargs)

    def _strict_message(self, construct: str) -> str:
        return (
            f"cannot capture {self.name} as one graph (graph.strict is on): {construct}; turn graph.strict off to run "
            "that part eagerly, or change the model"
        )

    def _sharded_message(self, construct: str) -> str:
        return (
            f"cannot capture {self.name} as one graph at ZeRO stage 3: {construct}. Graph mode gathers the units "
            "inside the graph, so this cannot run as a split between two graphs; run eagerly, it would gather "
            "every unit at once and keep them until backward (the whole model on every rank). Change the model "
            "(or remove the hook), or turn graph mode off: eager ZeRO-3 gathers unit by unit around it"
        )

    def _fall_back(self, reason: str) -> None:
        self.stats.fallbacks.append(reason)
        warnings.warn(
            f"graph mode: part of {self.name}'s forward runs eagerly: {reason} (graph.strict makes this an error)",
            stacklevel=4,
        )


def _graph_breaks() -> Counter[str]:
    return Counter(torch._dynamo.utils.counters["graph_break"])


def _condensed(reason: str) -> str:
    """A graph-break reason without Dynamo's hints and links: its first line and its explanation."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    keep = lines[:1] + [line for line in lines[1:] if line.startswith("Explanation:")]
    return " ".join(keep)


def _construct(err: BaseException) -> str:
    """The first line of Dynamo's message (or the name of one of shardtrain's intended splits, such as a debug
    hook) and the user's line of code it stopped at."""
    text = str(err)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    head = lines[0] if lines else type(err).__name__
    intended = re.search(r"\(reason: (shardtrain [^()]*) " + re.escape(SPLIT_BY_DESIGN) + r"\)", text)
    if intended:
        head = f"a {intended.group(1).removeprefix('shardtrain ')} (shardtrain runs it eagerly, between graphs)"
    ours = ("shardtrain/graph/", "shardtrain/between_graphs.py")
    where = [line for line in lines if line.startswith("File ") and not any(o in line for o in ours)]
    return f"{head} (at {where[-1]})" if where else head


def capture(
    module: nn.Module,
    *,
    strict: bool = False,
    cache_size: int = 8,
    compiler: str = "aot_eager",
    dynamic_shapes: bool = True,
):
    """Run ``module`` in graph mode: see :class:`CapturedModule`."""
    return CapturedModule(
        module, strict=strict, cache_size=cache_size, compiler=compiler, dynamic_shapes=dynamic_shapes
    )
