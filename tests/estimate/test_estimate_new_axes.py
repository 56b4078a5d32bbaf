"""The planner on the axes built after it: pipeline stages, context parallelism's ring, fp8's float8 gathers.

Each estimate is held against what a world-2 engine run holds or counts: each pipeline stage's model state
(``engine.state_bytes()`` on its ranks), the ring's bytes (the context-parallel communicator's counts), the float8
gathers' bytes (ZeRO's communicator's ``all_gather_float8``); the printed bubble against its formula.
"""

from __future__ import annotations

import json

import pytest
import torch

import shardtrain
from shardtrain.errors import ConfigError
from shardtrain.estimate import Candidate, estimate_memory, fitting_layouts
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.testing import run_distributed

VOCAB, SEQ, MICRO, GAS = 64, 16, 2, 2


def tiny_gpt() -> GPT:
    """Three blocks: two stages hold two and one ([Note: stages keep the model's names]), the first the
    embeddings, the last the head; both dimensions of its linears are multiples of 16, so they convert to fp8."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_layer=3, n_head=4))


def six_block_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_layer=6, n_head=4))


def tiny_llama() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # the ring passes the key/value heads only
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(cfg)


PIPELINE = {
    "pipeline_parallel_size": 2,
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": GAS,
    "zero_optimization": {"stage": 1},
}
PIPELINE_3 = {**PIPELINE, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
CONTEXT = {
    "context_parallel_size": 2,
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": GAS,
    "zero_optimization": {"stage": 2},
}
FP8 = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": GAS,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "fp8": {"enabled": True, "emulate": True},
}


def _tokens(g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)


def _counted() -> dict:
    """On each rank of world 2: the state a pp-2 engine holds after a step, the bytes a cp-2 engine's ring and
    reduce-scatters moved in a step, and the float8 gathers' bytes of a ZeRO-3 fp8 engine's second step."""
    g = torch.Generator().manual_seed(1)
    out = {}
    model = tiny_gpt()
    engine = shardtrain.initialize(model, PIPELINE, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    batches = [(x, torch.roll(x, -1, dims=1)) for x in (_tokens(g) for _ in range(GAS))]
    engine.train_batch(iter(batches))
    out["pipeline"] = (engine.topology.pp_rank, engine.state_bytes())
    engine.close()
    model = tiny_gpt()  # ZeRO-3: each stage's units, sharded over its one rank
    engine = shardtrain.initialize(model, PIPELINE_3, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    engine.train_batch(iter(batches))
    out["pipeline_3"] = engine.state_bytes()
    engine.close()

    model = tiny_llama()
    engine = shardtrain.initialize(model, CONTEXT, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    for _ in range(GAS):
        x = _tokens(g)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    out["ring"] = {kind: s["bytes"] for kind, s in engine._sp.comm.stats().items()}
    engine.close()

    model = tiny_gpt()
    engine = shardtrain.initialize(model, FP8, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    for _ in range(2):  # the second step: the unit order is recorded, the last block kept gathered for backward
        engine.comm.reset_stats()
        for _ in range(GAS):
            x = _tokens(g)
            engine.backward(engine(x, torch.roll(x, -1, dims=1)))
            engine.step()
    out["float8"] = engine.comm.stats()["all_gather_float8"]["bytes"]
    engine.close()
    return out


@pytest.fixture(scope="module")
def counted() -> list[dict]:
    return run_distributed(_counted, 2)


def test_each_pipeline_stage_s_model_state_is_the_engine_s(counted):
    """Stage 0 holds the embeddings and two blocks, stage 1 a block, the final norm and the head: the planner's
    parameters, gradients and optimizer state of each equal what the engine's ranks of that stage hold."""
    for pp_rank, held in (r["pipeline"] for r in counted):
        est = estimate_memory(tiny_gpt, PIPELINE, world_size=2, seq_len=SEQ, device_type="cpu", pp_rank=pp_rank)
        assert est.model_state() == held, (pp_rank, est.model_state(), held)
    for pp_rank, held in ((r["pipeline"][0], r["pipeline_3"]) for r in counted):
        est = estimate_memory(tiny_gpt, PIPELINE_3, world_size=2, seq_len=SEQ, device_type="cpu", pp_rank=pp_rank)
        assert est.model_state() == held, (pp_rank, est.model_state(), held)
    stages = [
        estimate_memory(tiny_gpt, PIPELINE, world_size=2, seq_len=SEQ, pp_rank=r, activations=False) for r in (0, 1)
    ]
    whole = estimate_memory(tiny_gpt, {**PIPELINE, "pipeline_parallel_size": 1}, world_size=1, seq_len=SEQ)
    # the stages hold the whole model between them, none twice
    assert sum(s.model_state()["params"] for s in stages) == whole.model_state()["params"]


def test_the_ring_s_bytes_per_step_are_the_engine_s(counted):
    """cp 2 runs the log-sum-exp-merged ring ([Note: which context attention]): per layer and micro-batch a rank's
    own keys and values (half of two key/value heads of the sequence) sent once forward, once backward and their
    gradient twice, nothing reduce-scattered: the planner's per-step bytes are the counted ones; the keys and values
    it holds while attending are the sequence's (its own chunk and the other rank's)."""
    est = estimate_memory(tiny_llama, CONTEXT, world_size=2, seq_len=SEQ, device_type="cpu")
    whole = 2 * MICRO * 2 * SEQ * 8 * 4  # keys and values [rows, kv heads, S, head dim], fp32
    for r in counted:
        assert "reduce_scatter" not in r["ring"], r["ring"]
        assert est.traffic["context-parallel ring (keys and values)"] == r["ring"]["ring"]
    assert est.traffic["context-parallel ring (keys and values)"] == GAS * 2 * whole // 2 * (1 + 1 + 2)
    assert not any("reduce-scatter" in k for k in est.traffic if k.startswith("context-parallel"))
    kv = [row.nbytes for row in est.rows if "(cp ring)" in row.component]
    assert kv == [whole]


def test_the_float8_gathers_bytes_per_step_are_the_engine_s(counted):
    """ZeRO-3 with fp8 gathers the converted weights (the blocks' linears; the head stays in high precision) in
    float8, 1 byte per element: the planner's bytes per step equal those the engine counted."""
    est = estimate_memory(tiny_gpt, FP8, world_size=2, seq_len=SEQ, device_type="cpu")
    assert all(r["float8"] > 0 for r in counted)
    for r in counted:
        assert est.traffic["ZeRO-3 float8 gathers (1 byte/element)"] == r["float8"]
    # the gathered float8 units count 1 byte per converted element, not the compute dtype's 4
    plain = estimate_memory(tiny_gpt, {**FP8, "fp8": {"enabled": False}}, world_size=2, seq_len=SEQ, device_type="cpu")
    converted = sum(u.float8_numel for u in est.state.units)
    assert sum(u.nbytes for u in plain.state.units) - sum(u.nbytes for u in est.state.units) == 3 * converted
    assert converted == 3 * 12 * 32 * 32 and "ZeRO-3 float8 gathers" not in str(plain.traffic)


@pytest.mark.parametrize(
    ("schedule", "v", "m", "bubble", "in_flight"),
    [
        ("1F1B", 1, 4, 1 / 5, 2),
        ("GPipe", 1, 4, 1 / 5, 4),
        ("1F1B", 1, 1, 1 / 2, 1),
        ("Interleaved1F1B", 2, 2, 1 / 5, 4),
        # the V-shaped zero-bubble schedule: stages 0 and 3 on rank 0 (blocks 0-1 and 5), the idle slots of
        # torch's own action lists ([Note: a schedule's bubble from its own actions])
        ("ZBVZeroBubble", 2, 4, 1 / 25, 4),
    ],
)
def test_the_bubble_is_printed_and_the_first_stage_holds_the_micro_batches_in_flight(schedule, v, m, bubble, in_flight):
    """(p-1)/(v*m + p-1) at p 2 (zero-bubble: (p-1)/(3*v*m + p-1)); the first stage keeps min(m, p) micro-batches'
    activations per stage under 1F1B
    (and its interleaved form), all m under GPipe: that many times the stage's share of one micro-batch's."""
    config = {**PIPELINE, "gradient_accumulation_steps": m, "pipeline": {"schedule": schedule, "stages_per_rank": v}}
    est = estimate_memory(six_block_gpt, config, world_size=2, seq_len=SEQ, device_type="cpu")
    assert est.bubble == pytest.approx(bubble)
    assert f"pipeline bubble ({schedule}, p 2, m {m}): {bubble:.4f}" in est.format()
    more = [row.nbytes for row in est.rows if "more micro-batches in flight" in row.component]
    share = 3 / 6  # pipeline rank 0's blocks: 0-2 of two stages, or 0-1 and 4 of four
    assert more == [int(est.compute.activations * share) * (in_flight - 1)]


def test_layouts_the_planner_cannot_plan_are_refused_by_name():
    with pytest.raises(ConfigError, match="pp_rank 2: the pipeline ranks are 0 to 1"):
        estimate_memory(tiny_gpt, PIPELINE, world_size=2, seq_len=SEQ, pp_rank=2, activations=False)
    with pytest.raises(ConfigError, match="fewer than the 4 pipeline stages"):
        estimate_memory(tiny_gpt, {**PIPELINE, "pipeline_parallel_size": 4}, world_size=4, seq_len=SEQ)
    assert Candidate(4, pp=2, cp=2).dims.dp == 1


def test_a_search_tries_pipeline_sizes_up_to_the_config_s_and_each_stage_holds_less():
    fits = fitting_layouts(
        tiny_gpt, 2**40, PIPELINE, worlds=(2,), seq_len=SEQ, device_type="cpu", offload=False, activations=False
    )
    by_size = {(e.layout.pp, e.layout.stage, e.layout.tp): e.model_state()["params"] for e in fits}
    assert {pp for pp, _, _ in by_size} == {1, 2}
    # at stage 0 pipeline rank 0 holds its two blocks and the embeddings, not the whole model
    assert by_size[2, 0, 1] < by_size[1, 0, 1]
    assert "pp 2 (1F1B, 2 micro-batches; pp rank 0)" in {e.layout.describe() for e in fits if e.layout.pp == 2}.pop()


def test_cli_pp_cp_options_print_the_bubble_and_the_ring_s_bytes(capsys):
    from shardtrain.cli import main as cli_main

    def cli(*argv: str) -> tuple[int, str, str]:
        code = cli_main(["estimate", "test_estimate_new_axes:tiny_gpt", "--world", "2", "--seq-len", str(SEQ), *argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    code, out, _ = cli("--pp", "2", "--pp-rank", "1", "--json")
    got = json.loads(out)
    assert code == 0 and (got["layout"]["pp"], got["layout"]["pp_rank"]) == (2, 1)
    assert got["pipeline_bubble"] == pytest.approx(1 / 2)  # one micro-batch: (p-1)/(m+p-1)
    code, out, _ = cli("--cp", "2")
    # 3 layers x a rank's half of the keys and values [1 row, 4 heads, 16 tokens, 8] fp32 (4 KiB) sent once forward,
    # once backward and their gradient twice (the merged ring at cp 2: [Note: which context attention])
    assert code == 0 and "sent per step: context-parallel ring (keys and values): 24.00 KiB" in out
    code, _, err = cli("--pp", "3")
    assert code == 2 and "pipeline_parallel_size 3 does not divide the 2 processes" in err
    code, _, err = cli("--cp", "0")
    assert code == 2 and "--cp must be at least 1" in err


def test_a_search_tries_context_parallel_sizes_up_to_the_config_s_and_cp_runs_fewer_tokens():
    """Sizes 1 and 2 at world 2 (the config's cp 2 and below): a cp-2 layout's activations are those of half the
    tokens, so under the cp-1 layout's at the same stage and tensor-parallel size, and it carries the ring's rows."""
    fits = fitting_layouts(
        tiny_llama, 2**40, CONTEXT, worlds=(2,), seq_len=SEQ, device_type="cpu", offload=False, fast=False
    )
    by_layout = {(e.layout.cp, e.layout.stage, e.layout.tp): e for e in fits}
    assert {cp for cp, _, _ in by_layout} == {1, 2}
    for (cp, stage, tp), est in by_layout.items():
        if cp == 2:
            assert est.compute.activations < by_layout[1, stage, tp].compute.activations, (stage, tp)
            assert "context-parallel ring (keys and values)" in est.traffic
        else:
            assert not any(k.startswith("context-parallel") for k in est.traffic)


def test_the_merged_ring_s_bytes_and_held_keys_and_values_at_cp_3():
    """At cp 3 the log-sum-exp-merged ring ([Note: which context attention]): per layer and micro-batch a rank sends
    its own keys and values (1/cp of the sequence's) cp - 1 times forward, cp - 1 times backward and their gradient cp
    times (the counts tests/sequence_parallel/test_context_parallel.py asserts of the
    engine), reduce-scatters nothing, and holds its own chunk and two in flight."""
    config = {**CONTEXT, "context_parallel_size": 3}
    seq = 24
    est = estimate_memory(tiny_llama, config, world_size=3, seq_len=seq, device_type="cpu")
    whole = 2 * MICRO * 2 * seq * 8 * 4  # keys and values [rows, kv heads, S, head dim], fp32
    layers = 2
    assert est.traffic["context-parallel ring (keys and values)"] == GAS * layers * whole // 3 * (2 + 2 + 3)
    assert not any("reduce-scatter" in k for k in est.traffic if k.startswith("context-parallel"))
    kv = [row.nbytes for row in est.rows if "(cp ring)" in row.component]
    assert kv == [3 * whole // 3]


def test_a_pipeline_with_the_sequence_split_in_each_stage_is_estimated():
    """pp 2 x sp 2 and pp 2 x cp 2 (world 4) are built for Hugging Face Llama-family models
    (tests/pipeline_parallel/test_pipeline_sequence.py): estimated, each stage's rank running 1/2 of every sequence's
    tokens; the project's GPT refused as initialize refuses it."""
    plain = estimate_memory(tiny_llama, PIPELINE, world_size=2, seq_len=SEQ, device_type="cpu")
    for split in ("sequence_parallel_size", "context_parallel_size"):
        est = estimate_memory(tiny_llama, {**PIPELINE, split: 2}, world_size=4, seq_len=SEQ, device_type="cpu")
        assert est.layout.pp == 2 and est.layout.sp * est.layout.cp == 2
        assert est.compute.activations < plain.compute.activations, split
        with pytest.raises(
            ConfigError, match="built for Hugging Face Llama-family causal LMs cut into stages, not GPT"
        ):
            estimate_memory(tiny_gpt, {**PIPELINE, split: 2}, world_size=4, seq_len=SEQ, device_type="cpu")
