"""What the engine does to a forward's inputs and output under sequence parallelism.

Every rank of a sequence-parallel group is given the same whole batch (as under tensor parallelism) and keeps its
slice of the sequence, ``[r * S/P, (r + 1) * S/P)`` for sp rank ``r``:

* every tensor argument with at least two dimensions, positional or keyword, is split along dimension 1 (the
  sequence): ``input_ids``, ``labels``, ``position_ids``, ``inputs_embeds`` ``[b, S, ...]``, the project's GPT's
  ``idx`` and ``targets``. They must all have the same length ``S`` there, divisible by ``P``. Tensors of fewer
  dimensions and other values are passed unchanged.
* ``labels`` (keyword) of a causal LM (which shifts them itself) are shifted over the whole sequence first, as
  DeepSpeed ALST's ``shift_labels``, and handed to the model as ``shift_labels`` (and ``labels``), so that the
  target of a slice's last token, the first token of the next slice, is not lost at the boundary. Those of any
  other per-token head (a masked LM, token classification) are split as they are; heads that pool the sequence are
  refused ([Note: what the engine assumes of a model's loss] in :mod:`shardtrain.sequence_parallel.model_kinds`).
  Positional targets (the project's GPT) are already aligned with their tokens and are split as they are.
* ``position_ids``: when the model's ``forward`` takes them and none are given, the whole sequence's are made before
  the split, so rotary and learned position embeddings see global positions: ``0..S-1``, or what the model makes
  itself where it makes others (RoBERTa and its kin number tokens from ``padding_idx + 1``, skipping padding:
  their embeddings' ``create_position_ids_from_input_ids``, as transformers calls it).
* ``attention_mask`` ``[b, S]`` is not split: see [Note: masks under Ulysses].

[Note: masks under Ulysses]
After the all-to-all a rank holds whole sequences, so attention needs the whole sequence's mask. For a transformers
model the engine builds it per forward, before the split, with ``create_causal_mask`` (``create_bidirectional_mask`` for
an encoder) from the 2-D padding mask and position ids (packed rows when ``use_cache=False``), and passes the ``[b, 1,
S, S]`` result as ``attention_mask``: a 4-D mask passes the model's preparation unchanged and the Ulysses attention
applies it after the exchange ([Note: sliding windows under Ulysses] in :mod:`shardtrain.sequence_parallel.ulysses`);
None where transformers would take sdpa's causal or unmasked path. Positions stay ``0..S-1`` under left padding. Other
models take no mask: all ones is dropped, padding refused.

[Note: the loss over a sequence-parallel group]
The model computes, on each rank, the mean loss over the real targets (not -100) of its slice. The engine returns
``L = sum_r n_r * mean_r / N`` (``n_r`` real targets on rank ``r``, ``N`` their sum): the mean over the whole
sequence's real tokens, not a mean of the ranks' means. The sum over the group is an all-reduce whose backward is
the all-reduce of the gradients (every rank backpropagates the same ``L``), so rank ``r``'s parameters receive
``P * n_r/N * d mean_r`` and ZeRO's average over the ``dp * P`` ranks of its group ([Note: the sequence axis] in
:mod:`shardtrain.distributed.mesh`) gives, per data-parallel rank, ``sum_r n_r/N * d mean_r = dL``, averaged over
``dp``: the gradient of one process on the same batch.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardtrain.distributed.communicator import Communicator
from shardtrain.errors import ConfigError, RankMismatchError
from shardtrain.sequence_parallel.all_to_all import sum_over_group
from shardtrain.sequence_parallel.model_kinds import attention_is_causal, is_causal_lm, refuse_unservable, unwrapped
from shardtrain.sequence_parallel.router_loss import install as install_router_loss

IGNORE = -100


class _ConfigWithSdpa:
    """A transformers config as its mask functions see it, with sdpa's (boolean) mask rules: after
    :func:`~shardtrain.sequence_parallel.ulysses.install_hf` the model's own attention name has none."""

    _attn_implementation = "sdpa"

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def whole_sequence_mask(
    config: Any,
    mask: torch.Tensor | None,
    positions: torch.Tensor | None,
    batch: int,
    length: int,
    device: Any,
    causal: bool = True,
) -> torch.Tensor | None:
    """transformers' own boolean mask ``[b, 1, S, S]`` for the whole sequence (causal, padding, sequences packed by
    position ids; bidirectional with padding for ``causal=False``), or None where its sdpa path uses plain causal
    (or unmasked) attention (see [Note: masks under Ulysses])."""
    from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

    shape_only = torch.empty(batch, length, 0, device=device)  # read for its batch, length, dtype and device
    if not causal:
        return create_bidirectional_mask(config=_ConfigWithSdpa(config), inputs_embeds=shape_only, attention_mask=mask)
    if positions is not None and positions.dim() == 2 and positions.shape[0] not in (1, batch):
        raise ConfigError(f"position_ids of shape {tuple(positions.shape)} for a batch of {batch}")
    return create_causal_mask(
        config=_ConfigWithSdpa(config),
        inputs_embeds=shape_only,
        attention_mask=mask,
        past_key_values=None,
        position_ids=positions,
    )


def whole_cross_mask(
    config: Any, mask: torch.Tensor | None, batch: int, queries: int, keys: int, device: Any
) -> torch.Tensor | None:
    """transformers' own boolean cross-attention mask ``[b, 1, S_q, S_k]`` (every query sees every key that ``mask``,
    the keys' ``[b, S_k]`` padding mask, keeps), or None where there is no padding (an encoder-decoder model's
    cross-attention, [Note: encoder-decoder models under Ulysses] in :mod:`shardtrain.sequence_parallel.seq2seq`)."""
    from transformers.masking_utils import create_bidirectional_mask

    return create_bidirectional_mask(
        config=_ConfigWithSdpa(config),
        inputs_embeds=torch.empty(batch, queries, 0, device=device),
        attention_mask=mask,
        encoder_hidden_states=torch.empty(batch, keys, 0, device=device),
    )


def loss_over_group(loss: torch.Tensor, mine: int, total: int, comm: Communicator) -> torch.Tensor:
    """The whole sequence's mean loss from this slice's mean over its ``mine`` real targets (``total`` over the group):
    [Note: the loss over a sequence-parallel group]."""
    if total == 0:
        raise ConfigError("a batch with no target that is not -100: there is no loss to average")
    if mine == 0:
        # a model that ignores num_items_in_batch (BERT's masked LM: a plain mean) returns 0/0 for a slice of
        # -100s; its weight is 0, and nan_to_num's gradient there is 0, so the slice adds nothing either way
        loss = torch.nan_to_num(loss, nan=0.0)
    return sum_over_group(loss * mine, comm, "the loss of a sequence-parallel group") / total


def _own_position_maker(module: nn.Module):
    """For a transformers model whose embeddings number positions their own way when given none (RoBERTa's
    ``create_position_ids_from_input_ids``: ``padding_idx + 1`` on, padding kept at ``padding_idx``), a function of
    a forward's (args, kwargs) giving the whole sequence's position ids as that model makes them; else None."""
    for sub in module.modules():
        padding_idx = getattr(sub, "padding_idx", None)
        if not isinstance(padding_idx, int) or isinstance(sub, nn.Embedding):
            continue
        # a method of the embeddings (RoBERTa), or a function of their module (ESM)
        make = getattr(sub, "create_position_ids_from_input_ids", None)
        if make is None and isinstance(getattr(sub, "position_embeddings", None), nn.Embedding):
            make = getattr(sys.modules.get(type(sub).__module__), "create_position_ids_from_input_ids", None)
        if callable(make):

            def own(args: tuple, kwargs: dict[str, Any], make=make, padding_idx=padding_idx) -> torch.Tensor:
                ids = kwargs.get("input_ids", args[0] if args else None)
                if not torch.is_tensor(ids):  # from embeddings: padding_idx + 1 on, as both make them
                    embeds = kwargs["inputs_embeds"]
                    ids = torch.full(embeds.shape[:2], padding_idx + 1, device=embeds.device)
                return make(ids, padding_idx)

            return own
    return None


class SequenceSplitter:
    """Splits the inputs of each forward and combines its loss (see the module's docstring)."""

    def __init__(self, module: nn.Module, comm: Communicator) -> None:
        self.comm = comm
        self.size, self.rank = comm.size, comm.rank
        try:
            params = inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            params = {}
        self._takes_position_ids = "position_ids" in params
        self._own_positions = _own_position_maker(module)
        config = getattr(module, "config", None)  # a transformers model: its own mask rules (whole_sequence_mask)
        self._hf_config = config if config is not None and hasattr(config, "_attn_implementation") else None
        refuse_unservable(module)
        # what the model's loss and attention do with the sequence ([Note: what the engine assumes of a model's loss])
        self._shift_labels = self._hf_config is not None and is_causal_lm(module)
        self._causal = self._hf_config is None or attention_is_causal(module)
        # a mixture of experts' load-balancing loss over the whole sequence ([Note: the router's loss under Ulysses])
        self._router_loss = install_router_loss(module, unwrapped(module), comm) if self._hf_config else None
        self._model_name = type(module).__name__
        self._module = module
        self._batch_check = BatchCheck(comm)
        self._counts: tuple[int, int] | None = None  # (this rank's real targets, the group's)

    def split(self, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        kwargs = dict(kwargs)
        self._batch_check(args, kwargs)  # one sequence per group: the ranks must agree on it (first forward)
        if "num_items_in_batch" in kwargs:
            raise ConfigError(
                "num_items_in_batch with sequence_parallel_size > 1 is not built: the engine normalises the loss "
                "over the real tokens of each sequence-parallel group itself; do not pass it"
            )
        mask = kwargs.pop("attention_mask", None)  # whole-sequence: not split (see [Note: masks under Ulysses])
        length = self._length(args, kwargs)
        targets: torch.Tensor | None = None
        labels = kwargs.get("labels")
        self._hf_labels = torch.is_tensor(labels)
        if torch.is_tensor(labels) and labels.dim() < 2:
            raise ConfigError(
                f"labels of shape {tuple(labels.shape)} under sequence parallelism: one label per sequence needs the "
                "whole sequence's output, which no rank holds; per-token labels [batch, seq] only"
            )
        if torch.is_tensor(labels) and self._shift_labels:
            shifted = torch.full_like(labels, IGNORE)
            shifted[:, :-1] = labels[:, 1:]  # the target of token i is token i + 1, across slice boundaries
            kwargs["labels"] = kwargs["shift_labels"] = targets = shifted
        elif torch.is_tensor(labels):  # a masked LM, token classification: token i's target is label i
            targets = labels
        elif "targets" in kwargs and torch.is_tensor(kwargs["targets"]):
            targets = kwargs["targets"]
        elif len(args) > 1 and torch.is_tensor(args[1]) and not args[1].is_floating_point():
            targets = args[1]
        positions = kwargs.get("position_ids")
        if torch.is_tensor(positions) and positions.dim() == 1:  # [S]: one row for all, split like the others
            kwargs["position_ids"] = positions[None]
        first = next(t for t in (*args, *kwargs.values()) if torch.is_tensor(t) and t.dim() >= 2)
        mask_positions = kwargs.get("position_ids")
        if self._takes_position_ids and positions is None and self._own_positions is not None:
            # the model's own numbering of the whole sequence; it builds its mask without positions
            kwargs["position_ids"] = self._own_positions(args, kwargs)
        elif self._takes_position_ids and positions is None:
            kwargs["position_ids"] = mask_positions = torch.arange(length, device=first.device).expand(
                first.shape[0], length
            )
        whole_mask = self._whole_mask(mask, mask_positions, first, length, kwargs)
        if self._router_loss is not None:
            self._router_loss.record((first.shape[0], length), mask)
        args = tuple(self._slice(a) for a in args)
        kwargs = {k: self._slice(v) for k, v in kwargs.items()}
        if whole_mask is not None:
            kwargs["attention_mask"] = whole_mask
        self._counts = self._count(targets, length, tuple(first.shape[:2]), first.device)
        if self._hf_labels:  # a sum over this slice divided by its count: 0, not NaN, for a slice of padding
            kwargs["num_items_in_batch"] = max(self._counts[0], 1)
        return args, kwargs

    def _whole_mask(
        self, mask: Any, positions: torch.Tensor | None, first: torch.Tensor, length: int, kwargs: dict[str, Any]
    ) -> torch.Tensor | None:
        """The mask of the whole sequence ``[b, 1, S, S]`` the attention gets after the exchange, None where plain
        causal attention is it (see [Note: masks under Ulysses])."""
        if mask is None:
            padded = False
        elif not torch.is_tensor(mask) or mask.dim() not in (2, 4):
            raise ConfigError(
                f"attention_mask under sequence parallelism must be a [batch, seq] padding mask (or a [batch, 1, seq, "
                f"seq] one); got {mask if not torch.is_tensor(mask) else f'a tensor of shape {tuple(mask.shape)}'}"
            )
        elif mask.dim() == 4:
            if mask.shape[1] != 1 or tuple(mask.shape[2:]) != (length, length):
                raise ConfigError(
                    f"a 4-D attention_mask of shape {tuple(mask.shape)} under sequence parallelism: only [batch, 1, "
                    f"{length}, {length}] (one mask for every head, over the whole sequence) is built"
                )
            padded = True
        else:
            if mask.shape[1] != length:
                raise ConfigError(
                    f"attention_mask of shape {tuple(mask.shape)} does not cover the {length} tokens of the inputs"
                )
            padded = not bool(mask.all())
        if self._hf_config is None:
            if padded:
                raise ConfigError(
                    f"an attention_mask with padding under sequence parallelism is built for transformers models "
                    f"(whose mask rules the engine applies to the whole sequence); {self._model_name} is not one: "
                    "pad sequences at the end (causal attention keeps the pad tokens from the real ones) with "
                    "targets -100, and pass no mask"
                )
            return None  # all ones, for a model that takes none: causal attention is already the whole mask
        if mask is not None and mask.dim() == 4:
            return mask
        if mask is None and positions is not None and self._uses_cache(kwargs):
            # transformers tells sequences packed in a row apart (by their positions) only without a padding mask
            # and without a cache: neither do we
            positions = None
        return whole_sequence_mask(
            self._hf_config, mask, positions, first.shape[0], length, first.device, causal=self._causal
        )

    def _uses_cache(self, kwargs: dict[str, Any]) -> bool:
        """Whether the transformers model will make (or was given) a key/value cache in this forward, as its
        ``use_cache`` default says (the config's, off under gradient checkpointing in training)."""
        if kwargs.get("past_key_values") is not None:
            return True
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(self._hf_config, "use_cache", False)
        checkpointing = any(getattr(m, "gradient_checkpointing", False) for m in self._module.modules())
        return bool(use_cache) and not (checkpointing and self._module.training)

    def _length(self, args: tuple, kwargs: dict[str, Any]) -> int:
        lengths = {
            name: t.shape[1]
            for name, t in [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]
            if torch.is_tensor(t) and t.dim() >= 2
        }
        if not lengths:
            raise ConfigError(
                "sequence_parallel_size > 1 but no input has a sequence dimension: pass tensors [batch, seq, ...]"
            )
        if len(set(lengths.values())) > 1:
            raise ConfigError(
                f"inputs with different sequence lengths (dimension 1) under sequence parallelism: {lengths}; every "
                "tensor of two or more dimensions is split along dimension 1"
            )
        length = next(iter(lengths.values()))
        if length % self.size:
            raise ConfigError(
                f"sequence length {length} is not divisible by sequence_parallel_size {self.size}: each rank holds "
                f"an equal slice. Pad every sequence at the end to a multiple of {self.size} (labels -100 there; "
                "causal attention keeps the pad tokens from the real ones)"
            )
        return length

    def _slice(self, v: Any) -> Any:
        if not torch.is_tensor(v) or v.dim() < 2:
            return v
        per = v.shape[1] // self.size
        return v.narrow(1, self.rank * per, per).contiguous()  # models .view() their inputs

    def _count(
        self, targets: torch.Tensor | None, length: int, shape: tuple[int, int], device: torch.device
    ) -> tuple[int, int]:
        """(this slice's real targets, the whole sequence's), exchanged with the batch's shape: ranks of one group
        given batches of different shapes (the first forward's digest check passed) are refused here, at every
        forward, before the all-to-alls would pair pieces of different sizes."""
        if targets is None:  # no targets known: the slices weigh the same
            mine = length // self.size
        else:
            mine = int((self._slice(targets) != IGNORE).sum())
        counts = exchange_counts(self.comm, mine, shape, device, self._who, "rows, seq", "sequence")
        if not self._hf_labels and 0 in counts and sum(counts):
            # the model's mean over a slice without a real target is 0/0 (NaN), which no weight of 0 removes
            raise ConfigError(
                f"sequence-parallel ranks {[r for r, c in enumerate(counts) if c == 0]} got a slice whose targets "
                "are all -100: the model's mean loss over it is undefined. Pass transformers-style `labels=` (the "
                "engine then has the model divide by its own count) or batches with real targets in every slice"
            )
        return mine, sum(counts)

    def combine(self, output: Any) -> Any:
        """The whole sequence's loss in place of this slice's (a scalar output, or an output's ``loss``); other
        outputs (logits) are this rank's slice."""
        mine, total = self._counts
        if torch.is_tensor(output) and output.dim() == 0:
            return self._whole(output, mine, total)
        loss = getattr(output, "loss", None)
        if torch.is_tensor(loss) and loss.dim() == 0:
            output.loss = self._whole(loss, mine, total)
        return output

    def _whole(self, loss: torch.Tensor, mine: int, total: int) -> torch.Tensor:
        return loss_over_group(loss, mine, total, self.comm)

    def _who(self, sp_rank: int) -> str:
        return self._batch_check.who(sp_rank)


class BatchCheck:
    """At the first forward: the whole inputs of every rank of a sequence-parallel group, digested (one object
    all-gather over the group, which only its ranks join: another group's ranks, fed correctly, go on)."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.done = False
        self.global_ranks = list(comm.ranks) if comm.size > 1 else [comm.global_rank]

    def who(self, sp_rank: int) -> str:
        return f"sp rank {sp_rank} (global rank {self.global_ranks[sp_rank]})"

    def __call__(self, args: tuple, kwargs: dict[str, Any]) -> None:
        if self.done:
            return
        from shardtrain.tensor_parallel.batch_check import batch_digest, first_difference

        every = self.comm.all_gather_object(batch_digest(args, kwargs), what="sequence-parallel batch check")
        differ = [r for r, d in enumerate(every) if d != every[0]]
        if differ:
            where = first_difference(every[0], every[differ[0]], "sp rank 0", f"sp rank {differ[0]}")
            raise RankMismatchError(
                f"the ranks of a sequence-parallel group must all get the same whole batch (the engine splits the "
                f"sequence), but {', '.join(self.who(r) for r in differ)} got inputs different from "
                f"{self.who(0)} (its group: global ranks {self.global_ranks}): "
                f"{where}. Shard the data over the data-parallel "
                "ranks only: the ranks of a group share engine.topology.dp_rank "
                "(DistributedSampler(num_replicas=engine.topology.dp, rank=engine.topology.dp_rank))"
            )
        self.done = True


def exchange_counts(
    comm: Communicator,
    mine: int,
    shape: tuple[int, ...],
    device: torch.device,
    who: Callable[[int], str],
    dims: str,
    sequences: str,
) -> list[int]:
    """Every rank's count of real targets in its slice, exchanged with the shape of its batch (``dims`` names the
    shape's entries, ``sequences`` what the engine splits): ranks of one group given batches of different shapes are
    refused here, at every forward, before the all-to-alls would pair pieces of different sizes."""
    every = torch.tensor([mine, *shape], dtype=torch.int64, device=device)
    rows = comm.all_gather_dim(every[None], 0, what="the real-token counts of a sequence-parallel group").tolist()
    shapes = [tuple(r[1:]) for r in rows]
    if any(sh != shapes[0] for sh in shapes):
        raise RankMismatchError(
            "the ranks of a sequence-parallel group were given batches of different shapes at this forward: "
            + ", ".join(f"{who(r)}: [{dims}] {list(sh)}" for r, sh in enumerate(shapes))
            + f". Every rank of a group must get the same whole batch (the engine splits the {sequences}); shard "
            "the data over the data-parallel ranks only"
        )
    return [int(r[0]) for r in rows]
