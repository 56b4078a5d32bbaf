"""ZeRO-1/2: the all-gather after a step runs behind the next forward ([Note: gathers after the step] in
shardtrain/zero/step_gather.py): the same numbers bit for bit, the waits where the parameters are first needed,
and every other reader of parameters or shards waits first."""

import copy

import pytest
import torch
from torch import nn

import shardtrain
from shardtrain.debug import Subscriber, SubscriberManager
from shardtrain.errors import RankMismatchError
from shardtrain.testing import run_distributed
from shardtrain.zero.step_gather import GatheringParameter

from helpers.parity import Recipe, global_micro_batches, make_model, make_optimizer, train_step


def _engine(recipe: Recipe, stage: int, extra: dict | None = None, model: nn.Module | None = None):
    model = model if model is not None else make_model(recipe)
    config = {
        "train_micro_batch_size_per_gpu": recipe.micro,
        "gradient_accumulation_steps": recipe.gas,
        "gradient_clipping": recipe.clip,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, **(extra or {}).get("zero", {})},
        **{k: v for k, v in (extra or {}).items() if k != "zero"},
    }
    return shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, recipe))


def _train(recipe: Recipe, stage: int, overlap: bool, extra: dict | None) -> dict:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    engine = _engine(recipe, stage, extra)
    gathers = engine._optimizer.gathers
    gathers.overlap = overlap
    batches = global_micro_batches(recipe, world)
    losses, norms = [], []
    for step in range(recipe.steps):
        losses.append(train_step(engine, recipe, batches, step, rank))
        norms.append(engine.get_global_grad_norm())
    return {"losses": losses, "norms": norms, "params": engine.full_state_dict(), "waits": dict(gathers.waits)}


CASES = [
    (1, Recipe(steps=4), None),
    (2, Recipe(steps=4), None),
    (2, Recipe(model="tied", steps=4), None),  # tied embeddings and a frozen parameter
    (1, Recipe(model="outside", steps=4), None),  # a block's weight read by the root before the block runs
    (3, Recipe(steps=3), None),  # stage 3 with every parameter persistent: gathered after the step too
    (2, Recipe(steps=3), {"bf16": {"enabled": True}}),  # fp32 masters refresh the shards before the gather
    (2, Recipe(steps=3), {"zero": {"allgather_bucket_size": 4000}}),  # in flight: 4000 elements, the rest waited
]


def _bitwise_body(cases: list) -> list[str]:
    problems = []
    for stage, recipe, extra in cases:
        what = f"stage {stage} {recipe.model} {extra or ''}"
        late, now = _train(recipe, stage, True, extra), _train(recipe, stage, False, extra)
        if late["waits"].get("forward", 0) == 0:
            problems.append(f"{what}: no gather was waited for in a forward hook (nothing overlapped)")
        if now["waits"]:
            problems.append(f"{what}: gathers were deferred with overlap off: {now['waits']}")
        if late["losses"] != now["losses"] or late["norms"] != now["norms"]:
            problems.append(f"{what}: losses/norms {late['losses']} {late['norms']} vs {now['losses']} {now['norms']}")
        for k, v in (late["params"] or {}).items():
            if not torch.equal(v, now["params"][k]):
                problems.append(f"{what}: {k} differs")
    return problems


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.soak), 3])  # world 3, the odd one, by default
def test_bitwise_same_as_gathering_at_the_step(world):
    """Deferring the waits changes where the host waits, never a value: losses, gradient norms and parameters
    equal those of the synchronous gather exactly, at an odd world size too."""
    for rank, problems in enumerate(run_distributed(_bitwise_body, world, CASES)):
        assert problems == [], f"rank {rank}: {problems}"


def _bucket_of(engine, p: torch.Tensor) -> int:
    return engine.layout.record_of(p).bucket.index


def _overlap_body() -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    recipe = Recipe(gas=1)
    model = make_model(recipe)
    model.unused = nn.Linear(8, 8)  # no forward reads it: its bucket is waited for by the next step
    engine = _engine(recipe, 2, model=model)
    gathers = engine._optimizer.gathers
    batches = global_micro_batches(recipe, dist.get_world_size())
    train_step(engine, recipe, batches, 0, rank)
    seen = {"after_step": sorted(gathers.pending)}

    def note(key: str):  # a hook that records what is in flight and returns None (it must not replace anything)
        return lambda *_: seen.setdefault(key, sorted(gathers.pending)) and None

    model.register_forward_pre_hook(note("start"), prepend=True)
    model.tok.register_forward_hook(note("after_tok"))
    model.blocks[0].register_forward_hook(note("after_block0"))
    waits = dict(gathers.waits)
    lo, hi = rank * recipe.micro, (rank + 1) * recipe.micro
    x, y = batches[1]
    loss = engine(x[lo:hi], y[lo:hi])
    seen["after_forward"] = sorted(gathers.pending)
    seen["forward_waits"] = gathers.waits["forward"] - waits.get("forward", 0)
    engine.backward(loss)
    seen["after_backward"] = sorted(gathers.pending)
    before = gathers.waits["step"] + gathers.waits["engine"]
    engine.step()
    seen["step_waits"] = gathers.waits["step"] + gathers.waits["engine"] - before
    seen["all"] = sorted(b.index for b in gathers.buckets)
    seen["tok"] = _bucket_of(engine, model.tok.weight)
    seen["unused"] = {_bucket_of(engine, p) for p in model.unused.parameters()}
    seen["block0"] = {_bucket_of(engine, p) for p in model.blocks[0].parameters()}
    return seen


def test_gathers_wait_in_the_forward_hook_of_their_first_module():
    """After a step every bucket's gather is still in flight when the next forward starts; the embedding's pre-hook
    waits for its bucket only, the first block's for its own, and a bucket no forward reads is waited for by the
    next step."""
    for seen in run_distributed(_overlap_body, 2):
        everything = seen["all"]
        assert len(everything) >= 4, everything  # small buckets: there is something to overlap
        assert seen["after_step"] == everything
        assert seen["start"] == everything
        assert seen["after_tok"] == [b for b in everything if b != seen["tok"]]
        later = set(seen["after_tok"]) - seen["block0"]
        assert set(seen["after_block0"]) == later and later, seen
        assert seen["after_forward"] == sorted(seen["unused"])
        assert seen["forward_waits"] == len(everything) - len(seen["unused"])
        assert seen["after_backward"] == sorted(seen["unused"])  # backward needs no parameter of it
        assert seen["step_waits"] == len(seen["unused"])  # before the optimizer writes their chunks


class _ReadsHeadWeight(Subscriber):
    def __init__(self) -> None:
        self.read: list[torch.Tensor] = []

    def pre_forward(self, step, name, module, args, kwargs):
        if name == "":  # the root: before any module hook of ours ran
            self.read.append(module.head.weight.detach().clone())
        return None


def _after_step(engine, batches, step: int) -> list[int]:
    import torch.distributed as dist

    train_step(engine, Recipe(gas=1), batches, step % len(batches), dist.get_rank())
    pending = engine._optimizer.gathers.pending
    assert pending, "nothing in flight after a step: the path below would prove nothing"
    return pending


def _settled(engine) -> dict[str, torch.Tensor]:
    engine._optimizer.gathers.wait_all("test")
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _paths_body(folder: str) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    recipe = Recipe(gas=1)
    engine = _engine(recipe, 2)
    gathers = engine._optimizer.gathers
    batches = global_micro_batches(recipe, dist.get_world_size())
    lo, hi = rank * recipe.micro, (rank + 1) * recipe.micro
    x, y = batches[0]
    out = {}

    _after_step(engine, batches, 0)  # state_dict(): every parameter read waits for its bucket
    sd = {k: v.clone() for k, v in engine.module.state_dict().items()}
    out["state_dict"] = (gathers.pending, _same(sd, _settled(engine)))

    pending = _after_step(engine, batches, 1)  # one weight read: its bucket only
    head = engine.module.head.weight.clone()
    head_bucket = _bucket_of(engine, engine.module.head.weight)
    left = gathers.pending
    out["attribute"] = (
        left == [b for b in pending if b != head_bucket],
        torch.equal(head, _settled(engine)["head.weight"]),
    )

    _after_step(engine, batches, 2)
    full = engine.full_state_dict()
    out["full_state_dict"] = (gathers.pending, rank != 0 or _same(full, _settled(engine)))

    _after_step(engine, batches, 3)
    engine.save_checkpoint(folder, tag="a")
    out["save"] = (gathers.pending,)
    saved = _settled(engine)
    _after_step(engine, batches, 4)
    engine.load_checkpoint(folder, tag="a")  # writes shards: the gathers of step 4 must not land after it
    out["load"] = (gathers.pending, _same(_settled(engine), saved))

    _after_step(engine, batches, 5)
    with engine.gathered(engine.module.head, modifier_rank=0):
        out["gathered"] = (gathers.pending,)

    _after_step(engine, batches, 6)
    engine.eval()
    with torch.no_grad():
        engine(x[lo:hi], y[lo:hi])
    engine.train()
    out["eval"] = (gathers.pending,)

    manager = SubscriberManager()
    sub = _ReadsHeadWeight()
    manager.subscribe(engine, sub)
    _after_step(engine, batches, 7)
    accesses = gathers.waits["access"]
    engine(x[lo:hi], y[lo:hi])  # a forward that no backward follows
    out["subscriber"] = (gathers.waits["access"] > accesses, torch.equal(sub.read[-1], _settled(engine)["head.weight"]))
    manager.unsubscribe(engine)

    _after_step(engine, batches, 8)
    clone = copy.deepcopy(engine.module)
    plain = not any(isinstance(p, GatheringParameter) for p in [*clone.parameters(), *engine.module.parameters()])
    out["deepcopy"] = (plain, _same(clone.state_dict(), _settled(engine)))

    _after_step(engine, batches, 9)  # ranks part ways: the desync check still fails on both, nothing left in flight
    try:
        engine.full_state_dict() if rank == 0 else engine.save_checkpoint(folder, tag="b")
        out["desync"] = ("no error",)
    except RankMismatchError:
        out["desync"] = (gathers.pending,)

    _after_step(engine, batches, 10)
    engine.close()
    out["close"] = (gathers.pending, not any(isinstance(p, GatheringParameter) for p in engine.module.parameters()))
    return out


def test_every_reader_of_parameters_waits(tmp_path):
    """state_dict(), a weight read through engine.module, full_state_dict(), save_checkpoint, load_checkpoint,
    gathered(modifier_rank=...), an eval forward, a debug subscriber reading a weight before our hooks, deepcopy,
    the desync check of ranks that part ways, and close(), each right after a step with the gathers in flight."""
    for rank, out in enumerate(run_distributed(_paths_body, 2, str(tmp_path))):
        assert out["state_dict"] == ([], True), rank
        assert out["attribute"] == (True, True), rank
        assert out["full_state_dict"] == ([], True), rank
        assert out["save"] == ([],), rank
        assert out["load"] == ([], True), rank
        assert out["gathered"] == ([],), rank
        assert out["eval"] == ([],), rank
        assert out["subscriber"] == (True, True), rank
        assert out["deepcopy"] == (True, True), rank
        assert out["desync"] == ([],), rank
        assert out["close"] == ([], True), rank
