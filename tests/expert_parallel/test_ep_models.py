"""Expert parallelism on more transformers mixture-of-experts models, against one process on the same global batch
(losses, each rank's load-balancing loss, global gradient norms, final parameters with the experts reassembled):

* Qwen2-MoE: a shared expert behind its sigmoid gate;
* DeepSeek-V3: shared experts, MLA attention, a first dense layer (``first_k_dense_replace``), group-limited routing
  (``n_group`` / ``topk_group``) and a nonzero routing bias (``e_score_correction_bias``);
* gpt-oss: expert biases, its clamped SwiGLU, a router with a bias, attention sinks;
* transformers' activation checkpointing (gradient checkpointing) under expert parallelism at ZeRO stage 2;
* dropless: a routing bias that sends every token of every rank to one expert, which then computes all of them.

ep 2 at world 2 in the default run (gpt-oss also with the grouped_mm experts); marked soak, ep 3 at world 3 (DeepSeek-V3
with 6 experts in 3 groups, gpt-oss, Qwen2-MoE with torch's reentrant checkpoint) and world 4 (DeepSeek-V3 at ep 2 x
dp 2, Qwen2-MoE at ep 4 with checkpointing)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardtrain
from shardtrain.errors import ConfigError
from shardtrain.expert_parallel import declared_ep_plan, experts_to_split
from shardtrain.testing import run_distributed

MICRO, SEQ, VOCAB, LR = 1, 6, 32, 1e-2
LAYER0_PLAN = {"": "ep_dispatch_experts", ".gate_up_proj": "grouped_gemm", ".down_proj": "grouped_gemm"}


def make_model(
    kind: str, experts: int, top_k: int = 2, bias: str = "random", plan: str = "", implementation: str = "eager"
):
    """A tiny random model of ``kind``. DeepSeek-V3's routing bias: ``"random"`` (small values of both signs) or
    ``"one"`` (expert 5 far ahead of the others: every token goes to it). ``plan="layer 0"``: an expert-parallel plan
    that splits the experts of layer 0 only."""
    import transformers

    torch.manual_seed(0)
    shared = dict(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts_per_tok=top_k, initializer_range=0.2, max_position_embeddings=32, tie_word_embeddings=False,
        attn_implementation="eager", experts_implementation=implementation,
    )  # fmt: skip
    aux = dict(output_router_logits=True, router_aux_loss_coef=0.1)
    if kind == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(
            intermediate_size=24, moe_intermediate_size=12, shared_expert_intermediate_size=20, num_experts=experts,
            decoder_sparse_step=1, norm_topk_prob=False, **shared, **aux,
        )  # fmt: skip
        model = transformers.Qwen2MoeForCausalLM(cfg)
        if plan == "layer 0":  # transformers' plan, set on the model: layer 1's experts stay whole on every rank
            model.ep_plan = {f"model.layers.0.mlp.experts{w}": s for w, s in LAYER0_PLAN.items()}
        return model
    if kind == "gpt_oss":
        cfg = transformers.GptOssConfig(
            intermediate_size=12, num_local_experts=experts, head_dim=4, sliding_window=4, **shared, **aux
        )
        return transformers.GptOssForCausalLM(cfg)
    assert kind == "deepseek_v3", kind
    # MLA: every head has its own keys and values (num_key_value_heads = num_attention_heads)
    shared.update(num_hidden_layers=3, num_key_value_heads=4)
    cfg = transformers.DeepseekV3Config(
        intermediate_size=24, moe_intermediate_size=12, n_routed_experts=experts, n_shared_experts=1,
        first_k_dense_replace=1, n_group=experts // 2 if experts % 4 else 2, topk_group=1 if experts % 4 == 0 else 2,
        routed_scaling_factor=2.5, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
        v_head_dim=4, head_dim=4, norm_topk_prob=top_k > 1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **shared,
    )  # fmt: skip
    model = transformers.DeepseekV3ForCausalLM(cfg)
    g = torch.Generator().manual_seed(2)
    for layer in model.model.layers[cfg.first_k_dense_replace :]:
        routing_bias = layer.mlp.gate.e_score_correction_bias
        if bias == "one":
            routing_bias.zero_()[5] = 10.0  # sigmoid scores are in (0, 1): expert 5 always wins, its group too
        else:
            routing_bias.copy_(0.2 * torch.randn(experts, generator=g))
    return model


def global_batches(world: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (MICRO * world, SEQ), generator=g) for _ in range(n)]


def _forward(model, ids: torch.Tensor):
    out = model(input_ids=ids, labels=ids)
    aux = getattr(out, "aux_loss", None)
    return out.loss, (float(aux.detach()) if aux is not None else None)


def _model(case: dict, **more):
    kwargs = {k: case[k] for k in ("top_k", "bias", "plan", "implementation") if k in case}
    return make_model(case["kind"], case["experts"], **{**kwargs, **more})


def _checkpointing(model, case: dict) -> None:
    """transformers' activation checkpointing: ``True`` its default (torch's non-reentrant checkpoint),
    ``"reentrant"`` torch's reentrant one."""
    if case.get("checkpointing"):
        kwargs = {"use_reentrant": case["checkpointing"] == "reentrant"}
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)


def reference(case: dict, world: int) -> dict:
    """One process, the whole global batch: each micro-step's loss is the mean of the losses of the ranks' rows (the
    load-balancing loss is over a rank's tokens, as in data parallelism). No activation checkpointing, except the
    reentrant one: under it transformers' load-balancing loss does not reach the layers' parameters (the router logits
    it captures are computed under no_grad), in one process as here, so the reference runs it too."""
    model = _model(case, plan="")
    if case.get("checkpointing") == "reentrant":
        _checkpointing(model, case)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    gas, clip = case["gas"], case["clip"]
    batches = global_batches(world, case["steps"] * gas)
    losses, norms, aux = [], [], []
    for step in range(case["steps"]):
        total = 0.0
        for m in range(gas):
            ids = batches[step * gas + m]
            parts = [_forward(model, ids[r * MICRO : (r + 1) * MICRO]) for r in range(world)]
            loss = sum(p[0] for p in parts) / world
            aux.append([p[1] for p in parts])
            (loss / gas).backward()
            total += loss.item() / gas
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "norms": norms, "aux": aux, "params": model.state_dict(), "init": init}


def _train(case: dict) -> dict:
    """This rank's run: its rows of every global micro-batch. Returns its losses, load-balancing losses, the global
    norms, the tokens each expert got from this rank per MoE layer in the first forward, how many times the routers
    ran in the first micro-step, its state dict and the experts it holds."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(case)
    _checkpointing(model, case)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": case["gas"],
        "gradient_clipping": case["clip"],
        "zero_optimization": {"stage": case["stage"]},
        "expert_parallel_size": case["ep"],
        "collective_timeout_s": 120.0,
    }
    engine = shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters(), lr=LR))
    routed: list[torch.Tensor] = []
    routers = [m for n, m in model.named_modules() if n.endswith(("mlp.gate", "mlp.router"))]
    hooks = [r.register_forward_hook(lambda _m, _i, out: routed.append(out[2].flatten())) for r in routers]
    batches = global_batches(world, case["steps"] * case["gas"])
    losses, norms, aux, router_calls = [], [], [], None
    for step in range(case["steps"]):
        total = 0.0
        for m in range(case["gas"]):
            ids = batches[step * case["gas"] + m][rank * MICRO : (rank + 1) * MICRO]
            loss, a = _forward(engine, ids)
            aux.append(a)
            engine.backward(loss)
            engine.step()
            router_calls = len(routed) if router_calls is None else router_calls  # forward and any recompute
            total += loss.item() / case["gas"]
        losses.append(total)
        norms.append(engine.get_global_grad_norm())
    for h in hooks:
        h.remove()
    counts = [torch.bincount(r, minlength=case["experts"]).tolist() for r in routed[: len(routers)]]
    held = {n: m.expert_range for n, m in model.named_modules() if hasattr(m, "expert_range")}
    state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    engine.close()
    return {"losses": losses, "norms": norms, "aux": aux, "counts": counts, "held": held, "state": state,
            "router_calls": router_calls, "routers": len(routers)}  # fmt: skip


def _runs(cases: list[dict]) -> list[dict]:
    """Every case on the same ranks (one start of the processes)."""
    return [_train(case) for case in cases]


def _unbuilt(kind: str):
    """Tiny models whose experts (or plan entries) expert parallelism does not split."""
    import transformers

    torch.manual_seed(0)
    small = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    if kind == "llama4":  # every token pre-scaled by its router score goes to every expert
        cfg = transformers.Llama4TextConfig(intermediate_size=12, intermediate_size_mlp=24, num_local_experts=4,
                                            head_dim=4, **small)  # fmt: skip
        return transformers.Llama4ForCausalLM(cfg)
    if kind == "dbrx":  # experts' weights [num_experts * ffn, hidden], not one row per expert
        cfg = transformers.DbrxConfig(
            d_model=16, n_heads=4, n_layers=1, vocab_size=VOCAB, attn_config={"kv_n_heads": 2, "rope_theta": 1e4},
            ffn_config={"ffn_hidden_size": 12, "moe_num_experts": 4, "moe_top_k": 2},
        )  # fmt: skip
        return transformers.DbrxForCausalLM(cfg)
    if kind == "switch":  # one module per expert, top-1 routing with a capacity, and a router z-loss
        cfg = transformers.SwitchTransformersConfig(
            vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_decoder_layers=2, num_heads=4,
            num_experts=4, expert_capacity=8, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
        )  # fmt: skip
        return transformers.SwitchTransformersForConditionalGeneration(cfg)
    model = make_model("qwen2_moe", 4)
    if kind == "distributed by transformers":  # what from_pretrained(distributed_config=...) marks on the model
        model._is_distributed_loading_by_transformers = True
    elif kind == "colwise plan":  # the shape of Gemma 4's plan: a dense layer split over the expert group
        model.ep_plan = {**model.ep_plan, "model.layers.*.mlp.shared_expert.gate_proj": "colwise"}
    else:  # a plan that dispatches to experts whose down_proj it leaves whole
        model.ep_plan = {k: v for k, v in model.ep_plan.items() if not k.endswith("down_proj")}
    return model


def _gather(results: list[dict], ep: int) -> dict:
    """The full state dict from the ranks of the first expert group: expert weights concatenated in expert order."""
    full = dict(results[0]["state"])
    for name, (first, _) in results[0]["held"].items():
        assert first == 0
        for k in [k for k in full if k.startswith(name + ".")]:
            parts = [r["state"][k] for r in results[:ep]]
            assert [r["held"][name][0] for r in results[:ep]] == [i * parts[0].shape[0] for i in range(ep)]
            full[k] = torch.cat(parts)
    return full


def _assert_parity(results: list[dict], ref: dict, ep: int, what: str) -> None:
    world = len(results)
    for s, b in enumerate(ref["losses"]):
        a = sum(r["losses"][s] for r in results) / world
        assert abs(a - b) <= 2e-5 * abs(b), f"{what}: step {s}: loss {a} vs reference {b}"
    for r in results:
        for s, (a, b) in enumerate(zip(r["norms"], ref["norms"])):
            assert abs(a - b) <= 1e-4 * abs(b), f"{what}: step {s}: grad norm {a} vs reference {b}"
    for rank, r in enumerate(results):  # each rank's load-balancing loss is one process's on its tokens
        for i, (a, b) in enumerate(zip(r["aux"], ref["aux"])):
            if b[rank] is None:  # the model computes none (DeepSeek-V3 balances with its routing bias)
                assert a is None, f"{what}: micro-step {i} rank {rank}: aux {a}, one process none"
                continue
            assert abs(a - b[rank]) <= 2e-5 * abs(b[rank]), f"{what}: micro-step {i} rank {rank}: aux {a} vs {b}"
    full = _gather(results, ep)
    assert full.keys() == ref["params"].keys(), what
    for k, w in ref["params"].items():
        if not w.is_floating_point() or k.endswith("e_score_correction_bias"):  # buffers: equal, not trained
            assert torch.equal(full[k], w.float()), f"{what}: {k}"
            continue
        moved = (w - ref["init"][k]).norm().item()
        err = (full[k] - w).norm().item()
        assert moved > 0, f"{what}: {k} did not move: the check proves nothing"
        assert err <= 5e-3 * moved, f"{what}: {k}: error {err:.3g} vs distance moved {moved:.3g}"


def _case(kind: str, stage: int, **more) -> dict:
    return {"kind": kind, "experts": 8, "ep": 2, "stage": stage, "steps": 2, "gas": 1, "clip": 0.0, **more}


WORLD2 = {
    # every token of every rank to expert 5 (top-1), held by rank 1: no capacity, no token dropped; rank 0 receives no
    # row and must still take part in the backward exchanges
    "dropless": _case("deepseek_v3", 2, top_k=1, bias="one"),
    "qwen2_moe": _case("qwen2_moe", 2, gas=2, clip=0.5),  # the shared expert and its sigmoid gate, accumulation
    "deepseek_v3": _case("deepseek_v3", 1, clip=0.5),  # MLA, a dense first layer, group-limited biased routing
    "gpt_oss": _case("gpt_oss", 2, clip=0.5),  # expert biases, its own activation
    # transformers' grouped_mm experts (the biases added per row), one process running the same implementation
    "gpt_oss grouped_mm": _case("gpt_oss", 2, implementation="grouped_mm"),
    "checkpointing": _case("qwen2_moe", 2, checkpointing=True),  # recomputed forward: the exchange runs again
    "plan": _case("qwen2_moe", 1, plan="layer 0"),  # the model's own plan: only layer 0's experts split
}
WORLD3 = {
    "deepseek_v3 ep 3": _case("deepseek_v3", 2, experts=6, ep=3, clip=0.5),  # 6 experts in 3 groups
    "gpt_oss ep 3": _case("gpt_oss", 1, experts=6, ep=3, gas=2),
    "qwen2_moe ep 3 reentrant": _case("qwen2_moe", 2, experts=6, ep=3, checkpointing="reentrant"),
}


WORLD4 = {  # ep 2 x dp 2: expert buckets over the 2 ranks holding the same experts, dense ones over 4
    "deepseek_v3 ep 2 x dp 2": _case("deepseek_v3", 2, clip=0.5),
    "qwen2_moe ep 4": _case("qwen2_moe", 1, ep=4, gas=2, checkpointing=True),
}


@pytest.fixture(scope="module")
def world2() -> dict[str, list[dict]]:
    runs = run_distributed(_runs, 2, list(WORLD2.values()), timeout=300)
    return {name: [r[i] for r in runs] for i, name in enumerate(WORLD2)}


def _check(results: list[dict], case: dict, what: str) -> None:
    _assert_parity(results, reference(case, len(results)), case["ep"], what)


@pytest.mark.parametrize("name", ["qwen2_moe", "deepseek_v3", "gpt_oss", "gpt_oss grouped_mm"])
def test_model_trains_like_one_process_under_expert_parallelism(world2, name):
    _check(world2[name], WORLD2[name], name)
    assert [r["held"] for r in world2[name]][1]  # the experts were split
    if not name.startswith("deepseek_v3"):  # the load-balancing loss was there to compare
        assert all(a is not None and a > 0 for r in world2[name] for a in r["aux"])


def test_deepseek_v3_keeps_its_first_dense_layer_and_group_limited_routing(world2):
    results = world2["deepseek_v3"]
    assert sorted(results[0]["held"]) == ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]
    # n_group 2, topk_group 1: each token's two experts lie in one group of four
    for r in results:
        assert r["counts"] and all(sum(row) == MICRO * SEQ * 2 for row in r["counts"])


def test_activation_checkpointing_at_stage_2_trains_like_one_process(world2):
    results = world2["checkpointing"]
    _check(results, WORLD2["checkpointing"], "gradient checkpointing")
    # each router ran twice in the first micro-step: the forward and its recomputation in backward
    assert all(r["router_calls"] == 2 * r["routers"] for r in results), [r["router_calls"] for r in results]
    assert all(r["router_calls"] == r["routers"] for r in world2["qwen2_moe"])


def test_a_routing_that_sends_every_token_to_one_expert_drops_none(world2):
    results = world2["dropless"]
    _check(results, WORLD2["dropless"], "dropless")
    for r in results:  # every token of the rank went to expert 5, on rank 1; a capacity factor would drop most
        assert r["counts"] == [[MICRO * SEQ if e == 5 else 0 for e in range(8)]] * 2, r["counts"]
    assert [r["held"]["model.layers.1.mlp.experts"] for r in results] == [(0, 4), (4, 8)]


@pytest.mark.soak
def test_models_with_ep_3_train_like_one_process():
    runs = run_distributed(_runs, 3, list(WORLD3.values()), timeout=600)
    for i, (name, case) in enumerate(WORLD3.items()):
        results = [r[i] for r in runs]
        _check(results, case, name)
        assert [sorted(r["held"].values())[0] for r in results] == [(0, 2), (2, 4), (4, 6)], name
    reentrant = [r[2] for r in runs]  # recomputed by torch's reentrant checkpoint: each router ran twice
    assert all(r["router_calls"] == 2 * r["routers"] for r in reentrant), [r["router_calls"] for r in reentrant]


@pytest.mark.soak
def test_models_at_world_4_train_like_one_process():
    runs = run_distributed(_runs, 4, list(WORLD4.values()), timeout=600)
    for i, (name, case) in enumerate(WORLD4.items()):
        _check([r[i] for r in runs], case, name)


def test_the_model_s_expert_parallel_plan_decides_which_experts_are_split(world2):
    results = world2["plan"]
    assert [sorted(r["held"].items()) for r in results] == [
        [("model.layers.0.mlp.experts", (0, 4))],
        [("model.layers.0.mlp.experts", (4, 8))],
    ]
    _check(results, WORLD2["plan"], "a plan splitting layer 0 only")  # layer 1's experts trained whole, as dense


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("llama4", "model.layers.0.feed_forward.experts is a Llama4TextExperts: its forward takes no routing"),
        ("dbrx", "transformer.blocks.0.ffn.experts is a DbrxExperts: its weights are not one row per expert"),
        ("switch", "encoder.block.1.layer.1.mlp.experts is a SwitchTransformersExperts: a list of one module per"),
        ("colwise plan", "has 'model.layers.*.mlp.shared_expert.gate_proj': 'colwise', which is not built"),
        ("half plan", "dispatches tokens to model.layers.0.mlp.experts but does not split its weight down_proj"),
        ("distributed by transformers", "Qwen2MoeForCausalLM was already distributed by transformers"),
    ],
)
def test_experts_and_plans_expert_parallelism_does_not_split_are_refused_by_name(kind, words):
    # what initialize says at ep 2, before anything is split (install_expert_parallel asks experts_to_split first)
    with pytest.raises(ConfigError) as refused:
        experts_to_split(_unbuilt(kind), 2)
    assert words in str(refused.value) and "expert_parallel_size (ep_size) 2" in str(refused.value), refused.value


def test_plans_are_read_as_transformers_declares_them():
    model = make_model("gpt_oss", 8)
    assert declared_ep_plan(model) == {
        f"model.layers.*.mlp.experts{w}": "grouped_gemm" if w else "ep_dispatch_experts"
        for w in ("", ".gate_up_proj", ".gate_up_proj_bias", ".down_proj", ".down_proj_bias")
    }
    assert list(experts_to_split(model, 2)) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    wrapped = torch.nn.ModuleDict({"lm": model})  # a transformers model inside the user's module: its names prefixed
    assert list(experts_to_split(wrapped, 4)) == ["lm.model.layers.0.mlp.experts", "lm.model.layers.1.mlp.experts"]


# -- DeepSpeed-MoE's and AutoEP's keys ([Note: DeepSpeed's MoE keys] in config/deepspeed_keys.py) --------------------


def _load(extra: dict):
    from shardtrain.config.sections import load_config

    return load_config({"train_micro_batch_size_per_gpu": 1, **extra})


@pytest.mark.parametrize(
    "section",
    [
        # what DeepSpeed-MoE computes with drop_tokens false: every token to its experts, the router as it is
        {"moe": {"enabled": True, "ep_size": 2, "drop_tokens": False, "capacity_factor": 1.25, "min_capacity": 4,
                 "eval_capacity_factor": 2.0, "use_rts": True, "use_tutel": False, "use_residual": False,
                 "noisy_gate_policy": None, "type": "standard", "top2_2nd_expert_sampling": False,
                 "enable_expert_tensor_parallelism": False}},
        # AutoEP at its defaults: the model's own routing, found from the model
        {"expert_parallel": {"enabled": True, "autoep_size": 2, "expert_tensor_parallel_size": 1,
                             "use_grouped_mm": True, "preset_model": "mixtral", "route_norm": None,
                             "route_scale": 1.0, "score_apply": "auto", "score_func": "auto", "top_k": "auto",
                             "routed_scaling_factor": "auto", "combine_impl": "weighted_sum",
                             "num_expert_groups": None, "load_balance_coeff": None, "expert_pattern": None}},
        {"moe": {"ep_size": 2}, "expert_parallel_size": 2},  # the same size twice
    ],
)  # fmt: skip
def test_deepspeed_moe_keys_that_say_what_the_model_does_are_accepted(section):
    assert _load(section).expert_parallel_size == 2


def test_autoep_turned_off_splits_nothing():
    assert _load({"expert_parallel": {"enabled": False, "autoep_size": 2}}).expert_parallel_size == 1


@pytest.mark.parametrize(
    ("section", "words"),
    [
        ({"moe": {"ep_size": 2, "capacity_factor": 1.0}}, "moe.capacity_factor: DeepSpeed-MoE drops the tokens over"),
        ({"moe": {"min_capacity": 4, "drop_tokens": True}}, "moe.drop_tokens: true is not supported"),
        ({"moe": {"eval_capacity_factor": 1.0}}, "add `drop_tokens: false`"),
        ({"moe": {"noisy_gate_policy": "Jitter"}}, "moe.noisy_gate_policy: 'Jitter' is not supported"),
        ({"moe": {"noisy_gate_policy": "RSample"}}, "which this value would change"),
        ({"moe": {"use_residual": True}}, "moe.use_residual: true is not supported: Residual MoE"),
        ({"moe": {"type": "residual"}}, "moe.type: 'residual' is not supported"),
        ({"moe": {"top2_2nd_expert_sampling": True}}, "samples each token's second expert with Gumbel noise"),
        ({"moe": {"enable_expert_tensor_parallelism": True}}, "experts split over tensor-parallel ranks"),
        ({"moe": {"k": 2}}, "moe.k: a DeepSpeed key shardtrain does not support (the top-k is the model's own"),
        ({"moe": {"num_experts": 8}}, "the number of experts is the model's own"),
        ({"moe": {"enabled": False}}, "moe.enabled: false is not supported"),
        ({"moe": {"ep_size": 2}, "expert_parallel_size": 4}, "moe.ep_size: 2 differs from expert_parallel_size 4"),
        (
            {"moe": {"ep_size": 2}, "expert_parallel": {"enabled": True, "autoep_size": 4}},
            "expert_parallel.autoep_size: 4 differs from moe.ep_size 2",
        ),
        ({"moe": {"ep_sise": 2}}, "moe.ep_sise: unknown key 'ep_sise'; did you mean 'ep_size'?"),
        ({"moe": 2}, "moe: expected a section"),
        ({"expert_parallel": {"enabled": True, "top_k": 4}}, "expert_parallel.top_k: 4 is not supported"),
        ({"expert_parallel": {"enabled": True, "score_func": "softmax"}}, "expert_parallel.score_func: 'softmax'"),
        ({"expert_parallel": {"enabled": True, "num_limited_groups": 2}}, "expert_parallel.num_limited_groups: 2"),
        ({"expert_parallel": {"enabled": True, "expert_pattern": "mlp.experts"}}, "a custom pattern is not read"),
        ({"expert_parallel": {"enabled": True, "load_balance_coeff": 1e-3}}, "auxiliary-loss-free load balancing"),
        ({"expert_parallel": {"enabled": True, "expert_tensor_parallel_size": 2}}, "Accepted (no effect): `1`"),
        ({"expert_parallel": {"enabled": "yes"}}, "expert_parallel.enabled: expected true or false, got 'yes'"),
    ],
)
def test_deepspeed_moe_keys_that_drop_tokens_or_change_routing_are_refused_by_name(section, words):
    with pytest.raises(ConfigError) as err:
        _load(section)
    assert words in str(err.value), str(err.value)
