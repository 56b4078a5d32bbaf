"""Sequence parallelism for an encoder-decoder model (T5, BART and their kin): both of its sequences split.

[Note: encoder-decoder models under Ulysses]
The encoder's sequence (``S_e`` tokens) and the decoder's (``S_d``) are each split as one sequence is ([Note: masks
under Ulysses] in :mod:`shardtrain.sequence_parallel.inputs`), after padding at the end to a multiple of ``P``: the
encoder's padding is masked out of both attentions that read it as keys, the decoder's gets labels -100. Decoder
inputs made from ``labels`` are made from the whole labels before the split (``prepare_decoder_input_ids_from_labels``):
the shift to the right crosses the slices' boundaries.

All three attentions go through the Ulysses exchange; the cross-attention's queries come from this rank's decoder
slice, its keys and values from its slice of the encoder output (the exchange never assumed equal lengths). Not an
all-gather of the encoder output: every rank would hold and project, in every decoder layer, the whole encoder output,
so neither memory nor compute would fall with ``P`` (it sends fewer bytes only for a short encoder).

The model is given no mask (any it built would be a slice's): the engine builds the three whole masks once per
forward, before the split, and each attention takes its role's (encoder; decoder self-attention when ``is_causal``;
else cross-attention). T5's relative bias is made after the exchange from the whole lengths, for this rank's heads.
Absolute positions (BART and kin): a pre-hook on ``embed_positions`` adds ``r * S/P``, padding held at the last real
position. Labels are split unshifted; the loss is combined as [Note: the loss over a sequence-parallel group] says.
Refused by name: generation state, other positions, attention outside transformers' interface, experts, tensor
parallelism (docs/sequence-parallel.md, "What is refused").
"""

from __future__ import annotations

import inspect
import re
import sys
from typing import Any

import torch
from torch import nn

from shardtrain.distributed.communicator import Communicator
from shardtrain.errors import ConfigError
from shardtrain.sequence_parallel.inputs import (
    IGNORE,
    BatchCheck,
    exchange_counts,
    loss_over_group,
    whole_cross_mask,
    whole_sequence_mask,
)
from shardtrain.sequence_parallel.model_kinds import refuse_unservable_common, unwrapped
from shardtrain.sequence_parallel.ulysses import kv_repeats

ENCODER_INPUTS = ("input_ids", "inputs_embeds", "attention_mask")
DECODER_INPUTS = ("decoder_input_ids", "decoder_inputs_embeds", "labels", "decoder_attention_mask")
_ROLES = ("encoder", "decoder", "cross")
# experts and their routers: a load-balancing or z-loss term computed per slice would not be the sequence's
_EXPERTS = re.compile(r"Router|Experts|SparseMLP")


def is_encoder_decoder(model: nn.Module) -> bool:
    config = getattr(unwrapped(model), "config", None)
    return hasattr(config, "_attn_implementation") and bool(getattr(config, "is_encoder_decoder", False))


def _has_relative_bias(module: nn.Module) -> bool:
    return isinstance(getattr(module, "relative_attention_bias", None), nn.Module) and callable(
        getattr(module, "compute_bias", None)
    )


def _offsettable(positions: Any) -> bool:
    """Whether an ``embed_positions`` numbers its tokens as ``forward(ids or shape, past_key_values_length,
    position_ids)``, counting from ``past_key_values_length`` when given no ``position_ids`` (BART's learned, Marian's
    sinusoidal positions): the form the engine's pre-hook offsets."""
    if not isinstance(positions, nn.Embedding):
        return False
    try:
        params = list(inspect.signature(positions.forward).parameters)
    except (TypeError, ValueError):
        return False
    return len(params) >= 3 and params[1] == "past_key_values_length" and params[2] == "position_ids"


def _takes_start_token(shift: Any) -> bool:
    """Whether ``shift`` is BART's ``shift_tokens_right(input_ids, pad_token_id, decoder_start_token_id)``."""
    try:
        params = list(inspect.signature(shift).parameters)
    except (TypeError, ValueError):
        return False
    return params == ["input_ids", "pad_token_id", "decoder_start_token_id"]


class Seq2SeqSplitter:
    """Splits an encoder-decoder model's two sequences and combines its loss; the whole masks and position bias its
    attention takes after the exchange (see the module's Note)."""

    def __init__(self, module: nn.Module, comm: Communicator) -> None:
        self.comm = comm
        self.size, self.rank = comm.size, comm.rank
        model = unwrapped(module)
        self._model_name = name = type(model).__name__
        refuse_unservable_common(model)
        experts = sorted({type(m).__name__ for m in model.modules() if _EXPERTS.search(type(m).__name__)})
        if experts:
            raise ConfigError(
                f"{name} routes tokens to experts ({', '.join(experts[:3])}): its router's load-balancing loss under "
                "sequence parallelism would be each slice's, not the sequence's, and it is built for decoder-only "
                "models only. Not built: train it without sequence_parallel_size"
            )
        for key in ("encoder_attention_heads", "decoder_attention_heads", "num_heads"):  # refused before a forward
            heads = getattr(model.config, key, None)
            if isinstance(heads, int):
                kv_repeats(heads, heads, self.size)
        self._model = model
        self._encoder, self._decoder = model.get_encoder(), model.get_decoder()
        if self._encoder is model or self._decoder is model:
            raise ConfigError(f"{name} has no separate encoder and decoder (get_encoder / get_decoder)")
        self._roles = self._attention_roles()
        self._bias_owners = self._position_bias_owners()
        self.hooks = self._position_hooks()
        try:
            self._params = inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            self._params = {}
        pad = getattr(model.config, "pad_token_id", None)
        self._pad_id = pad if isinstance(pad, int) else 0
        self._batch_check = BatchCheck(comm)
        # the state of one forward, set by split: its real lengths, whole masks, position biases, attention calls
        self._real = {"encoder": 0, "decoder": 0}
        self._masks: dict[str, torch.Tensor | None] = {}
        self._biases: dict[nn.Module, torch.Tensor] = {}
        self._attended: set[str] = set()
        self._active = False
        self._counts: tuple[int, int] | None = None
        self.whole_inputs = self  # what the Ulysses attention asks for masks and bias (WholeAttentionInputs)

    # -- what the model is, checked at initialize ------------------------------------------------------------------
    def _attention_roles(self) -> dict[nn.Module, str]:
        """Each attention module's role: ``encoder``, ``decoder`` (causal self-attention) or ``cross``."""
        roles: dict[nn.Module, str] = {}
        for m in self._encoder.modules():
            if isinstance(getattr(m, "is_causal", None), bool):
                roles[m] = "encoder"
        for m in self._decoder.modules():
            if isinstance(getattr(m, "is_causal", None), bool):
                roles[m] = "decoder" if m.is_causal else "cross"
        missing = [r for r in _ROLES if r not in roles.values()]
        if missing:
            raise ConfigError(
                f"{self._model_name}: the engine found no {' or '.join(missing)} attention going through "
                "transformers' attention interface (modules with an is_causal flag, in get_encoder() and "
                "get_decoder()): Ulysses reaches attention only there, and attention it does not reach would see "
                "this rank's slice alone. Not built: train it without sequence_parallel_size"
            )
        causal_encoder = [type(m).__name__ for m, r in roles.items() if r == "encoder" and m.is_causal]
        if causal_encoder:
            raise ConfigError(f"{self._model_name}'s encoder has causal attention ({causal_encoder[0]}): not built")
        return roles

    def _position_bias_owners(self) -> dict[nn.Module, nn.Module]:
        """Each self-attention module's owner of its relative position bias: itself, or the one module of its stack
        that has one (T5's first layer)."""
        owners: dict[nn.Module, nn.Module] = {}
        for role in ("encoder", "decoder"):
            mods = [m for m, r in self._roles.items() if r == role]
            own = [m for m in mods if _has_relative_bias(m)]
            for m in mods:
                if _has_relative_bias(m):
                    owners[m] = m
                elif len(own) == 1:
                    owners[m] = own[0]
                elif own:
                    raise ConfigError(
                        f"{self._model_name}: {len(own)} {role} layers own a relative position bias and others share "
                        "one; the engine cannot tell which one a layer uses. Not built"
                    )
        cross = [type(m).__name__ for m, r in self._roles.items() if r == "cross" and _has_relative_bias(m)]
        if cross:
            raise ConfigError(
                f"{self._model_name}'s cross-attention has a relative position bias ({cross[0]}): not built"
            )
        return owners

    def _position_hooks(self) -> list:
        hooks = []
        for stack, part in (("encoder", self._encoder), ("decoder", self._decoder)):
            positions = getattr(part, "embed_positions", None)
            relative = any(r == stack and m in self._bias_owners for m, r in self._roles.items())
            if positions is None and relative:
                continue  # T5: positions are the relative bias, made after the exchange
            if positions is None or not _offsettable(positions):
                what = type(positions).__name__ if positions is not None else "no embed_positions, no relative bias"
                raise ConfigError(
                    f"{self._model_name}'s {stack} makes its positions in a way the engine cannot offset for a slice "
                    f"({what}): each rank would number its slice's tokens from 0. Sequence parallelism serves "
                    "encoder-decoders with T5's relative position bias or BART-style embed_positions; train it "
                    "without sequence_parallel_size"
                )
            hook = positions.register_forward_pre_hook(
                lambda m, a, k, stack=stack: self._offset_positions(stack, m, a, k), with_kwargs=True
            )
            hooks.append(hook)
        return hooks

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []

    # -- a forward: split, attention, combine ----------------------------------------------------------------------
    def split(self, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        named = self._named(args, kwargs)
        self._batch_check((), named)  # one batch per group: the ranks must agree on it (first forward)
        for key in ("encoder_outputs", "past_key_values"):
            if named.get(key) is not None:
                raise ConfigError(
                    f"{key} under sequence parallelism is not built for {self._model_name}: pass the inputs "
                    "(input_ids, labels or decoder_input_ids) and let the engine split both sequences"
                )
        if named.get("use_cache"):
            raise ConfigError(
                "use_cache=True under sequence parallelism: a cache would hold this rank's slices of the keys and "
                "values; train with use_cache=False (generate without sequence_parallel_size)"
            )
        if "num_items_in_batch" in named:
            raise ConfigError(
                "num_items_in_batch with sequence_parallel_size > 1 is not built: the engine normalises the loss "
                "over the real tokens of each sequence-parallel group itself; do not pass it"
            )
        if "use_cache" in self._params:
            named["use_cache"] = False
        self._make_decoder_inputs(named)
        unknown = [
            k
            for k, v in named.items()
            if torch.is_tensor(v) and v.dim() >= 2 and k not in ENCODER_INPUTS + DECODER_INPUTS
        ]
        if unknown:
            raise ConfigError(
                f"{unknown[0]} of shape {tuple(named[unknown[0]].shape)} under sequence parallelism: the engine splits "
                f"an encoder-decoder model's encoder inputs {ENCODER_INPUTS} and decoder inputs {DECODER_INPUTS} by "
                "name, and does not know which sequence this one follows"
            )
        rows, enc, dec = self._lengths(named)
        first = next(v for v in named.values() if torch.is_tensor(v) and v.dim() >= 2)
        device = first.device
        enc_mask, dec_mask = self._pad(named, enc, dec, rows, device)
        enc_p, dec_p = self._padded(enc), self._padded(dec)
        config = self._model.config
        self._masks = {
            "encoder": whole_sequence_mask(self._encoder.config, enc_mask, None, rows, enc_p, device, causal=False),
            "decoder": whole_sequence_mask(self._decoder.config, dec_mask, None, rows, dec_p, device, causal=True),
            "cross": whole_cross_mask(config, enc_mask, rows, dec_p, enc_p, device),
        }
        self._real = {"encoder": enc, "decoder": dec}
        self._biases, self._attended, self._active = {}, set(), True
        labels = named.get("labels")
        out = {k: self._slice(v) if k in ENCODER_INPUTS + DECODER_INPUTS else v for k, v in named.items()}
        self._counts = self._count(labels, dec_p, (rows, enc_p, dec_p), device)
        return (), out

    def _named(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The forward's arguments, all by name (positional ones bound to the forward's signature)."""
        if not args:
            return dict(kwargs)
        try:
            bound = inspect.Signature(list(self._params.values())).bind_partial(*args, **kwargs)
        except TypeError as err:
            raise ConfigError(f"{self._model_name}'s forward does not take these arguments: {err}") from None
        named = {}
        for key, value in bound.arguments.items():
            if self._params[key].kind is inspect.Parameter.VAR_KEYWORD:
                named.update(value)
            elif self._params[key].kind is inspect.Parameter.VAR_POSITIONAL:
                raise ConfigError(f"{self._model_name}'s forward takes *{key}: pass its inputs by name")
            else:
                named[key] = value
        return named

    def _make_decoder_inputs(self, named: dict[str, Any]) -> None:
        if named.get("decoder_input_ids") is not None or named.get("decoder_inputs_embeds") is not None:
            return
        labels = named.get("labels")
        if labels is None:
            raise ConfigError(
                f"{self._model_name} under sequence parallelism needs its decoder's sequence: pass labels or "
                "decoder_input_ids (the model would otherwise make the decoder's inputs from its slice of input_ids)"
            )
        prepare = getattr(self._model, "prepare_decoder_input_ids_from_labels", None)
        shift = getattr(sys.modules.get(type(self._model).__module__), "shift_tokens_right", None)
        if prepare is None and callable(shift) and _takes_start_token(shift):  # Blenderbot: what its forward calls
            config = self._model.config

            def prepare(labels: torch.Tensor) -> torch.Tensor:
                return shift(labels, config.pad_token_id, config.decoder_start_token_id)

        if not torch.is_tensor(labels) or labels.dim() != 2 or prepare is None:
            raise ConfigError(
                f"labels {tuple(labels.shape) if torch.is_tensor(labels) else type(labels).__name__} without "
                f"decoder_input_ids for {self._model_name} under sequence parallelism: per-token labels [batch, "
                "seq] of a model that makes its decoder inputs from them as the engine can (its "
                "prepare_decoder_input_ids_from_labels or its module's shift_tokens_right), or pass decoder_input_ids"
            )
        named["decoder_input_ids"] = prepare(labels)  # shifted right over the whole sequence, before the split

    def _lengths(self, named: dict[str, Any]) -> tuple[int, int, int]:
        """(rows, encoder length, decoder length), every input of a sequence checked against its length."""
        shapes = {k: tuple(v.shape) for k, v in named.items() if torch.is_tensor(v) and v.dim() >= 2}
        rows = {s[0] for s in shapes.values()}
        if len(rows) > 1:
            raise ConfigError(f"inputs with different numbers of rows under sequence parallelism: {shapes}")
        lengths = []
        for side, keys in (("encoder", ENCODER_INPUTS), ("decoder", DECODER_INPUTS)):
            got = {k: shapes[k][1] for k in keys if k in shapes}
            if not got or set(got) <= {"attention_mask", "decoder_attention_mask"}:
                raise ConfigError(
                    f"{self._model_name} under sequence parallelism was given no {side} sequence ({keys}): both are "
                    "split, and the engine must see each whole"
                )
            if len(set(got.values())) > 1:
                raise ConfigError(f"the {side}'s inputs have different sequence lengths (dimension 1): {got}")
            for mask in ("attention_mask", "decoder_attention_mask"):
                if mask in keys and mask in shapes and len(shapes[mask]) != 2:
                    raise ConfigError(
                        f"{mask} of shape {shapes[mask]} under sequence parallelism: a [batch, seq] padding mask only "
                        "(the engine builds the whole sequences' masks from it)"
                    )
            lengths.append(next(iter(got.values())))
        return next(iter(rows)), lengths[0], lengths[1]

    def _padded(self, length: int) -> int:
        return -(-length // self.size) * self.size

    def _pad(
        self, named: dict[str, Any], enc: int, dec: int, rows: int, device: torch.device
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Pads both sequences at the end to a multiple of the group (the encoder's padding masked out, the
        decoder's labels -100); returns the two padding masks, which the model is not given."""
        fills = {
            "input_ids": self._pad_id,
            "inputs_embeds": 0,
            "attention_mask": 0,
            "decoder_input_ids": self._pad_id,
            "decoder_inputs_embeds": 0,
            "labels": IGNORE,
            "decoder_attention_mask": 0,
        }
        extra = {"encoder": self._padded(enc) - enc, "decoder": self._padded(dec) - dec}
        if extra["encoder"] and named.get("attention_mask") is None:
            named["attention_mask"] = torch.ones(rows, enc, dtype=torch.long, device=device)
        for key, fill in fills.items():
            value = named.get(key)
            more = extra["encoder" if key in ENCODER_INPUTS else "decoder"]
            if torch.is_tensor(value) and more:
                pad = value.new_full((value.shape[0], more, *value.shape[2:]), fill)
                named[key] = torch.cat([value, pad], dim=1)
        return named.pop("attention_mask", None), named.pop("decoder_attention_mask", None)

    def _slice(self, v: Any) -> Any:
        if not torch.is_tensor(v) or v.dim() < 2:
            return v
        per = v.shape[1] // self.size
        return v.narrow(1, self.rank * per, per).contiguous()

    def _count(self, labels: Any, length: int, shape: tuple[int, int, int], device: torch.device) -> tuple[int, int]:
        """(this slice's real targets, the group's), exchanged with the batch's shape: ranks of one group given
        batches of different shapes are refused at every forward, before the all-to-alls pair pieces of different
        sizes."""
        mine = int((self._slice(labels) != IGNORE).sum()) if torch.is_tensor(labels) else length // self.size
        who, dims = self._batch_check.who, "rows, encoder seq, decoder seq"
        return mine, sum(exchange_counts(self.comm, mine, shape, device, who, dims, "sequences"))

    def _offset_positions(self, stack: str, module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        """``embed_positions``' pre-hook: this slice's positions in the whole sequence (see the module's Note)."""
        if not self._active:  # called outside an engine forward: the model's own numbering
            return None
        first = args[0] if args else next(iter(kwargs.values()))
        length = first.shape[1] if torch.is_tensor(first) else int(first[1])
        past = args[1] if len(args) > 1 else kwargs.get("past_key_values_length", 0)
        given = args[2] if len(args) > 2 else kwargs.get("position_ids")
        if given is None:
            given = torch.arange(past, past + length, device=module.weight.device)
        positions = (given + self.rank * length).clamp(max=max(self._real[stack] - 1, 0))
        return args[:2], {**kwargs, "position_ids": positions}

    def whole_mask(self, module: nn.Module, device: torch.device) -> torch.Tensor | None:
        role = self._role(module)
        self._attended.add(role)
        mask = self._masks.get(role)
        if mask is not None and mask.device != device:  # built where the inputs were given: moved once a forward
            mask = self._masks[role] = mask.to(device)
        return mask

    def whole_position_bias(self, module: nn.Module, heads: slice, queries: int, keys: int) -> torch.Tensor | None:
        owner = self._bias_owners.get(module)
        if owner is None:
            return None  # cross-attention, or a model without a relative bias (its positions are embedded)
        if owner is module:  # computed by its owner at every call (again when activation checkpointing recomputes)
            bias = module.compute_bias(queries, keys, device=module.relative_attention_bias.weight.device)
            self._biases[owner] = bias = bias[:, heads]
            return bias
        if owner not in self._biases:
            raise ConfigError(
                f"{type(module).__name__}'s position bias is made by {type(owner).__name__} of the same stack, which "
                "did not run before it in this forward: not built"
            )
        return self._biases[owner]

    def _role(self, module: nn.Module) -> str:
        role = self._roles.get(module)
        if role is None:
            raise ConfigError(
                f"{self._model_name}: {type(module).__name__} runs attention through the engine but is neither in its "
                "encoder nor in its decoder; not built"
            )
        return role

    def combine(self, output: Any) -> Any:
        """The whole sequence's loss in place of this slice's (an output's ``loss``); other outputs (logits, the
        encoder's last hidden state) are this rank's slices."""
        self._active = False
        missing = [r for r in _ROLES if r not in self._attended]
        if missing:
            raise ConfigError(
                f"{self._model_name}'s {' and '.join(missing)} attention did not go through the Ulysses exchange (it "
                "does not call transformers' attention interface): each rank would attend within its slice only. "
                "Sequence parallelism is not built for it; train it without sequence_parallel_size"
            )
        mine, total = self._counts
        if torch.is_tensor(output) and output.dim() == 0:
            return loss_over_group(output, mine, total, self.comm)
        loss = getattr(output, "loss", None)
        if torch.is_tensor(loss) and loss.dim() == 0:
            output.loss = loss_over_group(loss, mine, total, self.comm)
        return output
