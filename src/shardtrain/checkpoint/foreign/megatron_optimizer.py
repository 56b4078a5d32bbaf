"""Megatron's optimizer state in model space, under the Hugging Face names of its model tensors, and its param
groups ([Note: Megatron optimizer state])."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardtrain.checkpoint.foreign.megatron_format import OPTIMIZER_STATE, MegatronSource
from shardtrain.checkpoint.foreign.megatron_names import MegatronTensorEntry
from shardtrain.errors import CheckpointError

# [Note: Megatron optimizer state]
# Megatron's optimizer state sharded "in model space" is stored as ``optimizer.state.<state key>.<model key>`` with
# the model tensor's global shape and layout (``exp_avg``, ``exp_avg_sq``), so each Hugging Face tensor's state is
# the same runs of those tensors; the step count is one number in the common state (``optimizer.state.common_step``).
# The param groups (in ``optimizer.param_groups`` of the common state) do not list their parameters; megatron's
# default grouping decides: ``wd_mult`` 0 holds the biases and 1-D parameters (norms), ``wd_mult`` 1 the rest.
# Other groupings (``lr_mult``, decoupled learning rates, experts' groups) are refused by name. ``fp32_param``
# (the masters of a bf16 run) is not read: the engine makes its masters from the weights.

ADAM_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


def optimizer_entries(
    model: dict[str, MegatronTensorEntry], sources: dict[str, MegatronSource], step: float | None
) -> dict[str, MegatronTensorEntry]:
    """``optim/<hf name>/<state key>`` for every model tensor whose state the checkpoint holds, and its ``step``
    ([Note: Megatron optimizer state])."""
    kinds = sorted({k[len(OPTIMIZER_STATE) :].split(".", 1)[0] for k in sources if k.startswith(OPTIMIZER_STATE)})
    kinds = [k for k in kinds if k != "fp32_param"]
    out: dict[str, MegatronTensorEntry] = {}
    for name, entry in model.items():
        hf = name.removeprefix("model/")
        found = False
        for kind in kinds:
            keys = {key: f"{OPTIMIZER_STATE}{kind}.{key}" for key, _, _ in entry.runs}
            states = [sources.get(k) for k in keys.values()]
            if not all(st is not None and st.global_shape == sources[m].global_shape for m, st in zip(keys, states)):
                continue
            runs = tuple((keys[key], start, length) for key, start, length in entry.runs)
            out[f"optim/{hf}/{kind}"] = MegatronTensorEntry(f"optim/{hf}/{kind}", entry.global_shape, "float32", runs)
            found = True
        if found and step is not None:
            out[f"optim/{hf}/step"] = MegatronTensorEntry(f"optim/{hf}/step", (), "float32", (), value=step)
    return out


def param_groups(saved: Any, model: dict[str, MegatronTensorEntry], ckpt: Path) -> list[dict[str, Any]]:
    """Megatron's param groups with their parameters' Hugging Face names, by megatron's default grouping
    ([Note: Megatron optimizer state])."""
    if not isinstance(saved, list) or not all(isinstance(g, dict) for g in saved):
        raise CheckpointError(f"{ckpt}: common.pt's optimizer.param_groups is not a list of groups; it is damaged")
    odd = [g for g in saved if g.get("lr_mult", 1.0) != 1.0 or g.get("is_expert_parallel") or g.get("is_decoupled_lr")]
    if odd or sorted(g.get("wd_mult", 1.0) for g in saved) not in ([0.0, 1.0], [1.0], [0.0]):
        raise CheckpointError(
            f"{ckpt}: Megatron param groups other than its default (no weight decay for biases and norms) cannot be "
            "matched to parameters (the checkpoint does not list them); load with load_optimizer_states=False"
        )

    def no_decay(entry: MegatronTensorEntry) -> bool:  # megatron's rule on its own (per-layer) tensors
        return len(entry.global_shape) == 1

    groups = []
    for g in saved:
        params = [n.removeprefix("model/") for n, e in model.items() if no_decay(e) == (g.get("wd_mult", 1.0) == 0.0)]
        hyper = {k: (list(g[k]) if isinstance(g[k], tuple) else g[k]) for k in ADAM_HYPERPARAMETERS if k in g}
        groups.append({**hyper, "params": params})
    return groups
