"""Expert parallelism beside tensor parallelism (``expert_parallel_size: E`` with ``tensor_parallel.size: T``): the
dense layers split by the model's plan, the experts whole on every tp rank of an expert group, each tp rank sending
its share of the tokens ([Note: experts beside tensor parallelism]). Tiny random Qwen3-MoE and Mixtral models trained
against one process on the same global batch (losses, each rank's load-balancing loss, global gradient norms, the
final parameters from ``full_state_dict()``) at world 4 = tp 2 x ep 2 (stages 0, 2, 3) and, marked soak, world 6 =
tp 3 x ep 2 and tp 2 x ep 3 with 6 experts; the groups, and the layouts refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import transformers

import shardtrain
from shardtrain.config.plan import check_layout
from shardtrain.config.sections import load_config
from shardtrain.distributed.mesh import make_groups
from shardtrain.errors import ConfigError
from shardtrain.tensor_parallel import assemble_blocks
from shardtrain.testing import run_distributed

from helpers.moe_cases import one_process, row_batches, tiny_moe

SEQ, LR = 6, 1e-2
TP3 = {"num_attention_heads": 6, "num_key_value_heads": 3, "vocab_size": 36}  # heads and vocabulary split by 3


def _train(case: tuple) -> dict:
    """This rank's run of ``case``: its data-parallel rank's rows of every global micro-batch."""
    kind, experts, tp, ep, stage, steps, gas, clip, overrides, zero, seq = case
    zero = dict(zero)
    pretrained = zero.pop("from_pretrained", None)  # a directory of save_pretrained's files of this very model
    model = tiny_moe(kind, experts, **overrides)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    if zero.pop("activation_checkpointing", False):  # transformers' own: each layer's forward again in backward
        model.gradient_checkpointing_enable()
        model.train()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": stage, **zero},
        "expert_parallel_size": ep,
        "tensor_parallel": {"size": tp},
        "collective_timeout_s": 120.0,
    }
    if pretrained is not None:  # built under zero.Init(config), each rank reading its blocks and experts
        engine = shardtrain.from_pretrained(
            transformers.AutoModelForCausalLM, pretrained, config=config, optimizer=lambda ps: torch.optim.AdamW(ps, LR)
        )
        model = engine.module
    else:
        engine = shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters(), lr=LR))
    topo = engine.topology
    routed: list[torch.Tensor] = []  # each layer's experts of every token, in the order of the forwards
    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    hooks = [g.register_forward_hook(lambda _m, _i, out: routed.append(out[2].clone())) for g in gates]
    losses, norms, aux = [], [], []
    batches = row_batches(topo.dp, steps * gas, seq)
    engine.comm_stats(reset=True)
    for step in range(steps):
        total = 0.0
        for m in range(gas):
            ids = batches[step * gas + m][topo.dp_rank : topo.dp_rank + 1]
            out = engine(input_ids=ids, labels=ids)
            aux.append(float(out.aux_loss.detach()))
            engine.backward(out.loss)
            engine.step()
            total += out.loss.item() / gas
            if step == 0 and m == 0:
                first = engine.comm_stats(by_group=True)
        losses.append(total)
        norms.append(engine.get_global_grad_norm())
    for h in hooks:
        h.remove()
    held = model.model.layers[0].mlp.experts.expert_range
    experts = {id(p) for m in model.modules() if hasattr(m, "expert_range") for p in m.parameters()}
    local = {}  # name -> (this rank's block, its tensor-parallel placement or None, an expert parameter)
    with engine.gathered(model):  # stage 3: each rank's blocks whole
        for name, p in model.named_parameters():
            record = engine.layout.record_of(p)
            placement = record.tp if record is not None and record.tp_split else None
            local[name] = (p.detach().clone(), placement, id(p) in experts)
    full = engine.full_state_dict()
    # one process's initial weights loaded into every rank's blocks, read back
    engine.load_full_state_dict(init if dist.get_rank() == 0 else None)
    reloaded = engine.full_state_dict()
    out = {"dp_rank": topo.dp_rank, "tp_rank": topo.tp_rank, "ep_rank": topo.ep_rank, "held": held}
    out.update(losses=losses, norms=norms, aux=aux, full=full, local=local, reloaded=reloaded)
    out["ep_bytes"] = first.get("ep", {}).get("all_to_all", {}).get("bytes", 0)
    out["routed"] = routed[: len(gates)]  # the first forward's
    engine.close()
    return out


def _runs(cases: list[tuple], path: str | None = None) -> list:
    """Every case on the same ranks, then (with ``path``) :func:`_checkpoint` there."""
    return [_train(case) for case in cases] + ([_checkpoint(path)] if path is not None else [])


def _engine(tp: int, ep: int, stage: int):
    model = tiny_moe("qwen3_moe", 8)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": stage, **(UNITS if stage == 3 else {})},
        "expert_parallel_size": ep,
        "tensor_parallel": {"size": tp},
        "collective_timeout_s": 120.0,
    }
    return shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters(), lr=LR))


def _steps(engine, batches: list[torch.Tensor]) -> list[float]:
    losses = []
    for batch in batches:
        ids = batch[engine.topology.dp_rank : engine.topology.dp_rank + 1]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _checkpoint(path: str) -> dict:
    """A checkpoint saved at tp 2 x ep 2, stage 3: resumed there, and loaded at tp 1 x ep 4, stage 1."""
    engine = _engine(2, 2, 3)
    batches = row_batches(2, 4, SEQ)
    _steps(engine, batches[:2])
    engine.save_checkpoint(path, tag="tp2-ep2")
    saved = engine.full_state_dict()
    unbroken = _steps(engine, batches[2:])
    engine.close()
    engine = _engine(2, 2, 3)
    engine.load_checkpoint(path, tag="tp2-ep2")
    resumed = _steps(engine, batches[2:])
    engine.close()
    engine = _engine(1, 4, 1)  # every rank another data-parallel rank, each holding 2 experts
    engine.load_checkpoint(path, tag="tp2-ep2")
    elsewhere = engine.full_state_dict()
    engine.close()
    return {"unbroken": unbroken, "resumed": resumed, "saved": saved, "elsewhere": elsewhere}


def _join(results: list[dict], tp: int, ep: int) -> dict[str, torch.Tensor]:
    """The whole parameters from each rank's blocks: a tensor-parallel block from the tp ranks of dp rank 0, the
    experts from the ranks of tp rank 0's first expert group (dp ranks 0 .. E - 1)."""
    out = {}
    for name, (t, placement, expert) in results[0]["local"].items():
        if expert:
            out[name] = torch.cat([results[e * tp]["local"][name][0] for e in range(ep)])
        elif placement is not None:
            out[name] = assemble_blocks([results[i]["local"][name][0] for i in range(tp)], placement)
        else:
            out[name] = t
    return out


def _assert_parity(results: list[dict], case: tuple) -> None:
    kind, experts, tp, ep, stage, steps, gas, clip, overrides, _, seq = case
    world = len(results)
    dp = world // tp
    what = f"{kind} tp {tp} ep {ep} stage {stage}, {seq} tokens per rank"
    ref = one_process(kind, experts, dp, steps, gas, clip, overrides, seq, LR)
    assert [r["dp_rank"] * tp + r["tp_rank"] for r in results] == list(range(world)), what  # rank = dp * T + tp
    assert [r["ep_rank"] for r in results] == [(r // tp) % ep for r in range(world)], what
    n = experts // ep
    assert [r["held"] for r in results] == [(e * n, (e + 1) * n) for e in (r["ep_rank"] for r in results)], what
    for s, b in enumerate(ref["losses"]):
        a = sum(r["losses"][s] for r in results) / world  # the tp ranks of a dp rank have its loss
        assert abs(a - b) <= 2e-5 * abs(b), f"{what}: step {s}: loss {a} vs reference {b}"
    for r in results:
        for s, (a, b) in enumerate(zip(r["norms"], ref["norms"])):
            assert abs(a - b) <= 1e-4 * abs(b), (
                f"{what}: dp rank {r['dp_rank']}: step {s}: grad norm {a} vs reference {b}"
            )
        for i, (a, b) in enumerate(zip(r["aux"], ref["aux"])):
            want = b[r["dp_rank"]]
            assert abs(a - want) <= 2e-5 * abs(want), f"{what}: micro-step {i}: aux {a} vs {want}"
    joined = _join(results, tp, ep)
    fulls = [joined, results[0]["full"]]
    assert all(r["full"] is None for r in results[1:]), what  # full_state_dict(): on rank 0 only
    for full in fulls:
        assert full.keys() == ref["params"].keys(), what
        for k, w in ref["params"].items():
            moved = (w - ref["init"][k]).norm().item()
            err = (full[k] - w).norm().item()
            assert moved > 0, f"{what}: {k} did not move: the check proves nothing"
            assert err <= 5e-3 * moved, f"{what}: {k}: error {err:.3g} vs distance moved {moved:.3g}"
    # load_full_state_dict gives every rank its blocks of the whole tensors: read back bit for bit
    reloaded = results[0]["reloaded"]
    assert reloaded.keys() == ref["init"].keys(), what
    assert all(torch.equal(reloaded[k], v) for k, v in ref["init"].items()), what


UNITS = {"stage3_param_persistence_threshold": 0}
# (kind, experts, tp, ep, stage, steps, gas, clip, model overrides, more zero_optimization, tokens per rank)
WORLD4 = [
    ("qwen3_moe", 8, 2, 2, 2, 2, 2, 0.5, {}, {}, SEQ),  # accumulation, clipping
    ("mixtral", 8, 2, 2, 3, 2, 1, 0.5, {}, UNITS, SEQ),  # stage 3: expert units over the expert-data-parallel group
    ("mixtral", 8, 2, 2, 0, 2, 1, 0.5, {}, {}, SEQ),  # stage 0: the norm counts each expert gradient once
    ("mixtral", 8, 2, 2, 1, 2, 1, 0.5, {}, {}, 3),  # 3 tokens per rank: shares of 2 and 1
    # shardtrain.from_pretrained: built under zero.Init(config), each rank reads its tp blocks and its experts
    ("qwen3_moe", 8, 2, 2, 3, 2, 1, 0.5, {}, {**UNITS, "from_pretrained": None}, SEQ),
]
WORLD6 = [
    ("qwen3_moe", 8, 3, 2, 2, 2, 1, 0.5, TP3, {}, SEQ),  # tp 3 x dp 2, ep 2
    ("qwen3_moe", 8, 3, 2, 3, 2, 1, 0.5, TP3, UNITS, 5),  # shares of 2, 2 and 1 tokens
    ("qwen3_moe", 8, 3, 2, 1, 2, 1, 0.5, TP3, {}, 2),  # shares of 1, 1 and none: tp rank 2 sends no token
    ("qwen3_moe", 6, 2, 3, 3, 2, 1, 0.5, {}, UNITS, SEQ),  # tp 2 x dp 3, ep 3 with 6 experts
    ("mixtral", 6, 2, 3, 1, 2, 1, 0.5, {}, {"mics_shard_size": 1}, SEQ),  # hybrid sharding: dense replicated 3 times
]


def _pretrained(cases: list[tuple], path) -> list[tuple]:
    """``cases`` with the ``from_pretrained`` directory filled in: save_pretrained's files of the case's model."""
    out = []
    for case in cases:
        if "from_pretrained" in case[9]:
            tiny_moe(case[0], case[1], **case[8]).save_pretrained(path)
            case = (*case[:9], {**case[9], "from_pretrained": str(path)}, case[10])
        out.append(case)
    return out


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    cases = _pretrained(WORLD4, tmp_path_factory.mktemp("pretrained"))
    return run_distributed(_runs, 4, cases, str(tmp_path_factory.mktemp("ckpt")), timeout=300)


def test_tp2_ep2_trains_like_one_process(world4):
    for i, case in enumerate(WORLD4):
        _assert_parity([r[i] for r in world4], case)


def test_a_checkpoint_resumes_bit_for_bit_and_loads_at_another_layout(world4):
    # saved at tp 2 x ep 2 (stage 3): the resumed run's losses are the unbroken run's bit for bit on every rank, and
    # loaded at tp 1 x ep 4 (stage 1) the weights are the saved ones, bit for bit
    for r in world4:
        assert r[-1]["resumed"] == r[-1]["unbroken"], (r[-1]["resumed"], r[-1]["unbroken"])
    saved, elsewhere = world4[0][-1]["saved"], world4[0][-1]["elsewhere"]
    assert saved.keys() == elsewhere.keys() and all(torch.equal(saved[k], elsewhere[k]) for k in saved)


def test_each_tp_rank_sends_its_share_of_the_tokens(world4):
    # the 6 tokens of a data-parallel rank are split 3 + 3 over its two tp ranks; tp rank t exchanges the rows of
    # its 3 tokens with tp rank t of the other data-parallel rank (its expert group), so the bytes of its exchange
    # are the formula of docs/expert-parallel.md over its share only (the routing recorded on each rank)
    tp, ep, hidden, case = 2, 2, 16, 1  # case 1: Mixtral, one micro-step per step
    results = [r[case] for r in world4]
    for r in results:
        mine = range(*r["held"])
        peer = next(o for o in results if o["tp_rank"] == r["tp_rank"] and o["dp_rank"] != r["dp_rank"])
        lo, hi = r["tp_rank"] * SEQ // tp, (r["tp_rank"] + 1) * SEQ // tp
        expected = 0
        for layer, idx in enumerate(r["routed"]):
            sent = sum(int(e) not in mine for e in idx[lo:hi].flatten())
            received = sum(int(e) in mine for e in peer["routed"][layer][lo:hi].flatten())
            expected += 8 * (ep - 1) + sent * 8 + 2 * (sent + received) * hidden * 4
        assert r["ep_bytes"] == expected, (r["dp_rank"], r["tp_rank"], r["ep_bytes"], expected)


OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
CHECKPOINTING = {"activation_checkpointing": True}
WORLD4_MORE = [
    ("mixtral", 8, 2, 2, 2, 2, 1, 0.5, {}, OFFLOAD, SEQ),  # the optimizer steps on the host
    ("mixtral", 8, 2, 2, 3, 2, 1, 0.5, {}, {**UNITS, **CHECKPOINTING}, SEQ),  # each layer's exchange again in backward
    ("qwen3_moe", 8, 2, 2, 2, 2, 1, 0.5, {}, {"mics_shard_size": 1, **CHECKPOINTING}, SEQ),  # hybrid sharding
]


@pytest.mark.soak
def test_tp2_ep2_with_offload_checkpointing_and_hybrid_sharding_trains_like_one_process():
    runs = run_distributed(_runs, 4, WORLD4_MORE, timeout=600)
    for i, case in enumerate(WORLD4_MORE):
        _assert_parity([r[i] for r in runs], case)


@pytest.mark.soak
def test_odd_layouts_train_like_one_process():
    runs = run_distributed(_runs, 6, WORLD6, timeout=900)
    for i, case in enumerate(WORLD6):
        _assert_parity([r[i] for r in runs], case)


def _partitions(world: int, tp: int, ep: int) -> dict[int, dict[str, list[int]]]:
    out = {}
    for rank in range(world):
        main, _ = make_groups(rank, world, tp, "gloo", "world", lambda ranks, backend: ranks, ep=ep)
        out[rank] = {axis: getattr(main, axis) for axis in ("dp", "tp", "ep", "edp")}
    return out


def test_expert_groups_are_cut_from_the_data_parallel_axis_at_each_tp_rank():
    groups = _partitions(8, 2, 2)  # dp 4: rank = dp_rank * 2 + tp_rank
    assert [groups[r]["tp"] for r in (0, 1, 6)] == [[0, 1], [0, 1], [6, 7]]
    assert [groups[r]["ep"] for r in range(8)] == [[0, 2], [1, 3], [0, 2], [1, 3], [4, 6], [5, 7], [4, 6], [5, 7]]
    assert [groups[r]["edp"] for r in range(8)] == [[0, 4], [1, 5], [2, 6], [3, 7], [0, 4], [1, 5], [2, 6], [3, 7]]
    six = _partitions(6, 2, 3)  # dp 3, one expert group per tp rank
    assert [six[r]["ep"] for r in range(6)] == [[0, 2, 4], [1, 3, 5]] * 3
    assert [six[r]["edp"] for r in range(6)] == [[r] for r in range(6)]


@pytest.mark.parametrize(
    "config, world, words",
    [
        (
            {"expert_parallel_size": 4, "tensor_parallel": {"size": 2}},
            4,
            "expert_parallel_size (ep_size) 4 does not divide the data-parallel size 2 (world / tensor_parallel.size "
            "2): the ranks of an expert group are data-parallel ranks, and the ranks holding the same experts are dp "
            "/ ep_size of them, so choose one of [1, 2]",
        ),
        (
            {"expert_parallel_size": 2, "tensor_parallel": {"size": 3}},
            3,
            "expert_parallel_size (ep_size) 2 does not divide the data-parallel size 1 (world / tensor_parallel.size "
            "3)",
        ),
        (
            {"expert_parallel_size": 4, "tensor_parallel": {"size": 2}, "sequence_parallel_size": 3},
            6,
            "expert_parallel_size (ep_size) 4 does not divide the 3 ranks ZeRO shards over (data-parallel size 1 x "
            "sequence_parallel_size 3)",
        ),
    ],
)
def test_layouts_that_do_not_fit_are_refused_naming_the_sizes(config, world, words):
    with pytest.raises(ConfigError, match="ep_size") as err:
        check_layout(load_config(config), world)
    assert words in str(err.value)


def test_a_plan_s_expert_entries_give_way_to_whole_experts():
    from shardtrain.tensor_parallel import TPPlan, replicate_experts

    plan = TPPlan(
        styles={
            "model.layers.*.self_attn.q_proj": "colwise",
            "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
            "model.layers.*.mlp.experts.down_proj": "rowwise",
            "model.layers.*.mlp.experts": "moe_tp_experts",
        }
    )
    experts = {f"model.layers.{i}.mlp.experts": ["gate_up_proj", "down_proj"] for i in range(2)}
    kept, dropped = replicate_experts(plan, experts)
    assert dropped == [
        "model.layers.*.mlp.experts.gate_up_proj",
        "model.layers.*.mlp.experts.down_proj",
        "model.layers.*.mlp.experts",
    ]
    assert dict(kept.styles) == {
        "model.layers.*.self_attn.q_proj": "colwise",
        **{f"{m}.{w}": "replicated_with_grad_allreduce" for m, ws in experts.items() for w in ws},
    }
