"""Activations: checkpointing of blocks by policy (:mod:`.recompute`), the host offload of the inputs they keep
(:mod:`.host_offload`) and their partition over the tensor-parallel group (:mod:`.partition`);
docs/activation-checkpointing.md. Takes an
:class:`~shardtrain.plan.policies.ActivationPolicy` and the blocks, never the config."""

from shardtrain.activations.host_offload import HostOffload
from shardtrain.activations.partition import TPPartition
from shardtrain.activations.recompute import KEPT_OPS, apply_checkpointing, keep_matmuls

__all__ = ["KEPT_OPS", "HostOffload", "TPPartition", "apply_checkpointing", "keep_matmuls"]
