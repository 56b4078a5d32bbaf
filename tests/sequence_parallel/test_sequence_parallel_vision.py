"""Sequence parallelism for vision transformers ([Note: vision transformers under Ulysses]): the patch sequence is
split after the embeddings (padded to a multiple of the group, the padding hidden from attention) and gathered before
the final norm. Against one process on the same global batch: image classification (a head on the class token),
masked image modelling (a head on every patch), DeiT's two extra tokens; worlds 2 and 3, dp x sp 2 x 2 in soak."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch

import shardtrain
from shardtrain.errors import ShardtrainError
from shardtrain.testing import run_distributed
from shardtrain.testing.parity import Recipe, assert_params_near, build_engine, reference_run, train_rows

from helpers.sp_cases import adamw, keyword_recipe

IMAGE, PATCH, ROWS, STEPS, GAS = 16, 4, 2, 2, 2  # 16 patches + the class token: 17, padded at sp 2 and 3


def _model(case: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    common = dict(
        hidden_size=48, num_hidden_layers=2, num_attention_heads=6, intermediate_size=64, image_size=IMAGE,
        patch_size=PATCH, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation="eager" if case.endswith("eager") else "sdpa",
    )  # fmt: skip
    if case.startswith("vit_mim"):
        model = transformers.ViTForMaskedImageModeling(transformers.ViTConfig(**common, encoder_stride=PATCH))
    elif case.startswith("vit"):
        model = transformers.ViTForImageClassification(transformers.ViTConfig(**common, num_labels=5))
    elif case == "deit":  # a distillation token too: 18 tokens
        model = transformers.DeiTForImageClassification(transformers.DeiTConfig(**common, num_labels=5))
    else:
        raise ValueError(case)
    return model.to(dtype)


def _batches(case: str, dp: int, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS * GAS):
        pixels = torch.randn(ROWS * dp, 3, IMAGE, IMAGE, generator=g).to(dtype)
        if case.startswith("vit_mim"):  # a random half of the patches masked, reconstructed by the head
            masked = torch.rand(ROWS * dp, (IMAGE // PATCH) ** 2, generator=g) < 0.5
            out.append({"pixel_values": pixels, "bool_masked_pos": masked})
        else:
            out.append({"pixel_values": pixels, "labels": torch.randint(0, 5, (ROWS * dp,), generator=g)})
    return out


def _recipe(case: str, sp: int, stage: int, dp: int) -> Recipe:
    """``case`` at ``sequence_parallel_size`` ``sp`` and ZeRO ``stage``, on batches of ``dp`` data-parallel ranks'
    rows (fp32 images: the float64 reference casts them)."""
    config = {"sequence_parallel_size": sp, "zero_optimization": {"stage": stage}}
    return keyword_recipe(partial(_model, case), partial(_batches, case, dp, torch.float32), GAS, config)


def _checkpointed(case: str) -> torch.nn.Module:
    """``case`` under activation checkpointing: the attention runs again in backward, where the padding must stay
    hidden too."""
    model = _model(case)
    model.gradient_checkpointing_enable()
    return model


def _run(recipe: Recipe, case: str, checkpointing: bool, augmented: bool = False) -> dict:
    if checkpointing:  # the engine's model only: the reference does not recompute
        recipe = dataclasses.replace(recipe, make_model=partial(_checkpointed, case))
    engine = build_engine(recipe)
    model = engine.module
    seen: list[int] = []  # the tokens each encoder layer is given: this rank's slice, not the whole sequence
    for m in model.modules():
        if type(m).__name__.endswith("Layer"):
            m.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(args[0].shape[1]), with_kwargs=True)
    sp = engine.topology.sp

    def loss(engine, batch: dict[str, torch.Tensor], i: int) -> torch.Tensor:
        if augmented and i and torch.distributed.get_rank() % sp:  # an augmentation drawn per rank
            batch = {**batch, "pixel_values": batch["pixel_values"] + 1.0}
        return engine(**batch).loss

    run = train_rows(engine, recipe, loss)
    return {**run, "params": engine.full_state_dict(), "tokens": sorted(set(seen))}


def _check_parity(case: str, world: int, sp: int, stage: int, checkpointing: bool = False, augmented=False) -> None:
    dp = world // sp
    recipe = _recipe(case, sp, stage, dp)
    results = run_distributed(_run, world, recipe, case, checkpointing, augmented, init_process_group=False)
    tokens = (IMAGE // PATCH) ** 2 + (2 if case == "deit" else 1)  # the class token, and DeiT's distillation token
    assert all(r["tokens"] == [-(-tokens // sp)] for r in results), [r["tokens"] for r in results]
    ref = reference_run(recipe, dp)
    for r in results:  # every rank of a group computes the whole loss
        for s, (got, want) in enumerate(zip(r["losses"], ref["losses"])):
            if dp == 1:
                assert abs(got - want) <= 1e-5 * abs(want), f"step {s}: loss {got} vs one process {want}"
    losses = [sum(r["losses"][s] for r in results[::sp]) / dp for s in range(STEPS)]
    for s, (got, want) in enumerate(zip(losses, ref["losses"])):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {s}: loss {got} vs one process {want}"
    for r in results:
        for s, (got, want) in enumerate(zip(r["norms"], ref["norms"])):
            assert abs(got - want) <= 1e-4 * want, f"step {s}: gradient norm {got} vs one process {want}"
    assert_params_near(results[0]["params"], ref["params"], ref["init"], exact=ref["exact"], require_moved=True)


@pytest.mark.parametrize(
    ("case", "world", "sp", "stage", "checkpointing"),
    [("vit", 2, 2, 3, False), ("vit_mim", 3, 3, 1, False), ("vit_eager", 3, 3, 3, True)],
)
def test_parity_with_one_process(case, world, sp, stage, checkpointing):
    """The class token's head and every patch's head; 17 tokens padded to 18 at sp 2 and 3; eager attention under
    activation checkpointing (the padding dropped when the attention runs again in backward). From the second
    micro-step on, the ranks other than sp rank 0 are given a differently augmented image: the group trains on sp
    rank 0's, as one process does."""
    _check_parity(case, world, sp, stage, checkpointing, augmented=True)


@pytest.mark.soak
@pytest.mark.parametrize(
    ("case", "world", "sp", "stage"),
    [("deit", 2, 2, 3), ("deit", 3, 3, 0), ("vit", 4, 2, 3), ("vit_mim_eager", 2, 2, 2), ("vit", 3, 3, 2)],
)
def test_parity_more_vision_models(case, world, sp, stage):
    _check_parity(case, world, sp, stage)


def test_vision_models_that_are_not_a_plain_patch_sequence_are_refused_by_name():
    import transformers

    from shardtrain.sequence_parallel import make_splitter

    comm = type("Comm", (), {"size": 2, "rank": 0, "global_rank": 0})()
    resnet = transformers.ResNetConfig(num_labels=3, hidden_sizes=[8, 8], depths=[1, 1], embedding_size=8)
    conv = transformers.ResNetForImageClassification(resnet)
    with pytest.raises(ShardtrainError) as err:
        make_splitter(conv, comm)
    assert "ResNetForImageClassification takes pixel_values" in str(err.value)
    assert "no such modules" in str(err.value) and "without sequence_parallel_size" in str(err.value)
    wav2vec = transformers.Wav2Vec2Config(
        vocab_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16
    )
    audio = transformers.Wav2Vec2ForCTC(wav2vec)
    with pytest.raises(ShardtrainError) as err:
        make_splitter(audio, comm)
    assert "Wav2Vec2ForCTC takes input_values" in str(err.value) and "audio" in str(err.value)
    tiny = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, image_size=8)
    video = transformers.VideoMAEForVideoClassification(transformers.VideoMAEConfig(**tiny, patch_size=4, num_frames=2))
    with pytest.raises(ShardtrainError, match="VideoMAEForVideoClassification is a video model"):
        make_splitter(video, comm)
    dino = transformers.Dinov2Model(transformers.Dinov2Config(**tiny, patch_size=4, drop_path_rate=0.1))
    with pytest.raises(ShardtrainError, match=r"Dinov2Model has drop_path_rate 0\.1"):
        make_splitter(dino, comm)


def _closed_engine_leaves_no_hooks() -> tuple[int, int]:
    model = _model("vit")
    config = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2, "zero_optimization": {"stage": 1}}
    engine = shardtrain.initialize(model, config=config, optimizer=adamw(model))
    embeddings, norm = model.vit.embeddings, model.vit.layernorm
    before = len(embeddings._forward_hooks) + len(norm._forward_pre_hooks)
    engine.close()
    return before, len(embeddings._forward_hooks) + len(norm._forward_pre_hooks)


def test_close_removes_the_patch_split_hooks():
    for before, after in run_distributed(_closed_engine_leaves_no_hooks, 2, init_process_group=False):
        assert before >= 2 and after == 0  # the split and gather hooks, and every other hook the engine made
