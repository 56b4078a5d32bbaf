"""The bodies the expert-parallel checkpoint tests run on their ranks (tests/expert_parallel/test_ep_checkpoint*.py),
and their checks: tiny random mixtures of experts (:func:`helpers.moe_cases.tiny_moe`, without the load-balancing
loss) trained on one global batch of ``ROWS`` rows split over the ranks, saved, resumed and loaded at other layouts,
compared with one process on the whole batch (:func:`reference`).

The load-balancing loss is off (it is computed over each rank's own tokens, so it changes with the split), so the loss
of a step does not depend on the layout and every layout is compared with one process."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist

import shardtrain
from shardtrain.checkpoint import open_checkpoint

from helpers.moe_cases import VOCAB, tiny_moe

SEQ, ROWS, LR = 6, 12, 1e-2
BEFORE, AFTER = 2, 2  # steps before the save, steps after it
UNITS = {"stage3_param_persistence_threshold": 0}  # stage 3: every parameter in a unit, gathered on use


def make_model(kind: str, experts: int, seed: int = 0):
    return tiny_moe(kind, experts, seed, router_logits=False)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (ROWS, SEQ), generator=g) for _ in range(BEFORE + AFTER)]


def reference(kind: str, experts: int) -> dict:
    """One process on the whole batch: the state after ``BEFORE`` steps (weights and AdamW state by parameter name),
    the losses of the ``AFTER`` steps that follow, and the final weights."""
    model = make_model(kind, experts)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    names = {id(p): n for n, p in model.named_parameters()}
    losses, saved = [], {}
    for step, ids in enumerate(batches()):
        if step == BEFORE:
            saved = {
                "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "optim": {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()},
            }
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {**saved, "losses": losses[BEFORE:], "final": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def build_engine(
    kind: str, experts: int, ep: int, stage: int, seed: int = 0, bf16: bool = False, zero: dict | None = None
):
    """``zero``: more of the ``zero_optimization`` section (hybrid sharding, offload, the persistence threshold)."""
    model = make_model(kind, experts, seed)
    config = {
        "train_micro_batch_size_per_gpu": ROWS // dist.get_world_size(),
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, **(zero or {})},  # several buckets
        "expert_parallel_size": ep,
        "bf16": {"enabled": bf16},
        "gradient_clipping": 0,  # the one-process reference does not clip
        "collective_timeout_s": 120.0,
    }
    return shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters(), lr=LR))


def train(engine, steps: range) -> list[float]:
    rank, rows = dist.get_rank(), ROWS // dist.get_world_size()
    losses = []
    for s in steps:
        ids = batches()[s][rank * rows : (rank + 1) * rows]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def mean_over_ranks(losses: list[float]) -> list[float]:
    t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def full_state(engine) -> dict:
    full = engine.full_state_dict()
    return {k: v.clone() for k, v in full.items()} if full is not None else None


def save_and_resume(
    kind: str, experts: int, ep: int, stage: int, save_dir: str, others: tuple = (), zero: dict | None = None
) -> dict:
    """Train ``BEFORE`` steps and save, then ``AFTER`` more (the unbroken run); a fresh engine from another seed loads
    the checkpoint and trains the same ``AFTER`` steps (the resumed run). Then, on the same ranks, each layout
    ``(ep', stage')`` or ``(ep', stage', zero')`` of ``others`` loads it as :func:`load_elsewhere` does (tag
    :func:`other_tag`). ``zero``: more of the ZeRO section of the run that saves."""
    engine = build_engine(kind, experts, ep, stage, zero=zero)
    train(engine, range(BEFORE))
    engine.save_checkpoint(save_dir, tag="a")
    saved_state = full_state(engine)
    unbroken = train(engine, range(BEFORE, BEFORE + AFTER))
    unbroken_state = full_state(engine)
    held = {n: m.expert_range for n, m in engine.module.named_modules() if hasattr(m, "expert_range")}
    engine.close()
    engine = build_engine(kind, experts, ep, stage, seed=5, zero=zero)
    engine.load_checkpoint(save_dir, tag="a")
    resumed = train(engine, range(BEFORE, BEFORE + AFTER))
    out = {
        "unbroken": unbroken,
        "resumed": resumed,
        "mean": mean_over_ranks(unbroken),
        "saved_state": saved_state,
        "unbroken_state": unbroken_state,
        "resumed_state": full_state(engine),
        "held": held,
        # each expert bucket's (ranks it is sharded over, kept whole between steps: persistent at stage 3)
        "expert_buckets": sorted({(b.world, b.gather_after_step) for b in engine.layout.buckets if b.expert}),
        "offloaded": engine._optimizer.offload is not None,
        "replicas": engine.layout.replicas,
    }
    out["full_loads"] = _full_loads(engine, saved_state, save_dir)
    engine.close()
    # at stage 3 from_pretrained builds the model under zero.Init, which expert parallelism refuses
    out["from_pretrained"] = _from_pretrained(kind, experts, ep, stage, save_dir) if stage < 3 else None
    for other in others:
        tag = other_tag(*other)
        out[tag] = load_elsewhere(kind, experts, *other[:2], save_dir, save_dir, tag, *other[2:])
    return out


def failed_save_keeps_the_previous(
    kind: str, experts: int, ep: int, stage: int, load_dir: str, save_dir: str, zero: dict | None = None
) -> dict:
    """Load ``load_dir``'s checkpoint, save it as ``good`` in ``save_dir``, train a step, then save ``bad`` while the
    files of global rank 3 cannot be written (a full disk, :class:`helpers.reliability.FullDisk`): this rank's error,
    the tag ``latest`` names then, whether ``bad`` was left behind, and whether loading ``latest`` gives back the
    state of the ``good`` save (rank 0; None elsewhere)."""
    from contextlib import nullcontext

    from shardtrain.checkpoint.latest import read_latest
    from shardtrain.errors import CheckpointError

    from helpers.reliability import FullDisk

    engine = build_engine(kind, experts, ep, stage, seed=5, zero=zero)
    engine.load_checkpoint(load_dir, tag="a")
    engine.save_checkpoint(save_dir, tag="good")
    good = full_state(engine)
    train(engine, range(BEFORE, BEFORE + 1))
    error = None
    full = FullDisk(0, which=lambda name: name.startswith("rank")) if dist.get_rank() == 3 else nullcontext()
    with full:
        try:
            engine.save_checkpoint(save_dir, tag="bad")
        except CheckpointError as err:
            error = str(err)
    latest = read_latest(save_dir)
    engine.load_checkpoint(save_dir)
    back = full_state(engine)
    engine.close()
    same = (
        None if back is None else back.keys() == good.keys() and all(torch.equal(back[k], v) for k, v in good.items())
    )
    return {"error": error, "latest": latest, "bad_left": (Path(save_dir) / "bad").exists(), "same": same}


def other_tag(ep: int, stage: int, zero: dict | None = None) -> str:
    """The tag under which :func:`save_and_resume` saves again at layout ``(ep, stage, zero)``."""
    return f"b_ep{ep}_stage{stage}" + "".join(f"_{k}" for k in sorted(zero or {}))


def bf16_resume(save_dir: str) -> bool:
    """bf16 (fp32 masters) at ep 2, stage 2: whether the resumed run's losses and full state equal the unbroken run's
    bit for bit."""
    engine = build_engine("mixtral", 8, 2, 2, bf16=True)
    train(engine, range(BEFORE))
    engine.save_checkpoint(save_dir, tag="a")
    unbroken, unbroken_state = train(engine, range(BEFORE, BEFORE + AFTER)), full_state(engine)
    engine.close()
    engine = build_engine("mixtral", 8, 2, 2, seed=5, bf16=True)
    engine.load_checkpoint(save_dir, tag="a")
    resumed, resumed_state = train(engine, range(BEFORE, BEFORE + AFTER)), full_state(engine)
    engine.close()
    same_state = unbroken_state is None or all(torch.equal(v, resumed_state[k]) for k, v in unbroken_state.items())
    return resumed == unbroken and same_state


def _full_loads(engine, full: dict | None, save_dir: str) -> list[bool]:
    """``load_full_state_dict`` of the full model, from rank 0's dict and from a safetensors file: each rank keeps
    its experts. Whether ``full_state_dict()`` then gives it back unchanged (rank 0), for each source."""
    from safetensors.torch import save_file

    path = Path(save_dir) / "full.safetensors"
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, str(path))
    dist.barrier()
    same = []
    for source in (full if dist.get_rank() == 0 else None, str(path)):
        engine.load_full_state_dict(source)
        back = full_state(engine)
        same.append(back is None or all(torch.equal(back[k], v) for k, v in full.items()))
    return same


def _from_pretrained(kind: str, experts: int, ep: int, stage: int, save_dir: str) -> dict:
    """``shardtrain.from_pretrained`` of what transformers' ``save_pretrained`` writes (one tensor per expert, as on
    the Hub) under expert parallelism: whether ``full_state_dict()`` is transformers' own ``from_pretrained`` of it
    (rank 0; None elsewhere), and the experts whose tensors this rank read."""
    import transformers

    from shardtrain.weights import loading as weights

    path = Path(save_dir) / "pretrained"
    if dist.get_rank() == 0:
        make_model(kind, experts, seed=3).save_pretrained(path)
    dist.barrier()
    read, loader = [], weights._loader

    def counting_loader(file, key):  # how converted tensors (experts.N.*, stacked) are read
        load = loader(file, key)
        return lambda: (read.append(key), load())[1]

    config = {"train_micro_batch_size_per_gpu": 1, "expert_parallel_size": ep, "zero_optimization": {"stage": stage}}
    weights._loader = counting_loader
    try:
        engine = shardtrain.from_pretrained(
            transformers.AutoModelForCausalLM, path, config=config, optimizer=lambda p: torch.optim.AdamW(p, lr=LR)
        )
    finally:
        weights._loader = loader
    full = full_state(engine)
    engine.close()
    out = {"experts_read": sorted({int(m[1]) for k in read if (m := re.search(r"experts\.(\d+)\.", k))}), "same": None}
    if full is not None:
        want = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
        out["same"] = full.keys() == want.keys() and all(torch.equal(full[k], v) for k, v in want.items())
    return out


def load_elsewhere(
    kind: str, experts: int, ep: int, stage: int, load_dir: str, save_dir: str, tag: str = "b", zero: dict | None = None
) -> dict:
    """Load the checkpoint at this layout, save it again at once (``tag``), then train ``AFTER`` steps."""
    engine = build_engine(kind, experts, ep, stage, seed=5, zero=zero)
    engine.load_checkpoint(load_dir, tag="a")
    engine.save_checkpoint(save_dir, tag=tag)
    losses = mean_over_ranks(train(engine, range(BEFORE, BEFORE + AFTER)))
    out = {"losses": losses, "final": full_state(engine), "step": engine.global_step}
    engine.close()
    return out


def same_tensors(a: Path, b: Path, tag_a: str = "a", tag_b: str = "b") -> None:
    """Every model and optimizer tensor of two checkpoints, assembled whole, is bitwise equal."""
    ra, rb = open_checkpoint(a, tag_a), open_checkpoint(b, tag_b)
    names = [n for n in ra.manifest.tensors if n.startswith(("model/", "optim/"))]
    assert names and sorted(names) == sorted(n for n in rb.manifest.tensors if n.startswith(("model/", "optim/")))
    for n in names:
        x, y = ra.read(n), rb.read(n)
        assert x.dtype == y.dtype and torch.equal(x, y), n


def close_to(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = 1e-4) -> None:
    err = (a.float() - b.float()).abs().max().item()
    assert err <= tol * max(1.0, b.abs().max().item()), f"{what}: max error {err}"


def check_against_reference(path: Path, tag: str, ref: dict) -> None:
    """The checkpoint's weights and AdamW state (moments, step) are one process's after ``BEFORE`` steps."""
    reader = open_checkpoint(path, tag)
    for k, v in ref["model"].items():
        close_to(reader.read(f"model/{k}"), v, k)
    for name, state in ref["optim"].items():
        for key, v in state.items():
            close_to(reader.read(f"optim/{name}/{key}").reshape(v.shape), v, f"{name}/{key}")


def check_loaded_elsewhere(saved: Path, again: Path, tag: str, run: dict, ref: dict) -> None:
    """A load at another layout: saved again right after it, the same tensors bit for bit; the training that follows
    is one process's (the AdamW moments and step carried: a fresh AdamW would take other steps)."""
    same_tensors(saved, again, "a", tag)
    assert run["step"] == BEFORE + AFTER
    for a, b in zip(run["losses"], ref["losses"], strict=True):
        assert abs(a - b) <= 2e-5 * abs(b), (run["losses"], ref["losses"])
    for k, v in ref["final"].items():
        moved = (v - ref["model"][k]).norm().item()
        assert moved > 0, k
        assert (run["final"][k] - v).norm().item() <= 5e-3 * moved, k
