"""A model cut by layers into pipeline stages: the project's GPT and Hugging Face Llama-family decoders.

[Note: stages keep the model's names]
A rank keeps only its stages' pieces, pruned from the model in place: layers it does not hold are dropped from the
layer list (which becomes a ``ModuleDict`` keyed by the layers' original indices), and the embeddings, final norm
and head are set to None where another stage holds them. Every kept parameter therefore has the name it has in the
whole model (``blocks.3.attn.qkv.weight``), so the layout, ``full_state_dict`` and checkpoints speak of the same
logical tensors at any pipeline size. Each stage's forward is a small module of its own (:class:`GPTStage`,
:class:`LlamaStage`) that runs the kept pieces, read from the model at each call (the later steps, tensor
parallelism's above all, replace some of them: a stage holding the pieces would run the replaced ones): the first
embeds, the last applies the final norm and head
(the loss is the schedule's ``loss_fn``, run on the last stage's output), and every Llama stage makes the rotary
embeddings and the causal mask it needs from its own input (they hold no parameters).

[Note: weights tied across stages]
A model whose output head is its input embedding (GPT-2, ``tie_word_embeddings=True``, ``GPTConfig.tie_embeddings``)
holds the one weight on the first stage (embedding) and the last (head). The last stage keeps the embedding module
too (unused there: it holds only the tied weight), so the weight has the same names on both stages
(``tok.weight``, ``head.weight``), as in the whole model. Each step, before the data-parallel reduction, the two
stages' ranks at one place add their gradients (one all-reduce over ``Topology.pp_ends_group``): every rank then
holds the whole model's gradient of the weight, both reduce and step it alike, and it stays equal on the two stages.
It is counted once in the global norm (the first stage's) and written once to a checkpoint (by the first stage).
:func:`tied_across_stages` names these weights; a model built as its stage says its own (a ``PipelineModule``'s
``TiedLayerSpec`` layers, from its ``tied_across_stages()``).

[Note: a model built as its stage]
A model may come already cut: DeepSpeed's ``PipelineModule`` (the shim's, ``compat/deepspeed/runtime/pipe``) builds
only its rank's stage when it is constructed. Such a model offers ``pipeline_stages(num_stages, stage_ids)``
(:class:`BuiltAsStage`), returning the module of each of ``stage_ids`` (a ``PipelineModule``: itself) and the last
stage's loss, or refusing a layout it was not built for; nothing is pruned, and the parameters keep the model's
names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from shardtrain.errors import ConfigError
from shardtrain.models.gpt import GPT
from shardtrain.pipeline_parallel.router_loss import RouterLoss, StageRouters, router_recorder

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@runtime_checkable
class BuiltAsStage(Protocol):
    """A model that holds one pipeline stage from its construction ([Note: a model built as its stage])."""

    def pipeline_stages(self, num_stages: int, stage_ids: list[int]) -> tuple[list[nn.Module], LossFn]: ...


def layers_of_stages(num_layers: int, num_stages: int) -> list[range]:
    """Each stage's layers: as even as they come, earlier stages one more where they do not divide."""
    if num_layers < num_stages:
        raise ConfigError(
            f"the model has {num_layers} layers, fewer than the {num_stages} pipeline stages "
            "(pipeline_parallel_size x pipeline.stages_per_rank): each stage needs at least one; use fewer stages"
        )
    base, extra = divmod(num_layers, num_stages)
    starts = [s * base + min(s, extra) for s in range(num_stages + 1)]
    return [range(starts[s], starts[s + 1]) for s in range(num_stages)]


def _keep_layers(layers: nn.ModuleList, kept: list[int]) -> nn.ModuleDict:
    return nn.ModuleDict({str(i): layers[i] for i in kept})


class GPTStage(nn.Module):
    """One stage of :class:`~shardtrain.models.gpt.GPT`: token and position embeddings on the first, the blocks of
    ``layers``, the final norm and head on the last (logits out; see [Note: stages keep the model's names])."""

    def __init__(self, model: GPT, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last, self.layer_ids = first, last, [str(i) for i in layers]
        self._whole = (model,)  # not a submodule: the model's pieces are read at each call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        model = self._whole[0]
        if self.first:  # x: token ids [b, t]
            x = model.tok(x) + model.pos(torch.arange(x.shape[1], device=x.device))
        for i in self.layer_ids:
            x = model.blocks[i](x)
        return model.head(model.ln_f(x)) if self.last else x


@runtime_checkable
class StageInputs(Protocol):
    """What a Llama stage's layers are given beside its hidden states when the sequence is split over ranks (a
    stage's ``sequence``, [Note: a sequence split in a pipeline] in ``engine/pipeline_sequence.py``)."""

    def stage_inputs(
        self, hidden: torch.Tensor, position_ids: torch.Tensor, whole_positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Any]]:
        """The stage's position ids, attention mask and what else every layer is given."""
        ...


class LlamaStage(nn.Module):
    """One stage of a Hugging Face Llama-family causal LM (``model.embed_tokens``, ``model.layers``, ``model.norm``,
    ``model.rotary_emb``, ``lm_head``): each stage makes its rotary embeddings and causal mask from its input and the
    micro-batch's ``position_ids`` (every stage is given them; ``0..t-1`` when none; sequences packed in a row are
    told apart by their positions restarting, as transformers does without a cache). ``sequence``: where the
    sequence is split over ranks, what makes the positions and the mask instead (set after the cut). With
    ``routers`` (a mixture of experts' load-balancing loss) every stage also takes and returns the routers' running
    sums beside the hidden states ([Note: the router's loss across stages] in :mod:`.router_loss`)."""

    takes_position_ids = True

    def __init__(
        self, model: nn.Module, layers: range, first: bool, last: bool, routers: StageRouters | None = None
    ) -> None:
        super().__init__()
        self.config = model.config
        self.first, self.last, self.layer_ids = first, last, [str(i) for i in layers]
        self._whole = (model,)  # not a submodule: the model's pieces are read at each call
        self.routers = routers
        self.sequence: StageInputs | None = None

    def carried_examples(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """What the stage takes beside the hidden states, as examples where the shapes are given ([Note: stage
        shapes given, not inferred] in :mod:`.schedule`): the routers' sums, or nothing."""
        return (self.routers.start(device),) if self.routers is not None else ()

    def forward(
        self, x: torch.Tensor, router_sums: torch.Tensor | None = None, **given: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from transformers.masking_utils import create_causal_mask

        model = self._whole[0]
        inner = model.model
        h = inner.embed_tokens(x) if self.first else x  # x: token ids [b, t], else hidden states [b, t, d]
        layer_kwargs: dict[str, Any] = {}
        if self.sequence is not None:  # this rank's share of the sequence: global positions, the whole mask
            position_ids, mask, layer_kwargs = self.sequence.stage_inputs(h, **given)
        else:
            position_ids = given.get("position_ids")
            if position_ids is None:
                position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            mask = create_causal_mask(
                config=self.config,
                inputs_embeds=h,
                attention_mask=None,
                past_key_values=None,
                position_ids=position_ids,
            )
        position_embeddings = inner.rotary_emb(h, position_ids=position_ids)
        recording = self.routers.recording() if self.routers is not None else contextlib.nullcontext([])
        with recording as router_logits:
            for i in self.layer_ids:
                h = inner.layers[i](
                    h,
                    attention_mask=mask,
                    position_embeddings=position_embeddings,
                    position_ids=position_ids,
                    **layer_kwargs,
                )
                h = h[0] if isinstance(h, tuple) else h
        out = model.lm_head(inner.norm(h)) if self.last else h
        if self.routers is None:
            return out
        sums = router_sums if router_sums is not None else self.routers.start(h.device)
        return out, self.routers.continued(sums, router_logits)


def _routers_of(layers: nn.Module, recorder: tuple[type[nn.Module], int]) -> list[nn.Module]:
    return [m for m in layers.modules() if isinstance(m, recorder[0])]


def _stage_routers(
    model: nn.Module,
    layer_list: nn.ModuleList,
    split: list[range],
    stages: list[int],
    recorder: tuple[type[nn.Module], int] | None,
) -> list[StageRouters | None]:
    """Each of ``stages``' routers, where the model adds a load-balancing loss ([Note: the router's loss across
    stages] in :mod:`.router_loss`); None each without one."""
    if recorder is None:
        return [None] * len(stages)
    experts, top_k = int(model.num_experts), int(model.num_experts_per_tok)
    return [
        StageRouters([r for i in split[s] for r in _routers_of(layer_list[i], recorder)], recorder[1], experts, top_k)
        for s in stages
    ]


def _is_llama_family(model: nn.Module) -> bool:
    inner = getattr(model, "model", None)
    return all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")) and hasattr(
        model, "lm_head"
    )


def _tied_weight(embedding: nn.Module, head: nn.Module) -> nn.Parameter | None:
    return embedding.weight if embedding.weight is head.weight else None


def tied_across_stages(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the first and the last pipeline stage share, in one order on both ([Note: weights tied across
    stages]); read before :func:`cut_model` prunes the model (after it, a rank sees only its own stages')."""
    if isinstance(model, BuiltAsStage):  # its tied weights, where it has any: ``tied_across_stages()``
        own = getattr(model, "tied_across_stages", None)
        return list(own()) if own is not None else []
    if isinstance(model, GPT):
        tied = _tied_weight(model.tok, model.head)
    elif _is_llama_family(model):
        tied = _tied_weight(model.model.embed_tokens, model.lm_head)
    else:
        tied = None
    return [tied] if tied is not None else []


def check_can_cut(model: nn.Module, num_stages: int) -> None:
    """Refuse, before anything is changed, a model that cannot be cut into ``num_stages`` stages here."""
    if isinstance(model, BuiltAsStage):
        return  # it says itself, in cut_model, whether it was built for this layout
    if isinstance(model, GPT):
        layers_of_stages(len(model.blocks), num_stages)
    elif _is_llama_family(model):
        layers_of_stages(len(model.model.layers), num_stages)
        router_recorder(model)  # a load-balancing loss not served across stages is refused here
    else:
        raise ConfigError(
            f"{type(model).__name__} cannot be cut into pipeline stages yet: built are shardtrain's GPT and Hugging "
            "Face Llama-family causal LMs (model.embed_tokens, model.layers, model.norm, model.rotary_emb, lm_head); "
            "use pipeline_parallel_size 1"
        )


def check_can_split_sequence(model: nn.Module, sp: int, cp: int) -> None:
    """Refuse, before anything is changed, a model whose stages cannot split their sequence over ``sp * cp`` ranks
    here: built for Hugging Face Llama-family stages (:class:`LlamaStage`, whose positions and masks are made from
    what every stage is given)."""
    if isinstance(model, (GPT, BuiltAsStage)) or not _is_llama_family(model):
        raise ConfigError(
            f"pipeline parallelism with sequence_parallel_size {sp} x context_parallel_size {cp} is built for Hugging "
            f"Face Llama-family causal LMs cut into stages, not {type(model).__name__}: set sequence_parallel_size "
            "and context_parallel_size to 1, or pipeline_parallel_size to 1"
        )
    if getattr(getattr(model, "config", None), "output_router_logits", False):
        # each rank's routers see its share of the tokens; the load-balancing loss needs the whole sequence's sums
        # ([Note: the router's loss across stages] in router_loss.py), which are not summed over the split yet
        raise ConfigError(
            f"pipeline parallelism with sequence_parallel_size {sp} x context_parallel_size {cp} and a mixture of "
            f"experts' load-balancing loss ({type(model).__name__}, config.output_router_logits) is not built yet: "
            "set output_router_logits to False, or the sequence split or pipeline_parallel_size to 1"
        )


def cut_model(model: nn.Module, num_stages: int, stages: list[int]) -> tuple[list[nn.Module], LossFn]:
    """Prune ``model`` in place to the pieces of ``stages`` (of ``num_stages``) and return each stage's module, in
    the order of ``stages``, and the loss of the last stage's output against the labels (see [Note: stages keep
    the model's names]); a model built as its stage returns itself ([Note: a model built as its stage])."""
    if isinstance(model, BuiltAsStage):
        return model.pipeline_stages(num_stages, list(stages))
    check_can_cut(model, num_stages)
    llama = not isinstance(model, GPT)
    inner = model.model if llama else model
    layer_list = inner.layers if llama else inner.blocks
    split = layers_of_stages(len(layer_list), num_stages)
    kept = sorted(i for s in stages for i in split[s])
    holds_first, holds_last = 0 in stages, num_stages - 1 in stages
    # the last stage keeps a tied embedding for its head's weight ([Note: weights tied across stages])
    keeps_embedding = holds_first or (holds_last and bool(tied_across_stages(model)))
    if llama:
        # [Note: the router's loss across stages] in router_loss.py: read before the layers are pruned
        recorder = router_recorder(model)
        routers = _stage_routers(model, layer_list, split, stages, recorder)
        inner.layers = _keep_layers(layer_list, kept)
        if not keeps_embedding:
            inner.embed_tokens = None
        if not holds_last:
            inner.norm, model.lm_head = None, None
        parts = [LlamaStage(model, split[s], s == 0, s == num_stages - 1, r) for s, r in zip(stages, routers)]
        vocab = model.config.vocab_size
        router_loss = RouterLoss(model, len(_routers_of(layer_list, recorder))) if recorder is not None else None

        def loss(output: torch.Tensor | tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
            logits = output[0] if router_loss is not None else output
            value = model.loss_function(logits=logits, labels=labels, vocab_size=vocab)
            if router_loss is None:
                return value
            return value + router_loss(output[1], logits.shape[0] * logits.shape[1])

        return parts, loss
    inner.blocks = _keep_layers(layer_list, kept)
    if not holds_first:
        model.tok, model.pos = (model.tok if keeps_embedding else None), None
    if not holds_last:
        model.ln_f, model.head = None, None
    parts = [GPTStage(model, split[s], s == 0, s == num_stages - 1) for s in stages]

    def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # read when called: a tensor-parallel plan replaces ``model.loss`` after the cut (its vocab-parallel loss of
        # the head's column blocks, [Note: tensor parallelism in a pipeline stage] in engine/parallelize.py)
        return model.loss(logits, targets)

    return parts, gpt_loss


__all__ = [
    "BuiltAsStage",
    "GPTStage",
    "LlamaStage",
    "StageInputs",
    "check_can_cut",
    "check_can_split_sequence",
    "cut_model",
    "layers_of_stages",
    "tied_across_stages",
]
