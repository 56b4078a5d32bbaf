"""Expert parallelism on a whole model: every experts module of a transformers mixture-of-experts model split over an
expert group (see [Note: tokens to their experts] in :mod:`shardtrain.expert_parallel.dispatch`)."""

from __future__ import annotations

from torch import nn

from shardtrain.distributed.communicator import Communicator
from shardtrain.errors import ConfigError
from shardtrain.expert_parallel.dispatch import _EXPERT_WEIGHTS, shard_experts


def find_experts(model: nn.Module) -> dict[str, nn.Module]:
    """The experts modules of ``model`` by name: transformers' fused experts (``num_experts`` and 3-D weights with one
    row per expert, e.g. ``MixtralExperts``, ``Qwen3MoeExperts``)."""
    found = {}
    for name, m in model.named_modules():
        n = getattr(m, "num_experts", None)
        if not isinstance(n, int) or isinstance(getattr(m, "expert_range", None), tuple):
            continue
        weights = [getattr(m, w, None) for w in _EXPERT_WEIGHTS]
        if any(isinstance(w, nn.Parameter) and w.dim() >= 2 and w.shape[0] == n for w in weights):
            found[name] = m
    return found


def install_expert_parallel(model: nn.Module, comm: Communicator) -> frozenset[int]:
    """Keep this rank's experts of every experts module of ``model`` and route their forward through the token
    exchange over ``comm`` (the expert group); returns the ids of the expert parameters, which the engine reduces
    over the expert-data-parallel group. In place; the parameter objects are kept. Refuses a model without experts
    and a number of experts the group does not divide, naming the layer."""
    experts = find_experts(model)
    if not experts:
        raise ConfigError(
            f"expert_parallel_size (ep_size) {comm.size} but {type(model).__name__} has no experts module (a "
            "transformers mixture-of-experts layer's fused experts: num_experts and gate_up_proj / down_proj weights "
            "with one row per expert); set expert_parallel_size to 1 for a dense model"
        )
    for name, m in experts.items():
        if m.num_experts % comm.size:
            raise ConfigError(
                f"{name} has {m.num_experts} experts (num_experts), which do not split over expert_parallel_size "
                f"(ep_size) {comm.size}: each rank holds num_experts / ep_size whole experts; choose a size that "
                f"divides {m.num_experts}"
            )
    ids = set()
    for name, m in experts.items():
        shard_experts(m, comm, name)
        ids.update(id(p) for w in _EXPERT_WEIGHTS if isinstance(p := getattr(m, w, None), nn.Parameter))
    return frozenset(ids)


def refuse_split_experts_checkpoint(ep: int, stage: int, what: str) -> None:
    """Checkpoints of a model whose experts are split are built at ZeRO stages 0-2 (each rank records which experts
    it holds, [Note: split parameters] in ``zero/layout.py``); at stage 3 they are refused before anything is written
    or read."""
    if ep > 1 and stage == 3:
        raise ConfigError(
            f"{what} with expert_parallel_size (ep_size) {ep} at ZeRO stage 3 is not built: the checkpoint of split "
            "experts is built at stages 0-2 (docs/expert-parallel.md); save at stage 2, or without expert parallelism"
        )


__all__ = ["find_experts", "install_expert_parallel", "refuse_split_experts_checkpoint"]
