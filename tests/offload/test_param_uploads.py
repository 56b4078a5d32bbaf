"""Parameter offload on a GPU ([Note: parameter uploads] in ``offload/param_uploads.py``), driven on the CPU: the
device's choice of streams is replaced where it is made (``param_uploads.upload_streams``, and the optimizer offload's
``host_copies.copy_streams``) by fakes whose copies run only in the order a CUDA stream would run them. A copy's
device buffer holds NaN until its copy has run, so a gather that read it early changes the numbers; the fakes log
copy, issue, wait, free and each use of a unit, and the tests assert that order. Training through them is bitwise
training with the parameters kept on the device (stage 3 without offload), at worlds 1 and 3, bf16 and fp32, with
accumulation and clipping."""

from __future__ import annotations

import itertools
import weakref
from contextlib import contextmanager

import pytest
import torch

import shardtrain
from shardtrain.config import load_config
from shardtrain.config.plan import resolve_plan
from shardtrain.errors import ConfigError
from shardtrain.offload import host_copies, param_uploads
from shardtrain.testing import run_distributed
from test_host_copies import DeferredStreams, assert_runs_bitwise_equal

from helpers.parity import Recipe, global_micro_batches, make_model, make_optimizer, train_step


class DeferredUploads:
    """:class:`~shardtrain.offload.param_uploads.UploadStreams` on the CPU. ``upload`` queues the copy on ``h2d``
    and returns a buffer of NaN; work issued inside ``issuing`` runs on ``h2d`` after the copies queued before it (so
    the queue is run first, as the stream would); ``use`` is the compute stream's wait. ``log``: ("copy", n, home
    unit), ("issue", n), ("wait", n), ("free", n), with ``n`` the upload's number, and the test's ("use", unit); the
    test sets ``unit`` (the unit being uploaded)."""

    pins = False

    def __init__(self, log: list) -> None:
        self.log = log
        self.queue: list = []
        self.numbers = itertools.count()
        self.number_of: dict[int, int] = {}  # id(buffer) -> its upload's number
        self.unit: int | None = None

    def mark(self) -> str:
        return "compute"

    def upload(self, host: torch.Tensor, after) -> torch.Tensor:
        n = next(self.numbers)
        buffer = torch.full(host.shape, float("nan"), dtype=host.dtype) if host.is_floating_point() else host * 0
        self.queue.append((n, lambda: buffer.copy_(host)))
        self.number_of[id(buffer)] = n
        weakref.finalize(buffer, self.log.append, ("free", n))
        self.log.append(("copy", n, self.unit))
        return buffer

    @contextmanager
    def issuing(self):
        ran = []
        for n, op in self.queue:  # the stream runs what was queued on it before the collective
            op()
            ran.append(n)
        self.queue.clear()
        self.log.append(("issue", *ran))

        class Issued:
            done = ran

        yield Issued
        Issued.done = list(ran)

    def use(self, event, buffers: list[torch.Tensor]) -> None:
        for b in buffers:
            self.log.append(("wait", self.number_of[id(b)]))


def train_uploaded(recipe: Recipe, world: int, top: dict, offload: str | None, nvme_path: str = "") -> dict:
    """Runs on every rank: stage 3, with ``offload`` (``"cpu"``, or ``"nvme"``: every unit in swap files) the
    parameters' and the optimizer's offload as on a GPU through the fakes; else plain stage 3. Returns the losses,
    norms, full parameters and the uploads' log."""
    import torch.distributed as dist

    rank = dist.get_rank()
    log: list = []
    if offload is not None:
        param_uploads.upload_streams = lambda device: DeferredUploads(log)  # this worker process only
        host_copies.copy_streams = lambda device: DeferredStreams()
    model = make_model(recipe)
    zero = {"stage": 3, "reduce_bucket_size": 2000, "allgather_bucket_size": 2000, "sub_group_size": 1500,
            "stage3_param_persistence_threshold": 0}  # fmt: skip
    if offload is not None:
        zero["offload_optimizer"] = {"device": "cpu"}
        zero["offload_param"] = {"device": offload}
        if offload == "nvme":
            zero["offload_param"].update(nvme_path=nvme_path, max_in_cpu=0)
    config = {
        "train_micro_batch_size_per_gpu": recipe.micro,
        "gradient_accumulation_steps": recipe.gas,
        "gradient_clipping": recipe.clip,
        "zero_optimization": zero,
        **top,
    }
    engine = shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, recipe))
    out: dict = {}
    if offload is not None:
        source = engine._param_offload
        assert isinstance(source, param_uploads.ParamUploads)
        original = source.will_need

        def will_need(unit) -> None:
            source.streams.unit = unit.index
            original(unit)

        source.will_need = will_need  # the gather service calls it through the instance
        # at rest every unit shard is a view into the host blocks, or (nvme) into its swap file's mapping
        out["mapped_bytes"] = source.mapped_bytes()
        out["homes_in_blocks"] = offload == "nvme" or all(
            any(blk.data_ptr() <= b.shard.data_ptr() < blk.data_ptr() + blk.numel() for blk in source.arena.blocks)
            for u in engine._runtime.units
            for b in u.buckets
        )
        for u in engine._runtime.units:
            u.module.register_forward_pre_hook(lambda m, a, index=u.index: log.append(("use", index)))
    batches = global_micro_batches(recipe, world)
    losses, norms = [], []
    for step in range(recipe.steps):
        losses.append(train_step(engine, recipe, batches, step, rank))
        norms.append(engine.get_global_grad_norm())
    out.update(losses=losses, norms=norms, params=engine.full_state_dict())
    if offload is not None:
        import gc

        gc.collect()
        out["log"] = log
        out["uploads"] = source.uploads
        out["units"] = len(engine._runtime.units)
        out["inflight_after"] = len(source._inflight)
        out["file_reads"] = source.files.reads if source.files is not None else 0
    engine.close()
    return out


def _check_order(log: list) -> tuple[int, int]:
    """Every upload: copied, then issued (its copy run on the stream before the collective), then waited for by the
    compute stream, then freed; every use of a unit after the wait of its latest upload. Returns (uploads, uses)."""
    at: dict[tuple[str, int], int] = {}
    unit_of: dict[int, int] = {}
    latest: dict[int, int] = {}  # unit -> its latest upload
    uses = 0
    for k, entry in enumerate(log):
        kind = entry[0]
        if kind == "copy":
            _, n, unit = entry
            at[("copy", n)] = k
            unit_of[n] = unit
            latest[unit] = n
        elif kind == "issue":
            for n in entry[1:]:
                at.setdefault(("issue", n), k)
        elif kind in ("wait", "free"):
            at.setdefault((kind, entry[1]), k)
        elif kind == "use":
            uses += 1
            n = latest.get(entry[1])
            assert n is not None, f"unit {entry[1]} used before any upload"
            assert ("wait", n) in at, f"unit {entry[1]} used before the compute stream waited for upload {n}"
    for n in unit_of:
        order = [at.get((kind, n)) for kind in ("copy", "issue", "wait", "free")]
        assert None not in order, (n, order)
        assert order == sorted(order), (n, order)
    return len(unit_of), uses


@pytest.mark.parametrize(
    ("world", "precision", "device"), [(1, "bf16", "cpu"), (3, "bf16", "cpu"), (2, "fp32", "cpu"), (2, "bf16", "nvme")]
)
def test_parameter_offload_on_the_gpu_path_is_bitwise_parameters_on_the_device(world, precision, device, tmp_path):
    """The CUDA code path of ``offload_param`` (``cpu``; ``nvme``: read from the swap file, then uploaded) beside
    ``offload_optimizer: cpu``, streams faked: losses, gradient norms and parameters equal stage 3 without offload,
    bit for bit; each unit is uploaded once per gather, in the order copy, issue, wait, free, and used only after its
    wait; nothing is left in flight."""
    recipe = Recipe(steps=3)
    top = {} if precision == "fp32" else {precision: {"enabled": True}}
    plain = run_distributed(train_uploaded, world, recipe, world, top, None)
    uploaded = run_distributed(train_uploaded, world, recipe, world, top, device, str(tmp_path))
    assert_runs_bitwise_equal(uploaded, plain)
    for r in uploaded:
        assert r["homes_in_blocks"]
        assert (r["mapped_bytes"] > 0 and r["file_reads"] > 0) == (device == "nvme")
        assert r["inflight_after"] == 0
        uploads, uses = _check_order(r["log"])
        assert uploads == r["uploads"] > 0
        # every unit is used in each forward of the run (3 steps x 2 micro-steps)
        assert uses >= r["units"] * recipe.steps * recipe.gas


def test_a_gather_that_read_its_buffer_before_the_copy_ran_breaks_parity():
    """The fake is strict enough to catch an early read: issuing outside the copy's stream order (the gather reads
    the NaN buffer) gives non-finite losses."""
    recipe = Recipe(steps=1)
    (early,) = run_distributed(_train_reading_early, 1, recipe)
    assert not all(torch.isfinite(torch.tensor(loss)) for loss in early)


def _train_reading_early(recipe: Recipe) -> list[float]:
    class EarlyReads(DeferredUploads):
        @contextmanager
        def issuing(self):  # the collective does not wait for the copies queued before it
            class Issued:
                done = None

            yield Issued

    log: list = []
    param_uploads.upload_streams = lambda device: EarlyReads(log)
    host_copies.copy_streams = lambda device: DeferredStreams()
    model = make_model(recipe)
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
            "stage3_param_persistence_threshold": 0}  # fmt: skip
    config = {"train_micro_batch_size_per_gpu": recipe.micro, "zero_optimization": zero}
    engine = shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, recipe))
    x, y = global_micro_batches(recipe, 1)[0]
    loss = engine(x[: recipe.micro], y[: recipe.micro])
    engine.close()
    return [loss.item()]


def test_parameter_offload_on_cuda_is_planned_and_its_unbuilt_companions_refused_by_name():
    """The Hugging Face ZeRO-3 offload config resolves on CUDA; without optimizer offload, with graph mode or a
    partial optimizer offload it is refused, naming the key to change."""
    both = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    assert resolve_plan(load_config({"zero_optimization": both}), 2, "cuda").offload.param.device == "cpu"
    refused = [
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, "without offload_optimizer"),
        ({"zero_optimization": both, "graph": {"enabled": True}}, "with graph mode"),
        (
            {"zero_optimization": {**both, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
            r"with offload_optimizer\.ratio 0\.5",
        ),
    ]
    for config, words in refused:
        with pytest.raises(ConfigError, match=rf"offload_param\.device 'cpu' on CUDA is not built {words}"):
            resolve_plan(load_config(config), 2, "cuda")
        assert resolve_plan(load_config(config), 2, "cpu") is not None  # a CPU-only machine runs them


def _train_on_cuda(offload_param: str | None, nvme_path: str) -> dict:
    """One GPU, stage 3, optimizer offload to the host; with ``offload_param`` also the parameters (``cpu`` or
    ``nvme``). Returns the losses, the full parameters, where the unit shards live and the device's peak."""
    from shardtrain.distributed.mesh import ensure_process_group

    ensure_process_group(300.0)
    recipe = Recipe(steps=3)
    model = make_model(recipe)
    zero = {
        "stage": 3,
        "reduce_bucket_size": 2000,
        "allgather_bucket_size": 2000,
        "stage3_param_persistence_threshold": 0,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
    }
    if offload_param is not None:
        zero["offload_param"] = {"device": offload_param, "nvme_path": nvme_path, "max_in_cpu": 0}
    config = {
        "train_micro_batch_size_per_gpu": recipe.micro,
        "gradient_clipping": recipe.clip,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
    }
    engine = shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, recipe))
    shards = [b.shard for u in engine._runtime.units for b in u.buckets]
    torch.cuda.reset_peak_memory_stats()
    losses = []
    for step in range(recipe.steps):
        x, y = global_micro_batches(recipe, 1)[step]
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    out = {
        "losses": losses,
        "params": {k: v.float() for k, v in engine.full_state_dict().items()},
        "shard_devices": {s.device.type for s in shards},
        "pinned": all(s.is_pinned() for s in shards if s.numel()),
        "peak": torch.cuda.max_memory_allocated(),
    }
    engine.close()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_on_cuda_parameter_offload_is_bitwise_optimizer_offload_alone(device, tmp_path):
    """On a GPU: the unit shards wait on the host (page-locked for ``cpu``) and training is bit for bit the run with
    only the optimizer offloaded (the same host step; the uploads are exact copies), with a lower device peak."""
    (kept,) = run_distributed(_train_on_cuda, 1, None, str(tmp_path))
    (moved,) = run_distributed(_train_on_cuda, 1, device, str(tmp_path))
    assert moved["losses"] == kept["losses"]
    for k, v in kept["params"].items():
        assert torch.equal(moved["params"][k], v), k
    assert kept["shard_devices"] == {"cuda"} and moved["shard_devices"] == {"cpu"}
    assert moved["pinned"] or device == "nvme"
    assert moved["peak"] < kept["peak"]


def _resume(recipe: Recipe, where: str, saved_with: str | None, loaded_with: str | None) -> dict:
    """Runs on every rank: two steps with ``saved_with`` parameter offload (the GPU path, faked), a checkpoint, then a
    fresh engine with ``loaded_with`` loads it and trains one more step."""
    import torch.distributed as dist

    rank = dist.get_rank()
    param_uploads.upload_streams = lambda device: DeferredUploads([])
    host_copies.copy_streams = lambda device: DeferredStreams()

    def engine_with(offload: str | None):
        zero = {"stage": 3, "reduce_bucket_size": 2000, "allgather_bucket_size": 2000,
                "offload_optimizer": {"device": "cpu"}, "stage3_param_persistence_threshold": 0}  # fmt: skip
        if offload is not None:
            zero["offload_param"] = {"device": offload}
        config = {"train_micro_batch_size_per_gpu": recipe.micro, "gradient_accumulation_steps": recipe.gas,
                  "gradient_clipping": recipe.clip, "bf16": {"enabled": True}, "zero_optimization": zero}  # fmt: skip
        model = make_model(recipe)
        return shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, recipe))

    batches = global_micro_batches(recipe, dist.get_world_size())
    first = engine_with(saved_with)
    assert isinstance(first._param_offload, param_uploads.ParamUploads) == (saved_with is not None)
    losses = [train_step(first, recipe, batches, step, rank) for step in range(2)]
    first.save_checkpoint(where)
    first.close()
    second = engine_with(loaded_with)
    assert isinstance(second._param_offload, param_uploads.ParamUploads) == (loaded_with is not None)
    second.load_checkpoint(where)
    losses.append(train_step(second, recipe, batches, 2, rank))
    out = {"losses": losses, "norms": [second.get_global_grad_norm()], "params": second.full_state_dict()}
    second.close()
    return out


def test_checkpoints_of_the_gpu_path_load_into_parameters_on_the_device_and_back(tmp_path):
    """A checkpoint saved from host shards (the GPU path, faked) loads into a run whose parameters stay on the device,
    and one saved there loads into host shards: the third step's loss and the parameters are those of the run
    without parameter offload on either side, bit for bit (world 2)."""
    recipe = Recipe(steps=3)
    runs = {
        (saved, loaded): run_distributed(_resume, 2, recipe, str(tmp_path / f"{saved}-{loaded}"), saved, loaded)
        for saved, loaded in ((None, None), ("cpu", None), (None, "cpu"))
    }
    reference = runs[(None, None)]
    for key in (("cpu", None), (None, "cpu")):
        assert_runs_bitwise_equal(runs[key], reference)
