"""transformers models under tensor parallelism through the engine: the parity-harness recipes of
``tests/tensor_parallel/test_tp_experts.py``, ``test_tp_latent_attention.py`` and ``test_tp_encoder_decoder.py``.

Each recipe is one of ``tp_arch_cases``' tiny transformers models (4 experts, top-2, 6 heads, every size divisible
by 2 and 3), or a :data:`VARIANTS` model at the same sizes, with its own plan (or the one shardtrain ships for it),
trained by the engine at a ZeRO stage with ``tensor_parallel.size`` tp, against one process on the same global
batches (``shardtrain.testing.parity``: each step's loss and global gradient norm, the final parameters). SGD
without clipping: a wrongly scaled gradient (a missing or doubled sum over the tensor-parallel ranks) moves its
parameters visibly.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from shardtrain.testing import parity

from helpers.tp_arch_cases import BATCH, SEQ, TINY, VOCAB, build

STEPS = 3


# Multi-head latent attention at the tiny sizes (its defaults are DeepSeek's full ones); q_lora_rank None: the
# query through one q_proj instead of q_a_proj -> q_a_layernorm -> q_b_proj
MLA = {"qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "kv_lora_rank": 16, "q_lora_rank": 16}
# The encoder-decoder models' names for the same sizes
SEQ2SEQ = {
    "d_model": 48,
    "d_kv": 8,
    "d_ff": 96,
    "num_layers": 2,
    "num_decoder_layers": 2,
    "num_heads": 6,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_ffn_dim": 96,
    "decoder_ffn_dim": 96,
    "encoder_attention_heads": 6,
    "decoder_attention_heads": 6,
    "decoder_start_token_id": 0,
}
# name -> (model type, sizes over TINY, the auto mapping of its class)
VARIANTS = {
    "deepseek_v2_q_proj": ("deepseek_v2", {**MLA, "q_lora_rank": None}, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    "deepseek_v2": ("deepseek_v2", MLA, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    "t5": ("t5", SEQ2SEQ, "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    "t5_gated": ("t5", {**SEQ2SEQ, "feed_forward_proj": "gated-gelu"}, "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    "bart": ("bart", SEQ2SEQ, "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
}


def make_model(model_type: str, experts: str | None = None) -> torch.nn.Module:
    """``tp_arch_cases.build``'s model (seeded, eval mode, eager attention); a :data:`VARIANTS` name builds its model
    type with those sizes. ``experts``: transformers' experts implementation (the default, grouped matmul, has no
    float64 kernel; ``"eager"`` computes the same function in any dtype)."""
    model = _make_model(model_type)
    if experts is not None:
        model.set_experts_implementation(experts)
    return model


def _make_model(model_type: str) -> torch.nn.Module:
    if model_type not in VARIANTS:
        return build(model_type)
    import transformers
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    real, sizes, mapping = VARIANTS[model_type]
    config = getattr(transformers, CONFIG_MAPPING_NAMES[real])(**{**TINY, **sizes})
    torch.manual_seed(0)
    cls = getattr(transformers, getattr(modeling_auto, mapping)[real])
    return cls._from_config(config, attn_implementation="eager").eval()


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def batches(rows: int) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randint(3, VOCAB, (rows, SEQ), generator=g),) for _ in range(STEPS)]


def loss(model, batch: tuple[torch.Tensor]) -> torch.Tensor:
    (ids,) = batch
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def recipe(model_type: str, stage: int, tp: int, dp: int = 1) -> parity.Recipe:
    return parity.Recipe(
        make_model=functools.partial(make_model, model_type),
        make_optimizer=make_optimizer,
        batches=functools.partial(batches, BATCH * dp),
        loss=loss,
        config={"zero_optimization": {"stage": stage}, "tensor_parallel": {"size": tp}, "collective_timeout_s": 60},
    )


def run_recipes(recipes: list[parity.Recipe]) -> list[dict]:
    """On every rank of one job: :func:`shardtrain.testing.parity.engine_run` of each recipe in turn."""
    return [parity.engine_run(r) for r in recipes]


# What the default run trains, per world size, in one job each: (model, ZeRO stage, tp)
LAYOUTS = {
    2: [
        ("mixtral", 3, 2),
        ("qwen3_moe", 1, 2),
        ("qwen2_moe", 2, 2),
        ("deepseek_v2", 3, 2),
        ("deepseek_v2_q_proj", 1, 2),
        ("t5", 3, 2),
        ("bart", 1, 2),
    ],
    3: [("mixtral", 3, 3), ("qwen2_moe", 0, 3), ("deepseek_v2", 2, 3), ("t5_gated", 2, 3), ("bart", 0, 3)],
}


def reference(model_type: str, dp: int = 1) -> dict:
    """The one-process run of the recipe; its float64 run (the bounds' calibration) with eager experts."""
    ref = parity.reference_run(recipe(model_type, 0, 1, dp), exact=False)
    eager = functools.partial(make_model, model_type, "eager")
    exact = dataclasses.replace(recipe(model_type, 0, 1, dp), make_model=eager)
    ref["exact"] = parity.reference_run(exact)["exact"]
    return ref


def outcomes(world: int, dp: int = 1, layouts: tuple | None = None) -> dict[tuple[str, int, int], str | None]:
    """(model, stage, tp) -> None when it matched one process (losses, gradient norms, final parameters), else what
    differed. ``layouts``: :data:`LAYOUTS` of ``world`` unless given. One job per distinct call, however spelled."""
    return _outcomes(world, dp, layouts or tuple(LAYOUTS[world]))


@functools.cache
def _outcomes(world: int, dp: int, layouts: tuple) -> dict[tuple[str, int, int], str | None]:
    from shardtrain.testing import run_distributed

    recipes = [recipe(m, stage, tp, dp) for m, stage, tp in layouts]
    results = run_distributed(run_recipes, world, recipes, timeout=300)
    out = {}
    for i, layout in enumerate(layouts):
        ref = reference(layout[0], dp)
        try:
            parity.assert_parity([r[i] for r in results], ref)
            out[layout] = None
        except AssertionError as err:
            out[layout] = str(err)
    return out
