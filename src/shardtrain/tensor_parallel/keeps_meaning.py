"""Whether a plan's style can split a module without changing what the module computes.

A style that splits a module (``colwise``, ``rowwise``, ``embedding_rowwise``, ...) is written for the torch class
it names: ``nn.Linear`` (or transformers' ``Conv1D``) and ``nn.Embedding``. Swapping a module for
:class:`~.layers.ColumnParallelLinear` or :class:`~.embedding.VocabParallelEmbedding` keeps exactly that class's
computation and nothing else. A module with *a computation of its own* would silently lose it: Gemma's
``Gemma2TextScaledWordEmbedding`` multiplies its lookup by ``sqrt(hidden)`` (a buffer, ``embed_scale``), MuseGlimmer's
embedding normalizes it; a quantized or LoRA linear subclass computes something else altogether. See
[Note: a plan keeps a module's meaning].

A module has a computation of its own when its class (or the instance) overrides the base class's ``forward``, or
it holds what the base class has not (buffers, parameters other than ``weight``/``bias``, submodules), or forward
hooks are registered on it (a replacement would drop them).

Such a module is kept -- the same object, its own ``forward`` -- and parallelized around that forward
(:mod:`.embedding`'s hooks) when the split provably commutes with it, and refused by name otherwise:

* ``embedding_rowwise`` (vocabulary split): each rank runs the module's forward on the ids it owns (the others
  mapped to a local row and masked out of the result) and the ranks' results are summed. Exact when the forward is
  a function of each position's looked-up row alone (a scale, a norm over the row);
* ``embedding_colwise`` (hidden split): each rank runs the forward on its columns of the table and the results are
  all-gathered. Exact when the forward acts on each column separately (a scale; not a norm over the row);
* the linear styles: refused (a row split sums partial products, which a forward of its own need not commute with,
  and no architecture transformers ships a plan for needs it).

Whether an embedding's forward commutes with its split is not guessed from its source: it is *checked* on a probe
(:func:`check_kept`), before anything changes, by running the module's own forward on each rank's block of the
real table (every rank holds the whole table before the split) and comparing the combined result with the forward
on the whole table. A model whose weights are not real yet (built on ``meta`` or as fake tensors) is not probed.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
from torch import nn
from torch.func import functional_call

from shardtrain.errors import LayoutError
from shardtrain.tensor_parallel.styles import TPStyle

# [Note: a plan keeps a module's meaning]
# A split layer replaces the module object only when the module computes exactly what its torch base class does;
# otherwise the module object stays (names, class, buffers, hooks and forward unchanged), only its weight is cut,
# and the communication goes around its forward. What cannot be honoured that way is a LayoutError naming the
# module, its class and what it computes of its own -- never a silent change of the model's numbers.


def base_class(module: nn.Module, layer: str) -> type | None:
    """The torch class a splitting style expects of ``module``, if ``module`` is one (``None``: none applies)."""
    if layer in ("vocab_embedding", "hidden_embedding"):
        return nn.Embedding if isinstance(module, nn.Embedding) else None
    if layer in ("column", "row"):
        hf = sys.modules.get("transformers.pytorch_utils")
        if hf is not None and isinstance(module, hf.Conv1D):
            return hf.Conv1D
        return nn.Linear if isinstance(module, nn.Linear) else None
    return None


def own_computation(module: nn.Module, base: type) -> list[str]:
    """What ``module`` computes beyond ``base`` (a list of reasons; empty: a plain replacement is exact)."""
    reasons = []
    cls = type(module)
    if "forward" in vars(module):
        reasons.append("its forward is replaced on the instance")
    elif cls.forward is not base.forward:
        reasons.append(f"{cls.__name__} overrides {base.__name__}.forward")
    if module._buffers:
        reasons.append(f"it holds buffers {sorted(module._buffers)}")
    extra = sorted(set(module._parameters) - {"weight", "bias"})
    if extra:
        reasons.append(f"it holds parameters {extra}")
    if module._modules:
        reasons.append(f"it holds submodules {sorted(module._modules)}")
    if module._forward_hooks or module._forward_pre_hooks:
        reasons.append("forward hooks are registered on it")
    return reasons


def keeps_module(module: nn.Module, style: TPStyle, name: str, size: int) -> bool:
    """Whether ``style`` must keep ``module`` (and parallelize around its own forward) rather than replace it.

    Raises :class:`LayoutError` naming the module, its class and why when neither keeps its meaning.
    """
    base = base_class(module, style.layer)
    if base is None:
        return False  # not a splitting style, or the layer's own check names the wrong class
    reasons = own_computation(module, base)
    if not reasons:
        return False
    what = f"{name} ({type(module).__name__}): {'; '.join(reasons)}"
    if style.layer in ("column", "row"):
        raise LayoutError(
            f"{what}. Style {style.name!r} would replace it with a plain {base.__name__} split and drop that "
            "computation, and a linear layer's own computation is not parallelized around here. Leave it out of the "
            "plan (replicated), or make it a plain nn.Linear."
        )
    check_kept(module, style, what, size)
    return True


def check_kept(module: nn.Module, style: TPStyle, what: str, size: int) -> None:
    """Probe that ``module``'s own forward commutes with ``style``'s split of its table; raise if it does not."""
    weight = module.weight
    if weight.is_meta or is_fake(weight) or any(b.is_meta or is_fake(b) for b in module.buffers()):
        return  # nothing real to probe
    vocab, dim = weight.shape
    if (vocab if style.layer == "vocab_embedding" else dim) % size:
        return  # the divisibility check names it
    ids = _probe_ids(vocab, size, module.padding_idx, weight.device)
    with torch.no_grad(), probe_mode(module):
        whole = module(ids)
        parts = []
        for rank in range(size):
            if style.layer == "vocab_embedding":
                per = vocab // size
                start = rank * per
                outside = (ids < start) | (ids >= start + per)
                local_ids = (ids - start).masked_fill(outside, 0)
                with local_padding(module, start, per):
                    out = functional_call(module, {"weight": weight[start : start + per]}, (local_ids,))
                parts.append(out.masked_fill(outside.unsqueeze(-1), 0.0))
            else:
                per = dim // size
                parts.append(functional_call(module, {"weight": weight[:, rank * per : (rank + 1) * per]}, (ids,)))
        combined = sum(parts) if style.layer == "vocab_embedding" else torch.cat(parts, dim=-1)
    split = "vocabulary rows" if style.layer == "vocab_embedding" else "embedding columns"
    if not isinstance(whole, torch.Tensor) or combined.shape != whole.shape:
        raise LayoutError(
            f"{what}. Style {style.name!r} splits its {split} over the tensor-parallel ranks, but its forward does not "
            "return one embedding vector per id. Leave it out of the plan (replicated)."
        )
    scale = whole.abs().max().item() or 1.0
    err = (combined - whole).abs().max().item()
    if err > 1e-5 * scale:
        raise LayoutError(
            f"{what}. Style {style.name!r} splits its {split} over the tensor-parallel ranks, and its forward does "
            f"not commute with that split (each rank's forward on its block, combined, differs from the forward on "
            f"the whole table by {err / scale:.2g} of its size: the forward mixes what the split separates). Leave "
            "it out of the plan (replicated)"
            + (", or use 'embedding_rowwise' (vocabulary split)." if style.layer == "hidden_embedding" else ".")
        )


@contextmanager
def local_padding(module: nn.Embedding, start: int, per: int):
    """``module.padding_idx`` as rank ``start // per``'s block sees it (``None`` if another rank owns it)."""
    saved = module.padding_idx
    module.padding_idx = local_padding_idx(saved, start, per)
    try:
        yield
    finally:
        module.padding_idx = saved


def local_padding_idx(padding_idx: int | None, start: int, per: int) -> int | None:
    return padding_idx - start if padding_idx is not None and start <= padding_idx < start + per else None


def _probe_ids(vocab: int, size: int, padding_idx: int | None, device) -> torch.Tensor:
    """Ids at both edges of every rank's block, and the padding id: ``[2, k]``."""
    per = vocab // size
    ids = sorted({i for r in range(size) for i in (r * per, r * per + per // 2, r * per + per - 1)})
    if padding_idx is not None:
        ids.append(padding_idx % vocab)
    ids = torch.tensor(ids + ids[::-1], dtype=torch.long, device=device)
    return ids.view(2, -1)


@contextmanager
def probe_mode(module: nn.Module):
    """Eval mode (no dropout) and the random streams left as they were: the probe must not change the run."""
    training = module.training
    devices = sorted({p.device.index or 0 for p in module.parameters() if p.is_cuda})
    module.eval()
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        module.train(training)


def is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)
