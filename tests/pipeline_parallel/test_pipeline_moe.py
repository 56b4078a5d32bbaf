"""Mixture-of-experts models under pipeline parallelism against one process on the same global batch (losses every
step, gradient norms, final parameters with the experts reassembled; [Note: parity bounds]): Hugging Face Qwen2-MoE
and Mixtral with their load-balancing loss on (``output_router_logits``), served across stages ([Note: the router's
loss across stages]): pp 2 (world 2, Qwen2-MoE, 1F1B) and pp 2 x ep 2 (world 4, Mixtral, ZeRO 1); ZeRO 3 and
Interleaved1F1B, activation checkpointing, pp 2 x tp 2 and a pp 2 x ep 2 checkpoint (resumed bit for bit, loaded in one
process) under soak. The loss's arithmetic split over stages is transformers' own to the bit, and a model whose loss
is another function is refused by name."""

from __future__ import annotations

import pytest
import torch

import shardtrain
from shardtrain.errors import ConfigError
from shardtrain.pipeline_parallel import check_can_cut, cut_model
from shardtrain.pipeline_parallel.router_loss import StageRouters, _finish
from shardtrain.testing import run_distributed
from shardtrain.testing.parity import assert_parity, train_one_process

VOCAB, SEQ, LAYERS, EXPERTS = 32, 8, 4, 4
STEPS, GAS, MICRO, CLIP, LR = 2, 4, 1, 0.5, 1e-2


def make_moe(kind: str, router_loss: bool = True, seed: int = 0):
    """A tiny random ``kind`` (``qwen2_moe`` with its shared expert, or ``mixtral``; ``tied_mixtral`` with its head
    tied to the embedding) whose load-balancing loss is on (``output_router_logits``)."""
    import transformers

    torch.manual_seed(seed)
    shared = dict(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        num_experts_per_tok=2, initializer_range=0.2, max_position_embeddings=SEQ,
        tie_word_embeddings=kind.startswith("tied"), attn_implementation="eager", experts_implementation="eager",
        output_router_logits=router_loss, router_aux_loss_coef=0.1,
    )  # fmt: skip
    if kind == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(
            intermediate_size=24, moe_intermediate_size=12, shared_expert_intermediate_size=20, num_experts=EXPERTS,
            decoder_sparse_step=1, norm_topk_prob=False, **shared,
        )  # fmt: skip
        return transformers.Qwen2MoeForCausalLM(cfg)
    cfg = transformers.MixtralConfig(intermediate_size=12, num_local_experts=EXPERTS, head_dim=4, **shared)
    return transformers.MixtralForCausalLM(cfg)


def global_batches(dp: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (MICRO * dp, SEQ), generator=g) for _ in range(STEPS * GAS)]


def reference(kind: str, dp: int) -> dict:
    """One process: each micro-step's loss the mean of the data-parallel ranks' forwards on their rows (the
    load-balancing loss is over one forward's tokens, as under data parallelism)."""
    batches = global_batches(dp)

    def loss(model, i: int) -> torch.Tensor:
        rows = [batches[i][r * MICRO : (r + 1) * MICRO] for r in range(dp)]
        return sum(model(input_ids=x, labels=x).loss for x in rows) / dp

    def run(dtype: torch.dtype) -> dict:
        model = make_moe(kind).to(dtype)
        return train_one_process(model, torch.optim.AdamW(model.parameters(), lr=LR), loss, STEPS, GAS, CLIP)

    model = make_moe(kind)
    ref = train_one_process(model, torch.optim.AdamW(model.parameters(), lr=LR), loss, STEPS, GAS, CLIP)
    model.eval()
    with torch.no_grad():  # the trained model on the first step's micro-batches, the load-balancing loss included
        ref["eval"] = sum(float(loss(model, i)) for i in range(GAS)) / GAS
    ref["exact"] = run(torch.float64)["params"]
    return ref


def pipeline_run(
    kind: str, pp: int, ep: int, stage: int, schedule: str, tp: int = 1, extra: dict | None = None
) -> dict:
    model = make_moe(kind)
    config = {
        **(extra or {}),
        "pipeline_parallel_size": pp,
        "expert_parallel_size": ep,
        "tensor_parallel": {"size": tp},
        "pipeline": {"schedule": schedule, "stages_per_rank": 2 if schedule == "Interleaved1F1B" else 1},
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "collective_timeout_s": 120.0,
    }
    engine = shardtrain.initialize(model, config, optimizer=torch.optim.AdamW(model.parameters(), lr=LR))
    t = engine.topology
    rows = slice(t.dp_rank * MICRO, (t.dp_rank + 1) * MICRO)
    batches = [{"input_ids": x[rows], "labels": x[rows]} for x in global_batches(t.dp)]
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    calls = [0]
    hooks = [r.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for r in routers]
    losses, norms = [], []
    for step in range(STEPS):
        calls[0] = 0  # the first step also runs torch's inference of the stages' shapes
        losses.append(float(engine.train_batch(iter(batches[step * GAS : (step + 1) * GAS]))))
        norms.append(engine.get_global_grad_norm())
    # the routers' runs in the last step: once per micro-batch, twice where they are recomputed in backward
    router_runs = calls[0] / (GAS * len(routers))
    for h in hooks:
        h.remove()
    evaluated = float(engine.eval_batch(iter(batches[:GAS])))
    held = {n: m.expert_range for n, m in model.named_modules() if hasattr(m, "expert_range")}
    out = {"losses": losses, "norms": norms, "params": engine.full_state_dict(), "held": held, "ep": t.ep}
    out |= {"router_runs": router_runs, "eval": evaluated, "state_bytes": engine.state_bytes(), "config": config}
    engine.close()
    return out


def check(
    kind: str, pp: int, ep: int, world: int, stage: int = 0, schedule: str = "1F1B", tp: int = 1, **extra: dict
) -> list[dict]:
    results = run_distributed(pipeline_run, world, kind, pp, ep, stage, schedule, tp, extra, timeout=300.0)
    assert all(r["ep"] == ep for r in results)
    if ep > 1:  # each rank of a stage holds EXPERTS / ep of its layers' experts
        per_rank = EXPERTS // ep
        assert all(len(r["held"]) == LAYERS // pp for r in results), [r["held"] for r in results]
        assert {first for r in results for first, _ in r["held"].values()} == {0, per_rank}
    ref = reference(kind, world // (pp * tp))
    assert_parity(results, ref)
    for r in results:  # eval_batch of the trained stages: one process's evaluation of its trained model
        assert abs(r["eval"] - ref["eval"]) <= 1e-5 * abs(ref["eval"]), (r["eval"], ref["eval"])
    return results


def test_router_loss_split_over_stages_is_transformers_own():
    """The sums carried across a cut after layer 1 of 3, finished on the last stage, give transformers'
    load_balancing_loss_func of all three layers' logits to the bit, value and gradient."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    logits = torch.randn(3, 10, EXPERTS, generator=torch.Generator().manual_seed(3), requires_grad=True)
    theirs = load_balancing_loss_func(tuple(logits.unbind(0)), EXPERTS, 2, None)
    (expected,) = torch.autograd.grad(theirs, logits)
    first, last = StageRouters([], 0, EXPERTS, 2), StageRouters([], 0, EXPERTS, 2)
    sent = first.continued(first.start(torch.device("cpu")), list(logits.unbind(0))[:1])
    received = sent.detach().requires_grad_()  # what the next stage gets, and sends a gradient back for
    ours = _finish(last.continued(received, list(logits.unbind(0))[1:]), 30.0)
    (to_first,) = torch.autograd.grad(ours, received, retain_graph=True)
    (later,) = torch.autograd.grad(ours, logits)
    (earlier,) = torch.autograd.grad(sent, logits, to_first)
    assert torch.equal(ours, theirs)
    assert torch.equal(earlier + later, expected)


def test_a_stage_returns_the_routers_sums_and_the_last_adds_the_loss():
    """Cut without processes: the first of two stages sends its hidden states and the sums of its layers' routers;
    the last stage's loss is transformers' whole-model loss (cross-entropy plus the weighted load-balancing loss)."""
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    whole = make_moe("qwen2_moe")
    expected = whole(input_ids=ids, labels=ids).loss
    firsts, _ = cut_model(make_moe("qwen2_moe"), 2, [0])
    lasts, loss = cut_model(make_moe("qwen2_moe"), 2, [1])
    hidden, sums = firsts[0](ids)
    assert hidden.shape == (2, SEQ, 16) and sums.shape == (2, EXPERTS) and sums.requires_grad
    assert sums[0].sum() == 2 * SEQ * 2 * (LAYERS // 2)  # top-2 picks of every row of the first stage's layers
    out = lasts[0](hidden, sums)
    assert torch.allclose(loss(out, ids), expected, rtol=1e-6, atol=0)
    without = make_moe("qwen2_moe", router_loss=False)
    parts, plain = cut_model(without, 2, [0, 1])
    assert torch.is_tensor(parts[0](ids)) and plain(parts[1](parts[0](ids)), ids) < expected


def test_a_load_balancing_loss_of_another_form_is_refused(monkeypatch):
    import transformers.models.qwen2_moe.modeling_qwen2_moe as qwen2_moe

    def z_loss_too(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        return torch.stack([g.logsumexp(-1).square().mean() for g in gate_logits]).mean()

    monkeypatch.setattr(qwen2_moe, "load_balancing_loss_func", z_loss_too)
    model = make_moe("qwen2_moe")
    refused = r"output_router_logits under pipeline parallelism.*load_balancing_loss_func"
    with pytest.raises(ConfigError, match=refused):
        check_can_cut(model, 2)  # initialize's check, before the model is touched
    with pytest.raises(ConfigError, match=refused):
        cut_model(model, 2, [0])
    assert len(model.model.layers) == LAYERS  # refused before anything was pruned


def test_qwen2_moe_pp2_1f1b():
    assert [r["router_runs"] for r in check("qwen2_moe", pp=2, ep=1, world=2)] == [1, 1]


def test_mixtral_pp2_ep2_zero1():
    check("mixtral", pp=2, ep=2, world=4, stage=1)


def test_tied_mixtral_pp2_ep2_zero0():
    """The head tied to the embedding across the first and last stage, beside experts: at ZeRO 0 the norm sums the
    expert squares over the expert group and counts the tied weight once (the first stage's). Mixtral, not Qwen2-MoE:
    with these batches one element of Qwen2-MoE's last key bias has a gradient of 3e-9, under AdamW's eps, where a
    summation order moves its step by percents (the case [Note: parity bounds] describes)."""
    check("tied_mixtral", pp=2, ep=2, world=4, stage=0)


@pytest.mark.soak
@pytest.mark.parametrize("stage", [1, 3])
def test_mixtral_pp2_ep2_estimate_is_the_engine_s(stage):
    """ZeRO 3 composes too; and ``shardtrain estimate``'s model state of each pipeline rank at pp 2 x ep 2 (the
    stage's dense parameters over its two data-parallel ranks, its experts split over them) is what the engine's
    first rank of that stage holds, byte for byte."""
    from shardtrain.estimate import estimate_memory

    results = check("mixtral", pp=2, ep=2, world=4, stage=stage)
    for pp_rank, held in ((0, results[0]), (1, results[2])):
        est = estimate_memory(
            lambda: make_moe("mixtral"), held["config"], world_size=4, seq_len=SEQ, device_type="cpu",
            pp_rank=pp_rank, activations=False,
        )  # fmt: skip
        assert est.model_state() == held["state_bytes"], (pp_rank, est.model_state(), held["state_bytes"])


@pytest.mark.soak
def test_qwen2_moe_pp2_ep2_interleaved():
    check("qwen2_moe", pp=2, ep=2, world=4, stage=1, schedule="Interleaved1F1B")


@pytest.mark.soak
def test_mixtral_pp2_tp2():
    """Tensor parallelism in each stage: the stages' shapes given, the routers' sums among them ([Note: stage
    shapes given, not inferred])."""
    check("mixtral", pp=2, ep=1, world=4, stage=1, tp=2)


@pytest.mark.soak
def test_qwen2_moe_pp2_ep2_activation_checkpointing():
    """The blocks recomputed in backward: the routers run again there, outside the stage's forward, and are not
    recorded twice; the load-balancing loss's gradient reaches them through the recomputation."""
    results = check("qwen2_moe", pp=2, ep=2, world=4, stage=1, activation_checkpointing={"policy": "full"})
    assert [r["router_runs"] for r in results] == [2, 2, 2, 2]


def _checkpoint_engine(pp: int, ep: int, seed: int) -> shardtrain.Engine:
    model = make_moe("mixtral", seed=seed)
    config = {
        "pipeline_parallel_size": pp,
        "expert_parallel_size": ep,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "zero_optimization": {"stage": 1},
    }
    return shardtrain.initialize(model, config, optimizer=torch.optim.AdamW(model.parameters(), lr=LR))


def _save_and_resume(path: str) -> dict:
    """A step at pp 2 x ep 2, a save, a second step; then an engine of other initial weights loads the save and
    takes the second step again."""
    engine = _checkpoint_engine(2, 2, seed=0)
    t = engine.topology
    rows = slice(t.dp_rank * MICRO, (t.dp_rank + 1) * MICRO)
    batches = [{"input_ids": x[rows], "labels": x[rows]} for x in global_batches(t.dp)]
    engine.train_batch(iter(batches[:GAS]))
    engine.save_checkpoint(path, tag="step1")
    out = {"saved": engine.full_state_dict(), "straight": float(engine.train_batch(iter(batches[GAS:])))}
    out["final"] = engine.full_state_dict()
    engine.close()
    resumed = _checkpoint_engine(2, 2, seed=1)
    resumed.load_checkpoint(path, tag="step1")
    out["resumed"] = float(resumed.train_batch(iter(batches[GAS:])))
    out["resumed final"] = resumed.full_state_dict()
    resumed.close()
    return out


def _load_whole(path: str) -> dict:
    engine = _checkpoint_engine(1, 1, seed=1)
    engine.load_checkpoint(path, tag="step1")
    loaded = engine.full_state_dict()
    engine.close()
    return loaded


@pytest.mark.soak
def test_pp2_ep2_checkpoint_resumes_exactly_and_loads_in_one_process(tmp_path):
    """Each stage's ranks write their experts' rows into one manifest of the model's tensors: a pp 2 x ep 2 save
    resumes bit for bit (losses and parameters) and loads without pipelining or expert parallelism, whole."""
    path = str(tmp_path / "ckpt")
    first = run_distributed(_save_and_resume, 4, path, timeout=300.0)[0]
    assert first["resumed"] == first["straight"]
    assert first["final"].keys() == first["resumed final"].keys()
    assert all(torch.equal(v, first["resumed final"][k]) for k, v in first["final"].items())
    (whole,) = run_distributed(_load_whole, 1, path)
    assert whole.keys() == first["saved"].keys()
    assert all(torch.equal(whole[k], v) for k, v in first["saved"].items())
    assert any(k.endswith("experts.gate_up_proj") and v.shape[0] == EXPERTS for k, v in whole.items())


def test_a_sequence_split_beside_the_load_balancing_loss_is_refused_by_name():
    """Each rank's routers would see its share of the tokens only: refused before the model is touched; without the
    loss the same model may split its sequence."""
    from shardtrain.pipeline_parallel.cut import check_can_split_sequence

    with pytest.raises(ConfigError, match=r"sequence_parallel_size 2 x context_parallel_size 1 and a mixture"):
        check_can_split_sequence(make_moe("mixtral"), 2, 1)
    check_can_split_sequence(make_moe("mixtral", router_loss=False), 1, 2)
