"""Fused mixture-of-experts modules under tensor parallelism: transformers' ``moe_tp_experts`` style, checked.

transformers 5.x stores a model's routed experts as one module holding 3-D tensors (``MixtralExperts``,
``Qwen3MoeExperts``, ...): ``gate_up_proj`` ``[experts, 2 * intermediate, hidden]`` (gate and up stacked on the
intermediate dimension, or interleaved pairs, or stored transposed ``[experts, hidden, 2 * intermediate]``) and
``down_proj`` ``[experts, hidden, intermediate]``, called as ``experts(hidden_states, top_k_index, top_k_weights)``.
A model's plan splits each expert Megatron's way -- ``gate_up_proj`` on its intermediate (output) features,
``down_proj`` on its intermediate (input) features -- with parameter-level styles (``packed_colwise``: stride 2 for
the stacked gate and up; ``rowwise``), and names the module itself ``moe_tp_experts``: every rank runs every routed
token through its slice of every expert, and the outputs are partial sums.

[Note: experts under tensor parallelism]
``moe_tp_experts`` is a region (``gather``/``all_reduce``, :func:`~.parallelize.parallelize`): Megatron's **f** on
every input that requires grad (the hidden states *and* the router's ``top_k_weights``, which scale this rank's
partial outputs and so get partial gradients) and **g** on the output. The router runs before, on the replicated
hidden states, so every rank routes every token alike: no token moves between ranks (that is expert parallelism).

The split is exact only if it matches how the module's forward reads its weights, which neither the plan nor
transformers checks (Inkling's plan splits its stacked ``gate_up_proj`` with ``colwise``, stride 1: rank 0 would get
the gate half only). So before anything changes :func:`check_experts` reads the layout transformers'
``use_experts_implementation`` records on the module (stacked or interleaved gate/up, transposed, biases, a norm
after each expert) and refuses a split that does not cut each expert's intermediate features alike in both
projections, a bias (added once per rank: summed ``tp`` times) and a norm after the experts (it needs the whole sum).
With real weights it also probes the module: its forward on a few routed tokens with the whole weights against the
sum of the per-rank outputs (``functional_call``), refused by name with the difference if they disagree. Fake or
``meta`` weights are not probed, and a module without the decorator's record is then refused.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
from torch import nn
from torch.func import functional_call

from shardtrain.distributed.placement import TPPlacement, shard_block
from shardtrain.errors import LayoutError
from shardtrain.tensor_parallel.keeps_meaning import is_fake, probe_mode

_TOKENS_PER_EXPERT = 3  # probe tokens: every expert sees a few, in either slot of the top-2


def check_experts(
    module: nn.Module,
    name: str,
    placements: Mapping[str, TPPlacement],
    size: int,
    identities: tuple[nn.Module, ...] = (),
    compute_dtype: torch.dtype | None = None,
) -> None:
    """Refuse ``moe_tp_experts`` on ``module`` unless the plan's split of its parameters keeps its meaning.

    ``placements``: every parameter of ``module`` (names relative to it, children included) -> its placement
    under the plan ([Note: experts under tensor parallelism]). ``identities``: its children styled
    ``moe_identity_expert`` (:func:`share_identity`), which the probe runs as they will run. ``compute_dtype``: the
    dtype the weights will be cast to for training (None: they train as they are), for [Note: grouped_mm's
    alignment].
    """
    what = f"{name} ({type(module).__name__}): style 'moe_tp_experts'"
    if not any(p.is_split for p in placements.values()):
        raise LayoutError(
            f"{what} sums every rank's output, but the plan splits none of its parameters: each rank would compute "
            "the whole output and the sum would count it tp times. Split gate_up_proj/down_proj in the plan, or "
            "leave the module out of it."
        )
    recorded = _check_recorded_layout(module, what, placements, size)
    _check_grouped_mm_alignment(module, what, placements, size, compute_dtype)
    params = dict(module.named_parameters())
    if any(p.is_meta or is_fake(p) for p in params.values()):
        if not recorded:
            raise LayoutError(
                f"{what}: {type(module).__name__} does not record its weight layout (transformers' "
                "use_experts_implementation decorator) and its weights are not real (meta or fake), so nothing can "
                "show that the plan's split keeps its meaning. Build the model with real weights, or leave its "
                "experts out of the plan."
            )
        return
    _probe(module, what, params, placements, size, identities)


def share_identity(module: nn.Module, size: int) -> None:
    """``moe_identity_expert``: LongCat-Flash's zero-computation experts return their input, the same on every rank,
    and the enclosing ``moe_tp_experts`` sums the ranks' outputs; the input is divided by the tensor-parallel size
    first, so the sum is the identity again (and each rank's share of the gradient is 1/tp, which the region's
    **f** sums back to the whole)."""
    module.register_forward_pre_hook(lambda _m, args: (args[0] / size, *args[1:]))


def _check_recorded_layout(module: nn.Module, what: str, placements: Mapping[str, TPPlacement], size: int) -> bool:
    """The checks transformers' recorded layout allows; False when the module records none."""
    if not isinstance(getattr(module, "has_gate", None), bool):
        return False
    if getattr(module, "has_bias", False):
        raise LayoutError(
            f"{what}: its experts add biases (has_bias), which every rank would add to its partial output, so the "
            "sum over ranks would count them tp times. Train it without tensor parallelism on its experts (leave "
            "them out of the plan)."
        )
    if getattr(module, "has_post_expert_norm", False):
        raise LayoutError(
            f"{what}: a norm follows each expert (has_post_expert_norm), and a norm of a partial output is not the "
            "norm of the sum. Leave the experts out of the plan."
        )
    transposed = bool(getattr(module, "is_transposed", False))
    up_name = "gate_up_proj" if module.has_gate else "up_proj"
    inner_up = 2 if transposed else 1  # the intermediate features of gate_up_proj / up_proj
    inner_down = 1 if transposed else 2  # ... and of down_proj
    up, down = placements.get(up_name), placements.get("down_proj")
    if up is None or down is None:
        raise LayoutError(f"{what}: it has no {up_name!r} and 'down_proj' parameters to split")
    if up.dim != inner_up or down.dim != inner_down:
        raise LayoutError(
            f"{what}: the plan splits {up_name} ({up.describe()}) and down_proj ({down.describe()}), but each "
            f"expert's intermediate features are dim {inner_up} of {up_name} and dim {inner_down} of down_proj"
            f"{' (stored transposed)' if transposed else ''}: both must be split there, or the ranks' partial "
            "outputs do not add up to the whole."
        )
    want = 2 if module.has_gate and getattr(module, "is_concatenated", True) else 1
    if up.stride != want or down.stride != 1:
        layout = (
            "gate and up stacked (stride 2)"
            if want == 2
            else ("gate/up pairs interleaved (stride 1)" if module.has_gate else "no gate (stride 1)")
        )
        fix = ("packed_" if want == 2 else "") + ("rowwise" if transposed else "colwise")
        raise LayoutError(
            f"{what}: the plan splits {up_name} with stride {up.stride} and down_proj with stride {down.stride}, "
            f"but {up_name} holds {layout} and down_proj's intermediate features in order (stride 1): rank r would "
            f"pair other intermediate features in the two projections. Give {up_name} {fix!r} in the plan."
        )
    if module.has_gate and want == 1 and (up.global_shape[up.dim] // size) % 2:
        raise LayoutError(
            f"{what}: {up_name} interleaves gate/up pairs, and {up.global_shape[up.dim]} features over {size} ranks "
            "would cut a pair in two. Pick a tensor-parallel size that divides the intermediate size."
        )
    return True


def _check_grouped_mm_alignment(
    module: nn.Module,
    what: str,
    placements: Mapping[str, TPPlacement],
    size: int,
    compute_dtype: torch.dtype | None,
) -> None:
    """[Note: grouped_mm's alignment]
    transformers' default experts implementation, ``grouped_mm``, calls ``torch._grouped_mm``, which requires every
    stride of its operands but the last to be a multiple of 16 bytes (CPU and CUDA; else ``RuntimeError: strides should
    be multiple of 16 bytes`` at the first forward). A tensor-parallel split divides each expert's intermediate features
    by ``tp``, so ``moe_intermediate_size / tp`` elements must fill a multiple of 16 bytes in the experts' dtype (4 in
    fp32, 8 in bf16/fp16). Checked on each rank's block shapes, in the weights' and the compute dtype, before anything
    changes; refused by name with the sizes that fit. ``eager`` and ``batched_mm`` need nothing; only the split
    dimension is checked (the others are the whole model's, which transformers runs as they are)."""
    config = getattr(module, "config", None)
    if getattr(config, "_experts_implementation", None) != "grouped_mm":
        return
    params = dict(module.named_parameters(recurse=False))
    dtypes = {p.dtype for p in params.values() if p.is_floating_point()}
    if compute_dtype is not None and any(d == torch.float32 for d in dtypes):
        dtypes.add(compute_dtype)
    split = {  # name -> (placement, features per gate/up half or of down_proj, in the whole expert)
        n: (pl, pl.global_shape[pl.dim] // pl.stride)
        for n, pl in placements.items()
        if n in params and pl.is_split and len(pl.global_shape) == 3
    }
    for dtype in sorted(dtypes, key=lambda d: d.itemsize):  # the strictest first
        per = 16 // dtype.itemsize
        bad = [(n, pl, whole) for n, (pl, whole) in split.items() if (whole // size) % per]
        if bad:
            pname, placement, whole = bad[0]
            fits = [
                t for t in range(1, whole + 1) if all(w % t == 0 and (w // t) % per == 0 for _, w in split.values())
            ]
            raise LayoutError(
                f"{what}: each rank would hold {whole // size} of the {whole} intermediate features of every expert "
                f"in {pname} ({placement.describe()}, over {size} ranks), and transformers' 'grouped_mm' experts "
                f"implementation (torch._grouped_mm) needs rows of a multiple of 16 bytes: a multiple of {per} "
                f"features in {str(dtype).removeprefix('torch.')}. Use a tensor-parallel size from {fits or [1]}, "
                "or build the model with experts_implementation='eager' or 'batched_mm' ([Note: grouped_mm's "
                "alignment])."
            )


def _probe(
    module: nn.Module,
    what: str,
    params: dict[str, nn.Parameter],
    placements: Mapping[str, TPPlacement],
    size: int,
    identities: tuple[nn.Module, ...],
) -> None:
    args = _probe_inputs(module, what, next(iter(params.values())))
    with torch.no_grad(), probe_mode(module):
        whole = module(*args)
        parts = []
        shares = [m.register_forward_pre_hook(lambda _m, a: (a[0] / size, *a[1:])) for m in identities]
        try:
            for rank in range(size):
                blocks = {n: shard_block(p, placements[n], rank, size).contiguous() for n, p in params.items()}
                parts.append(functional_call(module, blocks, args))
        finally:
            for handle in shares:
                handle.remove()
    if not isinstance(whole, torch.Tensor) or any(p.shape != whole.shape for p in parts):
        raise LayoutError(
            f"{what}: its forward does not return one tensor of the same shape from each rank's blocks as from the "
            "whole weights; the partial outputs cannot be summed. Leave the experts out of the plan."
        )
    combined = torch.stack(parts).sum(0)
    scale = whole.abs().max().item() or 1.0
    err = (combined - whole).abs().max().item()
    tol = 1e-5 if whole.dtype in (torch.float32, torch.float64) else 3e-2
    if err > tol * scale:
        split = ", ".join(f"{n} {placements[n].describe()}" for n in params)
        raise LayoutError(
            f"{what}: the plan's split ({split}) does not keep the experts' meaning: each rank's forward on its "
            f"blocks, summed over ranks, differs from the forward on the whole weights by {err / scale:.2g} of its "
            "size (the split pairs other features than the forward reads together, or a term is added on every "
            "rank). Fix the plan's styles for these parameters, or leave the experts out of the plan."
        )


def _probe_inputs(module: nn.Module, what: str, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A few tokens routed to every expert (top-2), as the module's forward takes them."""
    experts = getattr(module, "num_experts", None) or getattr(module, "total_experts", None)  # LongCat: + identities
    hidden = getattr(module, "hidden_dim", None) or getattr(module, "hidden_size", None)
    routed = ["hidden_states", "top_k_index", "top_k_weights"]
    signature = list(inspect.signature(module.forward).parameters)
    if not isinstance(experts, int) or not isinstance(hidden, int) or signature not in (routed, ["hidden_states"]):
        raise LayoutError(
            f"{what}: shardtrain checks an experts module on a probe before splitting it, and cannot build one for "
            f"{type(module).__name__} (it needs integer num_experts (or total_experts) and hidden_dim (or hidden_size) "
            "attributes and a forward taking "
            f"(hidden_states, top_k_index, top_k_weights) or (hidden_states); this one takes ({', '.join(signature)})"
            "). Leave the experts out of the plan."
        )
    gen = torch.Generator().manual_seed(0)
    tokens = experts * _TOKENS_PER_EXPERT
    states = torch.randn(tokens, hidden, generator=gen).to(device=like.device, dtype=like.dtype)
    if signature == ["hidden_states"]:  # already routed: the tokens of each expert in turn
        return (states,)
    first = torch.arange(tokens) % experts
    if experts == 1:
        index = first.unsqueeze(-1)
    else:  # a second expert, distinct from the first
        index = torch.stack([first, (first + 1 + torch.arange(tokens) // experts % (experts - 1)) % experts], -1)
    weights = torch.rand(*index.shape, generator=gen) + 0.5
    return states, index.to(like.device), weights.to(device=like.device, dtype=like.dtype)
