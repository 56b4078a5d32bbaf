"""Expert parallelism (``expert_parallel_size``; docs/expert-parallel.md): the experts of each mixture-of-experts
layer split over the ranks of an expert group, tokens sent to their experts and back by all-to-all.

    dispatch.py  the token exchange around a transformers experts module, and the split of its expert weights
    install.py   every experts module of a model split, the expert parameters named for the engine's buckets
"""

from shardtrain.expert_parallel.install import (
    declared_ep_plan,
    expert_weights,
    experts_to_split,
    find_experts,
    install_expert_parallel,
)

__all__ = [
    "declared_ep_plan",
    "expert_weights",
    "experts_to_split",
    "find_experts",
    "install_expert_parallel",
]
