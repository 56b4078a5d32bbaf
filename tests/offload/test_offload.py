"""Optimizer offload (``zero_optimization.offload_optimizer``): training with state in swap files (``nvme``) or in
host memory (``cpu``) gives bitwise the numbers of training without offload, at stages 1-3 and worlds 1-3, and
equals one process; the memory held for optimizer state is ``buffer_count`` sub-groups, not the whole state."""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import pytest
import torch

import shardtrain
from shardtrain.config.sections import inspect_config
from shardtrain.testing import run_distributed

from helpers.parity import (
    Recipe,
    assert_parity,
    global_micro_batches,
    make_model,
    make_optimizer,
    reference_run,
    train_step,
)


@functools.cache
def reference(recipe: Recipe, world: int) -> dict:
    return reference_run(recipe, world)


def train(
    recipe: Recipe, stage: int, world: int, zero_extra: dict | None = None, bucket: int = 2000, top: dict | None = None
) -> dict:
    """Runs on every rank: this rank's losses, the final full weights (rank 0), what offload held and where."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model = make_model(recipe)
    config = {
        "train_micro_batch_size_per_gpu": recipe.micro,
        "gradient_accumulation_steps": recipe.gas,
        "gradient_clipping": recipe.clip,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            "stage3_param_persistence_threshold": 0,
            **(zero_extra or {}),
        },
        **(top or {}),
    }
    engine = shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, recipe))
    offload = engine._optimizer.offload
    batches = global_micro_batches(recipe, world)
    losses, norms, resident = [], [], []
    for step in range(recipe.steps):
        losses.append(train_step(engine, recipe, batches, step, rank))
        norms.append(engine.get_global_grad_norm())
        resident.append(engine.state_bytes()["optimizer"])
    out = {
        "losses": losses,
        "norms": norms,
        "params": engine.full_state_dict(),
        "resident": resident,
        "scratch": [str(s.path) for s in engine._scratch.values()],
    }
    out["grad_bytes"] = engine._reducer.grad_bytes()  # gradient shards in memory after the last step
    out["grads_on_disk"] = sorted(offload.grads.on_disk) if offload is not None and offload.grads else []
    if offload is not None:
        out["groups"] = len(offload.groups)
        out["peak"] = offload.peak_held_bytes
        out["saved_files"] = sum(len(keys) for keys in offload._saved.values())
        out["bytes_read"] = offload.files.bytes_read if offload.files is not None else 0
        out["bytes_written"] = offload.files.bytes_written if offload.files is not None else 0
    if engine._param_offload is not None:  # which units' shards went to files, and each unit's shard size
        out["mapped_units"] = sorted(engine._param_offload.mapped_units)
        out["unit_numels"] = [sum(b.shard.numel() for b in u.buckets) for u in engine._runtime.units]
        out["mapped_bytes"] = engine._param_offload.mapped_bytes()
        out["most_ahead"] = engine._param_offload.most_ahead
        out["param_reads"] = engine._param_offload.reads
    engine.close()
    out["scratch_left"] = [p for p in out["scratch"] if Path(p).exists()]
    return out


def _bitwise_equal(a: list[dict], b: list[dict]) -> None:
    for ra, rb in zip(a, b):
        assert ra["losses"] == rb["losses"]
        assert ra["norms"] == rb["norms"]
    pa, pb = a[0]["params"], b[0]["params"]
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k


@pytest.mark.parametrize(("stage", "world"), [(1, 3), (2, 1), (2, 2), (2, 3), (3, 1), (3, 2), (3, 3)])
def test_nvme_offload_is_bitwise_in_memory_training(stage, world, tmp_path):
    recipe = Recipe(steps=4)
    nvme = {
        "sub_group_size": 1500,
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 3},
    }
    plain = run_distributed(train, world, recipe, stage, world)
    offloaded = run_distributed(train, world, recipe, stage, world, nvme)
    _bitwise_equal(offloaded, plain)
    assert_parity(offloaded, reference(recipe, world))
    for r, p in zip(offloaded, plain):
        if stage >= 2:  # the gradient shards went to files too: none left in memory ([Note: gradient offload])
            assert r["grad_bytes"] == 0 < p["grad_bytes"] and r["grads_on_disk"], (r["grad_bytes"], p["grad_bytes"])
        else:  # stage 1 keeps full gradient buffers (reduce-scatter into place): not offloaded
            assert r["grads_on_disk"] == [] and r["grad_bytes"] == p["grad_bytes"]
        assert r["groups"] > 3  # several sub-groups were swapped in and out
        assert r["saved_files"] > 0
        # between steps no element-wise state is resident: Adam's step counts only (8 bytes per tensor)
        assert max(r["resident"]) < 0.05 * max(max(p["resident"]) for p in plain)
        assert r["scratch_left"] == []  # close() removed the swap directory
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adagrad"])
def test_nvme_offload_other_optimizers(optimizer, tmp_path):
    """SGD's momentum, Adam's amsgrad maximum, Adagrad's sum made at construction: each goes through the files."""
    recipe = Recipe(steps=3, optimizer=optimizer)
    nvme = {"sub_group_size": 3000, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}
    plain = run_distributed(train, 2, recipe, 2, 2)
    offloaded = run_distributed(train, 2, recipe, 2, 2, nvme)
    _bitwise_equal(offloaded, plain)
    for r, q in zip(offloaded, plain):  # the state did go to the files and came back from them
        assert r["saved_files"] > 0 and r["bytes_written"] > 0
        assert r["bytes_read"] >= r["bytes_written"] / 3  # the 2nd and 3rd steps read what the steps before wrote
        assert max(r["resident"]) < 0.05 * max(q["resident"])  # none of it stayed in memory between steps


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_nvme_offload_under_mixed_precision_is_bitwise_in_memory_training(precision, tmp_path):
    """fp32 masters (resident) and compute-dtype parameters: the offloaded moments step them exactly alike."""
    recipe = Recipe(steps=3)
    nvme = {"sub_group_size": 2000, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}
    # gradient shards go to the files when they accumulate in fp32 (the dtype stepped), by name: DeepSpeed's default,
    # the compute dtype, keeps them in memory at half the bytes
    top = {precision: {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}
    plain = run_distributed(train, 2, recipe, 3, 2, None, 2000, top)
    offloaded = run_distributed(train, 2, recipe, 3, 2, nvme, 2000, top)
    _bitwise_equal(offloaded, plain)
    for r, q in zip(offloaded, plain):  # the fp32 masters went to the files with the moments
        assert max(r["resident"]) < 0.05 * max(q["resident"])
        # and the fp32 gradient shards (fp16: their norms taken after unscaling, from the files once more)
        assert r["grad_bytes"] == 0 < q["grad_bytes"] and r["grads_on_disk"]


def test_cpu_offload_on_a_cpu_machine_is_in_memory_training(tmp_path):
    """device cpu on a CPU-only machine: state stays in host memory (where it is), stepped per sub-group."""
    recipe = Recipe(steps=3)
    cpu = {"sub_group_size": 1000, "offload_optimizer": {"device": "cpu"}}
    plain = run_distributed(train, 2, recipe, 3, 2)
    offloaded = run_distributed(train, 2, recipe, 3, 2, cpu)
    _bitwise_equal(offloaded, plain)
    assert offloaded[0]["resident"] == plain[0]["resident"]
    assert offloaded[0]["scratch"] == []


def test_ratio_offloads_the_first_sub_groups_only(tmp_path):
    recipe = Recipe(steps=3)
    half = {
        "sub_group_size": 1500,
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "ratio": 0.5},
    }
    plain = run_distributed(train, 2, recipe, 2, 2)
    offloaded = run_distributed(train, 2, recipe, 2, 2, half)
    _bitwise_equal(offloaded, plain)
    for r, p in zip(offloaded, plain):
        assert r["grad_bytes"] == 0 and r["grads_on_disk"]  # resident sub-groups read their gradients too
        kept = r["resident"][-1] / p["resident"][-1]
        assert 0.3 < kept < 0.7, kept  # about half the state stays resident


# -- memory: buffer_count sub-groups, not the whole state ------------------------------------------


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def train_wide(nvme_path: str | None, steps: int = 2) -> dict:
    """One rank, a GPT whose Adam state (~25 MB) dwarfs the swap buffers; what the swapper held, and the RSS."""
    import ctypes
    import gc

    from shardtrain.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=256, n_layer=4, n_head=4))
    zero: dict = {"stage": 2, "sub_group_size": 100_000}
    if nvme_path is not None:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 3}
    engine = shardtrain.initialize(
        model, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero}, torch.optim.AdamW(model.parameters())
    )
    x = torch.randint(0, 64, (2, 16))
    for _ in range(steps):
        engine.backward(engine(x, torch.roll(x, -1, 1)))
        engine.step()
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap pages back to the OS: RSS counts what is live
    out = {"rss": _rss_bytes()}
    offload = engine._optimizer.offload
    if offload is not None:
        files = offload.files
        # a sub-group's buffer holds its state and, read with it, its gradients (see [Note: gradient offload])
        grads = offload.grads is not None
        sizes = {
            g.index: sum(files.path(i, k).stat().st_size for i in g.members for k in offload._saved.get(i, {}))
            + grads * sum(offload.shapes[i].numel() * 4 for i in g.members)
            for g in offload.groups
        }
        out |= {
            "peak": offload.peak_held_bytes,
            "held": offload.held_bytes(),
            "group_bytes": max(sizes.values()),
            "total_bytes": sum(sizes.values()),
            "regions": max(sum(len(offload._saved.get(i, {})) + grads for i in g.members) for g in offload.groups),
            "buffer_count": offload.buffer_count,
        }
    engine.close()
    return out


def test_optimizer_state_in_memory_is_buffer_count_sub_groups(tmp_path):
    """The swapper's buffers (their storages, measured) never hold more than ``buffer_count`` sub-groups of state,
    a small part of the whole state on disk; and the process's resident memory shows the state is gone from it."""
    (offloaded,) = run_distributed(train_wide, 1, str(tmp_path))
    (plain,) = run_distributed(train_wide, 1, None)
    largest = offloaded["group_bytes"] + offloaded["regions"] * 4096  # each state region starts on a page
    assert offloaded["peak"] <= offloaded["buffer_count"] * largest
    assert offloaded["peak"] >= largest  # the buffers did hold a sub-group (the accounting counts something)
    assert offloaded["total_bytes"] >= 4 * offloaded["peak"]  # the whole state is far larger than what was held
    assert offloaded["held"] <= offloaded["peak"]
    # the in-memory run keeps all ~25 MB of Adam state resident; the offloaded one at most the buffers
    saved = plain["rss"] - offloaded["rss"]
    assert saved >= 0.5 * (offloaded["total_bytes"] - offloaded["peak"]), (saved, offloaded)


# -- checkpoints: offloaded state saved and loaded in any layout ---------------------------------


def ckpt_run(
    recipe: Recipe,
    stage: int,
    zero_extra: dict | None,
    steps: int,
    save: str | None,
    load: str | None,
    top: dict | None = None,
):
    """Train ``steps`` steps (after loading ``load``), then save to ``save``; returns losses and final weights."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(Recipe(seed=recipe.seed + 7) if load else recipe)  # a loaded run's values come from the file
    config = {
        "train_micro_batch_size_per_gpu": recipe.micro,
        "gradient_accumulation_steps": recipe.gas,
        "gradient_clipping": recipe.clip,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 2000,
            "stage3_param_persistence_threshold": 0,
            **(zero_extra or {}),
        },
        **(top or {}),
    }
    engine = shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, recipe))
    if load:
        engine.load_checkpoint(load)
    batches = global_micro_batches(recipe, world)
    losses = [train_step(engine, recipe, batches, engine.global_step, rank) for _ in range(steps)]
    if save:
        engine.save_checkpoint(save, tag="t")
    params = engine.full_state_dict()
    engine.close()
    return {"losses": losses, "params": params}


def _optim_tensors(path: Path) -> dict[str, torch.Tensor]:
    from shardtrain.checkpoint import open_checkpoint

    reader = open_checkpoint(path, "t")
    return {n: reader.read(n) for n in reader.manifest.tensors if n.startswith(("optim/", "model/"))}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_checkpoint_of_offloaded_state_equals_in_memory_checkpoint_and_resumes_exactly(precision, tmp_path):
    """bf16: the saved fp32 masters come from their swap files, and loading writes them back there."""
    recipe = Recipe(steps=4)
    nvme = {"sub_group_size": 1500, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "swap")}}
    top = {"bf16": {"enabled": True}} if precision == "bf16" else None
    (tmp_path / "swap").mkdir()
    straight = run_distributed(ckpt_run, 2, recipe, 2, nvme, 4, None, None, top)
    run_distributed(ckpt_run, 2, recipe, 2, nvme, 2, str(tmp_path / "off"), None, top)
    run_distributed(ckpt_run, 2, recipe, 2, None, 2, str(tmp_path / "mem"), None, top)
    saved_off, saved_mem = _optim_tensors(tmp_path / "off"), _optim_tensors(tmp_path / "mem")
    assert saved_off.keys() == saved_mem.keys() and any(k.endswith("/exp_avg_sq") for k in saved_off)
    for k in saved_off:
        assert torch.equal(saved_off[k], saved_mem[k]), k
    # offload -> offload, same layout: the resumed steps are the straight run's, bitwise
    resumed = run_distributed(ckpt_run, 2, recipe, 2, nvme, 2, None, str(tmp_path / "off"), top)
    for r, s in zip(resumed, straight):
        assert r["losses"] == s["losses"][2:]
    for k, v in straight[0]["params"].items():
        assert torch.equal(resumed[0]["params"][k], v), k
    assert list((tmp_path / "swap").iterdir()) == []


@pytest.mark.parametrize(("save_offloaded", "world", "stage"), [(True, 3, 3), (False, 3, 1), (False, 1, 3)])
def test_checkpoint_loads_across_offload_and_world_size(save_offloaded, world, stage, tmp_path):
    """Saved at world 2 stage 2 (offloaded or not), loaded at another world and stage with and without offload:
    the two continue bitwise alike, so the offloaded engine loaded exactly what the in-memory one did."""
    recipe = Recipe(steps=4)
    (tmp_path / "swap").mkdir()
    nvme = {"sub_group_size": 1500, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "swap")}}
    run_distributed(ckpt_run, 2, recipe, 2, nvme if save_offloaded else None, 2, str(tmp_path / "c"), None)
    into_mem = run_distributed(ckpt_run, world, recipe, stage, None, 2, None, str(tmp_path / "c"))
    into_off = run_distributed(ckpt_run, world, recipe, stage, nvme, 2, None, str(tmp_path / "c"))
    for a, b in zip(into_off, into_mem):
        assert a["losses"] == b["losses"]
    for k, v in into_mem[0]["params"].items():
        assert torch.equal(into_off[0]["params"][k], v), k


def load_weights_then_train(nvme_path: str | None) -> dict:
    """bf16 at stage 2: one step, full weights loaded (they land in the fp32 masters), one step more."""
    import torch.distributed as dist

    recipe = Recipe(steps=2)
    model = make_model(recipe)
    zero: dict = {"stage": 2, "reduce_bucket_size": 2000, "sub_group_size": 1500}
    if nvme_path:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path}
    config = {"train_micro_batch_size_per_gpu": recipe.micro, "bf16": {"enabled": True}, "zero_optimization": zero}
    engine = shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, recipe))
    batches = global_micro_batches(recipe, dist.get_world_size())
    lo, hi = dist.get_rank() * recipe.micro, (dist.get_rank() + 1) * recipe.micro
    losses = []
    for step in range(2):
        if step == 1:
            weights = make_model(Recipe(seed=5)).state_dict() if dist.get_rank() == 0 else None
            engine.load_full_state_dict(weights)
        x, y = batches[step]
        loss = engine(x[lo:hi], y[lo:hi])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = engine.full_state_dict()
    engine.close()
    return {"losses": losses, "params": params}


def test_full_weights_load_into_offloaded_masters(tmp_path):
    plain = run_distributed(load_weights_then_train, 2, None)
    offloaded = run_distributed(load_weights_then_train, 2, str(tmp_path))
    for a, b in zip(offloaded, plain):
        assert a["losses"] == b["losses"]
    for k, v in plain[0]["params"].items():
        assert torch.equal(offloaded[0]["params"][k], v), k


# -- parameter offload (stage 3) ---------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3])
def test_nvme_parameter_offload_is_bitwise_in_memory_training(world, tmp_path):
    """Unit shards in mapped swap files (and the optimizer state in its own): the same numbers, bitwise."""
    recipe = Recipe(steps=3)
    both = {
        "sub_group_size": 1500,
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0},
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
    }
    plain = run_distributed(train, world, recipe, 3, world)
    offloaded = run_distributed(train, world, recipe, 3, world, both)
    _bitwise_equal(offloaded, plain)
    assert_parity(offloaded, reference(recipe, world))
    assert all(len(r["scratch"]) == 2 and r["scratch_left"] == [] for r in offloaded)


def test_parameter_offload_max_in_cpu_keeps_the_first_units(tmp_path):
    recipe = Recipe(steps=2)
    # units of this model at world 2: shards of 6352, 6352 and 2336 elements; the first two fit in 13000
    some = {"offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 13000}}
    plain = run_distributed(train, 2, recipe, 3, 2)
    offloaded = run_distributed(train, 2, recipe, 3, 2, some)
    _bitwise_equal(offloaded, plain)
    for r in offloaded:
        numels, mapped = r["unit_numels"], r["mapped_units"]
        kept = [i for i in range(len(numels)) if i not in mapped]
        # the first units, as many as fit in 13000 elements, stay in memory; every later one is in a file
        assert kept == list(range(len(kept))) and 0 < len(kept) < len(numels), (kept, numels)
        assert sum(numels[i] for i in kept) <= 13000 < sum(numels[: len(kept) + 1])
        assert r["mapped_bytes"] > 0


def test_checkpoint_with_parameter_offload_loads_in_memory(tmp_path):
    recipe = Recipe(steps=4)
    (tmp_path / "swap").mkdir()
    both = {
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "swap"), "max_in_cpu": 0},
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "swap")},
    }
    run_distributed(ckpt_run, 2, recipe, 3, both, 2, str(tmp_path / "off"), None)
    run_distributed(ckpt_run, 2, recipe, 3, None, 2, str(tmp_path / "mem"), None)
    saved_off, saved_mem = _optim_tensors(tmp_path / "off"), _optim_tensors(tmp_path / "mem")
    for k in saved_mem:
        assert torch.equal(saved_off[k], saved_mem[k]), k
    into_off = run_distributed(ckpt_run, 3, recipe, 3, both, 2, None, str(tmp_path / "mem"))
    into_mem = run_distributed(ckpt_run, 3, recipe, 3, None, 2, None, str(tmp_path / "mem"))
    for a, b in zip(into_off, into_mem):
        assert a["losses"] == b["losses"]
    for k, v in into_mem[0]["params"].items():
        assert torch.equal(into_off[0]["params"][k], v), k


# -- state made at the optimizer's construction follows the tensor it steps --------------------------


def test_state_made_at_construction_follows_the_stepped_tensor_to_its_device():
    """Adagrad makes ``sum`` at construction where the parameter is (on CUDA: the GPU) while, with offload, the
    optimizer steps a master on the host: the offload moves such state to the stepped tensor's device. Here the
    stepped tensor is on ``meta`` and the state on the CPU, the same logic in the other direction (the CUDA run is
    in test_offload_cuda.py)."""
    from shardtrain.offload.optimizer_state import OptimizerOffload, make_sub_groups

    p = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.Adagrad([p], initial_accumulator_value=0.5)
    stepped = torch.empty(3, device="meta")
    optimizer.state[stepped] = optimizer.state.pop(p)  # as the optimizer wrapper re-keys it on the master
    OptimizerOffload(optimizer, [stepped], make_sub_groups([3], 10), None, 1, world=None)
    state = optimizer.state[stepped]
    assert state["sum"].device == stepped.device and state["sum"].shape == (3,)
    assert state["step"].device.type == "cpu"  # per-tensor scalars stay where torch keeps them


# -- keys with an effect: ratio with device cpu (CUDA), pin_memory, buffer_count --------------------------------


def test_pack_blocks_lays_fragments_out_in_few_aligned_blocks():
    from shardtrain.offload.optimizer_state import pack_blocks

    nbytes = [40, 4, 0, 100, 300, 12, 8]
    sizes, where = pack_blocks(nbytes, breaks={5}, block=256, align=64)
    # 40@0, 4@64, 0@128, 100@128 fill block 0; 300 > 256 alone; 12 starts block 2 (a break); 8 follows it
    assert where == [(0, 0), (0, 64), (0, 128), (0, 128), (1, 0), (2, 0), (2, 64)]
    assert sizes == [228, 300, 72]
    for (b, off), n in zip(where, nbytes):
        assert off % 64 == 0 and off + n <= sizes[b]
    spans = sorted((b, off, off + n) for (b, off), n in zip(where, nbytes) if n)
    assert all(x[0] != y[0] or x[2] <= y[1] for x, y in itertools.pairwise(spans))  # no two tensors overlap


def test_host_masters_are_views_into_a_few_blocks_and_ratio_keeps_the_rest_in_place():
    """On CUDA the host masters were pinned one allocation per fragment; now a few blocks (one per sub-group at
    least). With ``ratio`` < 1 (``device: cpu``) only the first sub-groups get host masters, the others are
    stepped where they are. The layout is device-independent; here the "device" fragments are CPU tensors."""
    from shardtrain.offload.optimizer_state import host_masters

    torch.manual_seed(0)
    fragments = {k: torch.randn(n) for k, n in enumerate([100, 50, 150, 100, 200, 100, 100])}
    every = host_masters(None, fragments, pin=False, sub_group_size=300, ratio=1.0)
    assert all(torch.equal(every[k], t) and every[k] is not t for k, t in fragments.items())
    storages = {every[k].untyped_storage().data_ptr() for k in fragments}
    assert len(storages) == 3  # sub-groups [100, 50, 150], [100, 200], [100, 100]: one block each
    part = host_masters(None, fragments, pin=False, sub_group_size=300, ratio=0.75)
    on_host = [k for k, t in fragments.items() if part[k] is not t]
    assert on_host == [0, 1, 2, 3, 4]  # the first two sub-groups: 600 of 800 elements
    assert all(torch.equal(part[k], fragments[k]) for k in fragments)


def offload_warnings(zero_extra: dict) -> list[str]:
    """``initialize`` with ``zero_extra``; the warnings the engine logged."""
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("shardtrain").addHandler(Keep(level=logging.WARNING))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero_extra}}
    engine = shardtrain.initialize(model, config, torch.optim.AdamW(model.parameters()))
    engine.close()
    return [r for r in records if "offload" in r]


def test_offload_keys_that_cannot_act_on_this_machine_warn_at_initialize(tmp_path):
    """Without a GPU: ``ratio`` with device cpu (it splits the step between host and GPU), the optimizer's
    ``pin_memory`` (page-locked memory speeds device copies), ``buffer_count`` with device cpu (it counts swap
    buffers) each warn, naming the key; where the keys act (nvme) nothing is said."""
    silent = {
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "ratio": 0.5, "buffer_count": 2},
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 2},
    }
    assert run_distributed(offload_warnings, 1, silent)[0] == []
    loud = {
        "offload_optimizer": {"device": "cpu", "ratio": 0.5, "pin_memory": True, "buffer_count": 2},
        "offload_param": {"device": "cpu", "pin_memory": True, "buffer_count": 2},
    }
    said = run_distributed(offload_warnings, 1, loud)[0]
    for key in (
        "offload_optimizer.ratio 0.5",
        "offload_optimizer.pin_memory",
        "offload_optimizer.buffer_count",
        "offload_param.buffer_count",
        "offload_param.pin_memory",  # acts on CUDA (tests/offload/test_pin_memory.py), not here
    ):
        assert sum(w.startswith(f"zero_optimization.{key} has no effect") for w in said) == 1, (key, said)
    no_effect = inspect_config({"zero_optimization": {"stage": 3, **loud}}).no_effect
    assert not [n for n in no_effect if n.startswith("zero_optimization.offload_param.pin_memory: ")], no_effect


class _Bucket:
    def __init__(self, index: int, numel: int):
        self.index, self.shard = index, torch.randn(numel)


class _Unit:
    def __init__(self, index: int, numel: int):
        self.index, self.buckets = index, [_Bucket(index, numel)]


def test_parameter_offload_reads_each_shard_once_into_a_buffer_for_at_most_buffer_count_units(tmp_path):
    """Before its gather a unit's shard is read from its file with one read into a buffer that the all-gather sends
    from (its values, not the mapping's pages: see [Note: parameter offload]); at most ``buffer_count`` units hold
    one, a further unit is gathered from its mapping; once gathered, the shard is the mapping again."""
    from shardtrain.offload.parameters import ParamOffload
    from shardtrain.offload.swap import ScratchDir

    units = [_Unit(i, 1000) for i in range(4)]
    values = [u.buckets[0].shard.clone() for u in units]
    scratch = ScratchDir(tmp_path, 0, "zero_optimization.offload_param")
    offload = ParamOffload(units, scratch, 0, max_in_cpu=0, buffer_count=2)
    mapped = [u.buckets[0].shard for u in units]
    mapped[1][5] = 7.0  # a change through the mapping (the optimizer step's way) is what the next read sees
    values[1][5] = 7.0
    for u in units[:3]:  # the runtime asks for three units ahead of their gathers
        offload.will_need(u)
    for k in (0, 1):  # read into new memory, equal to the file's (and the mapping's) values
        shard = units[k].buckets[0].shard
        assert shard.data_ptr() != mapped[k].data_ptr() and torch.equal(shard, values[k])
    assert units[2].buckets[0].shard is mapped[2]  # past buffer_count: gathered from the mapping
    assert offload.reads == 2 and offload.bytes_read == 2 * 4000
    offload.done_with([units[0]])  # unit 0 gathered: its shard is the mapping again, a buffer is free
    assert units[0].buckets[0].shard is mapped[0]
    offload.will_need(units[3])
    assert units[3].buckets[0].shard is not mapped[3] and torch.equal(units[3].buckets[0].shard, values[3])
    offload.done_with(units)
    assert all(u.buckets[0].shard is m for u, m in zip(units, mapped)) and offload.most_ahead == 2
    scratch.remove()


def test_parameter_offload_with_one_buffer_is_bitwise_in_memory_training(tmp_path):
    recipe = Recipe(steps=2)
    one = {"offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0, "buffer_count": 1}}
    plain = run_distributed(train, 2, recipe, 3, 2)
    offloaded = run_distributed(train, 2, recipe, 3, 2, one)
    _bitwise_equal(offloaded, plain)
    assert all(r["most_ahead"] == 1 and r["param_reads"] > 0 for r in offloaded)
