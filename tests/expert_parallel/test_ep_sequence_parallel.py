"""Expert parallelism composed with sequence parallelism (``expert_parallel_size: E`` with ``sequence_parallel_size:
P``, [Note: experts under sequence parallelism] in ``shardtrain/distributed/mesh.py``): tiny random Mixtral and
Qwen3-MoE models trained against one process on the same global batch (losses with the load-balancing loss, each
rank's load-balancing loss, global gradient norms, final parameters), the expert groups cut from the ``dp * P`` ranks
ZeRO shards over; a routing where some expert gets no token from some rank; and the layouts that stay refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardtrain
from shardtrain.errors import ConfigError, LayoutError
from shardtrain.testing import run_distributed

from helpers.moe_cases import VOCAB, tiny_moe

MICRO, SEQ, LR = 1, 6, 1e-2
SIX_HEADS = {"num_attention_heads": 6, "num_key_value_heads": 3}
"""Heads a sequence-parallel size of 3 divides (Ulysses splits the heads over the group; Qwen3-MoE's heads are 4
wide, whatever their number)."""


def make_model(kind: str, experts: int, sp: int):
    return tiny_moe(kind, experts, **(SIX_HEADS if sp == 3 else {}))


def global_batches(dp: int, n: int) -> list[torch.Tensor]:
    """``n`` global micro-batches of ``MICRO`` rows per data-parallel rank; the ranks of a sequence-parallel group
    are given the same rows, whose sequence the engine splits."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (MICRO * dp, SEQ), generator=g) for _ in range(n)]


def reference(kind: str, experts: int, sp: int, dp: int, steps: int, gas: int, clip: float) -> dict:
    """One process on the whole global batch: each micro-step's loss is the mean of the data-parallel ranks' losses
    on their rows, each with the load-balancing loss of those rows (of whole sequences, as under sequence
    parallelism)."""
    model = make_model(kind, experts, sp)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    batches = global_batches(dp, steps * gas)
    losses, norms, aux = [], [], []
    for step in range(steps):
        total = 0.0
        for m in range(gas):
            ids = batches[step * gas + m]
            outs = [model(input_ids=r, labels=r) for r in ids.split(MICRO)]
            loss = sum(o.loss for o in outs) / dp
            aux.append([float(o.aux_loss.detach()) for o in outs])
            (loss / gas).backward()
            total += loss.item() / gas
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "norms": norms, "aux": aux, "params": model.state_dict(), "init": init}


def _train(kind: str, experts: int, sp: int, ep: int, stage: int, steps: int, gas: int, clip: float, extra: dict):
    """This rank's run: its data-parallel rank's rows of every global micro-batch. Returns its losses, its
    load-balancing losses, the global norms, the tokens each expert got from this rank in the first forward (per
    layer), the experts it holds, its coordinates and its state dict (at stage 3 gathered within its
    expert-data-parallel group)."""
    model = make_model(kind, experts, sp)
    extra = dict(extra)
    if extra.pop("activation_checkpointing", False):  # transformers' own: each layer's forward again in backward
        model.gradient_checkpointing_enable()
        model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {}), **extra}
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "zero_optimization": zero,
        "sequence_parallel_size": sp,
        "expert_parallel_size": ep,
        "collective_timeout_s": 120.0,
    }
    engine = shardtrain.initialize(model, config=config, optimizer=opt)
    topo = engine.topology
    routed: list[torch.Tensor] = []
    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    hooks = [g.register_forward_hook(lambda _m, _i, out: routed.append(out[2].flatten())) for g in gates]
    batches = global_batches(topo.dp, steps * gas)
    losses, norms, aux = [], [], []
    for step in range(steps):
        total = 0.0
        for m in range(gas):
            ids = batches[step * gas + m][topo.dp_rank * MICRO : (topo.dp_rank + 1) * MICRO]
            out = engine(input_ids=ids, labels=ids)
            aux.append(float(out.aux_loss.detach()))
            engine.backward(out.loss)
            engine.step()
            total += out.loss.item() / gas
        losses.append(total)
        norms.append(engine.get_global_grad_norm())
    for h in hooks:
        h.remove()
    counts = [torch.bincount(r, minlength=experts).tolist() for r in routed[: len(gates)]]  # the first forward
    held = {n: m.expert_range for n, m in model.named_modules() if hasattr(m, "expert_range")}
    with engine.gathered(model):  # stage 3: each rank's experts whole within its expert-data-parallel group
        state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    where = {"dp_rank": topo.dp_rank, "sp_rank": topo.sp_rank, "zero_rank": topo.zero_rank, "ep_rank": topo.ep_rank}
    where["ep_group"] = dist.get_process_group_ranks(topo.ep_group)
    where["edp_group"] = dist.get_process_group_ranks(topo.edp_group)
    expert_buckets = {b.world for b in engine.layout.buckets if b.expert}
    engine.close()
    out = {"losses": losses, "norms": norms, "aux": aux, "counts": counts, "held": held, "state": state}
    out.update(where=where, expert_buckets=expert_buckets)
    return out


def _runs(cases: list[tuple], save_dir: str | None = None) -> list:
    """Every case on the same ranks, then (world 2) what is refused and, with ``save_dir``, the checkpoints of
    :func:`save_and_resume` at sp 2 x ep 2 (stage 2) loaded at ep 1 (stage 0)."""
    out = [_train(*case) for case in cases]
    if dist.get_world_size() != 2:
        return [out]
    base = {"train_micro_batch_size_per_gpu": MICRO, "sequence_parallel_size": 2, "collective_timeout_s": 120.0}
    more = [out, {"ep 4": _refused({**base, "expert_parallel_size": 4})}]
    return more + ([save_and_resume(2, 2, 2, save_dir, (1, 0))] if save_dir is not None else [])


def _refused(config: dict) -> str | None:
    """What ``initialize`` says of ``config`` (the tiny Mixtral), None when it builds."""
    model = tiny_moe("mixtral", 8)
    try:
        shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters())).close()
    except (ConfigError, LayoutError) as err:
        return str(err)
    return None


def _gather(results: list[dict], ep: int) -> dict:
    """The full state dict from the ranks of the first expert group (ZeRO ranks ``0 .. E-1``): expert weights
    concatenated in expert order."""
    first = sorted((r for r in results if r["where"]["zero_rank"] < ep), key=lambda r: r["where"]["ep_rank"])
    full = dict(first[0]["state"])
    for name in first[0]["held"]:
        for k in [k for k in full if k.startswith(name + ".")]:
            full[k] = torch.cat([r["state"][k] for r in first])
    return full


def _assert_parity(results: list[dict], case: tuple) -> None:
    kind, experts, sp, ep, stage, steps, gas, clip, _ = case
    world = len(results)
    dp = world // sp
    what = f"{kind} dp {dp} x sp {sp}, ep {ep}, stage {stage}"
    ref = reference(kind, experts, sp, dp, steps, gas, clip)
    for s, b in enumerate(ref["losses"]):
        a = sum(r["losses"][s] for r in results) / world  # every rank of a sequence returns its rows' whole loss
        assert abs(a - b) <= 2e-5 * abs(b), f"{what}: step {s}: loss {a} vs reference {b}"
    for r in results:
        for s, (a, b) in enumerate(zip(r["norms"], ref["norms"])):
            assert abs(a - b) <= 1e-4 * abs(b), f"{what}: step {s}: grad norm {a} vs reference {b}"
        # the load-balancing loss of the whole sequence of its rows, on every rank of the sequence-parallel group
        for i, (a, b) in enumerate(zip(r["aux"], ref["aux"])):
            want = b[r["where"]["dp_rank"]]
            assert abs(a - want) <= 2e-5 * abs(want), f"{what}: micro-step {i} {r['where']}: aux {a} vs {want}"
    full = _gather(results, ep)
    assert full.keys() == ref["params"].keys(), what
    for k, w in ref["params"].items():
        moved = (w - ref["init"][k]).norm().item()
        err = (full[k] - w).norm().item()
        assert moved > 0, f"{what}: {k} did not move: the check proves nothing"
        assert err <= 1e-3 * moved, f"{what}: {k}: error {err:.3g} vs distance moved {moved:.3g}"


# (kind, experts, sp, ep, stage, steps, gas, clip, more zero_optimization)
WORLD2 = [
    ("mixtral", 8, 2, 2, 2, 2, 2, 0.5, {}),  # dp 1 x sp 2: the expert group is the sequence-parallel group
    ("qwen3_moe", 8, 2, 2, 3, 2, 1, 0.5, {}),
    ("mixtral", 8, 2, 2, 0, 2, 1, 0.5, {}),  # stage 0: the norm sums the expert squares over the expert group
]
WORLD3 = [("qwen3_moe", 6, 3, 3, 2, 2, 1, 0.5, {})]  # dp 1 x sp 3, 6 experts over 3 ranks
WORLD4 = [  # dp 2 x sp 2
    ("mixtral", 8, 2, 2, 2, 2, 2, 0.5, {}),  # expert groups {0, 1}, {2, 3}: within a sequence group
    ("qwen3_moe", 8, 2, 2, 3, 2, 1, 0.5, {}),
    ("qwen3_moe", 8, 2, 4, 2, 2, 1, 0.5, {}),  # one expert group spanning both sequences: experts whole
    ("mixtral", 8, 2, 4, 3, 2, 1, 0.5, {}),
    ("mixtral", 8, 2, 2, 2, 2, 1, 0.5, {"mics_shard_size": 2}),  # hybrid sharding over the dp * sp ranks
    ("qwen3_moe", 8, 2, 2, 1, 2, 2, 0.5, {}),
    ("qwen3_moe", 8, 2, 4, 0, 2, 1, 0.5, {}),
    ("mixtral", 8, 2, 2, 3, 2, 1, 0.5, {"activation_checkpointing": True}),  # both exchanges run again in backward
    ("mixtral", 8, 2, 2, 2, 2, 1, 0.5, {"offload_optimizer": {"device": "cpu"}}),
]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_distributed(_runs, 2, WORLD2, str(tmp_path_factory.mktemp("ckpt")), timeout=300)


@pytest.fixture(scope="module")
def world3():
    return run_distributed(_runs, 3, WORLD3, timeout=300)


def test_sp2_ep2_trains_like_one_process(world2):
    for i, case in enumerate(WORLD2):
        _assert_parity([r[0][i] for r in world2], case)


def test_sp3_ep3_with_six_experts_trains_like_one_process(world3):
    _assert_parity([r[0][0] for r in world3], WORLD3[0])


def _check_groups(results: list[dict], experts: int, ep: int) -> None:
    """Expert groups of ``ep`` adjacent ZeRO ranks (``zero_rank = dp_rank * sp + sp_rank``), each rank holding the
    experts of its ``ep_rank``, and expert buckets sharded over the ``dp * sp / ep`` ranks holding the same experts."""
    world = len(results)
    for rank, r in enumerate(results):
        w = r["where"]
        assert w["zero_rank"] == rank and w["ep_rank"] == rank % ep, w  # tp 1: the ZeRO axis is the world
        assert w["ep_group"] == list(range(rank - rank % ep, rank - rank % ep + ep)), w
        assert w["edp_group"] == list(range(rank % ep, world, ep)), w
        n = experts // ep
        assert set(r["held"].values()) == {(w["ep_rank"] * n, (w["ep_rank"] + 1) * n)}, r["held"]
        assert r["expert_buckets"] == {world // ep}, r["expert_buckets"]


def test_expert_groups_are_cut_from_the_data_and_sequence_parallel_ranks(world2, world3):
    _check_groups([r[0][0] for r in world2], 8, 2)
    _check_groups([r[0][0] for r in world3], 6, 3)


def test_an_expert_that_gets_no_token_from_a_rank(world2, world3):
    # a rank routes its SEQ / sp tokens top-2: at most 6 of the 8 (or 6) experts get one, and the parity above holds
    for runs, sp, experts in ((world2, 2, 8), (world3, 3, 6)):
        counts = [r[0][0]["counts"] for r in runs]
        assert all(len(row) == experts and sum(row) == MICRO * SEQ // sp * 2 for c in counts for row in c), counts
        starved = [(rank, layer) for rank, c in enumerate(counts) for layer, row in enumerate(c) if 0 in row]
        assert starved, counts


def test_layouts_that_stay_refused_are_refused_by_name(world2):
    refused = world2[0][1]
    assert "expert_parallel_size (ep_size) 4 does not divide the 2 ranks ZeRO shards over" in refused["ep 4"]


@pytest.mark.soak
def test_dp2_sp2_with_ep2_and_ep4_trains_like_one_process():
    runs = run_distributed(_runs, 4, WORLD4, timeout=900)
    for i, case in enumerate(WORLD4):
        _assert_parity([r[0][i] for r in runs], case)
    _check_groups([r[0][0] for r in runs], 8, 2)
    _check_groups([r[0][2] for r in runs], 8, 4)


# -- checkpoints -----------------------------------------------------------------------------------------------------

BEFORE, AFTER = 2, 2  # steps before the save, steps after it


def _ckpt_engine(sp: int, ep: int, stage: int, seed: int = 0):
    model = tiny_moe("mixtral", 8, seed)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000},  # several buckets
        "sequence_parallel_size": sp,
        "expert_parallel_size": ep,
        "gradient_clipping": 0,  # the one-process reference does not clip
        "collective_timeout_s": 120.0,
    }
    return shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters(), lr=LR))


def _ckpt_train(engine, steps: range) -> list[float]:
    topo = engine.topology
    losses = []
    for s in steps:
        ids = global_batches(topo.dp, BEFORE + AFTER)[s][topo.dp_rank * MICRO : (topo.dp_rank + 1) * MICRO]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _full(engine) -> dict | None:
    full = engine.full_state_dict()
    return {k: v.clone() for k, v in full.items()} if full is not None else None


def save_and_resume(sp: int, ep: int, stage: int, save_dir: str, other: tuple[int, int]) -> dict:
    """Train ``BEFORE`` steps and save, then ``AFTER`` more (the unbroken run); a fresh engine from another seed loads
    the checkpoint and trains the same ``AFTER`` steps (the resumed run); then an engine at ``other = (ep', stage')``
    on the same ranks loads it, takes its full state dict and trains the same steps."""
    engine = _ckpt_engine(sp, ep, stage)
    _ckpt_train(engine, range(BEFORE))
    engine.save_checkpoint(save_dir, tag="a")
    saved = _full(engine)
    with engine.gathered(engine.module):
        own = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    held = {n: m.expert_range for n, m in engine.module.named_modules() if hasattr(m, "expert_range")}
    unbroken = _ckpt_train(engine, range(BEFORE, BEFORE + AFTER))
    out = {"saved": saved, "own": own, "held": held, "zero_rank": engine.topology.zero_rank, "unbroken": unbroken}
    out["unbroken_state"] = _full(engine)
    engine.close()
    engine = _ckpt_engine(sp, ep, stage, seed=5)
    engine.load_checkpoint(save_dir, tag="a")
    out["resumed"] = _ckpt_train(engine, range(BEFORE, BEFORE + AFTER))
    out["resumed_state"] = _full(engine)
    engine.close()
    engine = _ckpt_engine(sp, *other, seed=5)
    engine.load_checkpoint(save_dir, tag="a")
    out["elsewhere_loaded"] = _full(engine)
    out["elsewhere"] = _ckpt_train(engine, range(BEFORE, BEFORE + AFTER))
    engine.close()
    return out


def _ckpt_reference(dp: int) -> dict:
    """One process: the weights after ``BEFORE`` steps and the ``AFTER`` losses (each a mean over the data-parallel
    ranks' losses on their rows)."""
    model = tiny_moe("mixtral", 8)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    saved, losses = {}, []
    for step, ids in enumerate(global_batches(dp, BEFORE + AFTER)):
        if step == BEFORE:
            saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
        loss = sum(model(input_ids=r, labels=r).loss for r in ids.split(MICRO)) / dp
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"saved": saved, "losses": losses[BEFORE:]}


def _check_checkpoint(results: list[dict], sp: int, ep: int) -> None:
    world = len(results)
    ref = _ckpt_reference(world // sp)
    r0 = results[0]
    # full_state_dict() joins the experts of the first expert group: what each of its ranks holds, in expert order
    first = sorted((r for r in results if r["zero_rank"] < ep), key=lambda r: r["zero_rank"])
    for k, v in r0["saved"].items():
        name = next((n for n in r0["held"] if k.startswith(n + ".")), None)
        want = torch.cat([r["own"][k] for r in first]) if name is not None else r0["own"][k]
        assert torch.equal(v, want), k
        err, moved = (v - ref["saved"][k]).norm().item(), (ref["saved"][k] - tiny_moe("mixtral", 8).state_dict()[k])
        assert err <= 1e-3 * moved.norm().item() + 1e-7, f"{k}: the checkpoint is not one process's weights"
    for r in results:  # resuming at the same layout is exact
        assert r["resumed"] == r["unbroken"], (r["resumed"], r["unbroken"])
    for k, v in r0["unbroken_state"].items():
        assert torch.equal(v, r0["resumed_state"][k]), k
    for k, v in r0["saved"].items():  # loaded at another layout: every tensor as saved
        assert torch.equal(v, r0["elsewhere_loaded"][k]), k
    for s, want in enumerate(ref["losses"]):  # and training goes on as one process's
        for name in ("unbroken", "elsewhere"):
            got = sum(r[name][s] for r in results) / world
            assert abs(got - want) <= 2e-5 * abs(want), (name, s, got, want)


def test_checkpoints_resume_exactly_and_load_at_another_expert_layout(world2):
    # dp 1 x sp 2, ep 2 at stage 2, loaded at ep 1 (stage 0) on the same ranks
    _check_checkpoint([r[2] for r in world2], sp=2, ep=2)


@pytest.mark.soak
def test_checkpoints_of_dp2_sp2_load_at_another_expert_layout(tmp_path):
    # dp 2 x sp 2, ep 2 at stage 1 (each expert block in ZeRO fragments over an expert-data-parallel group of 2),
    # loaded at ep 4 (stage 2): each expert on one rank
    results = run_distributed(save_and_resume, 4, 2, 2, 1, str(tmp_path), (4, 2), timeout=600)
    _check_checkpoint(results, sp=2, ep=2)


@pytest.mark.soak
def test_stage_3_checkpoints_of_sp2_x_ep2_resume_and_load_at_stage_2(tmp_path):
    # sp 2 x ep 2 at stage 3 (the experts' units over an expert-data-parallel group of one rank), loaded at ep 1
    # (stage 2) on the same ranks
    results = run_distributed(save_and_resume, 2, 2, 2, 3, str(tmp_path), (1, 2), timeout=600)
    _check_checkpoint(results, sp=2, ep=2)
