"""Expert parallelism in the engine (``expert_parallel_size``): tiny random Mixtral and Qwen3-MoE models trained
against one process on the same global batch (losses with the load-balancing loss, each rank's load-balancing loss,
global gradient norms, final parameters), at ep 2 (world 2), ep 3 with 6 experts (world 3), ep 1 x dp 3, ep 2 x dp 2
(world 4, soak); ZeRO stages 0-2, clipping, bf16, a routing where an expert gets no token from some rank; and the
layouts and features it is not built with, refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardtrain
from shardtrain.errors import ConfigError
from shardtrain.testing import run_distributed

from helpers.moe_cases import VOCAB, tiny_moe

MICRO, SEQ, LR = 1, 6, 1e-2


def make_model(kind: str, experts: int):
    return tiny_moe(kind, experts)


def global_batches(world: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (MICRO * world, SEQ), generator=g) for _ in range(n)]


def _forward(model, ids: torch.Tensor):
    out = model(input_ids=ids, labels=ids)
    return out.loss, out.aux_loss


def reference(kind: str, experts: int, world: int, steps: int, gas: int, clip: float, bf16: bool) -> dict:
    """One process, the whole global batch: each micro-step's loss is the mean of the losses of the ranks' rows (the
    load-balancing loss is over a rank's tokens, as in data parallelism without experts). bf16 as the engine does
    it: bf16 compute, fp32 masters, gradients summed in fp32."""
    model = make_model(kind, experts)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    masters = {p: p.detach().clone() for p in params} if bf16 else {p: p for p in params}
    opt = torch.optim.AdamW(list(masters.values()), lr=LR)
    if bf16:
        model.to(torch.bfloat16)
    batches = global_batches(world, steps * gas)
    losses, norms, aux = [], [], []
    for step in range(steps):
        total = 0.0
        for m in range(gas):
            ids = batches[step * gas + m]
            parts = [_forward(model, ids[r * MICRO : (r + 1) * MICRO]) for r in range(world)]
            loss = sum(p[0] for p in parts) / world
            aux.append([float(p[1].detach()) for p in parts])
            (loss / gas).backward()
            if bf16:
                for p in params:
                    masters[p].grad = p.grad.float() + (masters[p].grad if masters[p].grad is not None else 0)
                    p.grad = None
            total += loss.item() / gas
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(masters.values()), clip if clip > 0 else float("inf"))))
        opt.step()
        opt.zero_grad()
        if bf16:
            with torch.no_grad():
                for p in params:
                    p.copy_(masters[p])
        losses.append(total)
    return {"losses": losses, "norms": norms, "aux": aux, "params": model.state_dict(), "init": init}


def _train(
    kind: str,
    experts: int,
    ep: int,
    stage: int,
    steps: int,
    gas: int,
    clip: float,
    bf16: bool,
    extra: dict | None = None,
) -> dict:
    """This rank's run: its rows of every global micro-batch. Returns its losses, load-balancing losses, the global
    norms, the tokens each expert got from this rank per layer, its state dict and the experts it holds."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(kind, experts)
    extra = dict(extra or {})
    if extra.pop("activation_checkpointing", False):  # transformers' own: each layer's forward again in backward
        model.gradient_checkpointing_enable()
        model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": stage},
        "expert_parallel_size": ep,
        "bf16": {"enabled": bf16},
        "collective_timeout_s": 120.0,
        **extra,
    }
    engine = shardtrain.initialize(model, config=config, optimizer=opt)
    routed: list[torch.Tensor] = []
    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    hooks = [g.register_forward_hook(lambda _m, _i, out: routed.append(out[2].flatten())) for g in gates]
    batches = global_batches(world, steps * gas)
    losses, norms, aux = [], [], []
    engine.comm_stats(reset=True)
    first = {}  # the expert group's all-to-all bytes of the first micro-step (the routing recorded below)
    for step in range(steps):
        total = 0.0
        if step == steps - 1:  # the last step's traffic by group: the unit order is recorded by now
            engine.comm_stats(reset=True)
        for m in range(gas):
            ids = batches[step * gas + m][rank * MICRO : (rank + 1) * MICRO]
            loss, a = _forward(engine, ids)
            aux.append(float(a.detach()))
            engine.backward(loss)
            engine.step()
            total += loss.item() / gas
            if not first:
                first = engine.comm_stats(by_group=True).get("ep", {"all_to_all": {"bytes": 0}})
        losses.append(total)
        norms.append(engine.get_global_grad_norm())
    last = engine.comm_stats(by_group=True)
    # each bucket: (expert, ranks it is sharded over, padded elements, bytes per element, gathered on use: the number
    # of the layer its unit is, -1 for the root unit; None below stage 3 and for persistent buckets)
    units = {b.index: u.name for u in engine._runtime.units for b in u.buckets}
    layers = {name: int(name.rsplit(".", 1)[1]) if "layers." in name else -1 for name in units.values()}
    geometry = [
        (b.expert, b.world, b.padded_numel, b.shard.element_size(), layers.get(units.get(b.index)))
        for b in engine.layout.buckets
    ]
    for h in hooks:
        h.remove()
    counts = [torch.bincount(r, minlength=experts).tolist() for r in routed[: len(gates)]]  # the first forward
    held = {n: m.expert_range for n, m in model.named_modules() if hasattr(m, "expert_range")}
    with engine.gathered(model):  # stage 3: each rank's experts whole within its expert-data-parallel group
        state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    out = {"losses": losses, "norms": norms, "aux": aux, "counts": counts, "held": held, "state": state}
    out.update(last_step=last, geometry=geometry, offloaded=engine._optimizer.offload is not None)
    out["params_in_files"] = engine._param_offload is not None  # offload_param nvme: unit shards in swap files
    out["first_ep_bytes"] = first["all_to_all"]["bytes"]
    if ep > 1:
        out["refused"] = None
        try:
            with engine.gathered(model.model.layers[0].mlp.experts, modifier_rank=0):
                pass
        except ConfigError as err:
            out["refused"] = str(err)
    engine.close()
    return out


def _runs(world: int, cases: list[tuple]) -> list[list[dict]]:
    """Every case on the same ranks (one start of the processes): each rank's results, by case."""
    return [[_train(*case) for case in cases], [_refusals(world), _frozen_experts(world)]]


def _frozen_experts(world: int) -> dict:
    """A model whose first layer's experts are frozen: each rank's slice of them after initialize and two steps
    (world 2 only)."""
    if world != 2:
        return {}
    model = make_model("mixtral", 8)
    for p in model.model.layers[0].mlp.experts.parameters():
        p.requires_grad_(False)
    config = {"train_micro_batch_size_per_gpu": MICRO, "expert_parallel_size": world, "collective_timeout_s": 120.0}
    engine = shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters(), lr=LR))
    ids = global_batches(world, 2)
    for batch in ids:
        rows = batch[dist.get_rank() * MICRO : (dist.get_rank() + 1) * MICRO]
        engine.backward(_forward(engine, rows)[0])
        engine.step()
    experts = model.model.layers[0].mlp.experts
    out = {"range": experts.expert_range, "frozen": {n: p.detach().clone() for n, p in experts.named_parameters()}}
    out["trained"] = model.model.layers[1].mlp.experts.gate_up_proj.detach().clone()
    engine.close()
    return out


def _refusals(world: int) -> dict:
    """What is refused at initialize, by its words."""
    out = {}
    for name, build in {
        "dense model": lambda: torch.nn.Linear(4, 4),
        "experts not divisible": lambda: make_model("mixtral", 4) if world == 3 else None,
    }.items():
        model = build()
        if model is None:
            continue
        try:
            shardtrain.initialize(
                model,
                config={"train_micro_batch_size_per_gpu": 1, "expert_parallel_size": world, **UNITS},
                optimizer=torch.optim.AdamW(model.parameters()),
            )
            out[name] = None
        except ConfigError as err:
            out[name] = str(err)
    return out


def _gather(results: list[dict], ep: int, key: str = "state") -> dict:
    """The full state dict from the ranks of the first expert group: expert weights concatenated in expert order."""
    full = dict(results[0][key])
    for name, (first, _) in results[0]["held"].items():
        assert first == 0
        for k in [k for k in full if k.startswith(name + ".")]:
            parts = [r[key][k] for r in results[:ep]]
            assert [r["held"][name][0] for r in results[:ep]] == [i * parts[0].shape[0] for i in range(ep)]
            full[k] = torch.cat(parts)
    return full


def _assert_parity(results: list[dict], ref: dict, ep: int, bf16: bool, what: str) -> None:
    world = len(results)
    loss_rtol, norm_rtol = (1e-3, 2e-2) if bf16 else (2e-5, 1e-4)
    for s, b in enumerate(ref["losses"]):
        a = sum(r["losses"][s] for r in results) / world
        assert abs(a - b) <= loss_rtol * abs(b), f"{what}: step {s}: loss {a} vs reference {b}"
    for r in results:
        for s, (a, b) in enumerate(zip(r["norms"], ref["norms"])):
            assert abs(a - b) <= norm_rtol * abs(b), f"{what}: step {s}: grad norm {a} vs reference {b}"
    for rank, r in enumerate(results):  # each rank's load-balancing loss is one process's on its tokens
        for i, (a, b) in enumerate(zip(r["aux"], ref["aux"])):
            # in bf16, once the runs' parameters differ by rounding, a token near a tie between two experts may pick
            # another one: the load-balancing loss counts tokens, so it moves by more than the cross-entropy does
            rtol = loss_rtol if i == 0 or not bf16 else 1e-2
            assert abs(a - b[rank]) <= rtol * abs(b[rank]), f"{what}: micro-step {i} rank {rank}: aux {a} vs {b}"
    full = _gather(results, ep)
    assert full.keys() == ref["params"].keys(), what
    if bf16:  # bf16 rounding differs with the summation order: the bar of tests/zero/test_mixed_precision.py
        err = sum((full[k] - w.float()).abs().sum().item() for k, w in ref["params"].items())
        init = ref["init"]
        moved = sum((w.float() - init[k].bfloat16().float()).abs().sum().item() for k, w in ref["params"].items())
        assert err <= 0.1 * moved, f"{what}: total parameter error {err:.3g} vs total distance moved {moved:.3g}"
        return
    for k, w in ref["params"].items():
        moved = (w - ref["init"][k]).norm().item()
        err = (full[k] - w).norm().item()
        assert moved > 0, f"{what}: {k} did not move: the check proves nothing"
        assert err <= 5e-3 * moved, f"{what}: {k}: error {err:.3g} vs distance moved {moved:.3g}"


# ZeRO-3 with every parameter in a unit (gathered on use), and with the small ones (norms, router) persistent
UNITS = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
MIXED = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 200}}
PARAMS_NVME = {"offload_param": {"device": "nvme", "nvme_path": "<swap dir>"}}


def hybrid(stage: int, shard: int, **zero) -> dict:
    """Hybrid sharding (``mics_shard_size``): dense state sharded within groups of ``shard`` ranks and replicated
    across them; the expert buckets stay sharded over the expert-data-parallel group, never replicated."""
    return {"zero_optimization": {"stage": stage, "mics_shard_size": shard, **zero}}


def offload(stage: int, device: str = "cpu", **zero) -> dict:
    """The optimizer's state and step on the host (``offload_optimizer.device: cpu``) or in swap files (``nvme``, in
    the directory :func:`_with_swap_dir` fills in)."""
    section = {"device": device, **({"nvme_path": "<swap dir>"} if device == "nvme" else {})}
    return {"zero_optimization": {"stage": stage, "offload_optimizer": section, **zero}}


def _with_swap_dir(cases: list[tuple], path: str) -> list[tuple]:
    """``cases`` with their swap directory (nvme offload) set to ``path``."""
    out = []
    for case in cases:
        zero = case[8].get("zero_optimization", {}) if len(case) > 8 else {}
        for key in ("offload_optimizer", "offload_param"):
            if zero.get(key, {}).get("device") == "nvme":
                zero = {**zero, key: {**zero[key], "nvme_path": path}}
        out.append((*case[:8], {**case[8], "zero_optimization": zero}) if zero else case)
    return out


# (kind, experts, ep, stage, steps, gas, clip, bf16[, more config])
WORLD2 = [
    ("mixtral", 8, 2, 1, 3, 2, 0.5, False),  # clipping, gradient accumulation
    ("mixtral", 8, 2, 0, 2, 1, 0.0, False),  # stage 0: the norm sums expert squares over the expert group
    ("mixtral", 8, 2, 2, 2, 1, 0.5, True),  # bf16 with clipping
    # DeepSpeed's prescaling: divided by the factor before the sums, the rest of each group's average after
    ("mixtral", 8, 2, 2, 2, 1, 0.0, False, {"gradient_predivide_factor": 4.0}),
    ("mixtral", 8, 2, 1, 2, 1, 0.0, False, {"prescale_gradients": True}),
    ("mixtral", 8, 2, 3, 2, 2, 0.5, False, UNITS),  # stage 3: expert units of their own; clipping, accumulation
    ("mixtral", 8, 2, 1, 2, 2, 0.5, False, offload(1)),  # optimizer offload
    # the unit shards in swap files too (offload_param)
    ("mixtral", 8, 2, 3, 2, 1, 0.5, True, offload(3, "nvme", stage3_param_persistence_threshold=0, **PARAMS_NVME)),
    # transformers' gradient checkpointing: each layer's token exchange runs again in backward
    ("mixtral", 8, 2, 2, 2, 2, 0.5, False, {"activation_checkpointing": True}),
    # stage 3 in bf16, small parameters persistent
    ("mixtral", 8, 2, 3, 2, 1, 0.5, True, {**MIXED, "activation_checkpointing": True}),
    # hybrid sharding over shard groups of one rank: the dense gradients all-reduced across the two replicas
    ("mixtral", 8, 2, 1, 2, 2, 0.5, False, hybrid(1, 1)),
    ("mixtral", 8, 2, 3, 2, 1, 0.5, False, hybrid(3, 1, stage3_param_persistence_threshold=0)),
]
WORLD3 = [
    ("qwen3_moe", 6, 3, 2, 3, 1, 0.5, False),  # 6 experts over 3 ranks
    ("qwen3_moe", 6, 1, 2, 2, 1, 0.0, False),  # ep 1 x dp 3: plain data parallelism, experts whole
    ("qwen3_moe", 6, 3, 3, 2, 1, 0.5, False, UNITS),  # stage 3, 6 experts over 3 ranks
    ("qwen3_moe", 6, 3, 2, 2, 1, 0.5, False, offload(2)),
]
WORLD4 = [
    ("mixtral", 8, 2, 2, 2, 2, 0.5, False),  # ep 2 x dp 2: expert buckets over 2 ranks, dense over 4
    ("mixtral", 8, 2, 0, 2, 1, 0.5, False),
    ("mixtral", 8, 4, 1, 2, 1, 0.5, False),
    ("mixtral", 8, 2, 3, 2, 1, 0.5, False, UNITS),  # stage 3: expert units sharded over 2 ranks, dense over 4
    ("mixtral", 8, 2, 3, 2, 1, 0.5, True, MIXED),
    ("mixtral", 8, 2, 2, 2, 1, 0.5, False, offload(2)),
    ("mixtral", 8, 2, 3, 2, 1, 0.5, False, offload(3, "nvme", stage3_param_persistence_threshold=0, **PARAMS_NVME)),
    ("mixtral", 8, 2, 3, 2, 1, 0.5, False, {**UNITS, "activation_checkpointing": True}),
    # hybrid sharding: shard groups {0, 1} and {2, 3}, expert-data-parallel groups {0, 2} and {1, 3}
    ("mixtral", 8, 2, 2, 2, 2, 0.5, False, hybrid(2, 2)),
    ("mixtral", 8, 2, 1, 2, 1, 0.5, False, hybrid(1, 2, offload_optimizer={"device": "cpu"})),
    ("mixtral", 8, 2, 3, 2, 1, 0.5, False, hybrid(3, 2, stage3_param_persistence_threshold=0)),
    ("mixtral", 8, 4, 3, 2, 1, 0.5, False, hybrid(3, 2, stage3_param_persistence_threshold=200)),
]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_distributed(_runs, 2, 2, _with_swap_dir(WORLD2, str(tmp_path_factory.mktemp("swap"))), timeout=300)


@pytest.fixture(scope="module")
def world3():
    return run_distributed(_runs, 3, 3, WORLD3, timeout=300)


def _check_cases(runs: list, cases: list[tuple]) -> None:
    for i, case in enumerate(cases):
        kind, experts, ep, stage, steps, gas, clip, bf16 = case[:8]
        results = [r[0][i] for r in runs]
        offloaded = len(case) > 8 and "offload_optimizer" in case[8].get("zero_optimization", {})
        assert all(r["offloaded"] == offloaded for r in results), case  # the optimizer stepped on the host
        in_files = len(case) > 8 and "offload_param" in case[8].get("zero_optimization", {})
        assert all(r["params_in_files"] == in_files for r in results), case
        ref = reference(kind, experts, len(runs), steps, gas, clip, bf16)
        _assert_parity(results, ref, ep, bf16, f"{kind} ep {ep} stage {stage}{' bf16' if bf16 else ''}")


def test_ep2_trains_like_one_process(world2):
    _check_cases(world2, WORLD2)


def test_ep3_with_six_experts_and_ep1_train_like_one_process(world3):
    _check_cases(world3, WORLD3)


@pytest.mark.soak
def test_ep_with_data_parallel_replicas_trains_like_one_process(tmp_path):
    runs = run_distributed(_runs, 4, 4, _with_swap_dir(WORLD4, str(tmp_path)), timeout=900)
    _check_cases(runs, WORLD4)
    _check_stage3_traffic([r[0][3] for r in runs], ep=2, layers=2, gas=1)


def _check_stage3_traffic(results: list[dict], ep: int, layers: int, gas: int) -> None:
    """ZeRO-3 under expert parallelism, every parameter in a unit: each layer's expert parameters are buckets of their
    own, sharded over the dp / ep ranks holding the same experts, dense ones over all dp ranks; the last step's
    gathers and reduce-scatters of each group are those of its units' buckets, and nothing else (docs/expert-
    parallel.md). Per micro-step every unit is gathered in forward and again in backward, but the last layer and the
    root, kept gathered from forward to backward ([Note: kept after forward]), and reduce-scattered once."""
    world = len(results)
    for r in results:
        geometry = r["geometry"]
        expert = [g for g in geometry if g[0]]
        assert len(expert) == layers and {g[1] for g in expert} == {world // ep}, geometry
        assert {g[4] for g in expert} == set(range(layers)), geometry  # in the layers' units, none persistent
        assert all(g[1] == world for g in geometry if not g[0]), geometry
        for group, buckets in (("edp", expert), ("shard", [g for g in geometry if not g[0]])):
            n = buckets[0][1]
            ring = {g: g[2] * g[3] * (n - 1) // n for g in buckets}
            kept = {g for g in buckets if g[4] in (layers - 1, -1)}
            gathers = gas * sum(ring[g] * (1 if g in kept else 2) for g in buckets)
            stats = r["last_step"].get(group, {})
            if n == 1:  # a group of one has nothing to exchange
                assert all(v["bytes"] == 0 for v in stats.values()), (group, stats)
                continue
            assert stats["all_gather"]["bytes"] == gathers, (group, stats, gathers)
            assert stats["reduce_scatter"]["bytes"] == gas * sum(ring.values()), (group, stats)
        assert set(r["last_step"]["edp"]) <= {"all_gather", "reduce_scatter"}, r["last_step"]["edp"]


def test_activation_checkpointing_runs_each_layer_s_exchange_again(world2):
    # per MoE layer and micro-step, forward: counts, rows, expert ids, outputs back; backward: two; recomputed in
    # backward under checkpointing, the forward's four again (the parity above holds with it)
    layers = 2
    for case, gas, recomputed in ((0, 2, False), (8, 2, True), (9, 1, True)):
        for r in world2:
            calls = r[0][case]["last_step"]["ep"]["all_to_all"]["calls"]
            assert calls == gas * layers * (4 + 2 + (4 if recomputed else 0)), (case, calls)


def test_stage3_lays_each_layer_s_experts_out_over_the_ranks_holding_them(world2, world3):
    # at world 2 and 3 every rank of an expert group holds other experts: expert units of one rank each, their
    # gathers and reductions local; the dense units over every rank
    _check_stage3_traffic([r[0][5] for r in world2], ep=2, layers=2, gas=2)
    _check_stage3_traffic([r[0][2] for r in world3], ep=3, layers=2, gas=1)


def test_an_expert_that_gets_no_token_from_a_rank(world2):
    # the routing of the first forward, on each rank: some expert of some layer gets none of a rank's tokens, and
    # the parity above holds with it, at stage 1 and at stage 3 (case 5: the same model and first batch)
    for case in (0, 5):
        counts = [r[0][case]["counts"] for r in world2]
        starved = [
            (rank, layer, row.index(0)) for rank, c in enumerate(counts) for layer, row in enumerate(c) if 0 in row
        ]
        assert starved, counts
        assert all(sum(row) == MICRO * SEQ * 2 for c in counts for row in c)  # top-2: no token dropped


def test_the_expert_exchange_sends_the_bytes_of_the_formula(world2):
    # docs/expert-parallel.md: per MoE layer, 8 (E - 1) bytes of counts, the rows a rank sends to other ranks' experts
    # (H floats and one int64 id each) and, back, the outputs of the rows it received; backward the same two
    # exchanges of H floats reversed. The routing is the first forward's, recorded on each rank.
    ep, hidden = 2, 16
    counts = [r[0][0]["counts"] for r in world2]
    held = [r[0][0]["held"]["model.layers.0.mlp.experts"] for r in world2]
    for rank, r in enumerate(world2):
        expected = 0
        for layer in range(len(counts[rank])):
            mine = range(*held[rank])
            sent = sum(n for e, n in enumerate(counts[rank][layer]) if e not in mine)
            received = sum(counts[other][layer][e] for other in range(ep) if other != rank for e in mine)
            expected += 8 * (ep - 1) + sent * 8 + 2 * (sent + received) * hidden * 4
        assert r[0][0]["first_ep_bytes"] == expected, (rank, r[0][0]["first_ep_bytes"], expected)


def test_experts_are_split_over_the_expert_group(world2, world3):
    assert [r[0][0]["held"]["model.layers.0.mlp.experts"] for r in world2] == [(0, 4), (4, 8)]
    assert [r[0][0]["held"]["model.layers.1.mlp.experts"] for r in world3] == [(0, 2), (2, 4), (4, 6)]
    assert all(r[0][1]["held"] == {} for r in world3)  # ep 1: nothing split


def test_modifier_rank_on_experts_is_refused(world2):
    for case in (0, 5):  # stage 1 and stage 3
        refused = world2[0][0][case]["refused"]
        assert refused is not None
        # one rank's experts copied to every rank would overwrite the other experts of the same shape
        assert "modifier_rank=...) with expert_parallel_size (ep_size) 2 includes expert parameters" in refused
        assert "model.layers.0.mlp.experts.gate_up_proj" in refused


def test_a_model_without_experts_and_an_indivisible_expert_count_are_refused(world2, world3):
    assert "has no experts module" in world2[0][1][0]["dense model"]
    message = world3[0][1][0]["experts not divisible"]
    assert "has 4 experts (num_experts), which do not split over expert_parallel_size (ep_size) 3" in message


def test_frozen_experts_keep_each_rank_s_own_experts(world2):
    # frozen expert parameters are outside every bucket: each rank keeps its own slice of rank 0's model, never
    # another rank's experts of the same shape
    whole = make_model("mixtral", 8)
    want = dict(whole.model.layers[0].mlp.experts.named_parameters())
    init = whole.model.layers[1].mlp.experts.gate_up_proj.detach()
    for r in world2:
        first, last = r[1][1]["range"]
        for name, t in r[1][1]["frozen"].items():
            assert torch.equal(t, want[name].detach()[first:last]), name
        assert not torch.equal(r[1][1]["trained"], init[first:last])  # the trainable ones moved
