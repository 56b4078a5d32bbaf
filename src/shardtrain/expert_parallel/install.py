"""Expert parallelism on a whole model: every experts module of a transformers mixture-of-experts model split over an
expert group (see [Note: tokens to their experts] in :mod:`shardtrain.expert_parallel.dispatch`).

[Note: which experts modules are split]
An experts module is split when it is transformers' fused experts: an int ``num_experts``, 3-D weights with one row per
expert (``gate_up_proj``/``down_proj``, gpt-oss's biases) and a forward taking the routing (``hidden_states,
top_k_index, top_k_weights``), which the token exchange hands it. A model's plan (``base_model_ep_plan``, read as
transformers reads ``model.ep_plan``) decides where it has one: ``ep_dispatch_experts`` modules are split
(``grouped_gemm`` weights by rows), others stay whole; other styles and planned modules that are not fused experts are
refused by name. Without a plan every fused experts module is split; a non-fused ``experts`` module (Switch
Transformers, DBRX, Llama 4's pre-routed forward) is refused, naming its class.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable

from torch import nn

from shardtrain.distributed.communicator import Communicator
from shardtrain.errors import ConfigError
from shardtrain.expert_parallel.dispatch import _EXPERT_WEIGHTS, keep_rows, shard_experts

_SPLIT_STYLES = ("ep_dispatch_experts", "grouped_gemm")


def _routing_forward(m: nn.Module) -> bool:
    """Whether ``m``'s forward takes the routing: hidden states, the experts' indices and their weights."""
    try:
        params = list(inspect.signature(type(m).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in params)


def _not_fused(m: nn.Module) -> str | None:
    """Why ``m`` is not transformers' fused experts module, or None when it is."""
    if isinstance(m, nn.ModuleList | nn.ModuleDict):
        return "a list of one module per expert, not transformers' fused experts (3-D weights, one row per expert)"
    n = getattr(m, "num_experts", None)
    if not isinstance(n, int):
        return "it has no int num_experts"
    weights = [getattr(m, w, None) for w in _EXPERT_WEIGHTS]
    if not any(isinstance(w, nn.Parameter) and w.dim() >= 2 and w.shape[0] == n for w in weights):
        return (
            "its weights are not one row per expert (transformers' fused experts hold gate_up_proj / down_proj of "
            f"shape [num_experts, ...], num_experts = {n})"
        )
    if not _routing_forward(m):
        return (
            "its forward takes no routing (hidden_states, top_k_index, top_k_weights): the tokens come to it already "
            "routed and scaled, so there is nothing to send to the rank holding each expert"
        )
    return None


def find_experts(model: nn.Module) -> dict[str, nn.Module]:
    """The experts modules of ``model`` by name: transformers' fused experts (``num_experts``, 3-D weights with one
    row per expert and a forward given the routing, e.g. ``MixtralExperts``, ``Qwen3MoeExperts``, ``GptOssExperts``;
    see [Note: which experts modules are split])."""
    found = {}
    for name, m in model.named_modules():
        if isinstance(getattr(m, "expert_range", None), tuple):  # already split
            continue
        if isinstance(getattr(m, "num_experts", None), int) and _not_fused(m) is None:
            found[name] = m
    return found


def declared_ep_plan(model: nn.Module) -> dict[str, str]:
    """transformers' expert-parallel plan of ``model`` and of the transformers models inside it, full names with
    ``*`` for layer numbers (``model.ep_plan``: the config's ``base_model_ep_plan`` under the base model's prefix,
    or a plan set on the model); empty where none is declared."""
    plan: dict[str, str] = {}
    taken: list[str] = []
    for name, m in model.named_modules():  # outer modules first: a model's plan holds its inner models' plans
        if any(name.startswith(t + ".") for t in taken):
            continue
        own = getattr(m, "ep_plan", None)
        if isinstance(own, dict) and own:
            if not name:
                return {k: str(v) for k, v in own.items()}
            taken.append(name)
            plan.update({f"{name}.{k}": str(v) for k, v in own.items()})
    return plan


def _planned(name: str, patterns: set[str]) -> bool:
    """Whether a plan entry names ``name``: itself, or with ``*`` for its layer numbers."""
    return name in patterns or re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name) in patterns


def _planned_experts(model: nn.Module, plan: dict[str, str], ep: int) -> dict[str, nn.Module]:
    """The experts modules the plan splits, checked (see [Note: which experts modules are split])."""
    for pattern, style in plan.items():
        if style not in _SPLIT_STYLES:
            raise ConfigError(
                f"expert_parallel_size (ep_size) {ep}: {type(model).__name__}'s expert-parallel plan (transformers' "
                f"base_model_ep_plan / model.ep_plan) has {pattern!r}: {style!r}, which is not built: expert "
                f"parallelism here splits experts only ({' and '.join(map(repr, _SPLIT_STYLES))}), every other "
                "layer stays whole on the ranks of an expert group; drop that entry (model.ep_plan = {...}) or use "
                "tensor_parallel.size for the dense layers"
            )
    modules = {n: m for n, m in model.named_modules()}
    params = dict(model.named_parameters(remove_duplicate=False))
    dispatch = {p for p, s in plan.items() if s == "ep_dispatch_experts"}
    experts = {n: m for n, m in modules.items() if _planned(n, dispatch)}
    for name, m in experts.items():
        why = _not_fused(m)
        if why is not None:
            raise ConfigError(
                f"expert_parallel_size (ep_size) {ep}: {name} ({type(m).__name__}) is an ep_dispatch_experts module "
                f"of the model's expert-parallel plan, but {why}; set expert_parallel_size to 1"
            )
    rows = {p for p, s in plan.items() if s == "grouped_gemm"}
    for pname in params:
        if not _planned(pname, rows):
            continue
        owner, _, leaf = pname.rpartition(".")
        if owner not in experts or leaf not in _EXPERT_WEIGHTS:
            raise ConfigError(
                f"expert_parallel_size (ep_size) {ep}: the model's expert-parallel plan splits {pname} by expert "
                "('grouped_gemm'), but it is not an expert weight of an 'ep_dispatch_experts' module of the plan; "
                "drop that entry (model.ep_plan = {...})"
            )
    for name, m in experts.items():
        for w in _EXPERT_WEIGHTS:
            if isinstance(getattr(m, w, None), nn.Parameter) and not _planned(f"{name}.{w}", rows):
                raise ConfigError(
                    f"expert_parallel_size (ep_size) {ep}: the model's expert-parallel plan dispatches tokens to "
                    f"{name} but does not split its weight {w} by expert ('grouped_gemm'); add "
                    f"'{name}.{w}': 'grouped_gemm' to the plan (model.ep_plan = {{...}})"
                )
    return experts


def _refuse_unfused(model: nn.Module, found: dict[str, nn.Module], ep: int) -> None:
    """A module named ``experts`` that is not transformers' fused experts: refused, naming its class."""
    for name, m in model.named_modules():
        if name in found or name.rpartition(".")[2] != "experts":
            continue
        why = _not_fused(m)
        if why is not None:
            raise ConfigError(
                f"expert_parallel_size (ep_size) {ep}: {name} is a {type(m).__name__}: {why}. Expert parallelism "
                "splits transformers' fused experts modules (Mixtral, Qwen2/3-MoE, DeepSeek-V3, gpt-oss, ...); set "
                "expert_parallel_size to 1 for this model"
            )


def experts_to_split(model: nn.Module, ep: int) -> dict[str, nn.Module]:
    """The experts modules of ``model`` that an expert group of ``ep`` ranks splits, by name ([Note: which experts
    modules are split]). Refuses a plan style or experts module that is not built, a model without experts and a
    number of experts ``ep`` does not divide, naming the layer, and a model transformers has already distributed."""
    for name, m in model.named_modules():
        if getattr(m, "_is_distributed_loading_by_transformers", False) is True:
            raise ConfigError(
                f"expert_parallel_size (ep_size) {ep}: {name or type(model).__name__} was already distributed by "
                "transformers (from_pretrained(distributed_config=...)): its experts and weights are split its own "
                "way; load it without distributed_config and let expert_parallel_size split it"
            )
    plan = declared_ep_plan(model)
    if plan:
        experts = _planned_experts(model, plan, ep)
    else:
        experts = find_experts(model)
        _refuse_unfused(model, experts, ep)
    if not experts:
        raise ConfigError(
            f"expert_parallel_size (ep_size) {ep} but {type(model).__name__} has no experts module (a "
            "transformers mixture-of-experts layer's fused experts: num_experts and gate_up_proj / down_proj weights "
            "with one row per expert); set expert_parallel_size to 1 for a dense model"
        )
    for name, m in experts.items():
        if m.num_experts % ep:
            raise ConfigError(
                f"{name} has {m.num_experts} experts (num_experts), which do not split over expert_parallel_size "
                f"(ep_size) {ep}: each rank holds num_experts / ep_size whole experts; choose a size that "
                f"divides {m.num_experts}"
            )
    return experts


def expert_weights(model: nn.Module, ep: int) -> dict[str, list[str]]:
    """The experts modules :func:`experts_to_split` names, each with the names of its expert weights (what tensor
    parallelism keeps whole beside expert parallelism, [Note: experts beside tensor parallelism] in
    :mod:`.dispatch`)."""
    return {
        name: [w for w in _EXPERT_WEIGHTS if isinstance(getattr(m, w, None), nn.Parameter)]
        for name, m in experts_to_split(model, ep).items()
    }


def install_expert_parallel(
    model: nn.Module,
    comm: Communicator,
    cut: Callable[[str, nn.Parameter, int, int], None] = keep_rows,
    tp_comm: Communicator | None = None,
) -> frozenset[int]:
    """Keep this rank's experts of every experts module of ``model`` that :func:`experts_to_split` names and route
    their forward through the token exchange over ``comm`` (the expert group); returns the ids of the expert
    parameters, which the engine reduces over the expert-data-parallel group. In place; the parameter objects are
    kept. ``cut(name, p, first, count)`` keeps rows ``[first, first + count)`` of an expert weight: in memory and
    on ``meta`` by slicing (:func:`~shardtrain.expert_parallel.dispatch.keep_rows`); a model built under
    ``zero.Init()`` passes its construction runtime's (see [Note: experts under sharded construction] in
    ``construction/sharded_init.py``). ``tp_comm``: the tensor-parallel group, whose ranks hold the same experts whole
    and each exchange their share of the tokens ([Note: experts beside tensor parallelism] in :mod:`.dispatch`)."""
    ids = set()
    for name, m in experts_to_split(model, comm.size).items():
        shard_experts(m, comm, name, cut, tp_comm)
        ids.update(id(p) for w in _EXPERT_WEIGHTS if isinstance(p := getattr(m, w, None), nn.Parameter))
    return frozenset(ids)


__all__ = [
    "declared_ep_plan",
    "expert_weights",
    "experts_to_split",
    "find_experts",
    "install_expert_parallel",
]
