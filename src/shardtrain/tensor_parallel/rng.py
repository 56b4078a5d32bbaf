"""Random numbers inside and outside tensor-parallel regions (Megatron's RNG tracker idea, without a tracker).

[Note: tensor-parallel RNG]
Dropout on a *split* activation (this rank's heads, the MLP's hidden block) must draw different masks on different tp
ranks, or they drop the same positions of different blocks; on a *replicated* one (the residual stream) the same mask on
every rank, or the replicas drift apart. Megatron keeps a second per-rank generator state that checkpoints must save and
recomputation restore; here the only state is the default generators, which both already handle:

* ``enter()`` (a column-parallel layer's split output) draws ``base`` from the default CPU generator (the same on every
  tp rank), remembers the state after the draw and re-seeds the default generators (CPU, and the current CUDA device's
  once CUDA is initialized) from ``(base, tp_rank)``;
* ``exit()`` (the activation is replicated again) restores the remembered state.

Outside regions the default stream thus advances alike on every rank, and a recompute forks to the same seed. Forward
hooks close any region at both ends of the forward, so a checkpoint needs only the default states. A group of one skips
the fork (tp size 1 draws the unparallelized model's numbers). In graph mode at ZeRO-3 (one graph, [Note: one graph, no
splits] in :mod:`shardtrain.between_graphs`) ``enter()`` traces only its draw, and a graph drawing random numbers under
tensor parallelism is refused (``shardtrain.graph.sharded.refuse_random``).
"""

from __future__ import annotations

import torch

from shardtrain.between_graphs import between_graphs

_GOLDEN = 0x9E3779B97F4A7C15  # odd: (rank + 1) * _GOLDEN is distinct modulo 2**63 for every rank
_MASK63 = (1 << 63) - 1


class RegionRNG:
    """Forks the default generators on entering a tensor-parallel region and restores them on leaving it."""

    def __init__(self, tp_rank: int, tp_size: int) -> None:
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._traced_inside = False  # a region open in the graph being traced (one graph at ZeRO stage 3)
        self._draw = torch.zeros(1, dtype=torch.int64)  # where a traced enter() puts its draw (a graph must use it)
        # the generator states to restore on exit (one per forked generator), None outside a region
        self._resume: list[tuple[torch.Generator, torch.Tensor]] | None = None

    @property
    def inside(self) -> bool:
        """Whether a region is open (the default generators are forked)."""
        return self._resume is not None

    # generator states cannot be held in a captured graph
    @between_graphs("tensor-parallel RNG fork", traced_in_one_graph=True)
    def enter(self) -> None:
        """Open a region (no-op if one is open already, or for a group of one)."""
        if self._resume is not None or self.tp_size == 1:
            return
        if torch.compiler.is_compiling():  # one graph: the draw only (see the note)
            if not self._traced_inside:
                self._traced_inside = True
                self._draw.copy_(torch.randint(0, 1 << 62, (1,), device="cpu"))
            return
        cpu = torch.default_generator
        base = int(torch.randint(0, 1 << 62, (1,), generator=cpu).item())  # the one identical draw
        generators = [cpu]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            generators.append(torch.cuda.default_generators[torch.cuda.current_device()])
        self._resume = [(g, g.get_state()) for g in generators]
        seed = (base + (self.tp_rank + 1) * _GOLDEN) & _MASK63
        for i, g in enumerate(generators):
            g.manual_seed((seed + i) & _MASK63)

    @between_graphs("tensor-parallel RNG fork", traced_in_one_graph=True)
    def exit(self) -> None:
        """Close the open region, if any: the default generators continue as if it never was."""
        if torch.compiler.is_compiling():
            self._traced_inside = False
            return
        if self._resume is None:
            return
        for g, state in self._resume:
            g.set_state(state)
        self._resume = None
