"""Expert parallelism with tensor AND sequence parallelism on one mesh (``expert_parallel_size: E``,
``tensor_parallel.size: T``, ``sequence_parallel_size: P``; [Note: experts under tensor and sequence parallelism] in
``shardtrain/distributed/mesh.py``): the expert groups cut from the ``dp * P`` ranks at each tp rank, the experts
whole on every tp rank, each tp rank exchanging its share of its slice's tokens. Tiny random Mixtral and Qwen3-MoE
models trained against one process on the same global batch (losses with the load-balancing loss, each rank's
load-balancing loss, global gradient norms, the final parameters from ``full_state_dict()``) at world 4 = tp 2 x
sp 2 (E 2: the expert group spans the sequence-parallel group) and, marked soak, world 8 = dp 2 x sp 2 x tp 2 (E 2
and E 4, a model built by ``shardtrain.from_pretrained`` under ``zero.Init(config)``, and a checkpoint resumed bit for
bit and loaded at another layout) and world 6 = tp 2 x sp 3 (E 3) and tp 3 x sp 2 (E 2)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import transformers

import shardtrain
from shardtrain.distributed.mesh import make_groups
from shardtrain.testing import run_distributed

from helpers.moe_cases import one_process, row_batches, tiny_moe

LR = 1e-2
UNITS = {"stage3_param_persistence_threshold": 0}
SP3 = {"num_attention_heads": 12, "num_key_value_heads": 6}
"""Qwen3-MoE heads (4 wide) that tp 2 x sp 3 divides: 6 query and 3 key/value heads per tp rank, 2 and 1 per sp
rank."""


def _config(tp: int, sp: int, ep: int, stage: int, gas: int, clip: float, zero: dict) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": stage, **zero},
        "tensor_parallel": {"size": tp},
        "sequence_parallel_size": sp,
        "expert_parallel_size": ep,
        "collective_timeout_s": 120.0,
    }


def _train(case: tuple) -> dict:
    """This rank's run of ``case``: its data-parallel rank's row of every global micro-batch (its sequence slice
    taken by the engine). Returns its losses, load-balancing losses and global norms, its coordinates and groups,
    the experts it holds, the tokens each tp rank exchanged in the first forward, and (rank 0) the full state."""
    kind, experts, tp, sp, ep, stage, steps, gas, clip, overrides, zero, seq = case
    zero = dict(zero)
    pretrained = zero.pop("from_pretrained", None)  # a directory of save_pretrained's files of this very model
    model = tiny_moe(kind, experts, **overrides)
    if zero.pop("activation_checkpointing", False):  # transformers' own: each layer's forward again in backward
        model.gradient_checkpointing_enable()
        model.train()
    config = _config(tp, sp, ep, stage, gas, clip, zero)
    if pretrained is not None:  # built under zero.Init(config), each rank reading its tp blocks and its experts
        engine = shardtrain.from_pretrained(
            transformers.AutoModelForCausalLM, pretrained, config=config, optimizer=lambda ps: torch.optim.AdamW(ps, LR)
        )
        model = engine.module
    else:
        engine = shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters(), lr=LR))
    topo = engine.topology
    hidden: list[torch.Tensor] = []  # what the first layer's experts module is handed: this rank's slice's tokens
    experts_module = model.model.layers[0].mlp.experts
    hook = experts_module.register_forward_pre_hook(lambda _m, args: hidden.append(args[0].detach().clone()))
    batches = row_batches(topo.dp, steps * gas, seq)
    losses, norms, aux = [], [], []
    for step in range(steps):
        total = 0.0
        for m in range(gas):
            ids = batches[step * gas + m][topo.dp_rank : topo.dp_rank + 1]
            out = engine(input_ids=ids, labels=ids)
            aux.append(float(out.aux_loss.detach()))
            engine.backward(out.loss)
            engine.step()
            total += out.loss.item() / gas
        losses.append(total)
        norms.append(engine.get_global_grad_norm())
    hook.remove()
    where = {k: getattr(topo, k) for k in ("dp_rank", "sp_rank", "tp_rank", "zero_rank", "ep_rank")}
    where.update(ep_group=dist.get_process_group_ranks(topo.ep_group))
    where.update(edp_group=dist.get_process_group_ranks(topo.edp_group))
    out = {"losses": losses, "norms": norms, "aux": aux, "where": where, "held": experts_module.expert_range}
    out.update(first_tokens=hidden[0], expert_buckets={b.world for b in engine.layout.buckets if b.expert})
    out["full"] = engine.full_state_dict()
    engine.close()
    return out


def _runs(cases: list[tuple], ckpt: tuple | None = None) -> list:
    """Every case on the same ranks, then (with ``ckpt``) :func:`save_and_resume` of it."""
    return [_train(case) for case in cases] + ([save_and_resume(*ckpt)] if ckpt is not None else [])


def _assert_parity(results: list[dict], case: tuple) -> None:
    kind, experts, tp, sp, ep, stage, steps, gas, clip, overrides, _, seq = case
    world = len(results)
    dp = world // (tp * sp)
    what = f"{kind} dp {dp} x sp {sp} x tp {tp}, ep {ep}, stage {stage}"
    ref = one_process(kind, experts, dp, steps, gas, clip, overrides, seq, LR)
    for s, b in enumerate(ref["losses"]):
        a = sum(r["losses"][s] for r in results) / world  # every rank of a sequence returns its row's whole loss
        assert abs(a - b) <= 2e-5 * abs(b), f"{what}: step {s}: loss {a} vs reference {b}"
    for r in results:
        for s, (a, b) in enumerate(zip(r["norms"], ref["norms"])):
            assert abs(a - b) <= 1e-4 * abs(b), f"{what}: {r['where']}: step {s}: grad norm {a} vs reference {b}"
        for i, (a, b) in enumerate(zip(r["aux"], ref["aux"])):  # the whole sequence's, on every rank of its groups
            want = b[r["where"]["dp_rank"]]
            assert abs(a - want) <= 2e-5 * abs(want), f"{what}: micro-step {i} {r['where']}: aux {a} vs {want}"
    full = results[0]["full"]
    assert all(r["full"] is None for r in results[1:]), what  # full_state_dict(): on rank 0 only
    assert full.keys() == ref["params"].keys(), what
    for k, w in ref["params"].items():
        moved = (w - ref["init"][k]).norm().item()
        err = (full[k].float() - w).norm().item()
        assert moved > 0, f"{what}: {k} did not move: the check proves nothing"
        assert err <= 1e-3 * moved, f"{what}: {k}: error {err:.3g} vs distance moved {moved:.3g}"


def _check_layout(results: list[dict], case: tuple) -> None:
    """rank = zero_rank * T + tp_rank with zero_rank = dp_rank * P + sp_rank; the expert groups ``E`` adjacent
    zero ranks at one tp rank, each rank holding the experts of its ``ep_rank``, the expert buckets over the ``dp * P
    / E`` ranks holding the same experts; and the tp ranks of one (dp, sp) position handed the same tokens."""
    _, experts, tp, sp, ep, *_ = case
    world = len(results)
    zero, n = world // tp, experts // ep
    for rank, r in enumerate(results):
        w = r["where"]
        z, t = rank // tp, rank % tp
        assert (w["zero_rank"], w["tp_rank"], w["sp_rank"], w["dp_rank"]) == (z, t, z % sp, z // sp), w
        assert w["ep_rank"] == z % ep, w
        assert w["ep_group"] == [(z - z % ep + e) * tp + t for e in range(ep)], w
        assert w["edp_group"] == [(g * ep + z % ep) * tp + t for g in range(zero // ep)], w
        assert r["held"] == (w["ep_rank"] * n, (w["ep_rank"] + 1) * n), r["held"]
        assert r["expert_buckets"] == {zero // ep}, r["expert_buckets"]
        # the tp token-share of [Note: experts beside tensor parallelism] needs the same tokens on every tp rank
        peer = results[rank - t]
        assert torch.equal(r["first_tokens"], peer["first_tokens"]), (rank, rank - t)
    # and the sp ranks of a sequence hold other tokens (their slices)
    assert not torch.equal(results[0]["first_tokens"], results[tp]["first_tokens"])


# (kind, experts, tp, sp, ep, stage, steps, gas, clip, model overrides, more zero_optimization, sequence length)
WORLD4 = [  # dp 1 x sp 2 x tp 2, E 2: the expert group at each tp rank is the sequence-parallel group
    ("qwen3_moe", 8, 2, 2, 2, 2, 2, 2, 0.5, {}, {}, 6),  # slices of 3 tokens: tp shares of 2 and 1; accumulation
    ("mixtral", 8, 2, 2, 2, 3, 2, 1, 0.5, {}, UNITS, 8),  # stage 3: expert units over an edp group of one rank
]


def _pretrained(cases: list[tuple], path) -> list[tuple]:
    """``cases`` with the ``from_pretrained`` directory filled in: save_pretrained's files of the case's model."""
    out = []
    for case in cases:
        if "from_pretrained" in case[10]:
            tiny_moe(case[0], case[1], **case[9]).save_pretrained(path)
            case = (*case[:10], {**case[10], "from_pretrained": str(path)}, case[11])
        out.append(case)
    return out


def test_tp2_sp2_ep2_trains_like_one_process():
    runs = run_distributed(_runs, 4, WORLD4, timeout=280)
    for i, case in enumerate(WORLD4):
        _assert_parity([r[i] for r in runs], case)
        _check_layout([r[i] for r in runs], case)


def _partitions(world: int, tp: int, sp: int, ep: int) -> dict[int, dict[str, list[int]]]:
    out = {}
    for rank in range(world):
        main, _ = make_groups(rank, world, tp, "gloo", "world", lambda ranks, backend: ranks, sp=sp, ep=ep)
        out[rank] = {axis: getattr(main, axis) for axis in ("tp", "sp", "dp_sp", "ep", "edp")}
    return out


def test_expert_groups_are_cut_from_the_data_and_sequence_parallel_ranks_at_each_tp_rank():
    g = _partitions(8, 2, 2, 2)  # dp 2 x sp 2 x tp 2: zero ranks 0..3 at tp rank 0 are global 0, 2, 4, 6
    assert [g[r]["sp"] for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [g[r]["dp_sp"] for r in (0, 1)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert [g[r]["ep"] for r in range(8)] == [[0, 2], [1, 3], [0, 2], [1, 3], [4, 6], [5, 7], [4, 6], [5, 7]]
    assert [g[r]["edp"] for r in range(8)] == [[0, 4], [1, 5], [2, 6], [3, 7], [0, 4], [1, 5], [2, 6], [3, 7]]
    g4 = _partitions(8, 2, 2, 4)  # E 4: one expert group per tp rank, over both sequences
    assert [g4[r]["ep"] for r in (0, 1)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert [g4[r]["edp"] for r in range(8)] == [[r] for r in range(8)]


# -- soak: world 8 and world 6 -----------------------------------------------------------------------------------------
WORLD8 = [  # dp 2 x sp 2 x tp 2
    ("mixtral", 8, 2, 2, 2, 2, 2, 2, 0.5, {}, {}, 6),  # E 2: expert groups within a sequence group, edp of 2
    ("qwen3_moe", 8, 2, 2, 2, 3, 2, 1, 0.5, {}, UNITS, 8),
    ("qwen3_moe", 8, 2, 2, 4, 2, 2, 1, 0.5, {}, {}, 6),  # E 4: one expert group over both sequences
    ("mixtral", 8, 2, 2, 4, 3, 2, 1, 0.5, {}, {**UNITS, "activation_checkpointing": True}, 8),
    ("mixtral", 8, 2, 2, 2, 1, 2, 1, 0.5, {}, {"mics_shard_size": 2}, 6),  # hybrid sharding over dp * sp
    ("qwen3_moe", 8, 2, 2, 2, 0, 2, 1, 0.5, {}, {}, 6),
    # shardtrain.from_pretrained: built under zero.Init(config), each rank reads its tp blocks and its experts
    ("qwen3_moe", 8, 2, 2, 2, 3, 2, 1, 0.5, {}, {**UNITS, "from_pretrained": None}, 6),
]
TP3 = {"num_attention_heads": 6, "num_key_value_heads": 3, "vocab_size": 36}
"""Heads and vocabulary tp 3 divides, 2 query heads per tp rank for sp 2 (the key/value head repeated)."""
WORLD6 = [
    ("qwen3_moe", 6, 2, 3, 3, 2, 2, 1, 0.5, SP3, {}, 6),  # dp 1 x sp 3 x tp 2, 6 experts over 3 ranks
    # dp 1 x sp 2 x tp 3: slices of 2 tokens, tp shares of 1, 1 and none (tp rank 2 sends no token)
    ("qwen3_moe", 8, 3, 2, 2, 3, 2, 1, 0.5, TP3, UNITS, 4),
]


@pytest.mark.soak
@pytest.mark.timeout(900)
def test_dp2_sp2_tp2_with_ep2_and_ep4_trains_like_one_process_and_checkpoints(tmp_path):
    # the checkpoint: saved at dp 2 x sp 2 x tp 2, E 2, stage 2; resumed there and loaded at dp 2 x sp 4 (tp 1), E 4,
    # stage 1: other tensor-parallel blocks, sequence slices and expert blocks
    cases = _pretrained(WORLD8, tmp_path / "pretrained")
    runs = run_distributed(_runs, 8, cases, ((2, 2, 2, 2), str(tmp_path / "ckpt"), (1, 4, 4, 1)), timeout=870)
    for i, case in enumerate(WORLD8):
        _assert_parity([r[i] for r in runs], case)
        _check_layout([r[i] for r in runs], case)
    _check_checkpoint([r[-1] for r in runs], dp=2)


@pytest.mark.soak
def test_tp2_sp3_ep3_and_tp3_sp2_ep2_train_like_one_process():
    runs = run_distributed(_runs, 6, WORLD6, timeout=280)
    for i, case in enumerate(WORLD6):
        _assert_parity([r[i] for r in runs], case)
        _check_layout([r[i] for r in runs], case)


# -- checkpoints -------------------------------------------------------------------------------------------------------
BEFORE, AFTER, CKPT_SEQ = 2, 2, 8


def _ckpt_engine(tp: int, sp: int, ep: int, stage: int, seed: int = 0):
    model = tiny_moe("qwen3_moe", 8, seed)
    config = _config(tp, sp, ep, stage, 1, 0.5, {"reduce_bucket_size": 2000})  # several buckets
    return shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters(), lr=LR))


def _ckpt_train(engine, steps: range) -> list[float]:
    dp_rank, losses = engine.topology.dp_rank, []
    for s in steps:
        ids = row_batches(engine.topology.dp, BEFORE + AFTER, CKPT_SEQ)[s][dp_rank : dp_rank + 1]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def save_and_resume(layout: tuple[int, int, int, int], path: str, other: tuple[int, int, int, int]) -> dict:
    """``layout = (tp, sp, ep, stage)``: train ``BEFORE`` steps and save, then ``AFTER`` more (the unbroken run); a
    fresh engine from another seed loads the checkpoint and trains the same steps (the resumed run); an engine at
    ``other`` on the same ranks loads it, reads its full state and trains the same steps."""
    engine = _ckpt_engine(*layout)
    _ckpt_train(engine, range(BEFORE))
    engine.save_checkpoint(path, tag="a")
    out = {"saved": engine.full_state_dict()}
    out["unbroken"] = _ckpt_train(engine, range(BEFORE, BEFORE + AFTER))
    out["unbroken_state"] = engine.full_state_dict()
    engine.close()
    engine = _ckpt_engine(*layout, seed=5)
    engine.load_checkpoint(path, tag="a")
    out["resumed"] = _ckpt_train(engine, range(BEFORE, BEFORE + AFTER))
    out["resumed_state"] = engine.full_state_dict()
    engine.close()
    engine = _ckpt_engine(*other, seed=5)
    engine.load_checkpoint(path, tag="a")
    out["elsewhere_loaded"] = engine.full_state_dict()
    out["elsewhere"] = _ckpt_train(engine, range(BEFORE, BEFORE + AFTER))
    out["elsewhere_dp"] = engine.topology.dp
    engine.close()
    return out


def _check_checkpoint(results: list[dict], dp: int) -> None:
    r0 = results[0]
    for r in results:  # resuming at the same layout is bit for bit
        assert r["resumed"] == r["unbroken"], (r["resumed"], r["unbroken"])
    assert all(torch.equal(v, r0["resumed_state"][k]) for k, v in r0["unbroken_state"].items())
    assert r0["saved"].keys() == r0["elsewhere_loaded"].keys()
    assert all(torch.equal(v, r0["elsewhere_loaded"][k]) for k, v in r0["saved"].items())  # every tensor as saved
    # and training goes on at the other layout as at the saved one: the mean of the ranks' losses per step
    other = [sum(r["elsewhere"][s] for r in results) / len(results) for s in range(AFTER)]
    unbroken = [sum(r["unbroken"][s] for r in results) / len(results) for s in range(AFTER)]
    assert r0["elsewhere_dp"] == dp  # the same global batch
    for a, b in zip(other, unbroken):
        assert abs(a - b) <= 2e-5 * abs(b), (other, unbroken)
