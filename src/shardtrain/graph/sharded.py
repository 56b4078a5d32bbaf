"""ZeRO-3 inside the captured graph: gathers, releases and gradient reduce-scatters as graph operations.

[Note: ZeRO-3 as graph operations]
Eager ZeRO-3's hooks and storage resizes cannot be traced, so graph mode's forward runs ``functional_call(module,
{name: view of gather(unit shard) for every unit}, args, kwargs)`` with ``gather`` an autograd function: its forward
all-gathers the unit's flat shard, its backward reduce-scatters (averages) the unit's flat gradient, both functional
collectives ([Note: collectives in graphs] in :mod:`shardtrain.distributed.communicator`). Three steps make the
traced pair behave like ZeRO-3, not a model held whole (docs/graph-mode.md, "ZeRO-3 in the graph", walks through):

1. **Release**: saved gathered weights would keep every unit gathered until backward, so before the partitioner runs
   :func:`recompute_gathers` marks each all-gather, its wait and its views ``MUST_RECOMPUTE``: the shard is saved and
   backward re-gathers, except for the root and the last unit of the forward order ([Note: kept in the graph]).
   Release is then the generated code's liveness: a full buffer is freed after the last operation reading it.
2. **Prefetch and order** (:func:`schedule`, on both graphs): Dynamo traces all gathers first; the pass moves each
   wait and its views to just before first use and issues each all-gather one unit ahead (at most the current and the
   prefetched unit gathered). In backward each reduce-scatter is hoisted to its unit's last gradient and waited for
   when the next is issued (one in flight, as eager). It follows ``stage3_prefetch_bucket_size`` and ``overlap_comm``
   (:class:`Settings`); a swapped shard's read is part of its gather ([Note: swapped shards in graphs]).
3. **Gradients**: each trainable bucket has an fp32 leaf *sink* that ``gather`` takes and ignores; its gradient is the
   bucket's reduce-scattered gradient and its ``.grad`` the reducer's shard buffer, so micro-steps accumulate in place

   in fp32 and the step, clipping, checkpoints and ``engine.gathered()`` work as in eager ZeRO-3.
[Note: no split at ZeRO stage 3]
Every gather is issued before ``functional_call`` enters its parameter swap, a context manager TorchDynamo cannot
split. A construct it cannot trace inside the model (``.item()`` control flow, a ``torch.compiler.disable`` hook)
therefore cannot become a split between two graphs: TorchDynamo would run the whole forward eagerly, every unit
gathered up front and kept until backward, the whole model on every rank. So the stage-3 forward is compiled with
``fullgraph=True`` and such a construct is a ``GraphCaptureError`` naming it, raised while tracing (before any
gather ran), whatever ``graph.strict`` says. Debug subscribers are traced into the graph instead (see [Note:
statistics inside the graph] in :mod:`shardtrain.debug.traced`).

[Note: kept in the graph]
The graph keeps gathered from forward to backward the two units eager ZeRO-3 keeps (the root and the last unit of the
forward order, [Note: kept after forward] in :mod:`shardtrain.runtime.eager`), so both modes move the same bytes
and hold the same units. A unit has no name in the joint graph, so :func:`recompute_gathers` finds them by position:
:class:`UnitInputs` traces one gather per bucket in bucket order (``Settings.buckets``), so the k-th gather of ZeRO's
group is bucket k's, confirmed by its size. The root unit's module is the engine's module; the last unit is, of the
others, the one whose parameters the forward (operations not depending on a tangent) uses last: eager's last unit
hook. Nothing is kept if no other unit runs in forward; every bucket of a kept unit is kept (frozen ones too).
Gathers that do not match the buckets (one left out by the trace) keep nothing: every unit re-gathered, slower.
Their gathers are left unmarked, not marked saved: the partitioner saves what backward reads (the collective is never
recomputed), so a kept unit backward does not read (a root holding only an embedding) is freed after forward, where
eager holds it until its gradients are in; neither mode gathers it again. At most three units are whole at once
(root, current, prefetched), as in eager. Saved backward inputs of a kept unit carry its name in their meta
(``KEPT``), which :func:`schedule` reads: backward's first re-gather is issued at its start, during the kept units'
backward, and ``most_gathered`` counts the kept units until their last use. With ``offload_param`` nvme a kept unit's
shard read is not marked either. The numbers are eager ZeRO-3's (same shards, same reduction algorithm and order,
wire dtype included), but for the order AOT autograd adds a twice-used parameter's contributions (tied embeddings).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils.checkpoint import CheckpointPolicy

from shardtrain.distributed.communicator import Communicator
from shardtrain.errors import GraphCaptureError
from shardtrain.graph.swapped import read_shard
from shardtrain.plan.policies import PrefetchPolicy
from shardtrain.zero.layout import Bucket
from shardtrain.zero.reducer import divides_first
from shardtrain.zero.units import Unit


@dataclass(eq=False)
class BucketSpec:
    """What the graph needs to know of one unit bucket: the names, sizes and shapes of its parameters.

    Never changed after construction. The graph reads it from closures only, never as an argument: TorchDynamo
    before 2.13 can neither rebuild a frozen dataclass passed to an autograd Function nor take a plain one as a
    constant (both seen with torch 2.11 on an H200), so :func:`_gather_function` closes over it and ``layout`` is a
    function of no arguments."""

    unit: str
    names: tuple[str, ...]
    sizes: tuple[int, ...]  # each parameter's numel, then the padding
    shapes: tuple[tuple[int, ...], ...]
    wire_dtype: torch.dtype  # gradients are reduced in it
    comm: Communicator
    predivide: float | None = None  # prescale_gradients / gradient_predivide_factor, as the eager reducer's
    # tensor parallelism: per parameter whether its gradient is a partial sum over the tensor-parallel group
    # (``TPPlacement.partial_grad``), summed over ``tp_comm`` before the reduction, as the eager reducer's hook does
    tp_partial: tuple[bool, ...] = ()
    tp_comm: Communicator | None = None
    swapped: bool = False  # the shard is in a swap file: the graph reads it (see [Note: swapped shards in graphs])

    def __post_init__(self) -> None:
        sizes, shapes = self.sizes, self.shapes

        def layout() -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
            return sizes, shapes

        # the sizes and shapes as constants of the graph (``dynamic=True`` would trace them as symbols)
        self.layout = torch._dynamo.assume_constant_result(layout)


def _views(full: torch.Tensor, spec: BucketSpec) -> tuple[torch.Tensor, ...]:
    sizes, shapes = spec.layout()
    pieces = torch.split(full, sizes)
    return tuple(piece.view(shape) for piece, shape in zip(pieces, shapes))


def _gather_function(spec: BucketSpec) -> type[torch.autograd.Function]:
    """One bucket's gather as an autograd Function closing over its spec. Forward: all-gather the bucket's shard into
    its parameters. Backward: reduce-scatter (average) the bucket's gradient into the sink's gradient (see
    [Note: ZeRO-3 as graph operations])."""

    class GatherUnit(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, shard: torch.Tensor, sink: torch.Tensor) -> tuple[torch.Tensor, ...]:
            ctx.sink_dtype = sink.dtype
            return _views(spec.comm.graph_all_gather(shard), spec)

        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor) -> tuple[None, torch.Tensor]:
            sizes, _ = spec.layout()
            if any(spec.tp_partial):
                grads = tuple(spec.tp_comm.graph_all_reduce(g) if p else g for g, p in zip(grads, spec.tp_partial))
            flat = [g.reshape(-1).to(spec.wire_dtype) for g in grads]
            if len(sizes) > len(grads):  # the padding up to a multiple of the data-parallel size
                flat.append(flat[0].new_zeros(sizes[-1]))
            reduced = spec.comm.graph_reduce_scatter_avg(
                torch.cat(flat), spec.predivide, divides_first(spec.predivide, spec.wire_dtype)
            )
            return None, reduced.to(ctx.sink_dtype)

    return GatherUnit


class UnitInputs:
    """The ZeRO-3 units of an engine as inputs of the captured graph (see [Note: ZeRO-3 as graph operations]).

    ``shard_grad(bucket)`` is the reducer's fp32 gradient shard of a trainable bucket: the sink's ``.grad``;
    ``prefetch`` and ``overlap`` are the prefetch policy and ``overlap_comm`` (see
    :class:`Settings`); ``predivide`` is the reducer's (``prescale_gradients`` / ``gradient_predivide_factor``);
    ``tp_partial``: with tensor parallelism, the tensor-parallel communicator and the ids of the parameters whose
    gradients are partial sums over it (the graphs' tensor-parallel collectives are counted in its stats())."""

    def __init__(
        self,
        root: nn.Module,
        units: list[Unit],
        comm: Communicator,
        wire_dtype: Callable[[Bucket], torch.dtype],
        shard_grad: Callable[[Bucket], torch.Tensor],
        prefetch: PrefetchPolicy,
        overlap: bool = True,
        predivide: float | None = None,
        tp_partial: tuple[Communicator, frozenset[int]] | None = None,
        swapped: frozenset[int] = frozenset(),
    ) -> None:
        self.comm = comm
        tp_comm, partial = tp_partial if tp_partial is not None else (None, frozenset())
        # the graphs' collectives are counted in these communicators' stats() (see GraphTraffic)
        self.comms = (comm,) if tp_comm is None or tp_comm.alone else (comm, tp_comm)
        # only ZeRO's all-gathers are re-gathered in backward and scheduled, never tensor parallelism's
        self.settings = Settings(
            prefetch,
            overlap,
            group=comm.group.group_name if not comm.alone else "",
            tensor_parallel=len(self.comms) > 1,
            swapped=bool(swapped),
            # one gather per bucket in this order (parameters()): how the joint graph's gathers are told apart
            buckets=tuple((u.name, b.padded_numel) for u in units for b in u.buckets),
            root=next((u.name for u in units if u.module is root), None),
        )
        self.buckets: list[Bucket] = [b for u in units for b in u.buckets]
        index = {id(s.param): (i, k) for i, b in enumerate(self.buckets) for k, s in enumerate(b.slots)}
        # every place a unit parameter is registered (a tied parameter has several): (module, attribute, name, slot)
        self._places: list[tuple[nn.Module, str, str, tuple[int, int]]] = []
        for prefix, m in root.named_modules(remove_duplicate=False):
            for attr, p in m._parameters.items():
                if p is not None and id(p) in index:
                    self._places.append((m, attr, f"{prefix}.{attr}" if prefix else attr, index[id(p)]))
        self._shard_grad = shard_grad
        self.specs: list[BucketSpec] = []
        for u in units:
            for b in u.buckets:
                pad = b.padded_numel - b.numel
                self.specs.append(
                    BucketSpec(
                        unit=u.name,
                        names=tuple(s.name for s in b.slots),
                        sizes=tuple(s.numel for s in b.slots) + ((pad,) if pad else ()),
                        shapes=tuple(tuple(s.shape) for s in b.slots),
                        wire_dtype=wire_dtype(b),
                        comm=comm,
                        predivide=predivide,
                        tp_partial=tuple(id(s.param) in partial for s in b.slots) if partial else (),
                        tp_comm=tp_comm,
                        swapped=b.index in swapped,
                    )
                )
        self.gathers = [_gather_function(spec) for spec in self.specs]
        # fp32 leaves whose gradient is the bucket's reduced gradient; no storage of their own (stride 0)
        self.sinks: list[torch.Tensor | None] = [
            shard_grad(b).new_zeros(()).expand(b.shard_numel).requires_grad_() if b.requires_grad else None
            for b in self.buckets
        ]
        for sink in self.sinks:
            if sink is not None:
                torch._dynamo.mark_static(sink)
        # per bucket, whether each parameter requires grad now: read at every call, not at construction, because
        # requires_grad_() after initialize() must stop (or resume) training that parameter, as in eager mode
        self.trainable: tuple[tuple[bool, ...], ...] = ()

    def inputs(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """The graph's extra inputs for one call: the buckets' shards and sinks, the sinks' ``.grad`` pointed at the
        reducer's gradient shards (autograd accumulates into them in place)."""
        self.trainable = tuple(tuple(s.param.requires_grad for s in b.slots) for b in self.buckets)
        for b, sink in zip(self.buckets, self.sinks):
            torch._dynamo.mark_static(b.shard)  # sizes of shards are fixed: no symbols for them in the graph
            if sink is not None:
                sink.grad = self._shard_grad(b)
        return [b.shard for b in self.buckets], self.sinks

    @contextmanager
    def detached(self) -> Iterator[None]:
        """The unit parameters taken out of their modules for a call (the graph passes gathered ones in their
        place): TorchDynamo then never touches a partitioned parameter."""
        for m, attr, _, _ in self._places:
            m._parameters[attr] = None
        try:
            yield
        finally:
            for m, attr, _, (i, k) in self._places:
                m._parameters[attr] = self.buckets[i].slots[k].param

    def parameters(self, shards: list[torch.Tensor], sinks: list[torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """Every unit parameter under every name it is registered as, gathered (traced into the graph).

        A parameter frozen since ``initialize`` (``requires_grad_(False)``) gets a detached view: no gradient flows
        to it, so its part of the reduced gradient is zero, what eager ZeRO-3 reduces for a parameter that got no
        gradient (the schema holds the trainable set, so freezing captures a new graph that reads this again)."""
        views: list[tuple[torch.Tensor, ...]] = []
        for spec, gather, shard, sink, trains in zip(self.specs, self.gathers, shards, sinks, self.trainable):
            if spec.swapped:
                shard = read_shard(shard)
            if sink is None or not torch.is_grad_enabled() or not any(trains):
                views.append(_views(spec.comm.graph_all_gather(shard), spec))
            else:
                gathered = gather.apply(shard, sink)
                views.append(tuple(v if t else v.detach() for v, t in zip(gathered, trains)))
        return {name: views[i][k] for _, _, name, (i, k) in self._places}


def call_on_gathered(module: nn.Module, units: UnitInputs, shards: list, sinks: list, args: tuple, kwargs: dict):
    """The function graph mode captures at ZeRO stage 3 (one copy per cache entry, like ``call_module``)."""
    return torch.func.functional_call(module, units.parameters(shards, sinks), args, kwargs, tie_weights=False)


# -- graph passes ---------------------------------------------------------------------------------------------
_AG = torch.ops._c10d_functional.all_gather_into_tensor.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_RS = (torch.ops._c10d_functional.all_to_all_single.default, torch.ops._c10d_functional.reduce_scatter_tensor.default)
_READ = torch.ops.shardtrain.read_swapped_shard.default


def _is_view(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


_ASSEMBLY = frozenset(
    ["cat", "_to_copy", "convert_element_type", "view", "reshape", "_unsafe_view", "clone", "new_zeros", "zeros",
     "full", "t", "transpose", "permute", "expand", "contiguous"]
)  # fmt: skip


def _op_name(node: fx.Node) -> str:
    if node.op != "call_function":
        return ""
    return getattr(getattr(node.target, "overloadpacket", None), "__name__", "")


def _is_unit_gather(node: fx.Node, group: str | None) -> bool:
    """An all-gather of a unit over ZeRO's group ``group`` (None: every all-gather), not a tensor-parallel one."""
    return node.target is _AG and (group is None or node.args[-1] == group)


def _gather_starts(graph: fx.Graph, group: str | None) -> list[fx.Node]:
    """Each unit's gather: its all-gather over ZeRO's group ``group``, or at data-parallel size 1 (no all-gather) the
    read of its swapped shard."""
    return [
        n
        for n in graph.nodes
        if _is_unit_gather(n, group) or (n.target is _READ and not any(u.target is _AG for u in n.users))
    ]


def _read_into(start: fx.Node) -> fx.Node | None:
    """The read of a swapped shard that an all-gather sends (see [Note: swapped shards in graphs]), if any."""
    source = start.args[0] if start.target is _AG else None
    return source if isinstance(source, fx.Node) and source.target is _READ else None


def _gather_group(start: fx.Node) -> list[fx.Node]:
    """An all-gather, its wait and every view taken of the gathered buffer (not the ops that compute with it); or a
    swapped shard's read that is a gather itself (data-parallel size 1) and its views."""
    group, stack = [start], [start]
    while stack:
        node = stack.pop()
        for user in node.users:
            gathered = node is not start or start.target is _READ  # an all-gather's own users are its waits
            if user not in group and (user.target is _WAIT or (gathered and _is_view(user))):
                group.append(user)
                stack.append(user)
    return group


def recompute_gathers(joint: fx.Graph, settings: Settings | None = None) -> None:
    """Step 1 of [Note: ZeRO-3 as graph operations]: re-gather in backward instead of saving gathered values (the
    units' gathers over ``settings.group``; a tensor-parallel gather's output is an activation, saved as such), except
    the units eager ZeRO-3 keeps from forward to backward (see [Note: kept in the graph])."""
    starts = _gather_starts(joint, settings.group if settings is not None else None)
    kept = kept_gathers(joint, starts, settings)
    for k, node in enumerate(starts):
        if node in kept:  # saved for backward: neither read again nor gathered again there
            for member in _gather_group(node):  # the backward graph's inputs share the meta (see _most_gathered)
                member.meta[KEPT] = (kept[node], k)
            continue
        read = _read_into(node)  # read again from the swap file in backward too, not kept from forward
        for member in [read, *_gather_group(node)] if read is not None else _gather_group(node):
            member.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            member.meta["ac_graph_id"] = 0


# node meta: (unit name, bucket) of the gathered buffer a node is (or views), kept from forward to backward
KEPT = "shardtrain_kept_unit"


def kept_gathers(joint: fx.Graph, starts: list[fx.Node], settings: Settings | None) -> dict[fx.Node, str]:
    """The gathers of the units eager ZeRO-3 keeps from forward to backward, the root unit and the last unit of the
    forward order, among the joint graph's ``starts``, with their unit's name (see [Note: kept in the graph]); none if
    they cannot be told."""
    if settings is None or not settings.buckets or len(starts) != len(settings.buckets):
        return {}
    if any(_gathered_numel(n) != numel for n, (_, numel) in zip(starts, settings.buckets)):
        return {}
    backward = _depends_on_tangents(joint)
    order = {n: i for i, n in enumerate(joint.nodes)}
    last_use: dict[str, int] = {}  # per unit, the position of the forward's last operation on its parameters
    for start, (unit, _) in zip(starts, settings.buckets):
        group = set(_gather_group(start))
        uses = [order[u] for m in group for u in m.users if u not in group and u not in backward and u.op != "output"]
        if uses:
            last_use[unit] = max(last_use.get(unit, -1), *uses)
    others = [u for u in last_use if u != settings.root]
    if not others:  # eager ZeRO-3 keeps nothing when no unit but the root runs in forward
        return {}
    keep = {settings.root, max(others, key=last_use.__getitem__)}
    return {start: unit for start, (unit, _) in zip(starts, settings.buckets) if unit in keep}


def _depends_on_tangents(graph: fx.Graph) -> set[fx.Node]:
    """The joint graph's backward: every node that depends on a tangent (the gradient of an output)."""
    found = {n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")}
    for node in graph.nodes:  # topological order: a node's inputs come before it
        if node not in found and any(a in found for a in node.all_input_nodes):
            found.add(node)
    return found


@dataclass(frozen=True)
class Scheduled:
    """What :func:`schedule` left in one graph."""

    all_gathers: int
    reduce_scatters: int
    most_gathered: int  # units gathered at once at the worst point of the program order
    prefetched: int = 0  # all-gathers issued before the compute that precedes their wait
    overlapped: int = 0  # reduce-scatters with compute between their issue and their wait


ALWAYS_PREFETCH = PrefetchPolicy(budget=2**62)
"""Every unit gathered one unit ahead (no budget)."""


@dataclass(frozen=True)
class Settings:
    """The ``zero_optimization`` keys the schedule follows, as eager ZeRO-3 does.

    ``prefetch``: a unit's all-gather is issued one unit ahead when :meth:`PrefetchPolicy.ahead` admits its buffer
    (else right before its first use);
    ``overlap`` (``overlap_comm``): each reduce-scatter issued as soon as its gradients exist and waited for when
    the next one is issued (false: issued where autograd computes it and waited for at once)."""

    prefetch: PrefetchPolicy = ALWAYS_PREFETCH
    overlap: bool = True
    # the process group of ZeRO's collectives (its name): with tensor parallelism the graph also holds all-gathers
    # and all-reduces over the tensor-parallel group, which the passes leave where they are. None: every one
    group: str | None = None
    # tensor parallelism in the one graph: a forward that draws random numbers is refused (see refuse_random)
    tensor_parallel: bool = False
    swapped: bool = False  # shards read from swap files: Inductor must keep the reads where the schedule put them
    # per bucket, in the order the graph gathers them: its unit's name and its gathered size; and the root unit's
    # name (None: no root unit). What tells the kept units apart in the joint graph ([Note: kept in the graph])
    buckets: tuple[tuple[str, int], ...] = ()
    root: str | None = None


def schedule(gm: fx.GraphModule, settings: Settings = Settings()) -> Scheduled:
    """Step 2 of [Note: ZeRO-3 as graph operations] on one graph module."""
    done = schedule_graph(gm.graph, settings)
    gm.recompile()
    return done


def is_backward(graph: fx.Graph) -> bool:
    return any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)


def schedule_graph(graph: fx.Graph, settings: Settings = Settings()) -> Scheduled:
    """Step 2 of [Note: ZeRO-3 as graph operations] on one graph."""
    if settings.tensor_parallel and not is_backward(graph):
        refuse_random(graph)
    groups = [_gather_group(n) for n in _gather_starts(graph, settings.group)]
    order = {n: i for i, n in enumerate(graph.nodes)}

    def first_use(group: list[fx.Node]) -> fx.Node:
        members = set(group)
        users = [u for m in group for u in m.users if u not in members]
        return min(users, key=order.__getitem__)

    # each unit's wait and views right before their first use, in the order of that use
    placed = []
    for group in groups:
        if any(m.users for m in group[1:]):
            placed.append((first_use(group), group))
    placed.sort(key=lambda item: order[item[0]])
    for use, group in placed:
        for member in sorted(group[1:], key=order.__getitem__):
            use.prepend(member)
    # each all-gather issued when the previous unit's data has arrived (one unit ahead), if the prefetch budget
    # admits it; else right before its own wait. A backward that starts on units kept from forward issues its first
    # all-gather at its start, while their backward runs (eager ZeRO-3 prefetches it when the first kept unit is
    # needed in backward)
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    starts_on_kept = is_backward(graph) and any(KEPT in n.meta for n in inputs)
    for previous, (_, group) in zip([None, *placed], placed):
        fits = settings.prefetch.ahead(_gathered_numel(group[0]))
        if previous is not None and fits:
            _ready(previous[1]).append(group[0])
        elif previous is None and starts_on_kept and fits and group[0].target is _AG:  # a read alone overlaps nothing
            inputs[-1].append(group[0])
        else:
            _ready(group).prepend(group[0])
        read = _read_into(group[0])
        if read is not None:  # the shard's read right before the all-gather that sends it (one unit ahead)
            group[0].prepend(read)
    if settings.overlap:
        _schedule_reductions(graph)
    graph.lint()
    reductions = sum(1 for n in graph.nodes if n.target in _RS)
    gathers = sum(1 for g in groups if g[0].target is _AG)
    return Scheduled(gathers, reductions, _most_gathered(graph, settings.group), *_overlapping(graph, settings.group))


def refuse_random(graph: fx.Graph) -> None:
    """A forward with tensor parallelism may not draw random numbers (dropout): inside a tensor-parallel region each
    rank must draw from its own stream ([Note: tensor-parallel RNG]), a fork of the generator that a graph cannot
    hold, so the graph would draw the same mask on every rank where eager mode draws different ones. The regions'
    own draw (the stream outside regions advancing as in eager mode) is allowed."""
    for node in graph.nodes:
        if not _draws_random(node):
            continue
        frames = [line.strip() for line in (node.meta.get("stack_trace") or "").splitlines()]
        frames = [line for line in frames if line.startswith("File ")]
        if frames and "shardtrain/tensor_parallel/rng.py" in frames[-1]:
            continue
        where = f" ({frames[-1]})" if frames else ""
        raise GraphCaptureError(
            f"graph-mode ZeRO-3 with tensor parallelism: the forward draws random numbers ({node.target}{where}, "
            "dropout?); inside a tensor-parallel region every rank must draw from its own random stream, which one "
            "graph cannot hold (it would draw the same mask on every tensor-parallel rank). Set the dropout "
            "probabilities to 0 (or train in eval mode), or turn graph mode off: eager ZeRO-3 forks the generator "
            "per tensor-parallel rank"
        )


def _draws_random(node: fx.Node) -> bool:
    """Whether an operation of the graph draws random numbers: an op PyTorch tags as seeded, unless its dropout
    probability is 0 or it does not train (attention kernels are tagged whatever their ``dropout_p``)."""
    if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return True
    values = {a.name: v for a, v in zip(schema.arguments, node.args)} | dict(node.kwargs)
    return not (any(values.get(name) == 0 for name in ("dropout_p", "p")) or values.get("train") is False)


def _ready(group: list[fx.Node]) -> fx.Node:
    """Where a gathered unit's data is first needed: its all-gather's wait, or (a read at data-parallel size 1) the
    first view of what it read."""
    wait = next((m for m in group if m.target is _WAIT), None)
    if wait is not None:
        return wait
    views = set(group[1:])
    return next(n for n in group[0].graph.nodes if n in views)


def _gathered_numel(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() if isinstance(val, torch.Tensor) else 0


def _overlapping(graph: fx.Graph, group: str | None) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) with an operation that is none of theirs between issue and wait: prefetched
    gathers, reductions overlapped with compute."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    counts = {True: 0, False: 0}
    for n in nodes:
        if _is_unit_gather(n, group) or n.target in _RS:
            waits = [u for u in n.users if u.target is _WAIT]
            if waits:
                between = nodes[index[n] + 1 : index[waits[0]]]
                counts[n.target is _AG] += any(b.op == "call_function" and b.target is not _WAIT for b in between)
    return counts[True], counts[False]


def _schedule_reductions(graph: fx.Graph) -> None:
    """Backward: each reduce-scatter (and the assembly of its input) as soon as its gradients exist; its result
    waited for when the next one is issued."""
    starts = [n for n in graph.nodes if n.target in _RS]
    if not starts:
        return
    output = next(n for n in graph.nodes if n.op == "output")
    last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
    for start in starts:
        chain, stack = [], [start]
        while stack:  # the ops that assemble the reduced tensor (cat, casts, padding), not the gradients' compute
            node = stack.pop()
            for arg in node.all_input_nodes:
                if arg not in chain and len(arg.users) == 1 and _op_name(arg) in _ASSEMBLY:
                    chain.append(arg)
                    stack.append(arg)
        order = {n: i for i, n in enumerate(graph.nodes)}
        for node in sorted([*chain, start], key=order.__getitem__):
            inputs = node.all_input_nodes
            anchor = max(inputs, key=order.__getitem__) if inputs else last_input
            if order[anchor] < order[node]:
                anchor.append(node)
                order = {n: i for i, n in enumerate(graph.nodes)}
    order = {n: i for i, n in enumerate(graph.nodes)}
    starts.sort(key=order.__getitem__)
    for start, following in zip(starts, [*starts[1:], output]):
        tail, stack = [], [start]
        while stack:  # the wait and what turns its result into the gradient shard, up to the output
            node = stack.pop()
            for user in node.users:
                if user.op != "output" and user not in tail:
                    tail.append(user)
                    stack.append(user)
        for node in sorted(tail, key=order.__getitem__):
            if all(order[a] < order[following] for a in node.all_input_nodes if a not in tail):
                following.prepend(node)
        order = {n: i for i, n in enumerate(graph.nodes)}


def _most_gathered(graph: fx.Graph, group: str | None) -> int:
    """Most units gathered at one point of the graph's program order: all-gathers issued and not yet dead, and in
    backward the units kept from forward (inputs of the graph) until their last use."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    lifetimes = []
    for n in nodes:
        if _is_unit_gather(n, group):
            members = set(_gather_group(n))
            last = max((index[u] for m in members for u in m.users if u not in members), default=index[n])
            lifetimes.append((index[n], last))
    kept: dict[tuple[str, int], int] = {}  # the forward's kept buffers are its outputs: to its end, counted above
    for n in nodes:
        if n.op == "placeholder" and KEPT in n.meta:
            last = max((index[u] for u in n.users), default=index[n])
            kept[n.meta[KEPT]] = max(kept.get(n.meta[KEPT], 0), last)
    lifetimes.extend((0, last) for last in kept.values())
    return max((sum(1 for a, b in lifetimes if a <= i <= b) for i in range(len(nodes))), default=0)


class InductorPasses:
    """Steps 1 and 2 of [Note: ZeRO-3 as graph operations] as Inductor's custom passes (``joint_custom_pre_pass``
    before the partitioner, ``post_grad_custom_post_pass`` on the forward and backward graphs it compiles);
    ``report(which, scheduled, graph)`` is told what each scheduled graph holds."""

    def __init__(self, report: Callable[[str, Scheduled, fx.Graph], None], settings: Settings = Settings()) -> None:
        from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

        uuid = get_hash_for_files((__file__,))

        class Recompute(CustomGraphPass):
            def __call__(self, graph: fx.Graph) -> None:
                recompute_gathers(graph, settings)

            def uuid(self) -> bytes:
                return uuid

        class Schedule(CustomGraphPass):
            def __call__(self, graph: fx.Graph) -> None:
                report("backward" if is_backward(graph) else "forward", schedule_graph(graph, settings), graph)

            def uuid(self) -> bytes:
                return uuid

        self.config = {"joint_custom_pre_pass": Recompute(), "post_grad_custom_post_pass": Schedule()}
        if settings.swapped:
            # measured (world 2, 3 units): Inductor's reordering for peak memory moved every read of a swapped shard
            # before the first unit's compute, all shards held at once; without it the reads stay one unit ahead
            self.config["reorder_for_peak_memory"] = False
