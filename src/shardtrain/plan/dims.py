"""The parallel dimensions of a job, validated once and without a process group.

``world = pp * dp * cp * sp * tp`` (the ``cp * sp`` ranks of one sequence adjacent, [Note: the context axis]).
Each of the ``pp`` pipeline stages is a job of ``world / pp`` ranks laid out as without pipelining ([Note: the
pipeline axis] in :mod:`shardtrain.distributed.mesh`).
ZeRO shards over the ``dp * cp * sp`` ranks holding the same tensor-parallel block (``zero``), within groups of
``shard`` of them with hybrid sharding (``replicas = zero / shard``); expert groups are ``ep`` adjacent ranks of
that axis; ZeRO++ hpZ keeps secondary shards within groups of ``hpz`` adjacent ones. How ranks are numbered along
each axis is :func:`shardtrain.distributed.mesh.make_groups`'s ([Note: the sequence axis], [Note: the expert axis]).

Every size that cannot be laid out at ``world`` ranks is a :class:`~shardtrain.errors.LayoutError` raised here, with
the sizes that would fit: ``initialize``, ``shardtrain config check --world-size`` and ``shardtrain estimate`` all
build their dims through this class, so they give the same verdict in the same words.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardtrain.errors import LayoutError


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of every parallel axis at ``world`` ranks; constructing one validates it."""

    world: int
    tp: int = 1
    """Tensor-parallel size: ranks each layer is split across (``tensor_parallel.size``)."""
    sp: int = 1
    """Sequence-parallel size (Ulysses, ``sequence_parallel_size``)."""
    ep: int = 1
    """Expert-parallel size (``expert_parallel_size``), cut from the ``zero`` axis."""
    shard_size: int = -1
    """Hybrid sharding's group size (``zero_optimization.mics_shard_size``); -1: one group of every ZeRO rank."""
    hpz_size: int = 1
    """ZeRO++ hpZ's group size as asked (``zero_hpz_partition_size`` at stage 3; 0 or 1: off)."""
    pp: int = 1
    """Pipeline-parallel size (``pipeline_parallel_size``): stage ranks, each holding its own stages of the model."""
    cp: int = 1
    """Context-parallel size (ring attention, ``context_parallel_size``): ranks sharing one sequence in load-balanced
    chunks ([Note: the context axis] in :mod:`shardtrain.distributed.mesh`)."""

    def __post_init__(self) -> None:
        if self.world < 1:
            raise LayoutError(f"the world size must be at least 1, got {self.world}")
        if self.pp < 1 or self.world % self.pp:
            raise LayoutError(
                f"pipeline_parallel_size {self.pp} does not divide the {self.world} processes of this job: each "
                f"pipeline stage is held by world / pipeline_parallel_size ranks: choose one of {divisors(self.world)}"
            )
        # every other axis is laid out within one stage's ranks
        world, tp, sp = self.stage_world, self.tp, self.sp
        if tp < 1 or world % tp:
            raise LayoutError(
                f"tensor_parallel.size {tp} does not divide the {world} processes of this job: the data-parallel "
                f"size is world / tensor_parallel.size, so choose one of {divisors(world)}"
            )
        if sp < 1 or world % (sp * tp):
            sizes = [d for d in range(1, world // tp + 1) if world % (d * tp) == 0]
            per_block = f" (with tensor_parallel.size {tp}: {world // tp} ranks per tensor-parallel block)"
            raise LayoutError(
                f"sequence_parallel_size {sp} does not divide the {world} processes of this job"
                + (per_block if tp != 1 else "")
                + ": the data-parallel size is world / (sequence_parallel_size * tensor_parallel.size), so choose one "
                f"of {sizes}"
            )
        cp = self.cp
        if cp < 1 or world % (cp * sp * tp):
            sizes = [d for d in range(1, world // (sp * tp) + 1) if world % (d * sp * tp) == 0]
            raise LayoutError(
                f"context_parallel_size {cp} does not divide the {world} processes of this job"
                + (f" (with sequence_parallel_size {sp} x tensor_parallel.size {tp})" if sp * tp > 1 else "")
                + ": the data-parallel size is world / (context_parallel_size * sequence_parallel_size * "
                f"tensor_parallel.size), so choose one of {sizes}"
            )
        dp, zero = self.dp, self.zero
        if self.shard_size == 0 or self.shard_size < -1 or zero % self.shard:
            if sp == 1:
                raise LayoutError(
                    f"zero_optimization.mics_shard_size {self.shard_size} does not divide the data-parallel size "
                    f"{dp} (world {world} / tensor_parallel.size {tp}), so mics_shard_size {self.shard_size} does "
                    f"not divide the {zero} ranks ZeRO shards over: state is sharded within groups of "
                    f"mics_shard_size ranks and replicated across the groups, so choose one of {divisors(zero)} (or "
                    f"-1 to shard over all {zero})"
                )
            raise LayoutError(
                f"zero_optimization.mics_shard_size {self.shard_size} does not divide the {zero} ranks ZeRO shards "
                f"over (data-parallel size {dp} x sequence_parallel_size {sp}): under sequence parallelism state is "
                f"sharded over the data- and sequence-parallel ranks together, within groups of mics_shard_size and "
                f"replicated across the groups, so choose one of {divisors(zero)} (or -1 to shard over all {zero})"
            )
        if self.ep < 1 or zero % self.ep:  # see [Note: experts under sequence parallelism] in distributed/mesh.py
            if sp > 1:
                raise LayoutError(
                    f"expert_parallel_size (ep_size) {self.ep} does not divide the {zero} ranks ZeRO shards over "
                    f"(data-parallel size {dp} x sequence_parallel_size {sp}): under sequence parallelism every one "
                    f"of them holds other tokens, an expert group is ep_size adjacent ones and the ranks holding the "
                    f"same experts are {zero} / ep_size of them, so choose one of {divisors(zero)}"
                )
            within = f" (world / tensor_parallel.size {tp})" if tp > 1 else ""
            raise LayoutError(
                f"expert_parallel_size (ep_size) {self.ep} does not divide the data-parallel size {dp}{within}: "
                f"the ranks of an expert group are data-parallel ranks, and the ranks holding the same experts are "
                f"dp / ep_size of them, so choose one of {divisors(dp)}"
            )
        hpz = self.hpz_size
        if hpz > 1 and tp == 1 and sp == 1 and cp > 1 and self.replicas == 1 and zero % hpz:
            raise LayoutError(
                f"zero_optimization.zero_hpz_partition_size {hpz} does not divide the {zero} ranks ZeRO shards over "
                f"(data-parallel size {dp} x context_parallel_size {cp}): each group of that many adjacent ones (the "
                f"cp ranks of a sequence first) keeps a secondary copy of the parameter shards, so choose one of "
                f"{divisors(zero)}, or 1 to turn hpZ off"
            )
        if hpz > 1 and tp == 1 and sp == 1 and cp == 1 and self.replicas == 1 and dp % hpz:
            raise LayoutError(
                f"zero_optimization.zero_hpz_partition_size {hpz} does not divide the data-parallel size {dp} (world "
                f"{world}): each group of that many adjacent ranks keeps a secondary copy of the parameter shards, "
                f"so choose one of {divisors(dp)} (the ranks of one node), or 1 to turn hpZ off"
            )

    @property
    def stage_world(self) -> int:
        """The ranks holding one pipeline stage: ``world / pp`` (the whole world without pipelining)."""
        return self.world // self.pp

    @property
    def dp(self) -> int:
        """The data-parallel size: ranks given different batches, ``world / (pp * tp * sp * cp)``."""
        return self.stage_world // (self.tp * self.sp * self.cp)

    @property
    def zero(self) -> int:
        """The ranks ZeRO shards over (those holding the same tensor-parallel block): ``dp * cp * sp``."""
        return self.dp * self.cp * self.sp

    @property
    def shard(self) -> int:
        """The ranks of one ZeRO shard group: ``shard_size``, or every ZeRO rank."""
        return self.zero if self.shard_size == -1 else self.shard_size

    @property
    def replicas(self) -> int:
        """Hybrid sharding's replicas of each shard (1 without it)."""
        return self.zero // self.shard if self.shard >= 1 else 1

    @property
    def hpz(self) -> int:
        """hpZ's group size in effect: 1 when off (0 or 1, as in DeepSpeed), when it spans every ZeRO rank (plain
        ZeRO-3), or beside tensor or sequence parallelism or hybrid sharding (refused by name by the plan:
        :func:`shardtrain.config.plan.resolve_plan`). With context parallelism its groups are cut from the ``dp *
        cp`` ranks ZeRO shards over, as ZeRO's are ([Note: secondary shards] in :mod:`shardtrain.zero.hpz`)."""
        if self.hpz_size <= 1 or self.tp > 1 or self.sp > 1 or self.replicas > 1:
            return 1
        return self.hpz_size if self.hpz_size < self.zero else 1

    @property
    def hpz_asked(self) -> bool:
        """hpZ was asked with a group smaller than every ZeRO rank (it acts, or the plan refuses what it is with)."""
        return self.hpz_size > 1 and self.hpz_size != self.zero
