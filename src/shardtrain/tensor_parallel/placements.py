"""Step 2 of :func:`~.parallelize.parallelize`: every placement computed and checked before anything changes.

Each check raises :class:`LayoutError` naming the module or parameter and what to do instead: a dimension that
does not cut into tp x stride equal blocks, attention heads that do not divide among the ranks, a tied parameter
split differently (or not at all) by the modules sharing it, a ``local_*`` style with no enclosing ``gather``,
a per-rank attribute that does not divide.
"""

from __future__ import annotations

from torch import nn

from shardtrain.distributed.placement import TPPlacement
from shardtrain.errors import LayoutError
from shardtrain.tensor_parallel.embedding import HiddenParallelEmbedding, VocabParallelEmbedding
from shardtrain.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from shardtrain.tensor_parallel.plans import TPPlan, matches
from shardtrain.tensor_parallel.styles import TPStyle

SPLITTING_LAYERS = ("column", "row", "vocab_embedding", "hidden_embedding")
_EMBEDDINGS = {"vocab_embedding": VocabParallelEmbedding, "hidden_embedding": HiddenParallelEmbedding}


def module_placements(module: nn.Module, style: TPStyle, name: str) -> dict[str, TPPlacement]:
    """Local parameter name -> placement for a module-level style."""
    if style.layer == "column":
        return ColumnParallelLinear.placements(module, stride=style.stride, name=name)
    if style.layer == "row":
        return RowParallelLinear.placements(module, stride=style.stride, communicate=style.communicate, name=name)
    if style.layer in ("vocab_embedding", "hidden_embedding"):
        return _EMBEDDINGS[style.layer].placements(module, name=name)
    if style.partial_grad:
        return {
            n: TPPlacement(None, 1, tuple(p.shape), partial_grad=True)
            for n, p in module.named_parameters(recurse=False)
        }
    return {}


def parameter_placement(param: nn.Parameter, style: TPStyle, name: str) -> TPPlacement:
    """A parameter-level style, as Hugging Face reads it: colwise splits dim -2 (0 for a vector), rowwise -1."""
    shape, nd = tuple(param.shape), param.dim()
    if style.layer == "column":
        return TPPlacement(max(nd - 2, 0), style.stride, shape)
    if style.layer == "row":
        return TPPlacement(nd - 1, style.stride, shape) if nd >= 2 else TPPlacement(None, 1, shape)
    if style.layer == "none":
        return TPPlacement(None, 1, shape, partial_grad=style.partial_grad)
    raise LayoutError(f"{name}: style {style.name!r} applies to a module, not to a parameter")


def plan_param(planned: dict, param: nn.Parameter, placement: TPPlacement, name: str, size: int) -> None:
    """Record ``param``'s placement (checked divisible); a tied parameter must be laid out the same way again."""
    placement.check_divisible(size, name)
    previous = planned.get(id(param))
    if previous is not None and previous[0] != placement:
        raise LayoutError(
            f"{name} is the same parameter as {previous[1]} (tied weights), but the plan lays it out differently "
            f"there ({previous[0].describe()}) and here ({placement.describe()}). Give both modules styles that "
            "split it the same way (e.g. embedding_rowwise with colwise), or untie them."
        )
    planned.setdefault(id(param), (placement, name))


def check_heads(name: str, modules: dict[str, nn.Module], style: TPStyle, size: int) -> None:
    """Each rank must hold whole attention heads: read the head size off the enclosing attention module."""
    parent_name = name.rpartition(".")[0]
    parent = modules.get(parent_name)
    module = modules[name]
    out_dim, in_dim = (0, 1) if isinstance(module, nn.Linear) else (1, 0)
    width = module.weight.shape[out_dim if style.layer == "column" else in_dim] // style.stride  # one group
    head_dim = getattr(parent, "head_dim", None)
    counted = "head_dim"
    if not isinstance(head_dim, int):
        for attr in ("num_heads", "n_head", "n_heads", "num_attention_heads"):
            n = getattr(parent, attr, None)
            if isinstance(n, int) and n > 0 and width % n == 0:
                head_dim, counted = width // n, attr
                break
    if not isinstance(head_dim, int) or head_dim <= 0 or width % head_dim:
        return  # not laid out in heads
    heads = width // head_dim
    if heads % size:
        raise LayoutError(
            f"{name}.weight: its {heads} attention heads (of size {head_dim}, from {parent_name}.{counted}) cannot "
            f"be split evenly over tensor-parallel size {size}; every rank must hold whole heads. Pick a "
            f"tensor-parallel size that divides {heads}."
        )


def in_region(name: str, module_styles: dict[str, TPStyle], experts: bool = False) -> bool:
    """Whether an enclosing module of ``name`` has a ``gather``/``all_reduce`` style (``experts``: a
    ``moe_tp_experts`` one)."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        style = module_styles.get(".".join(parts[:i]))
        if style is not None and style.layer == "region" and (style.experts or not experts):
            return True
    return False


def check_tied(model: nn.Module, planned: dict, module_styles: dict, param_styles: dict) -> None:
    """A split parameter used by a module the plan does not split it for would be used whole: refuse."""
    modules = dict(model.named_modules())
    style_of = {id(modules[n]): s for n, s in module_styles.items()}  # a module registered twice has one style
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module._parameters.items():
            if p is None or id(p) not in planned or planned[id(p)][0].dim is None:
                continue
            full = f"{mname}.{pname}" if mname else pname
            style = style_of.get(id(module))
            splits_it = (style is not None and style.layer in SPLITTING_LAYERS) or full in param_styles
            if not splits_it:
                raise LayoutError(
                    f"{full} is the same parameter as {planned[id(p)][1]} (tied weights): the plan splits it there, "
                    f"but {mname or 'the root module'} would use it whole. Give {mname} a style that splits it the "
                    "same way, or untie the weights."
                )


def per_rank_attributes(model: nn.Module, plan: TPPlan, explicit: bool, size: int) -> list[tuple]:
    """``(module, attribute, per-rank value)`` for every attribute the plan's ``per_rank_attributes`` name."""
    out = []
    for pattern, attrs in plan.per_rank_attributes.items():
        hits = [(n, m) for n, m in model.named_modules() if n and matches(pattern, n)]
        if not hits and explicit:
            raise LayoutError(f"per_rank_attributes pattern {pattern!r} matches no module of {type(model).__name__}")
        for name, module in hits:
            for attr in attrs:
                value = getattr(module, attr, None)
                if not isinstance(value, int) or value % size:
                    raise LayoutError(
                        f"{name}.{attr} = {value!r} must be an integer divisible by the tensor-parallel size {size}"
                    )
                out.append((module, attr, value // size))
    return out
