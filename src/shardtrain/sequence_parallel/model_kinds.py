"""What a model does with the sequence, as the engine must know it to split one: its labels, its attention, its
inputs.

[Note: what the engine assumes of a model's loss]
The engine splits every ``[b, S, ...]`` input along the sequence and combines the slices' losses ([Note: the loss
over a sequence-parallel group] in :mod:`shardtrain.sequence_parallel.inputs`): right only for a mean over tokens in
which each token's term needs only its own position's output. So, per model:

* labels: a causal LM (transformers' ``*ForCausalLM`` or a class of its causal-LM mapping) shifts its ``labels``
  itself, so a slice's last target lies in the next slice: the engine shifts them over the whole sequence first and
  passes ``shift_labels``. Other per-token heads (masked LM, token classification) get their labels split as they
  are. A head that pools or compares positions (sequence classification, question answering, multiple choice,
  next-sentence prediction) would pool each rank's slice: refused.
* attention: causal where the modules' ``is_causal`` says so, else bidirectional (``create_bidirectional_mask``).
* sequence mixing: all of it inside the attention function Ulysses wraps. Refused by name, as each would see a slice
  alone: an indexer choosing keys before that function (DeepSeek sparse attention: AXK2, HY-V4), and state-space,
  recurrent, linear-attention and convolution layers (Mamba, Falcon-H1, RWKV, LFM2).
* positions: the engine makes the whole sequence's ``position_ids``; a forward taking none numbers each slice from
  0: refused (the silent loss errors of this and the mixing refusal: docs/sequence-parallel.md, "What is refused").
* inputs: an encoder-decoder has its own splitter ([Note: encoder-decoder models under Ulysses] in
  :mod:`shardtrain.sequence_parallel.seq2seq`); a vision transformer is split after its embeddings ([Note: vision
  transformers under Ulysses] in :mod:`shardtrain.sequence_parallel.vision`); audio and video models are refused.
"""

from __future__ import annotations

import inspect
import re

from torch import nn

from shardtrain.errors import ConfigError

# transformers' auto mappings whose heads read a pooled token or positions across the sequence
_POOLED_MAPPINGS = (
    "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
    "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES",
    "MODEL_FOR_NEXT_SENTENCE_PREDICTION_MAPPING_NAMES",
)
_POOLED_SUFFIXES = (
    "ForSequenceClassification",
    "ForQuestionAnswering",
    "ForMultipleChoice",
    "ForNextSentencePrediction",
)
# layers that carry state along the sequence outside attention (Mamba, linear attention, RWKV, short convolutions, ...)
_SEQUENCE_MIXERS = re.compile(
    r"Mamba|Mixer|LinearAttention|LightningAttention|DeltaNet|ShortConv|Rwkv|xLSTM|Lstm|Recurrent|SSM|Retention"
)
_NOT_TOKENS = ("pixel_values_videos", "input_features", "input_values")  # pixel_values: see vision.py


def unwrapped(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (``get_base_model``), else ``model``."""
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) else model


def _class_names(mapping: str) -> set[str]:
    from transformers.models.auto import modeling_auto

    names: set[str] = set()
    for value in getattr(modeling_auto, mapping, {}).values():
        names.update((value,) if isinstance(value, str) else value)
    return names


def _lineage(model: nn.Module) -> list[str]:
    return [c.__name__ for c in type(model).__mro__]


def is_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` (a transformers one) shifts its ``labels`` as a causal LM does (see [Note: what the engine
    assumes of a model's loss])."""
    causal = _class_names("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
    return any(name in causal or name.endswith("ForCausalLM") for name in _lineage(unwrapped(model)))


def attention_is_causal(model: nn.Module) -> bool:
    """Whether the model's self-attention is causal: its attention modules' ``is_causal`` (what transformers' sdpa
    and the model's own mask read); a model none of whose modules says is taken as causal if it is a causal LM or
    its config says ``is_decoder``, else as bidirectional."""
    model = unwrapped(model)
    flags = {m.is_causal for m in model.modules() if isinstance(getattr(m, "is_causal", None), bool)}
    if len(flags) == 1:
        return flags.pop()
    config = getattr(model, "config", None)
    if getattr(config, "is_causal", None) is False:
        return False
    return bool(flags) or is_causal_lm(model) or bool(getattr(config, "is_decoder", False))


def _mixes_sequence(module: nn.Module) -> bool:
    return isinstance(module, nn.Conv1d) or bool(_SEQUENCE_MIXERS.search(type(module).__name__))


def refuse_unservable(model: nn.Module) -> None:
    """A transformers model whose sequence the engine cannot split, refused by name at initialize (see [Note: what
    the engine assumes of a model's loss])."""
    model = unwrapped(model)
    config = getattr(model, "config", None)
    name = type(model).__name__
    if config is None or not hasattr(config, "_attn_implementation"):
        return
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError(
            f"{name} is an encoder-decoder model: its two sequences (of different lengths) are split by "
            "shardtrain.sequence_parallel.Seq2SeqSplitter (make_splitter picks it), not by the one-sequence splitter"
        )
    refuse_unservable_common(model)
    flags = {m.is_causal for m in model.modules() if isinstance(getattr(m, "is_causal", None), bool)}
    if len(flags) > 1:
        raise ConfigError(
            f"{name} mixes causal and bidirectional attention (cross-attention or a decoder over an encoder): "
            "sequence parallelism builds one kind of self-attention per model; not built yet"
        )
    try:
        takes_positions = "position_ids" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # no signature to read: the model's own business
        takes_positions = True
    if not takes_positions:
        raise ConfigError(
            f"{name}'s forward takes no position_ids: it numbers the tokens it is given from 0 (its position "
            "embeddings come from the input's length), and under sequence parallelism each rank is given a slice, so "
            "every slice after the first would get the first slice's positions. Not built: train it without "
            "sequence_parallel_size"
        )


def refuse_unservable_common(model: nn.Module) -> None:
    """What no splitter serves, one sequence or two: inputs that are not tokens (audio, video), heads that pool the
    sequence, sequence mixing outside attention, token dropout (see [Note: what the engine assumes of a model's
    loss])."""
    name = type(model).__name__
    main_input = getattr(model, "main_input_name", "input_ids")
    if main_input in _NOT_TOKENS:
        raise ConfigError(
            f"{name} takes {main_input}: its sequence (video or audio frames) is made inside the model, so the "
            f"engine cannot split it on the inputs (dimension 1 of {main_input} is frames, channels or features, not "
            "tokens); sequence parallelism is built for vision transformers on images, not for video or audio "
            "models yet"
        )
    pooled = set().union(*(_class_names(m) for m in _POOLED_MAPPINGS))
    if any(n in pooled or n.endswith(_POOLED_SUFFIXES) for n in _lineage(model)):
        raise ConfigError(
            f"{name}'s head reads one pooled token or compares positions across the whole sequence; under sequence "
            "parallelism each rank holds a slice of it, so its output and loss would be a slice's, not the "
            "sequence's. Not built: sequence parallelism serves per-token heads (causal LM, masked LM, token "
            "classification)"
        )
    mixers = sorted(
        {
            type(m).__name__
            for m in model.modules()
            if isinstance(m, nn.Conv1d) or _SEQUENCE_MIXERS.search(type(m).__name__)
        }
    )
    if mixers:
        raise ConfigError(
            f"{name} mixes its sequence outside attention ({', '.join(mixers[:4])}: a state-space, recurrent, linear-"
            "attention or convolution layer): Ulysses gives each rank the whole sequence inside attention only, so "
            "such a layer would run on this rank's slice alone and carry nothing across the slices. Not built: train "
            "it without sequence_parallel_size"
        )
    indexers = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Indexer")})
    if indexers:
        raise ConfigError(
            f"{name} uses sparse attention with a lightning indexer ({indexers[0]}, DeepSeek sparse attention): inside "
            "its attention module, before the attention function that Ulysses wraps, the indexer scores the tokens "
            "it is given and picks the keys each query attends, from the attention mask of those tokens. Under "
            "sequence parallelism it would be given this rank's slice: it would choose among the slice's tokens only, "
            "from a slice's mask. Not built: train it without sequence_parallel_size"
        )
    if any(getattr(m, "token_dropout", False) is True for m in model.modules()):
        raise ConfigError(
            f"{name} uses token dropout (ESM): its embeddings scale every sequence by the share of mask tokens in it, "
            "which each rank would count in its slice alone. Not built: train it without sequence_parallel_size, or "
            "with token_dropout=False in its config"
        )
