"""``parallelize(model, plan, tp_comm)``: apply a tensor-parallel plan to a model in place.

The order, each step finishing before the next starts so that an impossible plan leaves the model untouched:

1. *Match*: every module and parameter name is matched against the plan's patterns (:mod:`.plans`); each
   matched name gets the :class:`~.styles.TPStyle` of its most specific pattern. An explicit plan's pattern
   that matches nothing is an error (a typo would otherwise silently train a replicated model); Hugging Face's
   own plans may name modules a configuration does not build, as in ``transformers``.
2. *Check*: each split is computed as a :class:`~.placement.TPPlacement` and checked -- dimensions divisible by
   tp x stride, whole attention heads per rank, a tied parameter split the same way by every module using it,
   ``local_*`` styles inside a ``gather``/``all_reduce`` module, ``per_rank_attributes`` divisible.
   A module that computes something of its own (Gemma's scaled embedding) is kept and parallelized around its
   forward when the split provably commutes with it, and refused by name otherwise ([Note: a plan keeps a
   module's meaning], :mod:`.meaning`).
3. *Apply*: parameters are cut in place (the same ``nn.Parameter`` objects), matched modules are replaced by
   the tensor-parallel layers in every parent holding them (kept ones get hooks instead), ``gather``/``all_reduce``
   modules get their input/output hooks, per-rank attributes are divided, and the root module gets the hooks that
   close any open RNG region at both ends of its forward ([Note: tensor-parallel RNG]).

The result maps every ``model.named_parameters()`` name to its placement. Parameters marked ``partial_grad``
need their gradients summed over the tensor-parallel group after backward: :func:`sum_partial_gradients` (or the
engine's reducer) does it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from shardtrain.distributed.communicator import Communicator
from shardtrain.distributed.placement import ParameterSharder, TPPlacement
from shardtrain.errors import LayoutError
from shardtrain.tensor_parallel.communication import copy_to_tp_region, reduce_from_tp_region
from shardtrain.tensor_parallel.embedding import (
    HiddenParallelEmbedding,
    KeptEmbeddingParallel,
    VocabParallelEmbedding,
    kept_parallel,
)
from shardtrain.tensor_parallel.experts import check_experts, share_identity
from shardtrain.tensor_parallel.grad_check import ReplicatedGradCheck
from shardtrain.tensor_parallel.keeps_meaning import keeps_module
from shardtrain.tensor_parallel.latent import install_latent_kv_hook, rope_width
from shardtrain.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from shardtrain.tensor_parallel.loss import VocabParallelCrossEntropy
from shardtrain.tensor_parallel.placements import (
    check_heads,
    check_tied,
    in_region,
    module_placements,
    parameter_placement,
    per_rank_attributes,
    plan_param,
)
from shardtrain.tensor_parallel.plans import TPPlan, as_plan, best_match, own_plan, replicate_experts
from shardtrain.tensor_parallel.rng import RegionRNG
from shardtrain.tensor_parallel.styles import TPStyle, resolve_style

_TP_MODULES = (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    HiddenParallelEmbedding,
    VocabParallelCrossEntropy,
)
_LAYERS = {
    "column": ColumnParallelLinear,
    "row": RowParallelLinear,
    "vocab_embedding": VocabParallelEmbedding,
    "hidden_embedding": HiddenParallelEmbedding,
}


def parallelize(
    model: nn.Module,
    plan: Mapping[str, str | TPStyle] | TPPlan | None,
    tp_comm: Communicator,
    *,
    check_replicated_grads: bool = True,
    whole_experts: Mapping[str, Sequence[str]] | None = None,
    compute_dtype: torch.dtype | None = None,
    one_stage: bool = False,
) -> dict[str, TPPlacement]:
    """Apply a tensor-parallel plan to ``model`` in place, over the group of ``tp_comm``.

    ``plan``: name patterns -> style names (or :class:`TPStyle`), or a :class:`TPPlan`; ``None`` uses the
    Hugging Face model's own plan (:func:`~.plans.own_plan`: :func:`~.plans.hf_tp_plan`, else the plan shardtrain
    ships for its model type, [Note: encoder-decoder plans]). Every tensor-parallel rank must call this with
    the same model, built from the same seed or weights: each keeps its block of the values it holds.

    Returns every ``model.named_parameters()`` name -> :class:`TPPlacement` (replicated ones included). Raises
    :class:`LayoutError`, leaving the model unchanged, if the plan cannot be applied.

    ``check_replicated_grads``: at the end of the first backward, compare the gradients of the replicated
    parameters across the group once and raise :class:`LayoutError` naming any that differ (applied to split
    activations without ``replicated_with_grad_allreduce``) or that are marked to be summed but already agree
    ([Note: replicated gradients across tensor-parallel ranks]).

    ``whole_experts``: under expert parallelism, the experts modules it splits (name -> their expert weights' names),
    kept whole on every tp rank: the plan's patterns inside them are dropped and their weights'
    gradients summed over the group (:func:`~.plans.replicate_experts`).

    ``compute_dtype``: the dtype the engine casts the weights to for training (None: as they are), which split
    experts' blocks must suit ([Note: grouped_mm's alignment] in :mod:`~.experts`).

    ``one_stage``: ``model`` is pruned to one pipeline stage's pieces, so a pattern of a given plan may match
    only another stage's (the caller checks the plan against the whole model first, :func:`check_plan_matches`).
    """
    explicit = plan is not None and not one_stage
    tp_plan = as_plan(plan) if plan is not None else own_plan(model)
    if whole_experts:
        tp_plan, _ = replicate_experts(tp_plan, whole_experts)
    size = tp_comm.size
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if isinstance(module, _TP_MODULES) or kept_parallel(module):
            raise LayoutError(
                f"{type(model).__name__} is already tensor-parallel ({name} is a {type(module).__name__}); "
                "parallelize a model once."
            )
    module_styles, param_styles = _match(model, tp_plan, explicit)

    # -- check: every placement, before anything changes
    planned: dict[int, tuple[TPPlacement, str]] = {}  # id(param) -> (placement, first qualified name)
    kept: set[str] = set()  # split in place around their own forward ([Note: a plan keeps a module's meaning])
    for name, style in module_styles.items():
        for pname, placement in module_placements(modules[name], style, name).items():
            plan_param(planned, getattr(modules[name], pname), placement, f"{name}.{pname}", size)
        if keeps_module(modules[name], style, name, size):
            kept.add(name)
        if style.layer in ("column", "row"):
            check_heads(name, modules, style, size)
        if not style.communicate and style.layer in ("column", "row") and not in_region(name, module_styles):
            raise LayoutError(
                f"{name}: style {style.name!r} leaves its communication to an enclosing module, but no enclosing "
                "module has 'gather' or 'all_reduce'. Add one (e.g. the MLP holding it) or use the non-local style."
            )
    for name, style in param_styles.items():
        mname, _, pname = name.rpartition(".")
        if mname in module_styles and module_styles[mname].layer not in ("none", "region"):
            raise LayoutError(f"{name}: the plan styles both this parameter and its module {mname}; keep one")
        param = getattr(modules[mname], pname)
        plan_param(planned, param, parameter_placement(param, style, name), name, size)
    for name, style in module_styles.items():  # replicated parameters under a gather see partial gradients
        if style.layer == "region":
            for pname, p in modules[name].named_parameters():
                if id(p) not in planned or planned[id(p)][0].dim is None:
                    planned[id(p)] = (TPPlacement(None, 1, tuple(p.shape), partial_grad=True), f"{name}.{pname}")
    for name, style in module_styles.items():  # after every parameter's placement is known
        if style.experts:
            local = {
                pname: planned[id(p)][0] if id(p) in planned else TPPlacement(None, 1, tuple(p.shape))
                for pname, p in modules[name].named_parameters()
            }
            inside = name + "."
            shares = tuple(
                modules[n] for n, s in module_styles.items() if s.layer == "identity_share" and n.startswith(inside)
            )
            check_experts(modules[name], name, local, size, shares, compute_dtype)
        if style.layer == "identity_share" and not in_region(name, module_styles, experts=True):
            raise LayoutError(
                f"{name}: style 'moe_identity_expert' divides an identity expert's input by the tensor-parallel size "
                "so that an enclosing 'moe_tp_experts' module's sum over ranks restores it, but no enclosing module "
                "has 'moe_tp_experts'. Add it, or leave this module out of the plan."
            )
    latent = {n: rope_width(model, modules, n) for n, s in module_styles.items() if s.layer == "latent_kv"}
    check_tied(model, planned, module_styles, param_styles)
    attributes = per_rank_attributes(model, tp_plan, explicit, size)

    # -- apply
    rng = RegionRNG(tp_comm.rank, size)
    sharder = ParameterSharder(tp_comm.rank, size)
    parents = _parents(model)
    for name, style in module_styles.items():
        if name in kept:
            vocab = style.layer == "vocab_embedding"
            KeptEmbeddingParallel.install(modules[name], tp_comm, vocab=vocab, rng=rng, sharder=sharder, name=name)
            continue
        replacement = _build(modules[name], style, tp_comm, rng, sharder, name)
        if replacement is not None:
            for parent, attr in parents[id(modules[name])]:
                setattr(parent, attr, replacement)
        if style.layer == "region":
            _install_region_hooks(modules[name], tp_comm, rng, name)
        if style.layer == "latent_kv":
            install_latent_kv_hook(modules[name], tp_comm, latent[name], name)
        if style.layer == "identity_share":
            share_identity(modules[name], size)
    for name in param_styles:
        mname, _, pname = name.rpartition(".")
        param = getattr(modules[mname], pname)
        sharder.shard(param, planned[id(param)][0], name)
    for module, attr, value in attributes:
        setattr(module, attr, value)
    model.register_forward_pre_hook(lambda _m, _args: rng.exit())
    model.register_forward_hook(lambda _m, _args, _out: rng.exit(), always_call=True)

    placements = {
        name: planned[id(p)][0] if id(p) in planned else TPPlacement(None, 1, tuple(p.shape))
        for name, p in model.named_parameters()
    }
    if check_replicated_grads and size > 1:
        check_replicated_gradients(model, placements, tp_comm)
    return placements


def check_replicated_gradients(model: nn.Module, placements: Mapping[str, TPPlacement], tp_comm: Communicator) -> None:
    """Compare the replicated parameters' gradients across the group at the end of the first backward
    (``parallelize(check_replicated_grads=True)`` calls it; a model whose parameters are still on ``meta`` calls it
    once they are real). Register it before any hook that sums gradients (the engine's)."""
    params = dict(model.named_parameters())
    replicated = {n: (params[n], pl.partial_grad) for n, pl in placements.items() if pl.dim is None}
    # kept alive by its hooks, which it removes once done
    ReplicatedGradCheck({n: v for n, v in replicated.items() if v[0].requires_grad}, tp_comm)


def sum_partial_gradients(model: nn.Module, placements: Mapping[str, TPPlacement], tp_comm: Communicator) -> None:
    """Sum over the tensor-parallel group the gradients of the parameters marked ``partial_grad``."""
    for name, p in model.named_parameters():
        placement = placements.get(name)
        if placement is not None and placement.partial_grad and p.grad is not None:
            tp_comm.all_reduce(p.grad, what=f"the partial gradients of {name!r} (summed over tp ranks)")


def check_plan_matches(model: nn.Module, plan: Mapping[str, str | TPStyle] | TPPlan) -> None:
    """Raise :class:`LayoutError` naming a pattern of ``plan`` that matches no module or parameter of ``model``
    (what :func:`parallelize` checks of a given plan; run on the whole model before a pipeline cuts it)."""
    _match(model, as_plan(plan), explicit=True)


def _match(model: nn.Module, plan: TPPlan, explicit: bool) -> tuple[dict[str, TPStyle], dict[str, TPStyle]]:
    """Module name -> style and parameter name -> style, in ``named_modules`` order."""
    module_styles: dict[str, TPStyle] = {}
    param_styles: dict[str, TPStyle] = {}
    used: set[str] = set()
    for mname, module in model.named_modules():
        if mname and (pattern := best_match(plan.styles, mname)) is not None:
            used.add(pattern)
            module_styles[mname] = resolve_style(plan.styles[pattern], mname)
        for pname, _ in module.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if (pattern := best_match(plan.styles, full)) is not None:
                used.add(pattern)
                param_styles[full] = resolve_style(plan.styles[pattern], full)
    unused = [p for p in plan.styles if p not in used]
    if explicit and unused:
        raise LayoutError(
            f"tensor-parallel plan patterns {unused} match no module or parameter of {type(model).__name__}. "
            "Check the names against model.named_modules() (a * stands for exactly one name component)."
        )
    return module_styles, param_styles


def _parents(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(module) -> every (parent, attribute) holding it (a module may be registered under several names)."""
    parents: dict[int, list[tuple[nn.Module, str]]] = defaultdict(list)
    for _, parent in model.named_modules(remove_duplicate=False):
        for attr, child in parent._modules.items():
            if child is not None and (parent, attr) not in parents[id(child)]:
                parents[id(child)].append((parent, attr))
    return parents


def _build(module, style, comm, rng, sharder, name) -> nn.Module | None:
    """The tensor-parallel replacement for ``module`` (its parameters cut in place), or None to keep it."""
    if style.layer == "column":
        return ColumnParallelLinear.from_module(
            module,
            comm,
            stride=style.stride,
            gather_output=style.gather_output,
            communicate=style.communicate,
            rng=rng,
            sharder=sharder,
            name=name,
        )
    if style.layer == "row":
        return RowParallelLinear.from_module(
            module,
            comm,
            stride=style.stride,
            split_input=style.split_input,
            communicate=style.communicate,
            rng=rng,
            sharder=sharder,
            name=name,
        )
    if style.layer in ("vocab_embedding", "hidden_embedding"):
        return _LAYERS[style.layer].from_module(module, comm, rng=rng, sharder=sharder, name=name)
    if style.layer == "vocab_loss":
        return VocabParallelCrossEntropy.from_module(module, comm, rng=rng, name=name)
    return None


def _install_region_hooks(module: nn.Module, comm: Communicator, rng: RegionRNG, name: str) -> None:
    """``gather``/``all_reduce``: ``f`` on every input that carries a gradient, ``g`` on the (first) output."""

    def enter(_m, args, kwargs):
        return _enter_region(args, kwargs, comm, name)

    def leave(_m, _args, output):
        rng.exit()
        if isinstance(output, torch.Tensor):
            return reduce_from_tp_region(output, comm, name)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (reduce_from_tp_region(output[0], comm, name), *output[1:])
        raise LayoutError(f"{name}: a gather/all_reduce module must return a tensor or a tuple starting with one")

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(leave)


def _enter_region(args: tuple, kwargs: dict, comm: Communicator, name: str) -> tuple[tuple, dict]:
    """Megatron's ``f`` on every tensor of a region's inputs that requires grad, wherever it sits.

    A ``gather``/``all_reduce`` module's inputs are replicated and each rank's ``local_*`` children use them to
    compute a partial result, so *each* input's gradient is a partial sum over the ranks, not only the first
    one's: a second input (cross-attention's ``encoder_hidden_states``), or the first passed by keyword (``x=``),
    would otherwise train on a partial gradient, silently. Inputs are walked as a pytree (tuples, lists, dicts,
    and whatever types torch.utils._pytree knows); an object it cannot see into that holds a tensor requiring
    grad is refused by name rather than guessed at.
    """
    if not torch.is_grad_enabled():
        return args, kwargs
    leaves, spec = pytree.tree_flatten_with_path((args, kwargs))
    out = []
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            out.append(copy_to_tp_region(leaf, comm, name) if leaf.requires_grad else leaf)
            continue
        hidden = _tensor_attribute_requiring_grad(leaf)
        if hidden is not None:
            raise LayoutError(
                f"{name}: its input {_input_name(path)} is a {type(leaf).__name__} holding a tensor that requires "
                f"grad (.{hidden}); a gather/all_reduce module must sum that tensor's gradient over the "
                "tensor-parallel ranks but cannot see inside this type. Pass the tensor itself (or in a "
                "tuple/list/dict), or register the type with torch.utils._pytree."
            )
        out.append(leaf)
    args, kwargs = pytree.tree_unflatten(out, spec)
    return args, kwargs


def _tensor_attribute_requiring_grad(obj: object) -> str | None:
    fields = getattr(obj, "__dict__", None)
    if isinstance(obj, (nn.Module, type)) or not isinstance(fields, dict):
        return None
    return next((k for k, v in fields.items() if isinstance(v, torch.Tensor) and v.requires_grad), None)


def _input_name(path: tuple) -> str:
    """``args[1]``, ``x``, ``encoder_hidden_states[0]``: where an input sits in the call."""
    first, rest = path[0], pytree.keystr(path[1:])
    if first.idx == 0:
        return f"args{rest}"
    key, rest = path[1].key, pytree.keystr(path[2:])
    return f"{key}{rest}"
