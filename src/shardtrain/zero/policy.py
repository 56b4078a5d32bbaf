"""What ZeRO shards, as a frozen policy instead of a stage number compared in many places.

=====  ==========================  =================  ===================
stage  optimizer state (+ masters)  gradients          parameters
=====  ==========================  =================  ===================
0      replicated                  all-reduced        replicated
1      sharded                     reduce-scattered   replicated
2      sharded                     sharded (staged)   replicated
3      sharded                     sharded (staged)   sharded in units
=====  ==========================  =================  ===================

Each stage shards everything the previous one does; :meth:`ZeroPolicy.for_stage` is where a stage number is
turned into behaviour for the ZeRO components (layout, reducer, optimizer wrapper, units, checkpoint code), which
read the policy's fields. The stage number itself remains in user-facing places: the config, error messages,
``check_optimizer`` (stages 1-3 step fragments) and Hugging Face helpers that mirror DeepSpeed's ``stage == 3``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ZeroPolicy:
    stage: int
    shard_optimizer_state: bool
    """Each data-parallel rank steps only its fragment of every parameter (moments and masters sharded)."""
    shard_gradients: bool
    """Gradients are reduce-scattered bucket by bucket during backward; no full gradient buffer survives."""
    shard_parameters: bool
    """Parameters live as shards of units, gathered just in time for forward and backward."""

    @staticmethod
    def for_stage(stage: int) -> ZeroPolicy:
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
        return ZeroPolicy(
            stage=stage, shard_optimizer_state=stage >= 1, shard_gradients=stage >= 2, shard_parameters=stage >= 3
        )

    @property
    def gradient_reduction(self) -> str:
        """``all_reduce`` (whole gradients), ``reduce_scatter`` at the boundary into full buffers, or ``staged``."""
        if not self.shard_optimizer_state:
            return "all_reduce"
        return "staged" if self.shard_gradients else "reduce_scatter"
