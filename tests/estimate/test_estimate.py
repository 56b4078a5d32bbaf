"""The memory planner against the engine: model state exactly, the peak within 10% of the measured one.

"Measured" (docs/estimate.md): the bytes of tensors alive when the sixth training step starts (optimizer state
exists, ZeRO-3's orders are recorded and prefetch runs, the optimizer swapper's buffers have each held a sub-group),
counted over every storage reachable from Python, less the same count before this layout's model was built; plus the
most the step adds to that, from torch's profiler, which records every allocation and free of torch's CPU allocator
during the step (:class:`shardtrain.estimate.PeakMeter`). Memory outside torch's allocator (the interpreter, gloo's
buffers, mapped swap-file pages) is not counted, by the meter or the planner. Frees the profiler does not record
(gloo's worker thread dropping the last reference to a collective's tensors, seen under sequence parallelism) leave the
measured peak too high by at most the step's unrecorded bytes, which widen the lower bound.
"""

from __future__ import annotations

import functools
import gc
import json
import tempfile
from contextlib import nullcontext
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import shardtrain
from shardtrain.cli import main as cli_main
from shardtrain.errors import ConfigError, ShardtrainError
from shardtrain.estimate import Candidate, PeakMeter, estimate_memory, fitting_layouts, parse_bytes
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.tensor_parallel import GPT_TP_PLAN
from shardtrain.testing import run_distributed

VOCAB, SEQ, MICRO = 512, 64, 4
STEPS = 6  # measured: the last; by then the optimizer swapper's buffers have all served (docs/estimate.md)


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=64, n_layer=3, n_head=4))


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    return LlamaForCausalLM(cfg)


def tiny_mixtral(experts: int = 8):
    """``experts`` experts, top-2 routing, the load-balancing loss on: the model expert parallelism splits."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=experts,
        num_experts_per_tok=2,
        output_router_logits=True,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    return MixtralForCausalLM(cfg)


MODELS = {
    "gpt": tiny_gpt,
    "llama": tiny_llama,
    "mixtral": tiny_mixtral,
    "mixtral6": functools.partial(tiny_mixtral, 6),
}


def model_of(name: str):
    """The factory of a case: the model its name starts with (before the first ``-``), else the project's GPT."""
    return MODELS.get(name.split("-")[0], tiny_gpt)


def is_hf(name: str) -> bool:
    return name.split("-")[0].startswith(("llama", "mixtral"))


# (name, layout, config beyond the layout's keys); every layout is run by the engine and estimated; a name starting
# with "llama" or "mixtral" is that Hugging Face model (mixtral6: with 6 experts), the others the project's GPT
CASES = [
    ("stage0", Candidate(1, stage=0, micro_batch=MICRO, seq_len=SEQ), {}),
    # a sequence long enough that an S x S mask and attention weights would show ([Note: the estimate's batch is not
    # packed] in estimate/compute.py)
    ("llama-1024-stage0", Candidate(1, stage=0, micro_batch=1, seq_len=1024), {}),
    ("stage3", Candidate(2, stage=3, micro_batch=MICRO, seq_len=SEQ), {}),
    ("tp2-stage1-bf16", Candidate(2, stage=1, tp=2, dtype="bf16", micro_batch=MICRO, seq_len=SEQ), {}),
    (
        "stage3-nvme",
        Candidate(2, stage=3, offload_optimizer="nvme", offload_param="nvme", micro_batch=MICRO, seq_len=SEQ),
        {"sub_group_size": 20_000, "offload_param": {"max_in_cpu": 0}},
    ),
    ("stage3-bf16", Candidate(3, stage=3, dtype="bf16", micro_batch=MICRO, seq_len=SEQ), {}),
    ("stage2-checkpointing", Candidate(3, stage=2, micro_batch=MICRO, seq_len=SEQ, checkpointing=True), {}),
    ("mixtral-ep2-stage2", Candidate(2, stage=2, ep=2, micro_batch=MICRO, seq_len=SEQ), {}),
    ("mixtral-ep2-stage3", Candidate(2, stage=3, ep=2, micro_batch=MICRO, seq_len=SEQ), {}),
    (
        "mixtral-ep2-stage3-nvme",
        Candidate(2, stage=3, ep=2, offload_optimizer="nvme", offload_param="nvme", micro_batch=MICRO, seq_len=SEQ),
        {"sub_group_size": 20_000, "offload_param": {"max_in_cpu": 0}},
    ),
    ("sp2-stage2", Candidate(2, stage=2, sp=2, micro_batch=MICRO, seq_len=SEQ), {}),
    ("mixtral-ep2-sp2-stage2", Candidate(2, stage=2, ep=2, sp=2, micro_batch=MICRO, seq_len=SEQ), {}),
]
SOAK_CASES = [
    ("stage2", Candidate(2, stage=2, micro_batch=MICRO, seq_len=SEQ), {}),
    (
        "stage1-cpu-bf16",
        Candidate(2, stage=1, offload_optimizer="cpu", dtype="bf16", micro_batch=MICRO, seq_len=SEQ),
        {},
    ),
    ("llama-stage3-bf16", Candidate(2, stage=3, dtype="bf16", micro_batch=MICRO, seq_len=SEQ), {}),
    ("llama-tp2-stage2", Candidate(2, stage=2, tp=2, micro_batch=MICRO, seq_len=SEQ), {}),
    ("llama-stage2-checkpointing", Candidate(3, stage=2, micro_batch=MICRO, seq_len=SEQ, checkpointing=True), {}),
    (
        "stage3-default-threshold",
        Candidate(2, stage=3, micro_batch=MICRO, seq_len=SEQ),
        {"stage3_param_persistence_threshold": 10_000},
    ),
    (
        "stage3-nvme-optimizer-bf16",
        Candidate(3, stage=3, offload_optimizer="nvme", dtype="bf16", micro_batch=MICRO, seq_len=SEQ),
        {},
    ),
    ("mixtral-stage2", Candidate(2, stage=2, micro_batch=MICRO, seq_len=SEQ), {}),
    ("mixtral-ep2-stage1-bf16", Candidate(2, stage=1, ep=2, dtype="bf16", micro_batch=MICRO, seq_len=SEQ), {}),
    ("mixtral-ep2-stage0", Candidate(2, stage=0, ep=2, micro_batch=MICRO, seq_len=SEQ), {}),
    ("mixtral6-ep3-stage2", Candidate(3, stage=2, ep=3, micro_batch=MICRO, seq_len=SEQ), {}),
    ("mixtral-ep2-dp2-stage2", Candidate(4, stage=2, ep=2, micro_batch=MICRO, seq_len=SEQ), {}),
    ("mixtral-ep4-stage2", Candidate(4, stage=2, ep=4, micro_batch=MICRO, seq_len=SEQ), {}),
    ("mixtral-ep2-dp2-stage3", Candidate(4, stage=3, ep=2, micro_batch=MICRO, seq_len=SEQ), {}),
    ("mixtral-ep2-dp2-stage3-bf16", Candidate(4, stage=3, ep=2, dtype="bf16", micro_batch=MICRO, seq_len=SEQ), {}),
    (
        "mixtral-ep2-stage1-cpu-bf16",
        Candidate(2, stage=1, ep=2, offload_optimizer="cpu", dtype="bf16", micro_batch=MICRO, seq_len=SEQ),
        {},
    ),
    (
        "mixtral-stage3-nvme",
        Candidate(2, stage=3, offload_optimizer="nvme", offload_param="nvme", micro_batch=MICRO, seq_len=SEQ),
        {"sub_group_size": 20_000, "offload_param": {"max_in_cpu": 0}},
    ),
    (
        "mixtral-ep2-dp2-stage2-nvme-bf16",
        Candidate(4, stage=2, ep=2, offload_optimizer="nvme", dtype="bf16", micro_batch=MICRO, seq_len=SEQ),
        {"sub_group_size": 20_000},
    ),
    (
        "mixtral-ep2-dp2-stage3-nvme",
        Candidate(4, stage=3, ep=2, offload_optimizer="nvme", micro_batch=MICRO, seq_len=SEQ),
        {"sub_group_size": 20_000},
    ),
    ("sp2-dp2-stage2", Candidate(4, stage=2, sp=2, micro_batch=MICRO, seq_len=SEQ), {}),
    ("llama-sp2-stage3-bf16", Candidate(2, stage=3, sp=2, dtype="bf16", micro_batch=MICRO, seq_len=SEQ), {}),
    ("sp2-stage2-checkpointing", Candidate(2, stage=2, sp=2, micro_batch=MICRO, seq_len=SEQ, checkpointing=True), {}),
    ("llama-tp2-sp2-stage1", Candidate(4, stage=1, tp=2, sp=2, micro_batch=MICRO, seq_len=SEQ), {}),
    ("mixtral-ep4-sp2-stage3", Candidate(4, stage=3, ep=4, sp=2, micro_batch=MICRO, seq_len=SEQ), {}),
    ("mixtral-tp2-sp2-ep2-stage2", Candidate(8, stage=2, tp=2, sp=2, ep=2, micro_batch=MICRO, seq_len=SEQ), {}),
]


def config_of(layout: Candidate, zero_extra: dict, nvme: str | None = None) -> dict:
    zero: dict = {"stage": layout.stage, "stage3_param_persistence_threshold": 0, **zero_extra}
    for key, device in (("offload_optimizer", layout.offload_optimizer), ("offload_param", layout.offload_param)):
        if device != "none":
            zero[key] = {**zero.get(key, {}), "device": device}
            if device == "nvme":
                zero[key]["nvme_path"] = nvme or "/nvme"
    return {
        "train_micro_batch_size_per_gpu": layout.micro_batch,
        "zero_optimization": zero,
        "tensor_parallel": {"size": layout.tp},
        "bf16": {"enabled": layout.dtype == "bf16"},
        "expert_parallel_size": layout.ep,
        "sequence_parallel_size": layout.sp,
        "desync_check": False,
    }


def _checkpointed_blocks(model) -> None:
    if hasattr(model, "activation_checkpointing_enable"):  # as users of transformers turn it on
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return
    for block in model.blocks:  # what the planner does to the blocks of a model with checkpointing on
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def _loss(engine, name: str, x: torch.Tensor) -> torch.Tensor:
    if is_hf(name):
        return engine(input_ids=x, labels=x, use_cache=False).loss
    return engine(x, torch.roll(x, -1, dims=1))


def _train_and_measure(cases: list[tuple[str, Candidate, dict]], nvme: str) -> dict:
    rank = dist.get_rank()
    meter = PeakMeter()
    out = {}
    try:
        for name, layout, extra in cases:
            gc.collect()
            with meter.window(f"before:{name}", scan=True):
                pass
            model = model_of(name)()
            if layout.checkpointing:
                _checkpointed_blocks(model)
            engine = shardtrain.initialize(
                model,
                config_of(layout, extra, nvme),
                torch.optim.AdamW(model.parameters(), lr=1e-3),
                tp_plan=GPT_TP_PLAN if layout.tp > 1 and not is_hf(name) else None,
            )
            rows = torch.Generator().manual_seed(engine.topology.dp_rank)
            for step in range(STEPS):
                x = torch.randint(0, VOCAB, (layout.micro_batch, layout.seq_len), generator=rows)
                with meter.window(name, scan=True) if step == STEPS - 1 else nullcontext():
                    loss = _loss(engine, name, x)
                    engine.backward(loss)
                    engine.step()
                    del loss
            with meter.window(f"after:{name}", scan=True):  # the step's unrecorded frees, read below
                pass
            # parameter shards in swap files are tensors over mapped files: reachable, but not torch's memory
            mapped = engine._param_offload.mapped_bytes() if engine._param_offload is not None else 0
            out[name] = {"state": engine.state_bytes(), "rank": rank, "mapped": mapped}
            engine.close()
            del engine, model
    finally:
        meter.stop()
    for name in out:  # what the step added, on what was alive when it started (above what was there before)
        live = meter.live[name] - out[name]["mapped"] - meter.live[f"before:{name}"]
        out[name]["peak"] = meter.rise(name) + live
        out[name]["unrecorded"] = max(meter.unrecorded_frees(name, f"after:{name}"), 0)
    return out


@functools.cache
def measured(soak: bool = False) -> dict:
    results = {}
    all_cases = SOAK_CASES if soak else CASES
    with tempfile.TemporaryDirectory() as nvme:
        for world in sorted({w.world for _, w, _ in all_cases}):
            cases = [c for c in all_cases if c[1].world == world]
            per_rank = run_distributed(_train_and_measure, world, cases, nvme, timeout=300)
            results.update(per_rank[0])  # rank 0: the rank the planner reports
    return results


@functools.cache
def estimated(name: str):
    _, layout, extra = next(c for c in CASES + SOAK_CASES if c[0] == name)
    model, plan = model_of(name), None if is_hf(name) else GPT_TP_PLAN
    est = estimate_memory(model, config_of(layout, extra), layout=layout, device_type="cpu", tp_plan=plan)
    return est


def swap_buffers_unknown(name: str, layout: Candidate) -> bool:
    """Whether a case's peak outside the optimizer step depends on which sub-groups the ``nvme`` swap buffers held
    last: Mixtral's sub-groups differ in size (its fused experts against attention and norms; the project's GPT's
    much less), with experts or without. The estimate counts the ``buffer_count`` largest, the buffers hold at least
    the smallest ones (``RankState.offload_buffers_least``), so the measured peak may lie up to that much lower than
    the usual tolerance allows (measured: 2-14% below the estimate in repeated runs of one case)."""
    return name.startswith("mixtral") and layout.offload_optimizer == "nvme"


def _check(name: str, got: dict) -> None:
    est = estimated(name)
    assert est.model_state() == got["state"], (name, est.model_state(), got["state"])
    predicted, peak = est.memory_peak, got["peak"]
    where = f"{name}: predicted {predicted}, measured {peak}\n{est.format()}"
    unknown = est.state.optimizer.get("offload_buffers", 0) - est.state.offload_buffers_least
    slack = unknown if swap_buffers_unknown(name, est.layout) else 0
    # frees of the step the profiler missed ([Note: frees the profiler misses] in estimate/measure.py) leave the
    # measured peak above the bytes alive by at most their sum
    missed = got["unrecorded"]
    assert -0.10 * peak - missed <= predicted - peak <= 0.10 * peak + slack, where + f"\nunrecorded frees {missed}"


# "stage0" under soak (suite time): stage 0 stays checked by default with Llama's 1024 tokens
@pytest.mark.parametrize(
    "name", [pytest.param(c[0], marks=pytest.mark.soak) if c[0] == "stage0" else c[0] for c in CASES]
)
def test_model_state_is_exact_and_peak_within_10_percent(name):
    _check(name, measured()[name])


@pytest.mark.soak
@pytest.mark.parametrize("name", [c[0] for c in SOAK_CASES])
def test_more_layouts_and_a_hugging_face_model_within_10_percent(name):
    _check(name, measured(soak=True)[name])


def test_hybrid_sharding_shards_within_the_group_and_reads_the_deepspeed_key():
    """``mics_shard_size: S`` shards model state over groups of S ranks (the layout being built for issue 22 item 2):
    a rank of world 4 in groups of 2 holds what a rank of world 2 holds."""
    base = Candidate(2, stage=3, micro_batch=1, seq_len=16)
    cfg = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "mics_shard_size": 2}}
    hybrid = estimate_memory(tiny_gpt, cfg, world_size=4, seq_len=16, device_type="cpu", activations=False)
    assert hybrid.layout.shard_size == 2 and hybrid.layout.shard_group == 2
    plain2 = estimate_memory(tiny_gpt, cfg, layout=base, device_type="cpu", activations=False)
    plain4 = estimate_memory(tiny_gpt, cfg, layout=replace(base, world=4), device_type="cpu", activations=False)
    assert hybrid.model_state() == plain2.model_state()
    assert plain4.model_state()["optimizer"] < hybrid.model_state()["optimizer"]
    with pytest.raises(ConfigError, match="mics_shard_size 3 does not divide the 4 ranks ZeRO shards over"):
        estimate_memory(tiny_gpt, cfg, layout=replace(base, world=4, shard_size=3), device_type="cpu")


def test_expert_parallelism_holds_the_rank_s_experts_and_is_searched_where_the_model_has_experts():
    """Under ``expert_parallel_size: E`` a rank holds ``num_experts / E`` experts of every MoE layer, sharded over the
    ``dp / E`` ranks holding the same experts, and the dense parameters sharded over all ``dp`` (the engine's own
    layout, compared with a run by the cases above). The search tries every E that divides the experts and ``dp``
    where the model has experts, only where ``initialize`` builds it; what it refuses, the estimate refuses in its
    words."""
    model = tiny_mixtral()
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    common = {"seq_len": 16, "device_type": "cpu", "activations": False}
    cfg = {"zero_optimization": {"stage": 2}}

    def optimizer_elements(world: int, ep: int, stage: int = 2, config: dict = cfg) -> float:
        layout = Candidate(world, stage=stage, ep=ep, seq_len=16)  # fp32 AdamW: 8 bytes of moments per element stepped
        return estimate_memory(tiny_mixtral, config, layout=layout, **common).state.optimizer["device"] / 8

    # rank 0's fragments: ceil(padded / group) of the dense buckets over dp, of the expert buckets over dp / E
    assert optimizer_elements(4, 1) == pytest.approx((dense + expert) / 4, abs=8)
    assert optimizer_elements(4, 2) == pytest.approx(dense / 4 + expert / 2 / 2, abs=8)
    assert optimizer_elements(4, 4) == pytest.approx(dense / 4 + expert / 4, abs=8)
    # stage 3: the same fragments, in each unit's dense and expert buckets (threshold 0) or, for parameters held
    # whole (the default threshold keeps all of this small model's), in the persistent buckets
    units = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    for config in (units, {"zero_optimization": {"stage": 3}}):
        assert optimizer_elements(4, 2, 3, config) == pytest.approx(dense / 4 + expert / 2 / 2, abs=32)
    # hybrid sharding (shard groups of 2 at dp 4): dense state over the shard group, expert state still over the
    # dp / E ranks holding the same experts (expert buckets are never replicated)
    hybrid = Candidate(4, stage=3, ep=2, shard_size=2, seq_len=16)
    shards = estimate_memory(tiny_mixtral, units, layout=hybrid, **common).state.optimizer["device"] / 8
    assert shards == pytest.approx(dense / 2 + expert / 2 / 2, abs=32)
    stage3 = estimate_memory(tiny_mixtral, units, layout=Candidate(4, stage=3, ep=2, seq_len=16), **common)
    assert stage3.state.params["device"] / 4 == pytest.approx(dense / 4 + expert / 2 / 2, abs=32)
    # a block's gathered buffers: its dense parameters whole, and its experts whole on the ranks holding them
    for u in (u for u in stage3.state.units if not u.root):
        block = dict(model.named_modules())[u.name]
        held = sum(p.numel() / (2 if ".experts." in n else 1) for n, p in block.named_parameters())
        assert u.numel == pytest.approx(held, abs=8) and u.nbytes == 4 * u.numel
    fits = fitting_layouts(tiny_mixtral, 2**40, cfg, worlds=(2, 4), offload=False, **common)
    eps = {(e.layout.world, e.layout.stage, e.layout.ep) for e in fits if e.layout.ep > 1}
    assert eps == {(w, s, e) for w in (2, 4) for s in (0, 1, 2, 3) for e in (2, 4) if e <= w}
    assert all(e.layout.offload_optimizer == "none" for e in fits if e.layout.ep > 1)
    assert any(e.layout.tp == 2 for e in fits if e.layout.ep > 1)  # with tensor parallelism too

    # with tensor parallelism (tp 2 at world 4: dp 2) the experts are whole on every tp rank, split over the expert
    # group only: at ep 2 a rank steps half of them, at ep 1 half of them too but as tensor-parallel blocks
    # (moe_tp_experts) sharded over both data-parallel ranks: a quarter
    def tp_elements(ep: int) -> float:
        layout = Candidate(4, stage=2, tp=2, ep=ep, seq_len=16)
        return estimate_memory(tiny_mixtral, cfg, layout=layout, **common).state.optimizer["device"] / 8

    assert tp_elements(2) - tp_elements(1) == pytest.approx(expert / 2 - expert / 2 / 2, abs=16)
    # the fake run: each tp rank's share of the tokens through the exchange, the outputs gathered
    with_tp = estimate_memory(
        tiny_mixtral, cfg, layout=Candidate(4, stage=2, tp=2, ep=2, seq_len=16), device_type="cpu"
    )
    assert with_tp.peak["device"] > with_tp.state.params["device"] + with_tp.state.optimizer["device"]
    # with offload: the optimizer's at stages 1-3, the parameters' at stage 3, as initialize builds them with experts
    searched = fitting_layouts(tiny_mixtral, 2**40, cfg, worlds=(4,), offload=True, **common)
    expert_layouts = [e.layout for e in searched if e.layout.ep > 1]
    offloads = {(lay.stage, lay.offload_optimizer, lay.offload_param) for lay in expert_layouts}
    plain = {(s, "none", "none") for s in (0, 1, 2, 3)}
    assert offloads == plain | {(s, o, "none") for s in (1, 2, 3) for o in ("cpu", "nvme")} | {(3, "nvme", "nvme")}
    # on accelerators, optimizer offload to the host moves the dense and the expert fragments' state there: fp32
    # masters and two moments, 12 bytes per element of this rank's fragments, none left on the device
    gpu = {**common, "device_type": "cuda"}
    for stage in (1, 2, 3):
        layout = Candidate(4, stage=stage, ep=2, offload_optimizer="cpu", dtype="bf16", seq_len=16)
        opt = estimate_memory(tiny_mixtral, units, layout=layout, **gpu).state.optimizer
        assert "device" not in opt and opt["host"] / 12 == pytest.approx(dense / 4 + expert / 2 / 2, abs=32)
    assert "ep 4" in next(e for e in fits if e.layout.ep == 4).layout.describe()
    dense_fits = fitting_layouts(tiny_gpt, 2**40, cfg, worlds=(2,), offload=False, **common)
    assert dense_fits and all(e.layout.ep == 1 for e in dense_fits)
    refusals = [
        (tiny_mixtral, Candidate(4, stage=2, ep=3), "does not divide the data-parallel size 4"),
        (functools.partial(tiny_mixtral, 6), Candidate(4, stage=2, ep=4), "has 6 experts.*ep_size\\) 4"),
        (tiny_mixtral, Candidate(2, stage=2, tp=2, ep=2), "does not divide the data-parallel size 1"),
        (tiny_gpt, Candidate(2, stage=2, ep=2), "GPT has no experts module"),
    ]
    for model_fn, layout, message in refusals:
        with pytest.raises(ConfigError, match=message):
            estimate_memory(model_fn, cfg, layout=replace(layout, seq_len=16), **common)
    # with sequence parallelism: the expert groups are cut from the dp * sp ranks ZeRO shards over, so the state is
    # the one of the same world without it (measured against the engine in the cases above)
    with_sp = estimate_memory(tiny_mixtral, cfg, layout=Candidate(4, stage=2, ep=2, sp=2, seq_len=16), **common)
    without = estimate_memory(tiny_mixtral, cfg, layout=Candidate(4, stage=2, ep=2, seq_len=16), **common)
    assert with_sp.model_state() == without.model_state() and with_sp.layout.dp == 2


def test_sequence_parallelism_splits_the_sequence_shards_over_dp_times_sp_and_refuses_what_initialize_does():
    """Under ``sequence_parallel_size: P`` the data-parallel size is ``world / (tp * P)`` (the micro-batch comes
    from it), ZeRO shards over ``dp * P`` ranks (the state of the same world without it), a rank's forward holds
    its ``1/P`` of the sequence (less than a whole sequence's activations); a size that does not divide the heads
    or ``world / tp`` is refused in initialize's words, by the estimate with or without its fake run."""
    from shardtrain.estimate.planner import layout_from_config

    raw = {"train_batch_size": 16, "sequence_parallel_size": 2, "tensor_parallel": {"size": 2}}
    layout = layout_from_config(raw, world=8, seq_len=16)
    assert (layout.sp, layout.dp, layout.zero, layout.micro_batch) == (2, 2, 4, 8)  # 16 sequences over dp 2
    assert layout_from_config({**raw, "gradient_accumulation_steps": 2}, 8, 16).micro_batch == 4
    assert layout_from_config({"train_batch_size": 16}, 8, 16).micro_batch == 2  # dp 8 without the two
    cfg = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    common = {"device_type": "cpu", "tp_plan": GPT_TP_PLAN}
    with_sp = estimate_memory(tiny_gpt, {**cfg, "sequence_parallel_size": 2}, world_size=4, seq_len=64, **common)
    assert with_sp.layout.sp == 2 and "sp 2" in with_sp.layout.describe() and "dp 2 x sp 2" in with_sp.format()
    whole = estimate_memory(tiny_gpt, cfg, layout=replace(with_sp.layout, sp=1), **common)
    assert with_sp.model_state() == whole.model_state()  # ZeRO over dp * sp = 4 ranks either way
    assert with_sp.compute.activations < whole.compute.activations and with_sp.compute.peak < whole.compute.peak
    refusals = [
        (Candidate(3, sp=3, seq_len=48), "sequence_parallel_size 3 does not divide the 4 attention heads"),
        (Candidate(8, tp=2, sp=4, seq_len=16), r"4 does not divide the 2 attention heads a tensor-parallel rank"),
        (Candidate(4, tp=2, sp=3, seq_len=48), "sequence_parallel_size 3 does not divide the 4 processes of this job"),
    ]
    for layout, message in refusals:
        for activations in (True, False):
            with pytest.raises(ConfigError, match=message):
                estimate_memory(tiny_gpt, cfg, layout=layout, activations=activations, **common)
    # a search tries the sizes up to the one asked for, where the world and the heads allow them
    search = functools.partial(fitting_layouts, tiny_gpt, 2**40, cfg, seq_len=16, offload=False, **common)
    assert {e.layout.sp for e in search(worlds=(2,))} == {1}
    assert {(e.layout.tp, e.layout.sp) for e in search(worlds=(2,), sp=2)} == {(1, 1), (1, 2), (2, 1)}
    assert {e.layout.sp for e in search(worlds=(3,), sps=(3,))} == set()  # 4 heads


class ReadsValues(torch.nn.Module):
    """A forward that branches on a tensor's value: it cannot run on fake tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        y = self.lin(torch.ones(idx.shape[0], 4)).sum()
        return y if y.item() > 0 else -y


def test_bad_layouts_and_models_are_refused_by_name():
    with pytest.raises(ShardtrainError, match=r"cannot run on fake tensors.*--state-only"):
        estimate_memory(ReadsValues, world_size=1, seq_len=4, device_type="cpu")
    assert estimate_memory(ReadsValues, world_size=1, seq_len=4, device_type="cpu", activations=False).parameters == 20
    with pytest.raises(ConfigError, match=r"tensor_parallel\.size 2 does not divide the 3 processes of this job"):
        estimate_memory(tiny_gpt, layout=Candidate(3, tp=2, seq_len=16), device_type="cpu")
    with pytest.raises(ShardtrainError, match="neither an existing path"):
        estimate_memory("no/such/config.json", world_size=1)
    with pytest.raises(ShardtrainError, match="has no callable 'nope'"):
        estimate_memory("shardtrain.models.gpt:nope", world_size=1)
    with pytest.raises(ShardtrainError, match="not a built model"):
        estimate_memory(tiny_gpt(), world_size=1)
    with pytest.raises(ShardtrainError, match="not a size"):
        parse_bytes("lots")
    assert parse_bytes("16GiB") == 16 * 2**30 and parse_bytes("80GB") == 80 * 10**9 and parse_bytes("512MiB") == 2**29


def test_budget_lists_the_layouts_that_fit_fewest_ranks_then_least_memory():
    cfg = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    # planned for accelerators: on gloo the pairwise reduce-scatter's receive buffer puts world 2's stage-2 peak of
    # this 16-token model above world 1's stage 0
    common = {"seq_len": 16, "device_type": "cuda", "tp_plan": GPT_TP_PLAN}
    budget = estimate_memory(tiny_gpt, cfg, layout=Candidate(2, stage=2, seq_len=16), **common).peak["device"]
    largest = estimate_memory(tiny_gpt, cfg, layout=Candidate(1, stage=0, seq_len=16), **common)
    assert largest.peak["device"] > budget
    fits = fitting_layouts(tiny_gpt, budget, cfg, worlds=(1, 2), offload=False, **common)
    assert fits and all(e.peak["device"] <= budget for e in fits)
    described = [e.layout.describe() for e in fits]
    assert Candidate(2, stage=2, seq_len=16).describe() in described
    assert largest.layout.describe() not in described
    assert any(e.layout.tp == 2 for e in fits)  # tensor-parallel layouts are tried (with the plan given)
    keys = [(e.layout.world, e.peak["device"]) for e in fits]
    assert keys == sorted(keys)


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli_main(["estimate", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as done:
        cli_main(["estimate", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for option in (
        "--budget",
        "--worlds",
        "--jobs",
        "--world",
        "--stage",
        "--tp",
        "--mics-shard-size",
        "--ep",
        "--sp",
        "--seq-len",
    ):
        assert option in text
    assert "--offload-optimizer" in text


def test_cli_estimates_a_hugging_face_config_and_a_factory(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    hf.save_pretrained(tmp_path)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}))
    argv = [str(tmp_path), "--config", str(config), "--world", "2", "--seq-len", "32", "--json", "--state-only"]
    code, out, _ = _cli(capsys, *argv)
    assert code == 0
    report = json.loads(out)
    assert report["parameters"] == sum(p.numel() for p in LlamaForCausalLM(hf).parameters())
    assert report["layout"]["stage"] == 2 and report["layout"]["dtype"] == "bf16"  # from the config file
    api = estimate_memory(tmp_path, config, world_size=2, seq_len=32, activations=False)
    state_rows = {(r.component, r.where): r.nbytes for r in api.rows}
    assert all(state_rows[r["component"], r["where"]] == r["nbytes"] for r in report["rows"] if not r["transient"])
    # a factory, as a table; options override the config file
    code, out, _ = _cli(capsys, "test_estimate:tiny_gpt", "--config", str(config), "--stage", "3", "--seq-len", "16")
    assert code == 0 and "stage 3" in out and "optimizer state" in out and "peak: device" in out
    code, out, _ = _cli(
        capsys, "test_estimate:tiny_gpt", "--budget", "1KiB", "--worlds", "1", "--no-offload", "--seq-len", "16"
    )
    assert code == 1 and "no layout" in out
    code, _, err = _cli(capsys, "test_estimate:tiny_gpt", "--world", "3", "--tp", "2", "--seq-len", "16")
    assert code == 2 and "does not divide the 3 processes of this job" in err


def test_cli_ep_option_and_the_config_key(tmp_path, capsys):
    from transformers import MixtralConfig

    MixtralConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        max_position_embeddings=64,
    ).save_pretrained(tmp_path)
    argv = [str(tmp_path), "--world", "4", "--stage", "2", "--seq-len", "16", "--json", "--state-only"]
    reports = {}
    for ep in (1, 4):
        code, out, _ = _cli(capsys, *argv, "--ep", str(ep))
        assert code == 0
        reports[ep] = json.loads(out)
        assert reports[ep]["layout"]["ep"] == ep

    def row(ep: int, component: str) -> int:
        return next(r["nbytes"] for r in reports[ep]["rows"] if r["component"].startswith(component))

    # at stage 2 each rank keeps its parameters whole: with ep 4 one expert of the 4; its optimizer state is a
    # quarter of the experts either way (ZeRO shards over 4 ranks, or one whole expert over dp / ep = 1)
    assert row(4, "parameters") < row(1, "parameters")
    assert row(4, "optimizer state") == row(1, "optimizer state")
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"expert_parallel_size": 2, "zero_optimization": {"stage": 1}}))
    code, out, _ = _cli(capsys, str(tmp_path), "--config", str(config), "--world", "2", "--seq-len", "16", "--json",
                        "--state-only")  # fmt: skip
    assert code == 0 and json.loads(out)["layout"]["ep"] == 2 and json.loads(out)["layout"]["stage"] == 1
    code, _, err = _cli(capsys, *argv, "--ep", "3")
    assert code == 2 and "does not divide the data-parallel size 4" in err
    code, _, err = _cli(capsys, *argv, "--ep", "0")
    assert code == 2 and "--ep must be at least 1" in err


def test_cli_sp_option_and_the_config_key(tmp_path, capsys):
    argv = ["test_estimate:tiny_gpt", "--world", "4", "--stage", "2", "--seq-len", "16", "--json"]
    code, out, _ = _cli(capsys, *argv, "--sp", "2", "--state-only")
    assert code == 0 and json.loads(out)["layout"]["sp"] == 2
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"sequence_parallel_size": 4, "train_batch_size": 4}))
    code, out, _ = _cli(capsys, *argv, "--config", str(config))
    layout = json.loads(out)["layout"]
    assert code == 0 and (layout["sp"], layout["micro_batch"]) == (4, 4)  # dp 1: the 4 sequences on every rank
    code, _, err = _cli(capsys, *argv, "--sp", "3")
    assert code == 2 and "sequence_parallel_size 3 does not divide the 4 processes" in err
    code, _, err = _cli(capsys, *argv, "--sp", "0")
    assert code == 2 and "--sp must be at least 1" in err
    code, out, _ = _cli(capsys, "test_estimate:tiny_gpt", "--budget", "1TiB", "--worlds", "2", "--sp", "2",
                        "--no-offload", "--seq-len", "16", "--jobs", "1")  # fmt: skip
    assert code == 0 and "sp 2" in out


def _bytes_of(est) -> tuple:
    return est.layout, est.rows, est.compute, est.peak


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_fast_path_gives_the_reference_bytes(name):
    """The fast path (fake models reused between runs, only the whole-process peak tracked, layouts whose state alone
    is over the budget not run) gives the bytes of the reference path (torch's ``MemTracker`` as it is, a model built
    per run, every layout run), layout by layout, and the same layouts fit."""
    model, plan = (tiny_llama, None) if name == "llama" else (tiny_gpt, GPT_TP_PLAN)
    cfg = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    common = {"seq_len": 16, "device_type": "cpu", "tp_plan": plan}
    for layout in (
        Candidate(2, stage=3, dtype="bf16", micro_batch=2, seq_len=16),
        Candidate(2, stage=1, tp=2, seq_len=16, checkpointing=True),
    ):
        fast = estimate_memory(model, cfg, layout=layout, **common)
        assert _bytes_of(fast) == _bytes_of(estimate_memory(model, cfg, layout=layout, fast=False, **common))
    budget = estimate_memory(model, cfg, layout=Candidate(2, stage=2, seq_len=16), **common).peak["device"]
    for limit in (budget, 2**40):  # some layouts over the budget by their state alone; none
        fast = fitting_layouts(model, limit, cfg, worlds=(2,), **common)
        reference = fitting_layouts(model, limit, cfg, worlds=(2,), fast=False, **common)
        assert [_bytes_of(e) for e in fast] == [_bytes_of(e) for e in reference] and fast


@pytest.mark.parametrize(
    ("name", "dtype", "worlds"),
    # bf16 in soak: its path in the workers is fp32's; test_fast_path_gives_the_reference_bytes runs it by default
    [("gpt", "fp32", (3, 4)), pytest.param("gpt", "bf16", (4,), marks=pytest.mark.soak), ("llama", "fp32", (4,))],
)
def test_search_in_workers_gives_the_answer_of_one_process_and_of_the_reference(name, dtype, worlds):
    """The fake runs of a search spread over forked workers ([Note: fake runs in workers]) give, layout by layout,
    the rows and peaks of the same search in one process and of the reference path (torch's ``MemTracker`` as it
    is, a run per layout): every tensor-parallel size and stage with offload at world sizes 3 and 4, in fp32 and bf16
    (mixed precision drops each gradient after its accumulation); under a budget, the layouts that fit."""
    model, plan = (tiny_llama, None) if name == "llama" else (tiny_gpt, GPT_TP_PLAN)
    cfg = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    common = {"seq_len": 16, "device_type": "cpu", "tp_plan": plan}
    search = functools.partial(fitting_layouts, model, 2**40, cfg, worlds=worlds, dtype=dtype, **common)
    alone, spread = search(), search(workers=2)
    assert len(alone) > 10 and {1, 2} <= {e.layout.tp for e in alone}  # tp 3 divides no head count here
    assert [_bytes_of(e) for e in spread] == [_bytes_of(e) for e in alone]
    assert [_bytes_of(e) for e in search(fast=False)] == [_bytes_of(e) for e in alone]
    # a budget half of them fit: the layouts of the unbounded search under it, in the same order
    budget = sorted(e.peak["device"] for e in alone)[len(alone) // 2]
    tight = fitting_layouts(model, budget, cfg, worlds=worlds, dtype=dtype, workers=2, **common)
    assert [_bytes_of(e) for e in tight] == [_bytes_of(e) for e in alone if e.peak["device"] <= budget]
    with pytest.raises(ShardtrainError, match="workers must be at least 1"):
        fitting_layouts(model, 2**40, cfg, worlds=(1,), workers=0, **common)


def _worker_dies(i):
    import os

    os._exit(3)


def _worker_hangs(i):
    import time

    time.sleep(60)


def test_search_workers_that_die_or_hang_are_reported_not_waited_for(monkeypatch):
    from shardtrain.estimate import planner

    cfg = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    search = functools.partial(fitting_layouts, tiny_gpt, 2**40, cfg, worlds=(2,), seq_len=16, device_type="cpu")
    monkeypatch.setattr(planner, "_measure_index", _worker_dies)  # forked workers see the patched module
    with pytest.raises(ShardtrainError, match="a worker of the search died"):
        search(workers=2)
    monkeypatch.setattr(planner, "_measure_index", _worker_hangs)
    monkeypatch.setattr(planner, "RUN_TIMEOUT_S", 1.0)
    with pytest.raises(ShardtrainError, match=r"no fake run of the search finished in 1 s"):
        search(workers=2)


def test_progress_bar_shows_the_layouts_tried(monkeypatch, capsys):
    from shardtrain.estimate import planner

    monkeypatch.setattr(planner, "PROGRESS_DELAY_S", 0)
    cfg = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    fitting_layouts(tiny_gpt, 2**40, cfg, worlds=(1,), seq_len=16, device_type="cpu", offload=False, progress=True)
    assert "layouts:" in capsys.readouterr().err  # e.g. "layouts:  75%|...| 3/4 [...]"
    bars = []
    ticker = planner._ticker
    monkeypatch.setattr(planner, "_ticker", lambda bar: bars.append(bar) or ticker(bar))
    estimate_memory(tiny_gpt, cfg, world_size=1, seq_len=16, device_type="cpu", progress=True)
    # the fake run moved the bar: blocks forward, then parameter gradients (what is drawn depends on tqdm's refresh
    # interval, 0.1 s, which a fast run finishes within)
    (bar,) = bars
    assert bar.unit == "step" and bar.total > 1 and bar.n == bar.total


def test_parameter_offload_on_a_gpu_counts_the_unit_shards_in_host_memory():
    """``offload_param: cpu`` on CUDA ([Note: parameter uploads]): the unit shards the device held move to host
    memory, byte for byte, and the search tries it; without optimizer offload it is refused as initialize refuses it."""
    cfg = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    common = {"seq_len": 16, "device_type": "cuda", "activations": False}
    kept = estimate_memory(tiny_gpt, cfg, layout=Candidate(2, stage=3, offload_optimizer="cpu", dtype="bf16"), **common)
    layout = Candidate(2, stage=3, offload_optimizer="cpu", offload_param="cpu", dtype="bf16")
    moved = estimate_memory(tiny_gpt, cfg, layout=layout, **common)
    assert moved.state.params["host"] > 0
    assert moved.state.params["host"] + moved.state.params["device"] == kept.state.params["device"]
    assert moved.state.params["device"] < kept.state.params["device"] // 10  # buffers' whole parameters only
    assert moved.peak["host"] == kept.peak["host"] + moved.state.params["host"]
    # the host step's fp32 gradient copies are host memory too, one element per element stepped there (both runs)
    stepped = sum(f.length for b in kept.state.buckets if b.requires_grad for f in b.fragments)
    assert kept.state.grads["host"] == moved.state.grads["host"] == 4 * stepped
    assert any(r.where == "host" and r.component.startswith("parameters") and r.nbytes for r in moved.rows)
    # on a CPU-only machine 'cpu' is where the shards are: nothing moves
    on_cpu = estimate_memory(tiny_gpt, cfg, layout=layout, **{**common, "device_type": "cpu"})
    assert "host" not in on_cpu.state.params
    with pytest.raises(ConfigError, match="on CUDA is not built without offload_optimizer"):
        estimate_memory(tiny_gpt, cfg, layout=Candidate(2, stage=3, offload_param="cpu"), **common)
    searched = fitting_layouts(tiny_gpt, 2**40, cfg, worlds=(2,), offload=True, tp_plan=None, **common)
    assert {(e.layout.offload_optimizer, e.layout.offload_param) for e in searched if e.layout.stage == 3} >= {
        ("cpu", "cpu"),
        ("nvme", "nvme"),
    }
