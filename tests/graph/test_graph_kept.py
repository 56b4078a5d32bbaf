"""Graph-mode ZeRO-3 keeps from forward to backward exactly what eager ZeRO-3 keeps: the root unit and the last unit
of the forward order ([Note: kept after forward] in ``runtime/eager.py``, [Note: kept in the graph] in
``graph/sharded.py``), so both modes gather the same bytes per step and hold the same units between forward and
backward.

What each mode holds is read where it is held, not from the passes: eager ZeRO-3's units that are not sharded
after forward, and the units whose whole gathered buffer (told by its values, every rank's shard concatenated) is
held by a tensor the captured forward saved for its backward. The bytes are ``comm_stats()``'s, per step."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import shardtrain
from shardtrain.testing import run_distributed
from shardtrain.zero.units import UnitState

from helpers.tp_cases import SEQ, VOCAB

STEPS, MICRO = 3, 2


class Stack(nn.Module):
    """A root unit (an embedding, and a head unless ``head`` is false) and three blocks, run last-registered first
    if ``reverse``: the last unit of the forward order is then ``blocks.0``, the first unit of the layout's."""

    def __init__(self, reverse: bool, head: bool) -> None:
        super().__init__()
        self.reverse = reverse
        self.embed = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(16, VOCAB) if head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in reversed(self.blocks) if self.reverse else self.blocks:
            h = block(h)
        return self.head(h) if self.head is not None else h


class RootOnly(nn.Module):
    """No repeated block: the root is the only unit."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(x)))


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "root only":
        return RootOnly()
    return Stack(reverse=kind == "reversed, no head", head=kind == "stack")


def _loss(engine, kind: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = engine(x)
    if out.shape[-1] != VOCAB:
        return out.square().mean()
    return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())


def _compiled_backward_nodes(loss: torch.Tensor) -> list:
    found, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.name() == "CompiledFunctionBackward":
            found.append(node)
        stack.extend(n for n, _ in node.next_functions)
    return found


def held_by_graph(engine, loss: torch.Tensor) -> set[str]:
    """The units whose whole gathered buffer a tensor saved by the captured forward holds (by its values)."""
    buffers = []
    for name, _, buckets in engine.layout.unit_buckets:
        for b in buckets:
            full = b.shard.new_empty(b.padded_numel)
            dist.all_gather_into_tensor(full, b.shard.contiguous())  # not engine.comm: not in comm_stats()
            buffers.append((name, full))
    nodes = _compiled_backward_nodes(loss)
    assert nodes, "no captured backward"
    held = set()
    for node in nodes:
        for t in node.saved_tensors:
            whole = t.new_empty(0).set_(t.untyped_storage())  # the storage the saved tensor keeps alive
            held |= {name for name, full in buffers if whole.shape == full.shape and torch.equal(whole, full)}
    return held


def run(kind: str, graph: bool) -> dict:
    model = _model(kind)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "graph": {"enabled": graph, "strict": True},
        # graph mode has no per-gather unit-order check: off in both modes, so that comm_stats() holds the same kinds
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_gather_check": False},
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = shardtrain.initialize(model, config=config, optimizer=optimizer)
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(1)
    data = torch.randint(0, VOCAB, (STEPS, world * MICRO, SEQ + 1))
    engine.comm_stats(reset=True)
    out = {"held": [], "comm": [], "losses": []}
    for step in range(STEPS):
        rows = data[step, rank * MICRO : (rank + 1) * MICRO]
        loss = _loss(engine, kind, rows[:, :-1], rows[:, 1:])
        stats = engine.comm_stats(reset=True)
        if graph:
            out["held"].append(held_by_graph(engine, loss))
        else:
            out["held"].append({u.name for u in engine._runtime.units if u.state is not UnitState.SHARDED})
        engine.backward(loss)
        engine.step()
        after = engine.comm_stats(reset=True)
        out["comm"].append(_add(stats, after))
        out["losses"].append(loss.item())
    out["units"] = [(name, [b.padded_numel * b.flat_param.element_size() for b in bs])
                    for name, _, bs in engine.layout.unit_buckets]  # fmt: skip
    out["graph"] = engine.graph_stats() if graph else None
    out["params"] = engine.full_state_dict()
    engine.close()
    return out


def _add(a: dict, b: dict) -> dict:
    """Two ``comm_stats()`` readings added kind by kind."""
    return {
        kind: {k: a.get(kind, {}).get(k, 0) + b.get(kind, {}).get(k, 0) for k in {*a.get(kind, {}), *b.get(kind, {})}}
        for kind in {*a, *b}
    }


def both_modes(kinds: list[str]) -> list[dict]:
    return [{"graph": run(kind, True), "eager": run(kind, False)} for kind in kinds]


def check(world: int, cases: list[tuple[str, set[str], set[str]]]) -> None:
    """Per (model, kept, held): neither mode gathers ``kept`` again in backward and both gather every other unit
    again; eager ZeRO-3 holds ``kept`` between forward and backward (from its second step: its first forward does
    not know the order yet and releases the last unit), the graph ``held``, what of ``kept`` its backward reads,
    and no other unit. The modes gather the bytes that implies, the same from the second step on, and train
    bitwise alike."""
    results = run_distributed(both_modes, world, [kind for kind, _, _ in cases], timeout=600)
    for rank, per_model in enumerate(results):
        for (kind, kept, held), r in zip(cases, per_model, strict=True):
            graph, eager = r["graph"], r["eager"]
            what = f"{kind}, world {world}, rank {rank}"
            assert graph["units"] == eager["units"]
            assert graph["held"] == [held] * STEPS, (what, graph["held"])
            first = {"<root>"} & kept  # eager's first forward keeps the root only
            assert eager["held"] == [first] + [kept] * (STEPS - 1), (what, eager["held"])
            # per step: every bucket gathered in forward, and again in backward unless its unit is kept
            sizes = [(name, size * (world - 1) // world) for name, bs in graph["units"] for size in bs]
            regathered = [size for name, size in sizes if name not in kept]
            want = {"calls": len(sizes) + len(regathered), "bytes": sum(s for _, s in sizes) + sum(regathered)}
            want["sent"] = want["bytes"]
            for step, (g, e) in enumerate(zip(graph["comm"], eager["comm"], strict=True)):
                assert g["all_gather"] == want, (what, step, g["all_gather"], want)
                assert g["reduce_scatter"] == e["reduce_scatter"] and g["reduce_scatter"]["calls"] == len(sizes)
                if step == 1 and "all_gather_object" in e:
                    # eager's order exchange for a reversed block order: at the second step, where the first
                    # step's order flag is read (see [Note: reading device values a step later]); the rest is equal
                    assert e["all_gather_object"]["calls"] == 1, (what, e)
                    e = {k: v for k, v in e.items() if k != "all_gather_object"}
                if step >= 1:
                    assert e == g, (what, step, e, g)
            assert graph["graph"]["collectives"]["backward all-gathers"] == len(regathered), graph["graph"]
            assert graph["graph"]["fallbacks"] == [] and graph["graph"]["captures"] == 1, graph["graph"]
            assert graph["losses"] == eager["losses"], (what, graph["losses"], eager["losses"])
            if rank == 0:
                for k, v in eager["params"].items():
                    assert torch.equal(graph["params"][k], v), (what, k)


def test_graph_keeps_the_root_and_the_last_block_as_eager_zero3_does():
    """World 3: the root (embedding and head) and ``blocks.2``, held in both modes."""
    check(3, [("stack", {"<root>", "blocks.2"}, {"<root>", "blocks.2"})])


def test_the_last_unit_is_the_last_of_the_forward_order():
    """World 2. Blocks run in reverse: ``blocks.0`` is kept, not the last registered; the root holds only the
    embedding, whose gradient needs the indices and not the weight, so the graph saves none of it (eager holds it
    until its gradients are in), and neither gathers it again. A model whose root is its only unit keeps nothing in
    either mode (eager ZeRO-3 keeps only when a unit besides the root runs in forward)."""
    check(2, [("reversed, no head", {"<root>", "blocks.0"}, {"blocks.0"}), ("root only", set(), set())])
