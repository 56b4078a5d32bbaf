"""Every causal LM, masked LM and seq2seq architecture that ``transformers`` registers, built tiny and random, trained
under the engine at world 2 against one process: the cases of ``tests/engine/test_model_sweep.py`` and the table of
docs/models.md.

A *row* is (category, model type): ``decoder-only`` rows come from ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``,
``encoder-only`` from ``MODEL_FOR_MASKED_LM_MAPPING_NAMES``, ``encoder-decoder`` from
``MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES`` (BART is in all three: three rows, three classes). Each row is built
from one tiny config (:data:`TINY`: the tensor-parallel sweep's sizes, ``helpers/tp_arch_cases.py``, plus the names
encoder-decoder configs use; :data:`PER_MODEL` and :data:`PER_ROW`: a config's own keys and its towers' sizes) with
the mapping's class, seeded, in eval mode (no dropout: the two runs compute the same function; Reformer trains in
train mode with its dropouts 0, :data:`AFTER_BUILD`). :data:`LABELS` and :data:`EXTRA_INPUTS`: what a model's loss
needs besides ``labels=input_ids``.

Each row runs in three modes, each a ``shardtrain.initialize`` at world 2 with ZeRO stage 3 (persistence threshold 0:
every parameter is sharded):

* ``zero3``: two data-parallel ranks, each on its half of the global batch;
* ``tp``: ``tensor_parallel.size`` 2 with the model's own plan (the whole batch on both ranks);
* ``sp``: ``sequence_parallel_size`` 2 (Ulysses; ZeRO shards over the two ranks).

The reference is the same training in one process: the loss of a step is the mean of each data-parallel rank's rows'
loss (what data parallelism computes, aux losses included), SGD without clipping (a gradient off by any factor shows
in the parameters), three steps. A float64 run of the same reference calibrates the bounds
(``helpers.tp_arch_cases.arch_mismatches``). Each mode's outcome is one of

* ``match``: losses and every final parameter compared and agreed;
* ``refused``: the engine raised a :class:`~shardtrain.errors.ShardtrainError`, its message is the reason;
* ``failed``: another exception, loud (the message is kept);
* ``mismatch``: trained and disagreed: a failure of the sweep, never a row of the table;
* ``not buildable``: the tiny model does not build or train in one process (a row, not a mode: it says nothing about
  the engine).

Run a batch from the command line (what produced docs/models.md)::

    PYTHONPATH=src:tests python tests/helpers/model_sweep.py run --out /tmp/sweep/part-0.json --start 0 --count 40
    PYTHONPATH=src:tests python tests/helpers/model_sweep.py write --doc docs/models.md /tmp/sweep/part-*.json
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist
from torch import nn

from helpers.tp_arch_cases import TINY, arch_mismatches

VOCAB, SEQ, ROWS, STEPS, LR = TINY["vocab_size"], 8, 2, 3, 0.1
WORLD = 2
MAX_PARAMS = 15_000_000  # sub-configs (vision, audio towers) keep their full sizes: those are not run
MODES = ("zero3", "tp", "sp")
# mode -> (tensor_parallel.size, sequence_parallel_size); the data-parallel size is what the world leaves
MODE_SIZES = {"zero3": (1, 1), "tp": (2, 1), "sp": (1, 2)}
GLOBAL_ROWS = ROWS * WORLD  # one global batch for every mode and world

# The encoder-decoder and older configs name their sizes otherwise; unknown keys are kept as plain attributes.
SWEEP_TINY = dict(
    TINY,
    d_model=48,
    d_ff=96,
    d_kv=8,
    num_layers=2,
    num_decoder_layers=2,
    num_heads=6,
    encoder_layers=2,
    decoder_layers=2,
    encoder_ffn_dim=96,
    decoder_ffn_dim=96,
    encoder_attention_heads=6,
    decoder_attention_heads=6,
    decoder_start_token_id=0,
    n_positions=64,
    max_position_embeddings=64,
)

VISION = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
MLA = {"qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "kv_lora_rank": 16, "q_lora_rank": 16}

# Where one config class names a size otherwise, or checks sizes against each other (None: leave the key out)
PER_MODEL: dict[str, dict] = {
    "gptj": {"rotary_dim": 8},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "falcon": {"head_dim": None},  # a property of the config: hidden / heads
    "longcat_flash": {"qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "kv_lora_rank": 16},
    "youtu": {"qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "kv_lora_rank": 16},
    "mamba2": {"num_heads": 12, "head_dim": 8, "n_groups": 1},  # heads x head_dim = expand x hidden
    "bamba": {"mamba_n_heads": 12, "mamba_d_head": 8, "mamba_n_groups": 1},
    "granitemoehybrid": {"mamba_n_heads": 12, "mamba_d_head": 8, "mamba_n_groups": 1},
    # per-layer inputs (a second embedding over the whole vocabulary) and no layers reading another's cache
    "gemma3n_text": {
        "num_kv_shared_layers": 0,
        "vocab_size_per_layer_input": 96,
        "hidden_size_per_layer_input": 8,
        "laurel_rank": 8,
        "altup_num_inputs": 2,
    },
    "gemma4_text": {"num_kv_shared_layers": 0, "vocab_size_per_layer_input": 96, "hidden_size_per_layer_input": 8},
    # multi-head latent attention at these sizes, and experts in 2 groups of 2 (the default 8 groups leave none)
    **{
        key: {**MLA, "head_dim": None, "n_group": 2, "topk_group": 1}
        for key in ("deepseek_v3", "axk1", "bailing_hybrid")
    },
    "dbrx": {  # its own size names, and sub-configs for attention (which must name its rope_theta) and experts
        "d_model": 48,
        "n_heads": 6,
        "n_layers": 2,
        "max_seq_len": 64,
        "attn_config": {"kv_n_heads": 6, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"hidden_size": 48, "ffn_hidden_size": 96, "moe_num_experts": 4, "moe_top_k": 2},
    },
    # sliding-window layers have twice the key/value heads: 3 (6 there) keeps them within the 6 query heads; a
    # rotated share of the head that is a whole number of pairs
    "mimo_v2_flash": {
        "num_key_value_heads": 3,
        "v_head_dim": 8,
        "rope_parameters": {
            key: {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
            for key in ("full_attention", "sliding_attention")
        },
    },
    "codegen": {"num_attention_heads": 4, "rotary_dim": 4},  # its attention splits heads over 4 fused blocks
    # the default names no rope for its layer type
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},  # no default layer types
    "zamba": {"layers_block_type": ["mamba", "hybrid"], "n_mamba_heads": 2},  # the default pattern needs 6 layers
    "zamba2": {"layers_block_type": ["mamba", "hybrid"], "n_mamba_heads": 12},
    "zaya": {"num_experts_per_tok": 1},  # the only routing it supports
    # sparse attention's indexer (DeepSeek-V3.2's DSA) at these sizes, choosing 4 of the 8 tokens
    **{
        key: {**MLA, "index_head_dim": 16, "index_n_heads": 2, "index_topk": 4, **extra}
        for key, extra in (
            ("deepseek_v32", {"n_group": 2, "topk_group": 1}),
            ("glm_moe_dsa", {}),
            ("dots3_note_text", {"shared_experts_intermediate_size": 48}),
            ("dots3_note", {"shared_experts_intermediate_size": 48}),  # its causal LM takes the text config
        )
    },
    "xlnet": {"max_position_embeddings": None, "d_head": 8},  # no position limit; d_head is not derived
    # its encoder and decoder depths are its own keys (num_hidden_layers and decoder_layers refuse to be set)
    "prophetnet": {
        "num_hidden_layers": None,
        "decoder_layers": None,
        "num_encoder_layers": 2,
        "num_decoder_layers": 2,
        "ngram": 2,
    },
    **{key: {"num_codebooks": 1} for key in ("musicgen", "musicgen_melody")},  # see LABELS
    # local and LSH attention in chunks of 4 tokens, axial positions 2 x 4 = the batch's 8 tokens (which training
    # requires), a fixed hash seed (the same buckets in every run) and no dropout (it trains in train mode)
    "reformer": {
        "attn_layers": ["local", "lsh"],
        "local_attn_chunk_length": 4,
        "lsh_attn_chunk_length": 4,
        "num_buckets": 2,
        "num_hashes": 1,
        "hash_seed": 0,
        "axial_pos_shape": [2, 4],
        "axial_pos_embds_dim": [16, 32],
        "attention_head_size": 8,
        "feed_forward_size": 96,
        "max_position_embeddings": None,
        "hidden_dropout_prob": 0.0,
        "local_attention_probs_dropout_prob": 0.0,
        "lsh_attention_probs_dropout_prob": 0.0,
    },
    # byte-level: a small patcher, local encoder and decoder around the global transformer, and 64 hash buckets
    # for 2 byte-group sizes (the default 500,002 buckets for 6 sizes are 48M parameters)
    "blt": {
        "encoder_hash_byte_group_vocab": 64,
        "encoder_hash_byte_group_size": [3, 4],
        "patcher_config": {**VISION, "vocab_size": 260},
        "encoder_config": {**VISION, "hidden_size_global": 48},
        "decoder_config": {**VISION, "hidden_size_global": 48},
        "global_config": {
            **VISION,
            "hidden_size": 48,
            "num_attention_heads": 6,
            "num_hidden_layers": 2,
            "intermediate_size": 96,
        },
    },
    # Composite configs: the sizes above go to the language model (``text_config``, see ``build``); each tower
    # that the text-only batch does not run is built small, since a sub-config keeps its full size otherwise.
    "gemma3": {
        "text_config": {"model_type": "gemma3_text"},
        "mm_tokens_per_image": 4,
        "vision_config": {"model_type": "siglip_vision_model", **VISION, "image_size": 16, "patch_size": 4},
    },
    "gemma4": {
        "text_config": {"num_kv_shared_layers": 0, "vocab_size_per_layer_input": 96, "hidden_size_per_layer_input": 8},
        "vision_config": {**VISION, "num_key_value_heads": 2, "head_dim": 8, "position_embedding_size": 64},
        "audio_config": {**VISION, "subsampling_conv_channels": [8, 4], "output_proj_dims": 16},
    },
    "gemma4_unified": {
        "text_config": {},
        "vision_config": {"mm_embed_dim": 16, "mm_posemb_size": 16, "output_proj_dims": 48},
        "audio_config": {"audio_embed_dim": 16},
    },
    "phi4_multimodal": {
        "vision_config": {**VISION, "image_size": 28, "patch_size": 14, "crop_size": 28},
        "audio_config": {
            **VISION,
            "num_blocks": 1,
            "ext_pw_out_channel": 16,
            "depthwise_separable_out_channel": 16,
            "nemo_conv_channels": 16,
        },
    },
    "got_ocr2": {
        "text_config": {"model_type": "qwen2"},
        "vision_config": {
            **VISION,
            "output_channels": 16,
            "image_size": 64,
            "patch_size": 16,
            "window_size": 2,
            "global_attn_indexes": [0],
            "mlp_dim": 32,
        },
    },
    "moss_transcribe_diarize": {"text_config": {"model_type": "qwen3"}, "audio_config": VISION},
    "git": {"vision_config": {**VISION, "image_size": 32, "patch_size": 16}},  # 5 image tokens before the text
}

# Keys for one row only: Reformer's causal LM requires a decoder config, its masked LM refuses one
PER_ROW: dict[tuple[str, str], dict] = {("decoder-only", "reformer"): {"is_decoder": True}}

# Registered causal LMs that do not train on a batch of token ids: draft models for speculative decoding, whose
# forward takes the main model's ``inputs_embeds`` and ``shared_kv_states``, ignores ``input_ids`` and has no labels
# (their configs also require every layer to read the main model's key/value cache)
NOT_TRAINABLE = {
    model_type: (
        f"{model_type} is a draft model for speculative decoding: its forward takes the main model's inputs_embeds "
        "and shared_kv_states, ignores input_ids and computes no loss (no labels argument)"
    )
    for model_type in ("gemma4_assistant", "gemma4_unified_assistant")
}

# A package a model's tower needs that this environment lacks: (package, why)
REQUIRES = {
    "gemma3n": (
        "timm",
        "Gemma 3n's vision tower is timm's MobileNetV5 (TimmWrapperModel); neither timm nor the torchvision it "
        "imports is installed beside the pinned local torch wheel",
    ),
}

# What a model needs after it is built and before it runs
AFTER_BUILD = {
    "xmod": lambda model: model.set_default_language(model.config.languages[0]),  # which language's adapters
    # Reformer's reversible layers refuse a backward pass in eval mode; its dropouts are 0 (PER_MODEL), so train
    # mode computes the same function on every run
    "reformer": lambda model: model.train(),
}

# Inputs besides the token ids, for the global batch's rows (seeded): GIT's loss skips the image's tokens, so it
# trains on an image and its caption
EXTRA_INPUTS = {
    "git": lambda: {"pixel_values": torch.randn(GLOBAL_ROWS, 3, 32, 32, generator=torch.Generator().manual_seed(8))},
}

# Labels of another shape than the token ids: MusicGen's decoder reads (rows x codebooks, tokens) and predicts
# (rows, tokens, codebooks), one codebook here
LABELS = {
    "musicgen": lambda ids: ids.unsqueeze(-1),
    "musicgen_melody": lambda ids: ids.unsqueeze(-1),
}

# The default run's slice: one of each family the engine must get right (rows, categories).
DEFAULT_SLICE = (
    ("decoder-only", "llama"),
    ("decoder-only", "gpt2"),
    ("decoder-only", "qwen2"),
    ("decoder-only", "gemma2"),
    ("decoder-only", "gpt_neox"),
    ("decoder-only", "mixtral"),
    ("decoder-only", "gpt_oss"),  # attention sinks, one per head
    ("encoder-only", "bert"),
    ("encoder-decoder", "t5"),
    ("encoder-decoder", "bart"),
)


def mappings() -> dict[str, dict[str, str]]:
    from transformers.models.auto import modeling_auto as auto

    return {
        "decoder-only": dict(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
        "encoder-only": dict(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES),
        "encoder-decoder": dict(auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
    }


def registered_rows() -> list[tuple[str, str]]:
    """Every (category, model type) row, in registry order within each category."""
    return [(category, model_type) for category, names in mappings().items() for model_type in names]


def build(category: str, model_type: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The tiny random model of the row (the same on every call: seeded).

    [Note: a causal LM over a composite config]
    A model type's registered config may be composite (a language model with vision or audio towers) while the
    mapping's class takes only one of its sub-configs (``Qwen3_5ForCausalLM`` takes ``Qwen3_5TextConfig``,
    ``MusicgenForCausalLM`` its decoder's): that sub-config is built from the sizes, as transformers' auto class
    hands such a class ``config.get_text_config()``. A class that takes the composite config gets the sizes as its
    ``text_config`` (its towers as ``PER_MODEL`` sizes them). A row of :data:`NOT_TRAINABLE`, or one whose tower
    needs a package that is not installed (:data:`REQUIRES`), raises its reason: the row is not buildable."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type in NOT_TRAINABLE:
        raise ValueError(NOT_TRAINABLE[model_type])
    if model_type in REQUIRES and importlib.util.find_spec(REQUIRES[model_type][0]) is None:
        raise ImportError(f"{REQUIRES[model_type][0]} is not installed: {REQUIRES[model_type][1]}")
    sizes = {**SWEEP_TINY, **PER_MODEL.get(model_type, {}), **PER_ROW.get((category, model_type), {})}
    sizes = copy.deepcopy(sizes)  # configs may edit nested dicts
    model_class = getattr(transformers, mappings()[category][model_type])
    config_class = getattr(transformers, CONFIG_MAPPING_NAMES[model_type])
    if model_class.config_class in config_class.sub_configs.values():
        config_class = model_class.config_class  # see the note above
    if "text_config" in config_class.sub_configs:
        sizes["text_config"] = {**SWEEP_TINY, **sizes.get("text_config", {})}
    config = config_class(**{k: v for k, v in sizes.items() if v is not None})
    torch.manual_seed(0)
    model = model_class._from_config(config, attn_implementation="eager")
    model = model.to(dtype).eval()
    AFTER_BUILD.get(model_type, lambda m: None)(model)
    return model


def batch(rows: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(7))


def loss_of(
    model, ids: torch.Tensor, model_type: str = "", rows: slice = slice(None), dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The model's own loss on ``labels=ids`` (a causal LM shifts them, a masked LM predicts every token, a seq2seq
    model's decoder reads them shifted right; :data:`LABELS` where a model's labels have another shape). ``rows``:
    which rows of the global batch ``ids`` are, for the inputs of :data:`EXTRA_INPUTS` (in ``dtype``)."""
    labels = LABELS.get(model_type, lambda ids: ids)(ids)
    extra = {k: v[rows].to(dtype) for k, v in EXTRA_INPUTS.get(model_type, dict)().items()}
    return model(input_ids=ids, labels=labels, use_cache=False, **extra).loss


def reference(category: str, model_type: str, dp: int, dtype: torch.dtype) -> dict:
    """One process: each step's loss is the mean over the ``dp`` data-parallel ranks' rows of their loss."""
    model = build(category, model_type, dtype)
    ids = batch(GLOBAL_ROWS)
    parts = [slice(d * len(ids) // dp, (d + 1) * len(ids) // dp) for d in range(dp)]
    init = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = sum(loss_of(model, ids[part], model_type, part, dtype) for part in parts) / dp
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "params": {n: p.detach().float().clone() for n, p in model.named_parameters()},
        "init": init,
    }


def data_parallel_size(mode: str, world: int) -> int:
    tp, sp = MODE_SIZES[mode]
    return world // (tp * sp)


def engine_config(mode: str, world: int = WORLD) -> dict:
    tp, sp = MODE_SIZES[mode]
    return {
        "train_micro_batch_size_per_gpu": GLOBAL_ROWS // data_parallel_size(mode, world),
        "tensor_parallel": {"size": tp},
        "sequence_parallel_size": sp,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "gradient_clipping": 0,  # SGD without clipping, as the reference (DeepSpeed's default would clip at 1.0)
        "collective_timeout_s": 60,
    }


def engine_run(category: str, model_type: str, mode: str, lr: float = LR) -> dict | None:
    """On every rank: the engine's training; rank 0 gets the losses (mean over data-parallel ranks) and the full
    final parameters, other ranks None."""
    import shardtrain

    model = build(category, model_type)
    config = engine_config(mode, dist.get_world_size())
    engine = shardtrain.initialize(model, config=config, optimizer=torch.optim.SGD(model.parameters(), lr=lr))
    topo = engine.topology
    ids = batch(GLOBAL_ROWS)
    rows = slice(topo.dp_rank * len(ids) // topo.dp, (topo.dp_rank + 1) * len(ids) // topo.dp)
    ids = ids[rows]
    losses = []
    for _ in range(STEPS):
        loss = loss_of(engine, ids, model_type, rows)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (topo.dp_rank, topo.sp_rank, topo.tp_rank, losses))
    state = engine.full_state_dict()
    if dist.get_rank() != 0:
        return None
    first = {dp: l for dp, sp, tp, l in per_rank if sp == 0 and tp == 0}  # noqa: E741
    losses = [sum(first[d][s] for d in first) / len(first) for s in range(STEPS)]
    return {"losses": losses, "params": state}


def _message(err: BaseException) -> str:
    return " ".join("".join(traceback.format_exception_only(err)).split())[:600]


def run_rows(
    rows: list[tuple[str, str]], modes: tuple[str, ...] = MODES, engine_lr: float = LR, journal: str | None = None
) -> dict:
    """On each rank of a job (world 2 unless a test says otherwise): ``{"category/model_type": {"build": ...,
    mode: (status, detail)}}`` on rank 0 (other ranks return their partial view).

    Stops early, leaving the remaining rows out, when the ranks no longer agree (a failure on one rank that left the
    other in a collective): the caller runs the rest in a fresh job. ``engine_lr``: the engine's learning rate (the
    reference's is :data:`LR`): a test sets another to see that the comparison catches it. ``journal``: a file rank
    0 appends each finished row to (one JSON line), so that a crash loses no finished row."""
    import datetime
    import os

    if not dist.is_initialized():  # rank 0 trains the references alone meanwhile: minutes for a slow model
        os.environ.setdefault("SHARDTRAIN_DEVICE", "cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=1800))
    out: dict[str, dict] = {}
    rank = dist.get_rank()
    for category, model_type in rows:
        key = f"{category}/{model_type}"
        warnings.simplefilter("ignore")
        started = time.monotonic()
        row: dict = {}
        try:
            with torch.device("meta"):  # counted before any memory is spent on it
                size = sum(p.numel() for p in build(category, model_type).parameters())
            if size > MAX_PARAMS:
                raise ValueError(f"the tiny config still builds {size / 1e6:.0f}M parameters")
            refs = {}
            if rank == 0:
                for dp in sorted({data_parallel_size(m, dist.get_world_size()) for m in modes}):
                    refs[dp] = reference(category, model_type, dp, torch.float32)
                    try:
                        exact = reference(category, model_type, dp, torch.float64)
                    except Exception:  # some kernels have no float64: the fp32 bounds alone
                        exact = refs[dp]
                    refs[dp]["exact"] = exact
            row["build"] = ("ok", f"{size / 1e6:.2f}M parameters")
        except Exception as err:  # the tiny config, not the engine
            row["build"] = ("not buildable", _message(err))
        # only rank 0 trains the reference: every rank takes the first failure, or none enters the engine
        builds = [None] * dist.get_world_size()
        dist.all_gather_object(builds, row["build"])
        row["build"] = next((b for b in builds if b[0] != "ok"), builds[0])
        if row["build"][0] == "ok":
            for mode in modes:
                row[mode] = _run_mode(category, model_type, mode, refs, engine_lr)
        row["seconds"] = round(time.monotonic() - started, 1)
        try:  # the ranks still agree: the next row may run in this job
            views = [None] * dist.get_world_size()
            trained = ("match", "mismatch", "ran")  # rank 0 compares, the others only train
            outcome = {m: "trained" if v[0] in trained else v[0] for m, v in row.items() if isinstance(v, tuple)}
            dist.all_gather_object(views, outcome)
        except Exception as err:
            row.setdefault("note", f"the ranks stopped agreeing after this row: {_message(err)}")
            out[key] = row
            break
        if any(v != views[0] for v in views):
            row["note"] = f"the ranks saw different outcomes: {views}"
        out[key] = row
        if rank == 0:  # progress, for the long runs
            statuses = {m: v[0] for m, v in row.items() if isinstance(v, tuple)}
            print(f"model_sweep: {key} {statuses} {row['seconds']} s", file=sys.stderr, flush=True)
            if journal is not None:
                with open(journal, "a") as f:
                    f.write(json.dumps([key, row], default=str) + "\n")
    return out


def _run_mode(category: str, model_type: str, mode: str, refs: dict, lr: float) -> tuple[str, object]:
    from shardtrain.errors import ShardtrainError

    try:
        got = engine_run(category, model_type, mode, lr)
    except ShardtrainError as err:
        return ("refused", f"{type(err).__name__}: {str(err)[:600]}")
    except Exception as err:
        return ("failed", _message(err))
    if got is None:  # not rank 0: rank 0 compares
        return ("ran", None)
    ref = refs[data_parallel_size(mode, dist.get_world_size())]
    names = list(ref["params"])
    missing = [n for n in names if n not in got["params"]]
    if missing:
        return ("mismatch", [f"{n}: not in the engine's full state dict" for n in missing[:5]])
    result = {
        "losses": got["losses"],
        "ref_losses": ref["losses"],
        "exact_losses": ref["exact"]["losses"],
        "params": {n: got["params"][n].float() for n in names},
        "ref_params": ref["params"],
        "exact_params": ref["exact"]["params"],
        "init": ref["init"],
    }
    problems = arch_mismatches(result)
    return ("mismatch", problems) if problems else ("match", None)


# -- the command line: batches in fresh jobs, then the table


def run_batch(rows: list[tuple[str, str]], modes: tuple[str, ...] = MODES, timeout: float = 3600) -> dict:
    """Every row, in as many world-2 jobs as it takes. A job stops at the first row the ranks disagree on; a job
    that crashes (a rank killed) is charged to the row it was running: the first one its journal (rank 0 writes
    each finished row there) does not list."""
    import tempfile

    from shardtrain.testing import DistributedFailure, run_distributed

    out: dict[str, dict] = {}
    todo = list(rows)
    while todo:
        with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as journal:
            try:
                args = (run_rows, WORLD, todo, modes, LR, journal.name)
                got = run_distributed(*args, timeout=timeout, init_process_group=False)[0]
            except DistributedFailure as err:
                got = {}
                for line in journal.read().splitlines():
                    key, row = json.loads(line)
                    got[key] = row
                category, model_type = next(r for r in todo if f"{r[0]}/{r[1]}" not in got)
                crash = " ".join(str(err).split())[-300:]
                got[f"{category}/{model_type}"] = {"build": ("ok", ""), "note": f"the job crashed: {crash}"}
                for mode in modes:
                    got[f"{category}/{model_type}"][mode] = ("failed", f"a rank crashed running this row: {crash}")
        out.update(got)
        todo = [r for r in todo if f"{r[0]}/{r[1]}" not in out]
    return out


def main(argv: list[str]) -> None:
    import argparse
    import glob

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("--out", required=True)
    run.add_argument("--start", type=int, default=0)
    run.add_argument("--count", type=int, default=10_000)
    run.add_argument("--modes", default=",".join(MODES))
    run.add_argument("--rows", help="category/model_type,... (instead of --start and --count)")
    write = sub.add_parser("write", help="put the measured rows (batch files, journals) into docs/models.md's table")
    write.add_argument("--doc", required=True)
    write.add_argument(
        "--over-table", action="store_true", help="keep the doc's other rows as its table has them (a partial re-run)"
    )
    write.add_argument("parts", nargs="+")
    args = parser.parse_args(argv)
    if args.command == "run":
        rows = registered_rows()[args.start : args.start + args.count]
        if args.rows:
            rows = [tuple(row.split("/", 1)) for row in args.rows.split(",")]
        started = time.monotonic()
        out = run_batch(rows, tuple(args.modes.split(",")))
        with open(args.out, "w") as f:
            json.dump({"seconds": round(time.monotonic() - started), "rows": out}, f, indent=1, default=str)
    else:
        rows: dict = read_table(args.doc) if args.over_table else {}
        for pattern in args.parts:
            for path in sorted(glob.glob(pattern)):
                with open(path) as f:
                    if path.endswith(".jsonl"):  # a journal of a batch still running: its finished rows
                        merge_rows(rows, dict(json.loads(line) for line in f if line.strip()))
                    else:
                        merge_rows(rows, json.load(f)["rows"])
        write_doc(args.doc, rows)


def merge_rows(rows: dict, new: dict) -> None:
    """``new``'s rows into ``rows``: a row re-run in some modes (``run --modes tp``) keeps its other modes' outcomes;
    a row that does not build any more, or builds again, is replaced whole."""
    for key, row in new.items():
        old = rows.get(key)
        same_build = old is not None and old["build"][0] == row["build"][0] == "ok"
        rows[key] = {**old, **row} if same_build else row


BEGIN, END = "<!-- sweep table: begin -->", "<!-- sweep table: end -->"


def write_doc(path: str, measured: dict) -> None:
    """Replace what lies between :data:`BEGIN` and :data:`END` in ``path`` with the counts and the table."""
    with open(path) as f:
        text = f.read()
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    with open(path, "w") as f:
        f.write(head + BEGIN + "\n" + render_counts(measured) + "\n" + render_table(measured) + END + tail)


def read_table(path: str) -> dict:
    """The rows of ``path``'s table as :func:`write_doc` takes them (details as the cells hold them, already cut to
    a cell's length): what a partial re-run is written over, so that ``write_doc(path, read_table(path))`` leaves the
    file as it is."""
    with open(path) as f:
        table = f.read().split(BEGIN)[1].split(END)[0]
    measured: dict = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or cells[0] in ("category", "---") or cells[2] == "not yet measured":
            continue
        category, model_type, *modes = cells
        if modes[0].startswith("not buildable: "):
            measured[f"{category}/{model_type}"] = {
                "build": ("not buildable", modes[0].removeprefix("not buildable: "))
            }
            continue
        row: dict = {"build": ("ok", "")}
        for mode, cell in zip(MODES, modes):
            if cell != "not run":
                status, _, detail = cell.partition(": ")
                row[mode] = (status, detail)
        measured[f"{category}/{model_type}"] = row
    return measured


def counts(measured: dict) -> dict[str, dict[str, dict[str, int]]]:
    """category -> mode -> outcome -> rows (``not buildable`` and ``not yet measured`` counted in every mode)."""
    out: dict = {}
    for category, model_type in registered_rows():
        row = measured.get(f"{category}/{model_type}")
        for mode in MODES:
            if row is None:
                what = "not yet measured"
            elif row["build"][0] != "ok":
                what = "not buildable"
            else:
                what = row.get(mode, ("not run",))[0]
            per = out.setdefault(category, {}).setdefault(mode, {})
            per[what] = per.get(what, 0) + 1
    return out


def render_counts(measured: dict) -> str:
    lines = ["| category | rows | mode | match | refused | failed | mismatch | not buildable | not yet measured |"]
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for category, modes in counts(measured).items():
        for mode, per in modes.items():
            cells = [per.get(k, 0) for k in ("match", "refused", "failed", "mismatch", "not buildable")]
            cells.append(per.get("not yet measured", 0))
            lines.append(f"| {category} | {sum(per.values())} | {mode} | " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines) + "\n"


def render_table(measured: dict) -> str:
    """The rows of docs/models.md's table, one per registered row: measured or marked not measured."""
    lines = ["| category | model type | zero3 | tp | sp |", "|---|---|---|---|---|"]
    for category, model_type in registered_rows():
        row = measured.get(f"{category}/{model_type}")
        if row is None:
            cells = ["not yet measured"] * 3
        elif row["build"][0] != "ok":
            cells = [f"not buildable: {_cell(row['build'][1])}", "", ""]
        else:
            cells = [_outcome(row.get(mode)) for mode in MODES]
        lines.append(f"| {category} | {model_type} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _outcome(value) -> str:
    if value is None:
        return "not run"
    status, detail = value
    if status == "match":
        return "match"
    if status == "mismatch":
        return "**MISMATCH**: " + _cell("; ".join(detail)[:200])
    return f"{status}: {_cell(str(detail))}"


def _cell(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split()).replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


if __name__ == "__main__":
    main(sys.argv[1:])
