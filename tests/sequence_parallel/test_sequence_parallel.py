"""Ulysses sequence parallelism (``sequence_parallel_size``): parity with one process on the same global batch,
and what is refused (docs/sequence-parallel.md).

The labels carry -100 at random places, so the slices of a sequence hold different numbers of real targets: a mean
of the ranks' means (instead of the mean over the whole sequence's real tokens) fails the loss check at once.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

import shardtrain
from shardtrain.errors import ConfigError, RankMismatchError, ShardtrainError
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.sequence_parallel import kv_repeats
from shardtrain.testing import run_distributed
from shardtrain.testing.parity import Recipe, assert_params_near, engine_run, reference_run

VOCAB, SEQ, ROWS, STEPS, GAS = 64, 12, 2, 3, 2


def _model(case: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    if case == "gpt":  # 6 heads: P = 2 and 3 divide them
        model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=48, n_layer=2, n_head=6))
    else:
        import transformers

        cfg = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,  # GQA: split at P = 2, repeated at P = 3 (fewer key/value heads than ranks)
            max_position_embeddings=SEQ,
            tie_word_embeddings=False,
            attn_implementation="eager" if case == "llama_eager" else "sdpa",
        )
        model = transformers.LlamaForCausalLM(cfg)
    return model.to(dtype)


def _batches(dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, labels) of each micro-step, ``ROWS * dp`` rows; a fifth of the labels are -100."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS * GAS):
        x = torch.randint(0, VOCAB, (ROWS * dp, SEQ), generator=g)
        labels = torch.where(torch.rand(x.shape, generator=g) < 0.2, -100, torch.roll(x, -1, dims=1))
        labels[:, :: SEQ // 6] = torch.roll(x, -1, dims=1)[:, :: SEQ // 6]  # a real target in every slice (P <= 6)
        out.append((x, labels))
    return out


def _loss(case: str, model, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if case == "gpt":  # targets aligned with the tokens
        return model(x, labels)
    # transformers shifts the labels itself: pass the tokens' own ids, -100 where the target was dropped
    hf_labels = torch.cat([torch.full_like(x[:, :1], -100), torch.where(labels[:, :-1] == -100, -100, x[:, 1:])], 1)
    return model(input_ids=x, labels=hf_labels).loss


def _optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def _batch_loss(case: str, model, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return _loss(case, model, *batch)


def _recipe(case: str, sp: int, dp: int, stage: int, config: dict | None = None) -> Recipe:
    """``case`` at ``sequence_parallel_size`` ``sp`` and ZeRO ``stage`` on batches of ``dp`` data-parallel ranks' rows:
    AdamW, clipping at 1, the reference's loss the mean of the data-parallel ranks' (their rows hold different
    numbers of real targets)."""
    return Recipe(
        make_model=partial(_model, case),
        make_optimizer=_optimizer,
        batches=partial(_batches, dp),
        loss=partial(_batch_loss, case),
        gas=GAS,
        clip=1.0,
        config={"sequence_parallel_size": sp, "zero_optimization": {"stage": stage}, **(config or {})},
        per_rank_loss=True,
    )


def _inspect(engine) -> dict:
    topo = engine.topology
    stats = engine._sp.comm.stats()["all_to_all"]  # the sequence-parallel group's exchanges
    return {"axes": (topo.dp, topo.dp_rank, topo.sp, topo.sp_rank), "all_to_all": stats}


@pytest.mark.parametrize(
    ("case", "world", "sp", "stage"),
    [("gpt", 2, 2, 0), ("llama", 2, 2, 3), ("llama", 3, 3, 1), ("gpt", 3, 3, 3)],
)
def test_parity_with_one_process(case, world, sp, stage):
    dp = world // sp
    buckets = {"reduce_bucket_size": 2000, "allgather_bucket_size": 2000}
    recipe = _recipe(case, sp, dp, stage, {"zero_optimization": {"stage": stage, **buckets}})
    results = run_distributed(engine_run, world, recipe, _inspect, init_process_group=False)
    assert [r["axes"] for r in results] == [(dp, r // sp, sp, r % sp) for r in range(world)]
    ref = reference_run(recipe, dp)
    for d in range(dp):  # the loss is the whole sequence's: the same on every rank of a group
        group = [r["losses"] for r in results[d * sp : (d + 1) * sp]]
        assert all(g == group[0] for g in group), group
    losses = [sum(r["losses"][s] for r in results[::sp]) / dp for s in range(STEPS)]
    for s, (got, want) in enumerate(zip(losses, ref["losses"])):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {s}: loss {got} vs one process {want}"
    # the all-to-all bytes per rank (docs/sequence-parallel.md): per layer and micro-step, q, k, v and the output
    # each way, each sending (P-1)/P of its [b, heads, S/P, d] input; GQA's key/value heads after their repeat
    heads, kv, head_dim, layers = 6, (6 if case == "gpt" else 2 * kv_repeats(6, 2, sp)), 8, 2
    per_call = [ROWS * n * (SEQ // sp) * head_dim * 4 * (sp - 1) // sp for n in (heads, kv, kv, heads)]
    for r in results:
        assert r["all_to_all"]["calls"] == 8 * layers * STEPS * GAS
        assert r["all_to_all"]["bytes"] == 2 * layers * STEPS * GAS * sum(per_call)
    for r in results:  # the gradient: summed over the sequence-parallel ranks, averaged over the data-parallel ones
        for s, (got, want) in enumerate(zip(r["norms"], ref["norms"])):
            assert abs(got - want) <= 1e-4 * want, f"step {s}: gradient norm {got} vs one process {want}"
    assert_params_near(results[0]["params"], ref["params"], ref["init"], exact=ref["exact"], require_moved=True)


@pytest.mark.parametrize(
    ("case", "world", "sp", "stage"),
    [pytest.param("llama_eager", 2, 2, 1, marks=pytest.mark.soak)]
    + [pytest.param("llama_eager", 3, 3, 3, marks=pytest.mark.soak), ("gpt", 2, 2, 2)],
)
def test_parity_more_cases(case, world, sp, stage):
    """transformers' eager attention (the causal mask made after the exchange; the slower cases, soak), and ZeRO-2."""
    test_parity_with_one_process(case, world, sp, stage)


@pytest.mark.parametrize("case", ["gpt", "llama", "llama_eager"])
def test_attention_is_the_models_own_around_the_exchange(case):
    """Ulysses installed over a group of one (the exchanges are identities, so no process group is needed): any
    difference is the attention itself, its causal mask or the key/value heads the inner function sees."""
    from types import SimpleNamespace

    from shardtrain.sequence_parallel import install_ulysses

    x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(3))
    plain, wrapped = _model(case), _model(case)
    install_ulysses(wrapped, SimpleNamespace(size=1))
    if case == "gpt":
        want, got = plain(x), wrapped(x)
    else:
        want, got = plain(input_ids=x).logits, wrapped(input_ids=x).logits
        assert wrapped.config._attn_implementation.startswith("shardtrain_ulysses")
    assert (got - want).abs().max().item() <= 1e-6


@pytest.mark.soak
def test_parity_data_and_sequence_parallel():
    """(dp 2, sp 2) at world 4: ZeRO-3 shards over all 4 ranks, each pair shares its rows' sequences."""
    test_parity_with_one_process("llama", 4, 2, 3)


def test_key_value_heads_fewer_than_ranks_are_repeated_and_heads_must_divide():
    assert kv_repeats(6, 2, 2) == 1  # split as they are
    assert kv_repeats(6, 2, 3) == 3  # 2 key/value heads for 3 ranks: each repeated to 6
    assert kv_repeats(8, 2, 4) == 2  # the smallest repeat that divides: 4 heads, one per rank
    with pytest.raises(ConfigError, match="does not divide the 6 attention heads"):
        kv_repeats(6, 6, 4)


def _refusals() -> dict[str, str]:
    out = {}

    def attempt(name: str, fn) -> None:
        try:
            fn()
            out[name] = "no error"
        except ShardtrainError as err:
            out[name] = f"{type(err).__name__}: {err}"

    def engine(case: str = "llama", **extra):
        model = _model(case)
        config = {"train_micro_batch_size_per_gpu": ROWS, "sequence_parallel_size": 2, **extra}
        return shardtrain.initialize(model, config=config, optimizer=_optimizer(model))

    attempt("size", lambda: engine(sequence_parallel_size=3))
    attempt("graph", lambda: engine("gpt", graph={"enabled": True}))
    e = engine()
    x = torch.randint(0, VOCAB, (ROWS, SEQ))
    attempt("length", lambda: e(input_ids=x[:, :-1], labels=x[:, :-1]))
    mask = torch.ones_like(x)
    mask[:, -2:] = 0
    attempt("mask shape", lambda: e(input_ids=x, labels=x, attention_mask=mask[:, :-2]))
    g = engine("gpt")  # no transformers mask rules to apply to the whole sequence
    attempt("padding", lambda: g(x, x, attention_mask=mask))
    attempt("num_items_in_batch", lambda: e(input_ids=x, labels=x, num_items_in_batch=5))
    e = engine()
    mine = x + torch.distributed.get_rank()  # a loader sharded over every rank instead of the dp ranks
    attempt("different batches", lambda: e(input_ids=mine % VOCAB, labels=mine % VOCAB))
    return out


def test_what_is_not_built_is_refused_by_name():
    results = run_distributed(_refusals, 2, init_process_group=False)
    for r in results:
        assert "sequence_parallel_size 3 does not divide the 2 processes" in r["size"], r["size"]
        assert r["graph"].startswith(ConfigError.__name__) and "graph.enabled" in r["graph"], r["graph"]
        assert "sequence length 11 is not divisible by sequence_parallel_size 2" in r["length"], r["length"]
        assert "Pad every sequence at the end" in r["length"]
        assert "attention_mask of shape (2, 10) does not cover the 12 tokens" in r["mask shape"], r["mask shape"]
        assert "attention_mask with padding under sequence parallelism is built for transformers" in r["padding"], r[
            "padding"
        ]
        assert "num_items_in_batch" in r["num_items_in_batch"], r["num_items_in_batch"]
        assert r["different batches"].startswith(RankMismatchError.__name__), r["different batches"]
        assert (
            "but sp rank 1 (global rank 1) got inputs different from sp rank 0 (global rank 0)"
            in (r["different batches"])
        ), r["different batches"]
        assert "input kwargs['input_ids'] (torch.int64 [2, 12]) holds different values" in r["different batches"]


def _save_then_train(case: str, sp: int, path: str) -> dict:
    """Train one step, save, train one more: the checkpoint and the loss of the step after it."""
    model = _model(case)
    config = {"train_micro_batch_size_per_gpu": ROWS, "sequence_parallel_size": sp, "zero_optimization": {"stage": 3}}
    engine = shardtrain.initialize(model, config=config, optimizer=_optimizer(model))
    batches, rows = (
        _batches(engine.topology.dp),
        slice(engine.topology.dp_rank * ROWS, (engine.topology.dp_rank + 1) * ROWS),
    )
    losses = []
    for step in range(2):
        if step == 1:
            engine.save_checkpoint(path)
            saved = engine.full_state_dict()
        x, labels = batches[step]
        loss = _loss(case, engine, x[rows], labels[rows])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"saved": saved, "next_loss": losses[1], "after": engine.full_state_dict()}


def _load_then_train(case: str, sp: int, path: str) -> dict:
    model = _model(case)
    config = {"train_micro_batch_size_per_gpu": ROWS, "sequence_parallel_size": sp, "zero_optimization": {"stage": 1}}
    engine = shardtrain.initialize(model, config=config, optimizer=_optimizer(model))
    engine.load_checkpoint(path)
    loaded = engine.full_state_dict()
    x, labels = _batches(1)[1]
    loss = _loss(case, engine, x, labels)
    engine.backward(loss)
    engine.step()
    return {"loaded": loaded, "next_loss": loss.item(), "after": engine.full_state_dict(), "step": engine.global_step}


def test_a_checkpoint_saved_under_sequence_parallelism_loads_without_it(tmp_path):
    """Saved at sp 3 (world 3, ZeRO-3), loaded by one process (ZeRO-1): the same weights, and the next step (Adam's
    moments included) as if training had gone on at sp 3."""
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_save_then_train, 3, "llama", 3, path, init_process_group=False)[0]
    loaded = run_distributed(_load_then_train, 1, "llama", 1, path, init_process_group=False)[0]
    assert loaded["step"] == 2
    for k, v in saved["saved"].items():
        assert torch.equal(loaded["loaded"][k], v), k
    assert abs(loaded["next_loss"] - saved["next_loss"]) <= 1e-5 * saved["next_loss"]
    assert_params_near(loaded["after"], saved["after"], saved["saved"], require_moved=True)


def _bf16_run(recipe: Recipe) -> dict:
    run = engine_run(recipe)
    return {**run, "params": {n: v.float() for n, v in run["params"].items()} if run["params"] else None}


@pytest.mark.parametrize(("case", "sp", "stage"), [("gpt", 2, 2), pytest.param("llama", 3, 3, marks=pytest.mark.soak)])
def test_bf16_parity(case, sp, stage):
    """bf16 compute, fp32 masters, at the mixed-precision bar of tests/zero/test_mixed_precision.py."""
    recipe = _recipe(case, sp, 1, stage, {"bf16": {"enabled": True}})
    ref = reference_run(recipe, bf16=True)  # bf16 compute with fp32 masters, as tests/zero/test_mixed_precision.py's
    results = run_distributed(_bf16_run, sp, recipe, init_process_group=False)
    for s in range(STEPS):
        assert abs(results[0]["losses"][s] - ref["losses"][s]) <= 1e-3 * ref["losses"][s], s
        assert abs(results[0]["norms"][s] - ref["norms"][s]) <= 2e-2 * ref["norms"][s], s
    init = _model(case).state_dict()
    err = sum((results[0]["params"][n] - want).abs().sum().item() for n, want in ref["params"].items())
    moved = sum((want - init[n].to(torch.bfloat16).float()).abs().sum().item() for n, want in ref["params"].items())
    assert err <= 0.1 * moved, (err, moved)
