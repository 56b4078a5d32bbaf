"""The copies of an optimizer stepped on the host for device fragments ([Note: overlapped offload] in
``offload/host_copies.py``), driven on the CPU by a fake of the two side streams that runs each queued copy only when
the host waits for an event after it (or the compute stream joins): a copy waited for too late, or a buffer rewritten
before its copy ran, changes the numbers. Training through them is bitwise training without offload; the host
buffers are allocated once, at their exact size. The CUDA streams themselves run in test_offload_cuda.py."""

from __future__ import annotations

import pytest
import torch

import shardtrain
from shardtrain.offload import host_copies
from shardtrain.offload.host_copies import HostArena, HostCopies, pack_blocks
from shardtrain.testing import run_distributed

from helpers.parity import Recipe, global_micro_batches, make_model, make_optimizer, train_step


class DeferredStreams:
    """:class:`~shardtrain.offload.host_copies.CopyStreams` on the CPU: a copy runs when the host waits for an event
    recorded after it on its stream, or at a join (``join_runs``; the compute stream runs eagerly here, so a join
    must run what the device would have finished before the next compute operation)."""

    pins = False

    def __init__(self, join_runs: bool = True) -> None:
        self.join_runs = join_runs
        self.pending: dict[str, list] = {"d2h": [], "h2d": []}
        self.issued = {"d2h": 0, "h2d": 0}
        self.ran = {"d2h": 0, "h2d": 0}
        self.sent: list[tuple[int, torch.Tensor]] = []  # (destination address, values) of each copy back, as it ran
        self.waits = 0
        self.joins = 0

    def mark(self) -> tuple[str, int]:
        return ("compute", 0)

    def _queue(self, stream: str, op) -> None:
        self.pending[stream].append(op)
        self.issued[stream] += 1

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, after) -> None:
        self._queue("d2h", lambda: dst.copy_(src))

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, after) -> None:
        def op() -> None:
            self.sent.append((dst.data_ptr(), src.detach().clone()))
            dst.copy_(src)

        self._queue("h2d", op)

    def record(self, stream: str) -> tuple[str, int]:
        return (stream, self.issued[stream])

    def _run(self, stream: str, upto: int) -> None:
        while self.ran[stream] < upto:
            self.pending[stream].pop(0)()
            self.ran[stream] += 1

    def wait(self, event: tuple[str, int]) -> None:
        self.waits += 1
        stream, upto = event
        if stream != "compute":
            self._run(stream, upto)

    def join(self) -> None:
        self.joins += 1
        if self.join_runs:
            for stream, n in self.issued.items():
                self._run(stream, n)

    def host_scalar(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()


def _copies(streams: DeferredStreams, dtype: torch.dtype = torch.bfloat16):
    """Two buckets of 8 elements, two members in each (the last member of bucket 1 is stepped on the device)."""
    shards = [torch.arange(8, dtype=torch.float32) + 10 * b for b in range(2)]
    where = [(0, 0, 5), (0, 5, 3), (1, 0, 6), (1, 6, 2)]
    host = [True, True, True, False]
    stepped = [torch.randn(n) for _, _, n in where]
    fragments = [torch.zeros(n, dtype=dtype) for _, _, n in where]
    direct = [dtype == torch.float32] * 4
    return HostCopies(streams, where, host, stepped, fragments, direct), shards, stepped, fragments


def test_a_sub_group_waits_for_its_own_buckets_copies_only():
    streams = DeferredStreams(join_runs=False)
    copies, shards, _, _ = _copies(streams)
    copies.invalidate()
    copies.bucket_reduced(0, shards[0])
    copies.bucket_reduced(1, shards[1])
    assert streams.issued["d2h"] == 2 and streams.ran["d2h"] == 0  # one copy per bucket, non-blocking
    grads, raw = copies.host_grads([0, 1])  # the sub-group of bucket 0
    assert streams.ran["d2h"] == 1  # bucket 1's copy still runs while this sub-group steps
    assert torch.equal(grads[0], shards[0][:5]) and torch.equal(grads[1], shards[0][5:8]) and len(raw) == 2
    grads, _ = copies.host_grads([2])
    assert streams.ran["d2h"] == 2 and torch.equal(grads[0], shards[1][:6])
    # only the span host members cover is copied: bucket 1's last two elements step on the device
    assert copies.spans[1].host.numel() == 6


def test_buckets_not_copied_in_backward_are_copied_at_the_step_from_its_gradients():
    """No boundary backward since the gradients were zeroed (or a bucket whose reduction the reducer did not see):
    the step copies from its own gradients, already unscaled and clipped, so none of them is transformed again."""
    streams = DeferredStreams(join_runs=False)
    copies, shards, _, _ = _copies(streams)
    copies.bucket_reduced(0, shards[0])
    step_grads = [torch.full((n,), float(i)) for i, n in enumerate([5, 3, 6, 2])]
    copies.prepare(step_grads)
    assert streams.issued["d2h"] == 1 + 1  # bucket 1's host member, from the step's gradient
    grads, raw = copies.host_grads([0, 1, 2])
    assert torch.equal(grads[0], shards[0][:5])
    assert torch.equal(grads[2], step_grads[2])
    assert [r.data_ptr() for r in raw] == [grads[0].data_ptr(), grads[1].data_ptr()]  # bucket 0's copy is raw


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_copy_back_reads_its_buffer_before_the_next_step_rewrites_it(dtype):
    """The copy back of step 1 may still be queued when step 2 begins: the sub-group's master (fp32: sent from
    itself) and compute-dtype buffer (bf16) are rewritten only after the host waited for that copy."""
    streams = DeferredStreams(join_runs=False)
    copies, _, stepped, fragments = _copies(streams, dtype)
    group = (0, 1)
    start = streams.mark()
    copies.before_step(group)
    copies.send_back(group, start)  # step 1's values, queued
    first = [stepped[i].to(dtype, copy=True) for i in group]
    assert streams.ran["h2d"] == 0
    copies.before_step(group)  # step 2 of the sub-group: its last copy back has run now
    assert streams.ran["h2d"] == 2
    for i in group:
        stepped[i].add_(1.0)  # the optimizer rewrites the masters
    copies.send_back(group, start)
    copies.finish()  # (join_runs=False: the queued copies run when waited for)
    assert all(torch.equal(a, b) for (_, a), b in zip(streams.sent[:2], first))
    copies.before_step(group)
    assert all(torch.equal(fragments[i], stepped[i].to(dtype)) for i in group)


def test_host_buffers_are_exact_views_into_a_few_blocks_not_rounded_to_powers_of_two():
    """CUDA's caching host allocator would give each of these a power of two (about twice the bytes); the arena
    allocates a few blocks of the exact bytes (plus cache-line alignment)."""
    sizes = [(1 << 20) + 4 * k for k in range(1, 9)]
    arena = HostArena(sizes, pin=False)
    aligned = sum(-(-n // 64) * 64 for n in sizes[:-1]) + sizes[-1]  # each view starts on a cache line
    rounded = sum(1 << (n - 1).bit_length() for n in sizes)
    assert arena.allocated_bytes == aligned < 1.001 * sum(sizes)
    assert rounded > 1.99 * sum(sizes)
    assert len(arena.blocks) == 1
    views = [arena.view(k, torch.uint8, (n,)) for k, n in enumerate(sizes)]
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1
    assert pack_blocks([10, 10], block=16) == ([10, 10], [(0, 0), (1, 0)])


# -- training through the copies on the CPU ------------------------------------------------------


def train_through_copies(recipe: Recipe, stage: int, world: int, top: dict, offload: bool, redo: bool) -> dict:
    """Runs on every rank: training with ``offload_optimizer.device: cpu`` as on a GPU (host masters, gradients
    copied to host buffers, parameters copied back) with :class:`DeferredStreams` as the device's streams; ``redo``:
    the copies backward made are dropped, so every step copies its own gradients. Without ``offload``: training
    without offload."""
    import torch.distributed as dist

    rank = dist.get_rank()
    made: list[DeferredStreams] = []

    def fake(device: torch.device) -> DeferredStreams:
        made.append(DeferredStreams())
        return made[-1]

    host_copies.copy_streams = fake  # this worker process only
    model = make_model(recipe)
    zero = {"stage": stage, "reduce_bucket_size": 2000, "allgather_bucket_size": 2000, "sub_group_size": 1500}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": recipe.micro,
        "gradient_accumulation_steps": recipe.gas,
        "gradient_clipping": recipe.clip,
        "zero_optimization": zero,
        **top,
    }
    engine = shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, recipe))
    opt = engine._optimizer
    copies = opt.offload.copies if offload else None
    if redo:
        engine._reducer.host_copies = None  # the step copies every bucket itself
    batches = global_micro_batches(recipe, world)
    losses, norms, addresses, copies_per_step = [], [], [], []
    for step in range(recipe.steps):
        before = made[0].issued["d2h"] if made else 0
        losses.append(train_step(engine, recipe, batches, step, rank))
        norms.append(engine.get_global_grad_norm())
        if copies is not None:
            copies_per_step.append(made[0].issued["d2h"] - before)
            buffers = [g.data_ptr() for g in copies.grads if g.numel()]
            buffers += [s.data_ptr() for s in copies.sources.values()]
            addresses.append(buffers + [s.data_ptr() for s in opt.stepped_tensors() if s.numel()])
    out = {"losses": losses, "norms": norms, "params": engine.full_state_dict()}
    if copies is not None:
        numel = sum(s.numel() for s in opt.stepped_tensors())
        out.update(
            addresses=addresses,
            copies_per_step=copies_per_step,
            buckets=len(copies.spans),
            host_bytes=copies.allocated_bytes,
            fragment_bytes=sum(f.numel() * f.element_size() for f in opt.stepped_fragments()),
            grad_bytes=4 * numel,
            direct=sum(copies.direct),
            members=len(copies.direct),
            groups=len(opt.offload.groups),
            host_fragments=sum(1 for g in copies.grads if g.numel()),
        )
    engine.close()
    return out


def assert_runs_bitwise_equal(a: list[dict], b: list[dict]) -> None:
    """Every rank's losses and gradient norms, and rank 0's final parameters, bit for bit."""
    for ra, rb in zip(a, b):
        assert ra["losses"] == rb["losses"]
        assert ra["norms"] == rb["norms"]
    assert a[0]["params"].keys() == b[0]["params"].keys()
    for k, v in a[0]["params"].items():
        assert torch.equal(v, b[0]["params"][k]), k


@pytest.mark.parametrize(
    ("stage", "world", "precision"),
    [(2, 1, "bf16"), (2, 2, "fp32"), (2, 3, "bf16"), (1, 3, "fp16"), (3, 2, "bf16"), (3, 3, "fp32")],
)
def test_training_through_overlapped_copies_is_bitwise_training_without_offload(stage, world, precision):
    """Raw gradient copies unscaled and clipped on the host, per sub-group steps, parameters copied back: the
    numbers of training without offload, at stages 1-3, worlds 1-3, fp32, bf16 and fp16, with accumulation and
    clipping. Each bucket is copied once per step (in backward), into the same host buffers every step."""
    recipe = Recipe(steps=3)
    top = {} if precision == "fp32" else {precision: {"enabled": True}}
    plain = run_distributed(train_through_copies, world, recipe, stage, world, top, False, False)
    copied = run_distributed(train_through_copies, world, recipe, stage, world, top, True, False)
    assert_runs_bitwise_equal(copied, plain)
    for r in copied:
        assert r["groups"] > 1
        assert r["copies_per_step"] == [r["buckets"]] * recipe.steps  # in backward, none left for the step
        assert all(a == r["addresses"][0] for a in r["addresses"])  # allocated once, reused
        # host memory: the fp32 gradients of the host fragments, at their exact size (the fragments go back from
        # their masters, rounded to the compute dtype on the way)
        assert r["grad_bytes"] <= r["host_bytes"] <= r["grad_bytes"] + 64 * r["buckets"]
        assert r["direct"] == r["members"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_copies_made_at_the_step_instead_of_backward_are_bitwise_too(precision):
    """Buckets backward did not copy (graph mode's reductions, hybrid sharding) are copied at the step from its
    unscaled and clipped gradients; here every bucket is."""
    recipe = Recipe(steps=3)
    top = {precision: {"enabled": True}}
    plain = run_distributed(train_through_copies, 2, recipe, 2, 2, top, False, False)
    copied = run_distributed(train_through_copies, 2, recipe, 2, 2, top, True, True)
    assert_runs_bitwise_equal(copied, plain)
    for r in copied:
        assert r["copies_per_step"] == [r["host_fragments"]] * recipe.steps  # one per fragment, at the step
        assert r["host_fragments"] > r["buckets"]
