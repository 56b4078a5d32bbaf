"""Sequence parallelism composed on one mesh: with tensor parallelism, with hybrid sharding, and the mesh's groups.

Parity with one process on the same global batch (docs/sequence-parallel.md). The models hold 12 query heads: at
tensor_parallel.size 2 each tp rank holds 6, which sp 2 and 3 divide. The Llama has 2 key/value heads, one per tp
rank: fewer than the sequence-parallel size, so Ulysses repeats it inside each tp rank ([Note: Ulysses under tensor
parallelism]). The labels carry -100 at random places (the slices hold different numbers of real targets).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist

import shardtrain
from shardtrain.distributed.mesh import make_groups
from shardtrain.errors import ConfigError, LayoutError, ShardtrainError
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.testing import run_distributed
from shardtrain.testing.parity import Recipe, assert_params_near, engine_run, reference_run

VOCAB, SEQ, ROWS, STEPS, GAS = 64, 12, 2, 2, 2
HEADS, KV_HEADS, HEAD_DIM = 12, 2, 4


def model_of(case: str, dtype: torch.dtype = torch.float32, attn: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(0)
    if case == "gpt":
        model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=HEADS * HEAD_DIM, n_layer=2, n_head=HEADS))
    else:
        import transformers

        cfg = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HEADS * HEAD_DIM,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            max_position_embeddings=SEQ,
            tie_word_embeddings=False,
            attn_implementation=attn,
        )
        model = transformers.LlamaForCausalLM(cfg)
    return model.to(dtype)


def plan_of(case: str):
    from shardtrain.tensor_parallel import GPT_TP_PLAN

    return GPT_TP_PLAN if case == "gpt" else None  # Llama: the plan its config carries


def batches(dp: int, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, targets aligned with the tokens) of each micro-step, ``ROWS * dp`` rows; a fifth are -100, and every
    sixth position keeps a real target (so every slice at P <= 6 has one)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS * GAS):
        x = torch.randint(0, VOCAB, (ROWS * dp, SEQ), generator=g)
        y = torch.where(torch.rand(x.shape, generator=g) < 0.2, -100, torch.roll(x, -1, dims=1))
        y[:, ::6] = torch.roll(x, -1, dims=1)[:, ::6]
        out.append((x, y))
    return out


def loss_of(case: str, model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if case == "gpt":
        return model(x, y)
    # transformers shifts its labels: the tokens' own ids, -100 where the target was dropped
    labels = torch.cat([torch.full_like(x[:, :1], -100), torch.where(y[:, :-1] == -100, -100, x[:, 1:])], 1)
    return model(input_ids=x, labels=labels).loss


def optimizer_of(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def batch_loss(case: str, model, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return loss_of(case, model, *batch)


def recipe(case: str, sp: int, tp: int, stage: int, mics: int = -1, dp: int = 1) -> Recipe:
    """``case`` on the (dp, sp, tp) mesh at ZeRO ``stage`` (``mics``: its ``mics_shard_size``): AdamW, clipping at 1,
    the reference's loss the mean of the data-parallel ranks' row losses (their rows hold different numbers of real
    targets)."""
    zero = {"stage": stage, "reduce_bucket_size": 3000, "allgather_bucket_size": 3000}
    if mics != -1:
        zero["mics_shard_size"] = mics
    return Recipe(
        make_model=partial(model_of, case),
        make_optimizer=optimizer_of,
        batches=partial(batches, dp),
        loss=partial(batch_loss, case),
        gas=GAS,
        clip=1.0,
        config={"sequence_parallel_size": sp, "tensor_parallel": {"size": tp}, "zero_optimization": zero},
        tp_plan=plan_of(case),
        per_rank_loss=True,
    )


def mesh_of(engine) -> dict:
    """This rank's coordinates and groups on the mesh, and the bytes its sequence-parallel exchanges sent."""
    topo = engine.topology

    def ranks(group):
        return None if group is None else dist.get_process_group_ranks(group)

    return {
        "coords": (topo.dp_rank, topo.sp_rank, topo.tp_rank, topo.zero_rank, topo.replica_rank, topo.shard_rank),
        "groups": {
            "dp": ranks(topo.groups.dp),
            "sp": ranks(topo.sp_group),
            "tp": ranks(topo.tp_group),
            "shard": ranks(topo.shard_group),
            "replicate": ranks(topo.replicate_group),
        },
        "all_to_all": engine._sp.comm.stats()["all_to_all"]["bytes"],
    }


def check_parity(case: str, sp: int, tp: int, stage: int, mics: int = -1, dp: int = 1) -> list[dict]:
    world = dp * sp * tp
    parity = recipe(case, sp, tp, stage, mics, dp)
    results = run_distributed(engine_run, world, parity, mesh_of, init_process_group=False)
    for rank, r in enumerate(results):  # rank = (dp_rank * sp + sp_rank) * tp + tp_rank
        d, s, t = rank // (sp * tp), (rank // tp) % sp, rank % tp
        assert r["coords"][:4] == (d, s, t, d * sp + s), (rank, r["coords"])
        assert r["groups"]["dp"] == [(other * sp + s) * tp + t for other in range(dp)]
        assert r["groups"]["sp"] == [(d * sp + other) * tp + t for other in range(sp)]
        assert r["groups"]["tp"] == [(d * sp + s) * tp + other for other in range(tp)]
        if mics == -1:  # ZeRO: every dp and sp rank holding this tp block
            assert r["groups"]["shard"] == [i * tp + t for i in range(dp * sp)]
    ref = reference_run(parity, dp)
    for r in results:  # every rank of a (sp, tp) block returns the whole sequences' loss of its rows
        group = [q for q in results if q["coords"][0] == r["coords"][0]]
        assert all(q["losses"] == group[0]["losses"] for q in group)
    for step in range(STEPS):
        got = sum(results[d * sp * tp]["losses"][step] for d in range(dp)) / dp
        want = ref["losses"][step]
        assert abs(got - want) <= 1e-5 * want, f"step {step}: loss {got} vs one process {want}"
        for r in results:  # summed over the sp ranks and the tp blocks, averaged over dp, counted once
            assert abs(r["norms"][step] - ref["norms"][step]) <= 1e-4 * ref["norms"][step], (step, r["norms"])
    assert_params_near(results[0]["params"], ref["params"], ref["init"], exact=ref["exact"], require_moved=True)
    return results


def test_sp_with_tp_llama_gqa_parity():
    """(dp 1, sp 2, tp 2) at world 4, ZeRO-3 over the 2 ranks of each tp block: the Llama's one key/value head per tp
    rank repeated for the 2 sp ranks; the all-to-alls carry the local heads only."""
    results = check_parity("llama", sp=2, tp=2, stage=3)
    # per layer and micro-step, q, k, v and the output each way, each sending (P-1)/P of [rows, heads, S/P, d]:
    # 6 local query heads, the 1 local key/value head repeated to 2
    per_call = [ROWS * n * (SEQ // 2) * HEAD_DIM * 4 // 2 for n in (6, 2, 2, 6)]
    assert all(r["all_to_all"] == 2 * 2 * STEPS * GAS * sum(per_call) for r in results)


@pytest.mark.parametrize(
    ("case", "dp", "sp", "tp", "stage"),
    [("gpt", 1, 2, 2, 0), ("gpt", 1, 2, 2, 2), ("gpt", 1, 3, 2, 3)]
    + [
        pytest.param("llama", 1, 2, 2, 1, marks=pytest.mark.soak),
        pytest.param("llama", 1, 3, 2, 3, marks=pytest.mark.soak),
    ],
)
def test_sp_with_tp_more_cases(case, dp, sp, tp, stage):
    """The GPT's fused q/k/v (stride 3) and vocab-parallel loss; stage 0 (the gradient norm counts the sp ranks'
    whole gradients once); sp 3 x tp 2 at world 6. The GPT's cases are quick; the Llama's, several times slower,
    are soak."""
    check_parity(case, sp=sp, tp=tp, stage=stage, dp=dp)


def test_sp_with_hybrid_sharding_parity():
    """(dp 2, sp 2) at world 4 with mics_shard_size 2: ZeRO-3 shards within the two sp ranks of each dp rank and
    replicates across the dp ranks (shard groups of dp x sp's adjacent ranks, as without sequence parallelism)."""
    results = check_parity("gpt", sp=2, tp=1, stage=3, mics=2, dp=2)
    for rank, r in enumerate(results):
        assert r["groups"]["shard"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert r["groups"]["replicate"] == [rank % 2, rank % 2 + 2]
        assert r["coords"][4:] == (rank // 2, rank % 2)  # replica rank, shard rank


@pytest.mark.parametrize(
    ("case", "dp", "sp", "tp", "stage", "mics"),
    [("gpt", 1, 2, 2, 2, 1), ("gpt", 2, 3, 1, 3, 3)]
    + [pytest.param("llama", 2, 2, 1, 1, 1, marks=pytest.mark.soak)]
    + [pytest.param("llama", 1, 3, 2, 3, 1, marks=pytest.mark.soak)],
)
def test_sp_with_hybrid_sharding_more_cases(case, dp, sp, tp, stage, mics):
    """Shard groups smaller than an sp group (mics_shard_size 1: whole state on each rank, replicated over the sp
    ranks), with tensor parallelism, and at sp 3 (world 6)."""
    results = check_parity(case, sp=sp, tp=tp, stage=stage, mics=mics, dp=dp)
    for rank, r in enumerate(results):
        zero_rank = rank // tp
        assert r["coords"][3:] == (zero_rank, zero_rank // mics, zero_rank % mics)
        assert len(r["groups"]["shard"]) == mics and len(r["groups"]["replicate"]) == dp * sp // mics


def _groups_of_every_rank(dp: int, sp: int, tp: int, shard: int | None) -> list:
    world = dp * sp * tp
    return [
        make_groups(rank, world, tp, "gloo", "WORLD", lambda ranks, backend: tuple(ranks), shard, sp)[0]
        for rank in range(world)
    ]


@pytest.mark.parametrize(("dp", "sp", "tp", "shard"), [(2, 2, 2, None), (1, 3, 2, None), (3, 2, 1, 3), (2, 3, 2, 2)])
def test_every_axis_of_the_mesh_groups_the_right_ranks(dp, sp, tp, shard):
    """For every rank: its dp, sp and tp groups vary that coordinate only, ZeRO's group spans dp x sp of its tp
    block, and hybrid sharding cuts that group into adjacent shards and their replicas. No process group needed:
    ``make_groups`` is given a ``new_group`` that returns the ranks."""
    world = dp * sp * tp

    def coords(rank: int) -> tuple[int, int, int]:
        return rank // (sp * tp), (rank // tp) % sp, rank % tp

    every = _groups_of_every_rank(dp, sp, tp, shard)

    def members(group) -> tuple[int, ...]:
        return tuple(range(world)) if group == "WORLD" else group

    for rank, g in enumerate(every):
        d, s, t = coords(rank)

        assert members(g.dp) == tuple(r for r in range(world) if coords(r)[1:] == (s, t))
        assert members(g.tp) == tuple(r for r in range(world) if coords(r)[:2] == (d, s))
        assert members(g.sp) == tuple(r for r in range(world) if coords(r)[0] == d and coords(r)[2] == t)
        zero = tuple(r for r in range(world) if coords(r)[2] == t)  # every dp and sp rank of this tp block
        assert members(g.dp_sp) == zero
        if shard is None:
            assert g.shard is None and g.replicate is None
            continue
        i = zero.index(rank)  # zero_rank = dp_rank * sp + sp_rank
        assert members(g.shard) == zero[i // shard * shard : (i // shard + 1) * shard]
        assert members(g.replicate) == zero[i % shard :: shard]
        assert len(set(members(g.shard)) & set(members(g.replicate))) == 1


def _refusals() -> dict[str, str]:
    out = {}

    def attempt(name: str, heads: int = HEADS, **extra) -> None:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=heads * HEAD_DIM, n_layer=1, n_head=heads))
        config = {"train_micro_batch_size_per_gpu": ROWS, **extra}
        try:
            shardtrain.initialize(model, config=config, optimizer=optimizer_of(model), tp_plan=plan_of("gpt"))
            out[name] = "no error"
        except ShardtrainError as err:
            out[name] = f"{type(err).__name__}: {err}"

    # 6 heads: 3 per tp rank, which sp 2 does not divide
    attempt("heads", heads=6, sequence_parallel_size=2, tensor_parallel={"size": 2})
    attempt("tp", sequence_parallel_size=2, tensor_parallel={"size": 3})
    attempt("mics", sequence_parallel_size=4, zero_optimization={"stage": 3, "mics_shard_size": 3})
    return out


def test_what_does_not_fit_the_mesh_is_refused_by_name():
    for r in run_distributed(_refusals, 4, init_process_group=False):
        assert r["heads"].startswith(ConfigError.__name__), r["heads"]
        assert (
            "does not divide the 3 attention heads a tensor-parallel rank holds (6 / tensor_parallel.size 2)"
            in (r["heads"])
        ), r["heads"]
        assert r["tp"].startswith(LayoutError.__name__) and "tensor_parallel.size 3 does not divide the 4" in r["tp"]
        assert "mics_shard_size 3 does not divide the 4 ranks ZeRO shards over" in r["mics"], r["mics"]
