"""Context parallelism (``context_parallel_size``, docs/context-parallel.md): each sequence in load-balanced chunks
over the cp ranks, keys and values passed around a ring for attention. Parity with one process on the same global
batches (losses every step, gradient norms, final parameters), with causal and packed-document masks, and what is
refused.
"""

from __future__ import annotations

import dataclasses
import itertools
from functools import partial
from types import SimpleNamespace

import pytest
import torch

import shardtrain
from shardtrain.errors import ConfigError, ShardtrainError
from shardtrain.testing import run_distributed
from shardtrain.testing.parity import Recipe, assert_params_near, engine_run, reference_run

from helpers.sp_cases import adamw, keyword_recipe

VOCAB, SEQ, ROWS, STEPS, GAS = 64, 12, 2, 2, 2


def _length(cp: int) -> int:
    """A sequence length that cuts into ``2 * cp`` chunks: 12 for cp 2 and 3, 16 for cp 4."""
    return SEQ if SEQ % (2 * cp) == 0 else 16


def _llama(attn: str = "sdpa") -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query: each key/value head passed around serves two query heads
        max_position_embeddings=16,
        tie_word_embeddings=False,
        attn_implementation=attn,
    )
    return transformers.LlamaForCausalLM(cfg)


def _mixtral(attn: str = "sdpa") -> torch.nn.Module:
    """A mixture of experts whose load-balancing loss (large, so that a per-chunk one would show) is the whole
    sequence's, gathered over the sequence's ranks as under Ulysses."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.5,
        tie_word_embeddings=False,
        sliding_window=None,
        experts_implementation="eager",
        attn_implementation=attn,
    )
    return transformers.MixtralForCausalLM(cfg)


def _mistral(attn: str = "sdpa") -> torch.nn.Module:
    """A sliding window (5) shorter than the sequence (12 or 16) and longer than a chunk (2 or 3 tokens), so that a
    query reads keys of its own and the previous chunks and not all of them."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        sliding_window=5,
        tie_word_embeddings=False,
        attn_implementation=attn,
    )
    return transformers.MistralForCausalLM(cfg)


def _gpt() -> torch.nn.Module:
    from shardtrain.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=16, d_model=32, n_layer=2, n_head=4))


def _gpt_batches(dp: int, length: int = SEQ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, targets aligned with them) of each micro-step, ``ROWS * dp`` rows."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS * GAS):
        x = torch.randint(0, VOCAB, (ROWS * dp, length), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def _gpt_loss(model, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return model(*batch)


def _documents(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Position ids restarting at each document: 2 or 3 documents per row, cut at random places."""
    rows, length = [], x.shape[1]
    for _ in range(x.shape[0]):
        cuts = sorted(torch.randperm(length - 1, generator=g)[: 1 + int(torch.randint(2, (1,), generator=g))] + 1)
        starts = [0, *[int(c) for c in cuts], length]
        rows.append(torch.cat([torch.arange(b - a) for a, b in itertools.pairwise(starts)]))
    return torch.stack(rows)


def _batches(dp: int, packed: bool, length: int = SEQ) -> list[dict[str, torch.Tensor]]:
    """``ROWS * dp`` rows per micro-step; labels the tokens with a fifth dropped (-100); packed: position ids
    restarting per document and no key/value cache (transformers then keeps documents apart)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS * GAS):
        x = torch.randint(0, VOCAB, (ROWS * dp, length), generator=g)
        labels = torch.where(torch.rand(x.shape, generator=g) < 0.8, x, -100)
        batch = {"input_ids": x, "labels": labels}
        if packed:
            batch.update(position_ids=_documents(x, g), use_cache=False)
        out.append(batch)
    return out


def _layout(engine) -> dict:
    """Where this rank sits and what its cp group moved: its ring steps (keys and values), reduce-scatters (their
    gradients) and all-gathers (each forward's real-token counts)."""
    topo, stats = engine.topology, engine._sp.comm.stats()
    experts = engine._expert_comms.get("ep")  # expert parallelism's token exchange, when there is one
    return {
        "axes": (topo.cp, topo.cp_rank, topo.dp, topo.dp_rank, topo.zero_rank, topo.shard_size),
        "moved": {kind: (s["calls"], s["bytes"]) for kind, s in stats.items()},
        "experts": (topo.ep, topo.ep_rank, sum(s["calls"] for s in experts.stats().values()) if experts else 0),
    }


def _check_parity(
    world: int,
    cp: int,
    stage: int,
    packed: bool,
    attn: str = "sdpa",
    sp: int = 1,
    extra: dict | None = None,
    tp: int = 1,
) -> list[dict]:
    """``attn``: the tiny Llama's attention implementation, or "gpt" (the project's GPT, causal only), "mixtral" (a
    mixture of experts with its load-balancing loss), "mistral" (a sliding window); ``sp``:
    Ulysses within each cp rank; ``extra``: more of the engine's config."""
    dp, seq = world // (cp * sp * tp), cp * sp
    config = {"context_parallel_size": cp, "sequence_parallel_size": sp, "zero_optimization": {"stage": stage}}
    config["tensor_parallel"] = {"size": tp}
    config.update(extra or {})
    if attn == "gpt":
        batches = partial(_gpt_batches, dp, _length(cp * sp))
        recipe = Recipe(_gpt, adamw, batches, _gpt_loss, GAS, 1.0, config, per_rank_loss=True)
    else:
        models = {"mixtral": partial(_mixtral, "sdpa"), "mistral": partial(_mistral, "sdpa")}
        make = models.get(attn, partial(_llama, attn))
        recipe = keyword_recipe(make, partial(_batches, dp, packed, _length(cp * sp)), GAS, config)
    results = run_distributed(engine_run, world, recipe, _layout, init_process_group=False)
    ref = reference_run(recipe, dp)
    losses = [sum(r["losses"][s] for r in results[:: seq * tp]) / dp for s in range(STEPS)]
    for s, (got, want) in enumerate(zip(losses, ref["losses"])):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {s}: loss {got} vs one process {want}"
    for r in results:
        for s, (got, want) in enumerate(zip(r["norms"], ref["norms"])):
            assert abs(got - want) <= 1e-4 * want, f"step {s}: gradient norm {got} vs one process {want}"
    assert_params_near(results[0]["params"], ref["params"], ref["init"], exact=ref["exact"], require_moved=True)
    # rank = (dp_rank * cp + cp_rank) * sp + sp_rank; ZeRO shards over all dp * cp * sp ranks
    # ZeRO shards over the dp * cp * sp ranks holding one tensor-parallel block
    axes = [(cp, i // (sp * tp) % cp, dp, i // (seq * tp), i // tp, dp * seq) for i in range(world)]
    assert [r["axes"] for r in results] == axes
    if sp > 1:  # the ring's bytes are in the cp group's communicator, not the sequence group's
        return results
    kv_heads = (4 if attn == "gpt" else 2) // tp  # each tp rank's key/value heads go around its own cp group
    layers, micro_steps, whole = 2, STEPS * GAS, ROWS * kv_heads * _length(cp) * 8 * 4
    # a checkpointed block's forward runs again in backward, its ring steps too
    passes = 2 if (extra or {}).get("activation_checkpointing", {}).get("policy", "none") != "none" else 1
    counts = micro_steps * cp * 3 * 8 * (cp - 1) // cp
    for r in results:
        # [Note: the log-sum-exp merge], at every cp ([Note: which context attention]): per layer and micro-step,
        # each rank's keys and values [rows, kv heads, S / cp, head dim] (fp32) sent cp - 1 times in forward, cp - 1
        # times again in backward, and their gradient cp times; no reduce-scatter
        calls = layers * micro_steps * ((passes + 1) * (cp - 1) + cp)
        assert r["moved"]["ring"] == (calls, calls * 2 * whole // cp), r["moved"]
        assert "reduce_scatter" not in r["moved"], r["moved"]
        if attn != "mixtral":  # which also gathers its router logits over the group for its load-balancing loss
            assert r["moved"]["all_gather"] == (micro_steps, counts), r["moved"]
    return results


@pytest.mark.parametrize(
    ("world", "cp", "stage", "packed", "attn"),
    [(2, 2, 3, False, "sdpa"), (2, 2, 1, True, "sdpa"), (3, 3, 2, True, "sdpa"), (4, 2, 3, True, "sdpa")]
    + [(2, 2, 2, False, "gpt")],
)
def test_parity_with_one_process(world, cp, stage, packed, attn):
    """A tiny Llama at cp 2 and cp 3 (the chunks of a rank far apart), causal and packed documents, ZeRO 1-3; cp 2
    x dp 2 at stage 3 (world 4: ZeRO shards over the four ranks, two of which hold other rows); the project's GPT."""
    _check_parity(world, cp, stage, packed, attn)


@pytest.mark.soak
@pytest.mark.parametrize(
    ("world", "cp", "stage", "packed", "attn"),
    [(3, 3, 0, False, "sdpa"), (2, 2, 2, True, "eager"), (4, 2, 1, False, "sdpa"), (4, 4, 3, True, "sdpa")]
    + [(3, 3, 3, False, "gpt"), (4, 2, 3, False, "sdpa")],
)
def test_parity_more_layouts(world, cp, stage, packed, attn):
    """The last: cp 2 x dp 2 at ZeRO-3 with the causal mask (the default case above has packed documents)."""
    _check_parity(world, cp, stage, packed, attn)


@pytest.mark.soak  # about 27 s here each
@pytest.mark.parametrize("packed", [False, True])
def test_parity_of_a_mixture_of_experts_with_its_load_balancing_loss(packed):
    """Mixtral at cp 2: its load-balancing loss is one process's (router logits of every chunk gathered), with the
    causal mask and with packed documents (the router sees every token whatever its document)."""
    _check_parity(2, 2, 2, packed, "mixtral")


@pytest.mark.parametrize(("world", "cp", "stage"), [(2, 2, 1), pytest.param(3, 3, 3, marks=pytest.mark.soak)])
def test_parity_of_a_sliding_window_with_packed_documents(world, cp, stage):
    """Mistral's window (5) intersected with packed documents: a query reads the keys of its own document within
    the window, across chunk boundaries of other ranks; by the merged ring at cp 2 and cp 3, which computes only the
    blocks the window reaches (its padding-mask case is test_sliding_window_and_encoder_parity
    below)."""
    _check_parity(world, cp, stage, True, "mistral")
    if cp == 2:  # the window matters on these batches (2e-3 at the first loss), so the parity sees it ignored

        def unwindowed() -> torch.nn.Module:
            model = _mistral()
            model.config.sliding_window = None
            return model

        recipe = keyword_recipe(_mistral, partial(_batches, 1, True, _length(cp)), GAS, {})
        with_window = reference_run(recipe, exact=False)["losses"]
        without = reference_run(dataclasses.replace(recipe, make_model=unwindowed), exact=False)["losses"]
        assert abs(with_window[0] - without[0]) > 1e-3, (with_window, without)


@pytest.mark.soak
@pytest.mark.parametrize("stage", [1, 3])
def test_parity_with_activation_checkpointing(stage):
    """Every block recomputed in backward: its attention's ring steps run again, on the same forward's split."""
    _check_parity(2, 2, stage, True, extra={"activation_checkpointing": {"policy": "full"}})


@pytest.mark.parametrize(
    ("attn", "stage", "packed"),
    [("sdpa", 3, True)]
    + [pytest.param(*case, marks=pytest.mark.soak) for case in [("gpt", 1, False), ("sdpa", 2, False)]],
)
def test_parity_with_ulysses_inside_each_cp_rank(attn, stage, packed):
    """sp 2 x cp 2 (world 4): heads over the sp ranks of a cp rank (Ulysses' all-to-all gathers that cp rank's two
    chunks), chunks over cp; the Llama's 2 key/value heads split over sp 2; packed documents and causal."""
    _check_parity(4, 2, stage, packed, attn, sp=2)


def test_the_gqa_split_ulysses_alone_refuses_is_served_by_sp_times_cp():
    """The Llama (4 query heads, 2 key/value heads) over 8 ranks per sequence: Ulysses alone refuses it by name at
    initialize (sp 8 does not divide 4 heads), sp 2 x cp 4 installs (test_world_8_parity[gqa-sp2-cp4] trains it,
    soak)."""
    from shardtrain.sequence_parallel import install_ulysses
    from shardtrain.sequence_parallel.ring import install

    def comm(size: int) -> SimpleNamespace:
        return SimpleNamespace(size=size, rank=0, global_rank=0, ranks=list(range(size)))

    with pytest.raises(ConfigError, match="sequence_parallel_size 8 does not divide the 4 attention heads"):
        install_ulysses(_llama(), comm(8))
    model = _llama()
    install(model, comm(4), lambda: None, sp=comm(2))
    assert model.config._attn_implementation.startswith("shardtrain_context"), model.config._attn_implementation


def _check_recipe(recipe: Recipe, cp: int, stage: int) -> None:
    """A one-data-parallel-rank recipe of another test file run at ``cp`` against one process."""
    config = {**recipe.config, "sequence_parallel_size": 1, "context_parallel_size": cp}
    recipe = dataclasses.replace(recipe, config={**config, "zero_optimization": {"stage": stage}})
    results = run_distributed(engine_run, cp, recipe, init_process_group=False)
    ref = reference_run(recipe)
    for r in results:
        for s in range(STEPS):
            got, want = r["losses"][s], ref["losses"][s]
            assert abs(got - want) <= 1e-5 * abs(want), f"step {s}: loss {got} vs one process {want}"
            got, want = r["norms"][s], ref["norms"][s]
            assert abs(got - want) <= 1e-4 * want, f"step {s}: gradient norm {got} vs one process {want}"
    assert_params_near(results[0]["params"], ref["params"], ref["init"], exact=ref["exact"], require_moved=True)


@pytest.mark.parametrize(
    ("attn", "cp", "stage"),
    [("sdpa", 2, 2), pytest.param("sdpa", 3, 2, marks=pytest.mark.soak)],
)
def test_padded_batch_parity(attn, cp, stage):
    """Padding masks (row 0 right-padded, row 1 left-padded by 3 to 6 tokens, labels -100 there): the left-padded
    row's first queries read no key, and at cp 3 a chunk of it is padding only; no token reads
    padding on any rank."""
    from test_sequence_parallel_padding import recipe

    _check_recipe(recipe(attn, False, 1, 1, stage), cp, stage)


def test_a_left_padded_row_under_eager_attention_is_refused():
    """Eager attention (one process) gives a query that reads no key the mean of every value, SDPA gives 0: the two
    runs of test_padded_batch_parity's batches differ by 5e-3 at the first loss. Context attention computes SDPA's,
    so an eager model's left-padded rows are refused by name; right padding and sdpa are served."""
    from shardtrain.sequence_parallel.ring import refuse_eager_rows_without_keys
    from shardtrain.sequence_parallel.ring_attention import ContextSplit

    real = torch.ones(2, SEQ, dtype=torch.bool)
    real[0, -3:] = False  # right padding: every query reads key 0
    refuse_eager_rows_without_keys(ContextSplit(SEQ, real=real), "eager", "LlamaAttention 0")
    real[1, :2] = False
    with pytest.raises(ConfigError, match=r"LlamaAttention 0: rows \[1\] begin with padding"):
        refuse_eager_rows_without_keys(ContextSplit(SEQ, real=real), "eager", "LlamaAttention 0")
    refuse_eager_rows_without_keys(ContextSplit(SEQ, real=real), "sdpa", "LlamaAttention 0")
    refuse_eager_rows_without_keys(ContextSplit(SEQ, real=real, causal=False), "eager", "BertSelfAttention")


@pytest.mark.parametrize(
    ("case", "cp", "stage"),
    [("mistral_window", 2, 1), ("bert", 2, 3), pytest.param("mistral_window", 3, 3, marks=pytest.mark.soak)]
    + [pytest.param("bert", 3, 2, marks=pytest.mark.soak)],
)
def test_sliding_window_and_encoder_parity(case, cp, stage):
    """A Mistral whose window (5) is shorter than the sequence (12) and longer than a chunk, and a BERT masked LM
    (bidirectional: every query reads every key, of both chunks of every rank), with padded rows from the second
    micro-step on."""
    from test_sequence_parallel_models import _recipe

    _check_recipe(_recipe(case), cp, stage)


def test_the_window_changes_the_training():
    """The Mistral above trains differently without its window, so the parity above sees a window ignored."""
    from test_sequence_parallel_models import _recipe

    windowed = _recipe("mistral_window")

    def unwindowed():
        model = windowed.make_model()
        model.config.sliding_window = None
        return model

    with_window = reference_run(windowed, exact=False)["losses"]
    without = reference_run(dataclasses.replace(windowed, make_model=unwindowed), exact=False)["losses"]
    assert abs(with_window[1] - without[1]) > 1e-3, (with_window, without)


@pytest.mark.parametrize(("stage", "packed"), [(1, True), pytest.param(3, False, marks=pytest.mark.soak)])
def test_parity_with_tensor_parallelism(stage, packed):
    """cp 2 x tp 2 (world 4): each tp rank's heads (2 query heads, 1 key/value head of the Llama) attend over its own
    cp group (the ranks of its tp rank), the row-parallel output projection summing the heads as without cp."""
    _check_parity(4, 2, stage, packed, tp=2)


@pytest.mark.soak  # about 60 s here
def test_parity_of_a_mixture_of_experts_with_expert_parallelism():
    """Mixtral at cp 2 x ep 2 (world 4): each rank's tokens (its two chunks) sent to the ranks holding their experts,
    the load-balancing loss the whole sequence's."""
    results = _check_parity(4, 2, 1, False, "mixtral", extra={"expert_parallel_size": 2})
    # experts [0, 2) on zero ranks 0 and 2, [2, 4) on 1 and 3 (zero_rank % ep): a cp pair holds different experts
    assert [r["experts"][:2] for r in results] == [(2, 0), (2, 1), (2, 0), (2, 1)]
    assert all(r["experts"][2] > 0 for r in results)  # tokens were exchanged


def _bf16_run(recipe: Recipe) -> dict:
    run = engine_run(recipe)
    return {**run, "params": {n: v.float() for n, v in run["params"].items()} if run["params"] else None}


def test_bf16_parity():
    """bf16 compute with fp32 masters at cp 2 (packed documents): the keys and values passed around the ring in bf16,
    their gradients passed back with them; at the mixed-precision bar of
    tests/zero/test_mixed_precision.py (and of Ulysses' bf16 test) against one process's bf16 training."""
    config = {"context_parallel_size": 2, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    recipe = keyword_recipe(_llama, partial(_batches, 1, True, _length(2)), GAS, config)
    ref = reference_run(recipe, 1, bf16=True)
    results = run_distributed(_bf16_run, 2, recipe, init_process_group=False)
    for s in range(STEPS):
        assert abs(results[0]["losses"][s] - ref["losses"][s]) <= 1e-3 * ref["losses"][s], s
        assert abs(results[0]["norms"][s] - ref["norms"][s]) <= 2e-2 * ref["norms"][s], s
    init = _llama().state_dict()
    err = sum((results[0]["params"][n] - want).abs().sum().item() for n, want in ref["params"].items())
    moved = sum((want - init[n].to(torch.bfloat16).float()).abs().sum().item() for n, want in ref["params"].items())
    assert 0 < err <= 0.1 * moved, (err, moved)


def test_each_rank_holds_a_head_and_a_tail_chunk():
    from shardtrain.sequence_parallel.ring import positions_of

    assert positions_of(12, 3, 0).tolist() == [0, 1, 10, 11]
    assert positions_of(12, 3, 1).tolist() == [2, 3, 8, 9]
    assert positions_of(12, 3, 2).tolist() == [4, 5, 6, 7]
    every = torch.cat([positions_of(16, 4, r) for r in range(4)])
    assert sorted(every.tolist()) == list(range(16))


def test_documents_are_numbered_from_the_positions():
    """Attention alone, with these documents and every other mask, is checked in test_ring_attention.py."""
    from shardtrain.sequence_parallel.context_inputs import documents_of

    s = 12
    positions = torch.stack([torch.cat([torch.arange(3), torch.arange(s - 3)]), torch.arange(s)])
    positions[1, s // 2 :] = torch.arange(s - s // 2)
    documents = documents_of(positions)
    assert documents[0, :4].tolist() == [0, 0, 0, 1] and documents[1, s // 2] == 1
    assert documents_of(torch.arange(s)[None]) is None  # one document: plain causal attention


def _cp_refusal(world: int, config: dict) -> str:
    from shardtrain.config.plan import resolve_plan
    from shardtrain.config.sections import load_config

    try:
        resolve_plan(load_config({"train_micro_batch_size_per_gpu": 1, **config}), world)
    except ConfigError as err:
        return str(err)
    return "no error"


def test_what_context_parallelism_is_not_built_with_is_refused_by_name():
    cp2 = {"context_parallel_size": 2}
    assert "context_parallel_size 3 does not divide the 4 processes" in _cp_refusal(4, {"context_parallel_size": 3})
    for config, named in [
        (
            {"pipeline_parallel_size": 2, "sequence_parallel_size": 2},
            "both sequence and context parallelism (sequence_parallel_size 2 x context_parallel_size 2)",
        ),
    ]:
        message = _cp_refusal(8, {**cp2, **config})
        assert f"pipeline_parallel_size 2 with {named} is not built yet" in message, message
    assert "the ring attention's collectives do not run in captured graphs" in _cp_refusal(
        2, {**cp2, "graph": {"enabled": True}}
    )
    assert _cp_refusal(8, {**cp2, "zero_optimization": {"stage": 3}}) == "no error"
    assert _cp_refusal(8, {**cp2, "pipeline_parallel_size": 2}) == "no error"  # pp 2 x dp 2 x cp 2
    checkpointed = {**cp2, "pipeline_parallel_size": 2, "activation_checkpointing": {"policy": "full"}}
    assert _cp_refusal(8, checkpointed) == "no error"
    assert _cp_refusal(8, {**cp2, "sequence_parallel_size": 2}) == "no error"  # dp 2 x cp 2 x sp 2
    assert _cp_refusal(8, {**cp2, "tensor_parallel": {"size": 2}}) == "no error"  # dp 2 x cp 2 x tp 2
    assert _cp_refusal(8, {**cp2, "expert_parallel_size": 2}) == "no error"
    # hybrid sharding, hpZ and tiling: test_context_parallel_compositions.py
    assert _cp_refusal(2, {**cp2, "tiled_mlp_compute": True, "tiled_logits_loss": True}) == "no error"
    assert _cp_refusal(8, {**cp2, "zero_optimization": {"stage": 1, "mics_shard_size": 2}}) == "no error"
    assert _cp_refusal(8, {**cp2, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}) == "no error"


def _splitter_refusal(build) -> str:
    from shardtrain.sequence_parallel import ContextSplitter, install_context_attention

    comm = SimpleNamespace(size=2, rank=0, global_rank=0, ranks=[0, 1])
    try:
        model = build()
        splitter = ContextSplitter(model, comm)
        install_context_attention(model, comm, lambda: splitter.current)
    except ShardtrainError as err:
        return str(err)
    return "no error"


def test_models_and_masks_not_served_are_refused_by_name():
    import transformers

    tiny = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=32)
    mistral = transformers.MistralConfig(**tiny, num_key_value_heads=2, sliding_window=4)
    bert = transformers.BertConfig(**tiny)  # attention_probs_dropout_prob 0.1 by default
    assert _splitter_refusal(lambda: transformers.MistralForCausalLM(mistral)) == "no error"  # the window is applied
    assert "BertForMaskedLM has attention_dropout 0.1" in _splitter_refusal(lambda: transformers.BertForMaskedLM(bert))
    bert.attention_probs_dropout_prob = 0.0
    assert _splitter_refusal(lambda: transformers.BertForMaskedLM(bert)) == "no error"  # bidirectional is served
    assert "attention_dropout 0.1" in _splitter_refusal(
        lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny, attention_dropout=0.1))
    )
    assert _splitter_refusal(_llama) == "no error"
    # a 4-D mask and a length that does not cut into 2 x cp chunks: refused at the forward, before any collective
    from shardtrain.sequence_parallel import ContextSplitter

    splitter = ContextSplitter(_llama(), SimpleNamespace(size=2, rank=0, global_rank=0, ranks=[0, 1]))
    splitter._batch_check.done = True
    x = torch.zeros(1, SEQ, dtype=torch.long)
    with pytest.raises(ConfigError, match=r"only a \[batch, seq\] padding mask of the inputs' shape \(1, 12\)"):
        splitter.split((), {"input_ids": x, "attention_mask": torch.ones(1, 1, SEQ, SEQ)})
    with pytest.raises(ConfigError, match="sequence length 10 is not divisible by 2 x context_parallel_size 2"):
        splitter.split((), {"input_ids": x[:, :10]})


def test_a_diverging_rank_is_named_by_its_cp_and_sp_coordinates():
    """The desync check's names follow the mesh: rank = ((dp_rank * cp + cp_rank) * sp + sp_rank) * tp + tp_rank."""
    from shardtrain.distributed.desync import PhaseCheck

    assert PhaseCheck(None, 1, torch.device("cpu"), cp=2).name(3) == "rank 3 (dp 1, cp 1)"
    assert PhaseCheck(None, 1, torch.device("cpu"), sp=2, cp=2).name(5) == "rank 5 (dp 1, cp 0, sp 1)"
    assert PhaseCheck(None, 2, torch.device("cpu"), sp=2).name(5) == "rank 5 (dp 1, sp 0, tp 1)"


def _checkpoint_engine(layout: dict):
    model = _gpt()
    config = {"train_micro_batch_size_per_gpu": ROWS, "zero_optimization": {"stage": 1}, **layout}
    return shardtrain.initialize(model, config=config, optimizer=adamw(model))


def _save_then_train(layout: dict, path: str) -> dict:
    """Train one step at ``layout``, save, train one more: the saved weights, the next step's loss, the weights then."""
    engine, data, out = _checkpoint_engine(layout), _gpt_batches(1), {}
    for step in range(2):
        if step == 1:
            engine.save_checkpoint(path)
            out["saved"] = engine.full_state_dict()
        loss = engine(*data[step])
        engine.backward(loss)
        engine.step()
        out["next_loss"] = loss.item()
    out["after"] = engine.full_state_dict()
    return out


def _load_then_train(layout: dict, path: str) -> dict:
    engine = _checkpoint_engine(layout)
    engine.load_checkpoint(path)
    loaded = engine.full_state_dict()
    loss = engine(*_gpt_batches(1)[1])
    engine.backward(loss)
    engine.step()
    return {"loaded": loaded, "next_loss": loss.item(), "after": engine.full_state_dict()}


def _check_resumes(tmp_path, saved_at: dict, loaded_at: dict) -> None:
    """Saved at one layout of one sequence's ranks, loaded at another: the same weights, the same next step (Adam's
    moments and step count came back), as if training had not stopped. No parameter is split by cp."""
    path, world = str(tmp_path / "ckpt"), lambda layout: max(layout.values(), default=1)
    saved = run_distributed(_save_then_train, world(saved_at), saved_at, path, init_process_group=False)[0]
    loaded = run_distributed(_load_then_train, world(loaded_at), loaded_at, path, init_process_group=False)[0]
    assert loaded["loaded"].keys() == saved["saved"].keys()
    for k, v in saved["saved"].items():
        assert torch.equal(loaded["loaded"][k], v), k
    assert abs(loaded["next_loss"] - saved["next_loss"]) <= 1e-5 * saved["next_loss"]
    assert_params_near(loaded["after"], saved["after"], saved["saved"], require_moved=True)


def test_a_checkpoint_saved_at_cp_2_loads_at_sp_2(tmp_path):
    _check_resumes(tmp_path, {"context_parallel_size": 2}, {"sequence_parallel_size": 2})


@pytest.mark.soak
@pytest.mark.parametrize(
    ("saved_at", "loaded_at"),
    [({"context_parallel_size": 2}, {}), ({"sequence_parallel_size": 2}, {"context_parallel_size": 2})],
)
def test_a_checkpoint_moves_between_sequence_layouts(tmp_path, saved_at, loaded_at):
    _check_resumes(tmp_path, saved_at, loaded_at)
