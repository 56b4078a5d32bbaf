"""Pipeline parallelism with the sequence split in each stage, Ulysses (pp 2 x sp 2) and the ring (pp 2 x cp 2), world
4, against one process on the same global batch: each step's loss and gradient norm and the final parameters
(tolerances of [Note: parity bounds]) of a tiny Hugging Face Llama, causal and with packed documents (position ids
restarting), at ZeRO 1 and 3; the stages exchange each rank's share of the sequence ([Note: a sequence split in a
pipeline] in engine/pipeline_sequence.py); packed documents at pp 2 alone; what is not built is refused by name."""

from __future__ import annotations

import itertools

import pytest
import torch

import shardtrain
from shardtrain.errors import ConfigError
from shardtrain.testing import run_distributed
from shardtrain.testing.parity import assert_parity, train_one_process

from helpers.pipeline import CLIP, GAS, MICRO, SEQ, STEPS, VOCAB, make_model, make_optimizer


def _documents(rows: int, g: torch.Generator) -> torch.Tensor:
    """Position ids restarting at each document: 2 or 3 documents per row, cut at random places."""
    out = []
    for _ in range(rows):
        cuts = sorted(torch.randperm(SEQ - 1, generator=g)[: 1 + int(torch.randint(2, (1,), generator=g))] + 1)
        starts = [0, *[int(c) for c in cuts], SEQ]
        out.append(torch.cat([torch.arange(b - a) for a, b in itertools.pairwise(starts)]))
    return torch.stack(out)


def global_batches(dp: int, packed: bool) -> list[dict[str, torch.Tensor]]:
    """Every micro-step's global rows: labels the tokens with a fifth dropped (-100: the sequence ranks hold
    different numbers of real targets); packed: position ids restarting per document."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(STEPS * GAS):
        x = torch.randint(0, VOCAB, (MICRO * dp, SEQ), generator=g)
        batch = {"input_ids": x, "labels": torch.where(torch.rand(x.shape, generator=g) < 0.8, x, -100)}
        if packed:
            batch["position_ids"] = _documents(x.shape[0], g)
        out.append(batch)
    return out


def rows_of(batch: dict[str, torch.Tensor], dp_rank: int) -> dict[str, torch.Tensor]:
    return {k: v[dp_rank * MICRO : (dp_rank + 1) * MICRO] for k, v in batch.items()}


def reference(packed: bool, dp: int = 1) -> dict:
    batches = global_batches(dp, packed)

    def loss(model: torch.nn.Module, i: int) -> torch.Tensor:
        # each data-parallel rank's mean over its real targets, averaged as the engine averages gradients; without a
        # key/value cache transformers keeps packed documents apart, as a pipeline's stages do
        return sum(model(**rows_of(batches[i], d), use_cache=False).loss for d in range(dp)) / dp

    def run(dtype: torch.dtype) -> dict:
        model = make_model("llama").to(dtype)
        return train_one_process(model, make_optimizer(model), loss, STEPS, GAS, CLIP)

    ref = run(torch.float32)
    ref["exact"] = run(torch.float64)["params"]
    return ref


def config(sp: int, cp: int, stage: int, schedule: str = "1F1B") -> dict:
    return {
        "pipeline_parallel_size": 2,
        "sequence_parallel_size": sp,
        "context_parallel_size": cp,
        "pipeline": {"schedule": schedule},
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def split_run(sp: int, cp: int, stage: int, schedule: str, packed: bool, dp: int, extra: dict) -> dict:
    model = make_model("llama")
    engine = shardtrain.initialize(model, {**config(sp, cp, stage, schedule), **extra}, optimizer=make_optimizer(model))
    t = engine.topology
    assert (t.pp, t.sp, t.cp, t.dp, t.world_size) == (2, sp, cp, dp, 2 * sp * cp * dp)
    # the hidden states every kept layer is given: this rank's share of the sequence
    seen: set[tuple[int, ...]] = set()
    for layer in engine.module.model.layers.values():
        layer.register_forward_pre_hook(lambda _, args: seen.add(tuple(args[0].shape)))
    # every rank of a stage's sequence group: the same whole rows, its data-parallel rank's
    batches = [rows_of(b, t.dp_rank) for b in global_batches(dp, packed)]
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(float(engine.train_batch(iter(batches[step * GAS : (step + 1) * GAS]))))
        norms.append(engine.get_global_grad_norm())
    # evaluation builds a schedule of its own, its shapes given as training's are
    evaluated = float(engine.eval_batch(iter(batches[:GAS])))
    out = {"losses": losses, "norms": norms, "params": engine.full_state_dict(), "seen": seen, "eval": evaluated}
    out["grid"] = (engine.grid.dp_group, engine.grid.pp_group)  # DeepSpeed's rank lists
    engine.close()
    return out


def check(
    sp: int, cp: int, stage: int, packed: bool, schedule: str = "1F1B", dp: int = 1, extra: dict | None = None
) -> None:
    results = run_distributed(split_run, 2 * sp * cp * dp, sp, cp, stage, schedule, packed, dp, extra or {})
    assert_parity(results, reference(packed, dp))
    # eval_batch: the mean loss of the first step's micro-batches under the trained parameters, as one process has it
    model = make_model("llama")
    model.load_state_dict(results[0]["params"])
    with torch.no_grad():
        losses = [
            model(**rows_of(b, d), use_cache=False).loss for b in global_batches(dp, packed)[:GAS] for d in range(dp)
        ]
        expected = float(sum(losses)) / (GAS * dp)
    assert all(abs(r["eval"] - expected) <= 1e-5 * abs(expected) for r in results), [r["eval"] for r in results]
    # DeepSpeed's grid: a rank's data-parallel peers hold its stage and its share of the sequence
    seq, stage_world = sp * cp, sp * cp * dp
    for rank, r in enumerate(results):
        base, place = divmod(rank, stage_world)
        peers = [base * stage_world + d * seq + place % seq for d in range(dp)]
        assert r["grid"] == (peers, [place, stage_world + place]), (rank, r["grid"])
    share = SEQ // (sp * cp)
    assert all(r["seen"] == {(MICRO, share, 32)} for r in results), [r["seen"] for r in results]


@pytest.mark.parametrize(("stage", "packed"), [(1, True), (3, False)])
def test_ulysses_in_each_stage(stage, packed):
    """pp 2 x sp 2: each stage's sp ranks split the sequence (one slice each) and the heads, 1F1B."""
    check(sp=2, cp=1, stage=stage, packed=packed)


@pytest.mark.parametrize(("stage", "packed"), [(3, True), pytest.param(1, False, marks=pytest.mark.soak)])
def test_ring_in_each_stage(stage, packed):
    """pp 2 x cp 2: each stage's cp ranks hold a head and a tail chunk; packed documents stay apart."""
    check(sp=1, cp=2, stage=stage, packed=packed)


@pytest.mark.soak
@pytest.mark.parametrize(("sp", "cp"), [(2, 1), (1, 2)])
def test_gpipe_with_the_sequence_split(sp, cp):
    check(sp=sp, cp=cp, stage=1, packed=True, schedule="GPipe")


@pytest.mark.soak
@pytest.mark.parametrize(("sp", "cp"), [(2, 1), (1, 2)])
def test_with_data_parallel_ranks(sp, cp):
    """pp 2 x dp 2 x (sp 2 or cp 2), world 8: ZeRO 3 shards each stage over its dp x sp (or cp) ranks."""
    check(sp=sp, cp=cp, stage=3, packed=True, dp=2)


@pytest.mark.parametrize(("sp", "cp"), [pytest.param(2, 1, marks=pytest.mark.soak), (1, 2)])
def test_with_activation_checkpointing(sp, cp):
    """Each stage's blocks recomputed in backward, under 1F1B after the next micro-batch's forward: the whole
    sequence's mask (Ulysses) or the ring's split with its documents is an input the checkpoint keeps."""
    check(sp=sp, cp=cp, stage=1, packed=True, extra={"activation_checkpointing": {"policy": "full"}})


def test_packed_documents_without_a_split():
    """pp 2 alone (world 2): every stage is given the micro-batch's position ids, and keeps the documents apart."""
    check(sp=1, cp=1, stage=0, packed=True)


def _refused(model_kind: str, extra: dict) -> str:
    model = make_model(model_kind)
    with pytest.raises(ConfigError) as err:
        shardtrain.initialize(model, {**config(2, 1, 1), **extra}, optimizer=make_optimizer(model))
    return str(err.value)


def test_a_model_whose_stages_cannot_split_the_sequence_is_refused_by_name():
    """The project's GPT (its stages make positions of their own); Ulysses and the ring together, and either with
    tensor parallelism, are refused by the plan (tests/config/test_plan.py)."""
    message = run_distributed(_refused, 4, "gpt", {})[0]
    assert "built for Hugging Face Llama-family causal LMs cut into stages, not GPT" in message, message


def _gpt_given_positions() -> str:
    model = make_model("gpt")
    config = {"pipeline_parallel_size": 2, "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS}
    engine = shardtrain.initialize(model, config, optimizer=make_optimizer(model))
    x = torch.zeros(MICRO, SEQ, dtype=torch.long)
    micro = {"idx": x, "targets": x, "position_ids": torch.arange(SEQ)}
    with pytest.raises(ConfigError) as err:
        engine.train_batch(iter([micro] * GAS))
    engine.close()
    return str(err.value)


def test_position_ids_for_stages_that_take_none_are_refused_by_name():
    message = run_distributed(_gpt_given_positions, 2)[0]
    assert "position_ids in the micro-batches of a pipeline of GPTStage" in message, message
