"""The host step of an offloaded optimizer in one pass over memory: the clip factor, the update and the rounding to
the compute dtype, block by block, on all host cores.

[Note: one pass over a sub-group]
The multi-pass host step reads and writes every element of a sub-group once per operation: the clip's multiply, each
of AdamW's ~8 element-wise ops, then the rounding to the compute-dtype fragment, each a full sweep through DRAM.
:class:`OnePassStep` cuts the sub-group into blocks of at most :data:`BLOCK_ELEMENTS` elements per tensor and runs
the whole sequence on one block before the next, so the block's gradient, master, moments and fragment stay in the
core's cache between the ops and DRAM sees each byte once. The ops are the same ones in the same order: the pending
gradient factors (``Tensor.mul_``, as ``torch._foreach_mul_`` applies them on the CPU), then the optimizer's own
functional update (``torch.optim.adam.adam`` with the arguments ``Adam.step`` passes, or
:meth:`~shardtrain.optim.adam.DeepSpeedAdam.update_views`), then ``copy_`` into the fragment. Every op is element-wise,
so each element's result is the multi-pass step's bit for bit ([Note: vector tails] for the one catch);
``tests/offload/test_one_pass.py`` checks every byte. The step count is not element-wise: each block's update reads a
copy of the count before the step (torch's update adds one to it); the count itself advances once, after the last
block. Blocks run on a pool of ``torch.get_num_threads()`` Python threads (torch's ops release the GIL). Torch's
Adam/AdamW (plain, foreach or fused; not capturable, not differentiable) and DeepSpeedAdam, with no step hooks and
with their state made (a tensor's first step makes it), take this path; anything else steps as before, whole tensors.

[Note: vector tails]
A CPU kernel runs vector lanes over the body of each range it is handed and a scalar loop over the rest, and torch's
fused Adam rounds differently in the two (measured: moments differ in the last bit when a piece ends unaligned).
Its own run splits a tensor over the intra-op threads at multiples of a cache line, so its only scalar elements are
the tensor's last ``numel % 16``. Every piece here starts at a multiple of :data:`PIECE_ALIGN` elements of its
tensor and ends at one or at the tensor's end, leaving the scalar loop the same elements.

[Note: host-step block size]
:data:`BLOCK_ELEMENTS` = 131072 elements, 512 KiB per fp32 tensor: a block's ~12 ops touch its gradient, master,
two moments, two temporaries and the fragment, ~3 MiB, which stays in a core's L2 and its share of L3 between the
ops. While the workers run, torch's intra-op threads are set to 1 (restored after): each worker's op runs on its own
thread, instead of every op of every worker opening an OpenMP team over all cores (on the loaded 2-core VM, one
Python thread over two intra-op threads took 6-12 s for 16M elements, two workers 0.35 s). Per block the pass pays
Python's dispatch of ~12 ops and the temporaries' allocation; measured on that VM with ``bench/bench_offload.py
--host-step`` (34M elements; seconds per step, one thread): 8192 2.13, 32768 0.48, 131072 0.39, 524288 0.36; two
threads: 32768 0.93, 0.91, 0.61; 131072 0.78, 0.17, 0.39 (three runs). Larger blocks gain little past 131072 and
leave the cache. To be confirmed on a GPU host's CPU (16+ cores, a larger L3), where no run has been made yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import torch
import torch.optim.optimizer as optimizer_base
from torch.optim.adam import adam as torch_adam

BLOCK_ELEMENTS = 131072  # see [Note: host-step block size]
HOST_STEP_BYTES_PER_ELEMENT = 32
"""DRAM bytes one pass moves per fp32 element stepped ([Note: one pass over a sub-group]): the gradient, the master
and both moments, read once and written once (4 x 4 x 2); writing a half-precision fragment adds its itemsize (34
bytes for bf16, docs/offload.md 'The host step in one pass'). The time model reads it (``estimate/timing.py``)."""
PIECE_ALIGN = 64  # elements: a piece starts on a multiple of it (see [Note: vector tails])

Piece = tuple[int, int, int]
"""(member, first element, end element) of one stepped tensor, flattened."""


def cut_blocks(numels: Sequence[int], group_of: Sequence[int], block: int = BLOCK_ELEMENTS) -> list[list[Piece]]:
    """Members of ``numels`` elements, in order, cut into blocks of at most ``block`` elements: a large member in
    several, small consecutive members of the same param group (``group_of``) packed into one (fewer Python calls)."""
    if block <= 0 or block % PIECE_ALIGN:
        raise ValueError(f"a host-step block is a positive multiple of {PIECE_ALIGN} elements, got {block}")
    blocks: list[list[Piece]] = []
    current: list[Piece] = []
    room = block
    for i, n in enumerate(numels):
        if current and group_of[i] != group_of[current[0][0]]:
            blocks.append(current)
            current, room = [], block
        lo = 0
        while lo < n or (n == 0 and lo == 0):  # an empty member still advances its step count: one empty piece
            take = min(n - lo, room)
            if lo + take < n:  # a piece that stops inside its member stops on an aligned element
                take -= take % PIECE_ALIGN
                if take == 0:
                    blocks.append(current)
                    current, room = [], block
                    continue
            current.append((i, lo, lo + take))
            lo += take
            room -= take
            if room == 0:
                blocks.append(current)
                current, room = [], block
            if n == 0:
                break
    if current:
        blocks.append(current)
    return blocks


def _adam_kind(optimizer: torch.optim.Optimizer) -> str | None:
    """Which update :class:`OnePassStep` runs for ``optimizer``: "torch" (torch's Adam/AdamW), "views" (an optimizer
    with an ``update_views`` class method: DeepSpeedAdam), or None where it steps as before ([Note: one pass over a
    sub-group])."""
    hooks = (
        getattr(optimizer, "_optimizer_step_pre_hooks", None),
        getattr(optimizer, "_optimizer_step_post_hooks", None),
        optimizer_base._global_optimizer_pre_hooks,
        optimizer_base._global_optimizer_post_hooks,
    )
    if any(hooks):
        return None  # hooks run once per sub-group ([Note: sub-group stepping]): only optimizer.step calls them
    if callable(getattr(type(optimizer), "update_views", None)):  # DeepSpeedAdam (shardtrain.optim, a room above)
        return "views"
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        plain = all(not g.get("capturable") and not g.get("differentiable") for g in optimizer.param_groups)
        return "torch" if plain else None
    return None


_STATE_KEYS = ("exp_avg", "exp_avg_sq")


class OnePassStep:
    """Steps sub-groups of ``optimizer``'s tensors in one pass (see [Note: one pass over a sub-group])."""

    def __init__(self, optimizer: torch.optim.Optimizer, block: int = BLOCK_ELEMENTS, workers: int | None = None):
        self.optimizer, self.block = optimizer, block
        self.workers = workers if workers is not None else torch.get_num_threads()
        self._pool: ThreadPoolExecutor | None = None
        self._group_index: dict[int, int] = {}

    @staticmethod
    def supports(optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s update can run here (else its own ``step`` over whole tensors)."""
        return _adam_kind(optimizer) is not None

    def ready(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``tensors`` can step here now: the optimizer is supported and each has its state (a first step
        makes the state: the optimizer's own ``step`` does that)."""
        kind = _adam_kind(self.optimizer)
        if kind is None:
            return False
        for t in tensors:
            state = self.optimizer.state.get(t)
            if not state or "step" not in state or any(k not in state for k in _STATE_KEYS):
                return False
            group = self._param_group(t)
            if group is None or (group.get("amsgrad") and "max_exp_avg_sq" not in state):
                return False
            if t.is_complex() or t.device.type != "cpu":
                return False
        return True

    def _param_group(self, t: torch.Tensor) -> dict[str, Any] | None:
        if id(t) not in self._group_index:
            self._group_index = {id(p): k for k, g in enumerate(self.optimizer.param_groups) for p in g["params"]}
        k = self._group_index.get(id(t))
        return None if k is None else self.optimizer.param_groups[k]

    def step(
        self,
        tensors: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        outs: Sequence[torch.Tensor | None],
        factors: Sequence[Sequence[torch.Tensor | float]],
    ) -> None:
        """One step of ``tensors`` (each :meth:`ready`) with gradients ``grads``: each gradient multiplied in place
        by its ``factors`` in order, the update, then ``outs[i]`` (a tensor of ``tensors[i]``'s numel, any dtype, or
        None) given the updated values, block by block."""
        kind = _adam_kind(self.optimizer)
        states = [self.optimizer.state[t] for t in tensors]
        groups = [self._param_group(t) for t in tensors]
        flat = [t.view(-1) for t in tensors]
        flat_grads = [g.view(-1) for g in grads]
        flat_outs = [None if o is None else o.view(-1) for o in outs]
        if kind == "views":  # its step counts advance first, as in DeepSpeedAdam.step
            for s in states:
                s["step"] += 1
            counts = [float(s["step"]) for s in states]
        group_ids = [id(g) for g in groups]
        blocks = cut_blocks([t.numel() for t in flat], group_ids, self.block)

        def run(block: list[Piece]) -> None:
            members = [i for i, _, _ in block]
            ps = [flat[i][lo:hi] for i, lo, hi in block]
            gs = [flat_grads[i][lo:hi] for i, lo, hi in block]
            for i, g in zip(members, gs):
                for f in factors[i]:
                    g.mul_(f)
            group = groups[members[0]]
            ms = [states[i]["exp_avg"].view(-1)[lo:hi] for i, lo, hi in block]
            vs = [states[i]["exp_avg_sq"].view(-1)[lo:hi] for i, lo, hi in block]
            if kind == "views":
                type(self.optimizer).update_views(group, ps, gs, ms, vs, [counts[i] for i in members])
            else:
                amsgrad = group["amsgrad"]
                maxes = [states[i]["max_exp_avg_sq"].view(-1)[lo:hi] for i, lo, hi in block] if amsgrad else []
                beta1, beta2 = group["betas"]
                torch_adam(
                    ps,
                    gs,
                    ms,
                    vs,
                    maxes,
                    [states[i]["step"].clone() for i in members],  # advanced once, after every block
                    amsgrad=amsgrad,
                    has_complex=False,
                    beta1=beta1,
                    beta2=beta2,
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    maximize=group["maximize"],
                    foreach=group["foreach"],
                    capturable=False,
                    differentiable=False,
                    fused=group["fused"],
                    decoupled_weight_decay=group.get(
                        "decoupled_weight_decay", type(self.optimizer) is torch.optim.AdamW
                    ),
                )
            for (i, lo, hi), p in zip(block, ps):
                if flat_outs[i] is not None:
                    flat_outs[i][lo:hi].copy_(p)

        with torch.no_grad():
            if self.workers <= 1 or len(blocks) <= 1:
                for b in blocks:
                    run(b)
            else:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="shardtrain-host-step")
                intra_op = torch.get_num_threads()
                torch.set_num_threads(1)  # the workers are the parallelism (see [Note: host-step block size])
                try:
                    futures = [self._pool.submit(run, b) for b in blocks]
                    wait(futures)  # all of them, failed or not: no worker writes after the step returns or raises
                    for future in futures:
                        future.result()
                finally:
                    torch.set_num_threads(intra_op)
            if kind == "torch":
                for s in states:
                    s["step"] += 1

    def close(self) -> None:
        """Join the worker threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


__all__ = ["BLOCK_ELEMENTS", "PIECE_ALIGN", "OnePassStep", "cut_blocks"]
