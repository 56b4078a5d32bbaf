"""Runs of the activation-checkpointing tests: one model trained under the engine with several
``activation_checkpointing`` sections in one process (one ``run_distributed`` job per layout keeps them fast), and
the bytes a forward leaves alive for its backward."""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import shardtrain
from shardtrain.activations import HostOffload, TPPartition

from helpers.model_cases import MICRO, _gpt, _llama, batches, loss_of, optimizer, trained

BUILDERS = {"gpt": lambda: _gpt(n_layer=3), "llama": _llama}

SECTIONS = {
    "none": {},
    "full": {"policy": "full"},
    "selective": {"policy": "selective"},
    "full+cpu": {"policy": "full", "cpu_checkpointing": True},
    "selective+cpu": {"policy": "selective", "cpu_checkpointing": True},
}


class _Outputs(TorchDispatchMode):
    """Weak references to the storage of every tensor an operation makes."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[object, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                s = t.untyped_storage()
                ref = StorageWeakRef(s)
                self.made.setdefault(ref.cdata, (ref, s.nbytes()))
        return out


def offload_of(model: torch.nn.Module, kind: type = HostOffload) -> Any:
    """The engine's host offload (or ``kind``: its tensor-parallel partition) of checkpointed inputs, found on a
    block's forward hooks."""
    for m in model.modules():
        for hook in m._forward_pre_hooks.values():
            owner = getattr(hook, "__self__", None)
            if isinstance(owner, kind):
                return owner
    return None


def config_of(stage: int, section: dict, tp: int = 1, sp: int = 1) -> dict:
    """The config :func:`policy_runs` trains with."""
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 0},
        "activation_checkpointing": section,
    }
    if tp > 1:
        config["tensor_parallel"] = {"size": tp}
    if sp > 1:
        config["sequence_parallel_size"] = sp
    return config


def policy_runs(
    case: str, stage: int, names: list[str], steps: int = 3, tp: int = 1, sp: int = 1, sections: dict | None = None
) -> dict:
    """Train ``case`` at ZeRO ``stage`` once per section of ``names`` (in ``sections``, default :data:`SECTIONS`);
    per name the losses, grad norms and final parameters (rank 0's full state), the bytes the first forward left
    alive for backward (storages made during it that are alive until backward starts), the host offload's counts,
    and each block's recompute as the plan says (``policy: "budget"``: the planner's choice)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    dp, dp_rank = world // (tp * sp), rank // (tp * sp)  # the ranks of a tp or sp group share their batch
    out = {}
    for name in names:
        model = BUILDERS[case]()
        config = config_of(stage, (sections or SECTIONS)[name], tp, sp)
        tp_plan = None
        if tp > 1:
            from shardtrain.tensor_parallel import GPT_TP_PLAN

            tp_plan = GPT_TP_PLAN
        engine = shardtrain.initialize(model, config=config, optimizer=optimizer(model), tp_plan=tp_plan)
        offload = offload_of(model)
        losses, norms, kept, offloaded = [], [], None, []
        for s, x in enumerate(batches(dp, steps)):
            x = x[dp_rank * MICRO : (dp_rank + 1) * MICRO]
            if s == 0:
                with _Outputs() as made:
                    loss = loss_of(case, engine, x, torch.roll(x, -1, 1), s)
                kept = sum(n for ref, n in made.made.values() if not ref.expired())
                del made
            else:
                loss = loss_of(case, engine, x, torch.roll(x, -1, 1), s)
            if offload is not None:
                offloaded.append((offload.host_bytes, offload.offloaded))
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().clone())
            norms.append(engine.get_global_grad_norm())
            if offload is not None:
                assert offload.host_bytes == 0, "host copies left after backward"
        full = engine.full_state_dict()
        names_ = {n for n, p in model.named_parameters() if p.requires_grad}
        out[name] = {
            "losses": [float(v) for v in losses],
            "loss_tensors": losses,
            "norms": norms,
            "params": {k: v for k, v in full.items() if k in names_} if full is not None else None,
            "kept_bytes": kept,
            "offloaded": offloaded,
            "peak_host_bytes": offload.peak_host_bytes if offload is not None else 0,
            "per_block": engine.plan.activations.per_block,
            "partitioned": getattr(offload_of(model, TPPartition), "partitioned", 0),
        }
    return out


def reference(case: str, world: int, steps: int = 3) -> dict:
    """One process, no checkpointing, the global batch: fp32 losses, grad norms and parameters, and the float64
    run's parameters (``exact``), as :func:`helpers.model_cases.reference` trains its cases."""

    def train(dtype: torch.dtype) -> dict:
        model = BUILDERS[case]().to(dtype)
        init, opt, losses, norms = trained(model), optimizer(model), [], []
        for s, x in enumerate(batches(world, steps)):
            loss = loss_of(case, model, x, torch.roll(x, -1, 1), s)
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return {"losses": losses, "norms": norms, "params": trained(model), "init": init}

    ref = train(torch.float32)
    ref["exact"] = train(torch.float64)["params"]
    return ref


def assert_bitwise(run: dict, base: dict, what: str) -> None:
    """Same losses, gradient norms and final parameters, bit for bit."""
    for s, (a, b) in enumerate(zip(run["loss_tensors"], base["loss_tensors"])):
        assert torch.equal(a, b), f"{what}: step {s} loss {a.item()!r} vs {b.item()!r}"
    assert run["norms"] == base["norms"], f"{what}: grad norms {run['norms']} vs {base['norms']}"
    if base["params"] is not None:
        for k, v in base["params"].items():
            assert torch.equal(run["params"][k], v), f"{what}: parameter {k} differs"


__all__ = ["BUILDERS", "SECTIONS", "assert_bitwise", "config_of", "offload_of", "policy_runs", "reference"]
