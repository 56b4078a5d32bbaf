"""The all-gather after a ZeRO-1/2 step, hidden behind the next forward.

[Note: gathers after the step]
At stages 1-2 (and for stage 3's persistent parameters) each rank steps only its chunk of every bucket; the others'
chunks arrive by one all-gather per bucket ([Note: bucket layout]). Waiting for all at the end of ``step()`` would idle
compute, so the step issues them asynchronously, in the order the next forward needs them (last bucket first), and a
bucket is waited for only where one of its parameters is first needed:

* forward: a pre-hook on each module holding parameters of a bucket in flight waits for that bucket;
* any other read (``state_dict()``, a subscriber's pre-hook, ``copy.deepcopy``, a parameter used before its module
  runs): while in flight the parameter's class is :class:`GatheringParameter`, whose ``__torch_function__`` waits and
  restores the bucket's plain class; metadata (shape, dtype, ``.grad``) reads without waiting;
* this rank's chunk is the all-gather's input and must not change while sent: the step and the engine's shard readers
  and writers (save, load, full state dict, ``gathered``) first call :meth:`ParameterGathers.wait_all`.

Every rank issues the same all-gathers in the same order; only where it waits is local. At most
``allgather_bucket_size`` elements are in flight (past it the oldest is waited for). Graph mode gathers synchronously (a
captured graph must see plain parameters), and so does a bucket holding a parameter whose class is not ``nn.Parameter``
(the user's class is kept).
"""

from __future__ import annotations

from collections import Counter

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from shardtrain.distributed.communicator import Communicator, Handle
from shardtrain.zero.guarded import _METADATA, _op_name
from shardtrain.zero.layout import Bucket

# a parameter whose bucket is in flight -> (the gathers it belongs to, its bucket's index)
_IN_FLIGHT: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _gathering_args(args: tuple, kwargs: dict) -> list[GatheringParameter]:
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, GatheringParameter):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(x for x in a if isinstance(x, GatheringParameter))
    return found


class GatheringParameter(nn.Parameter):
    """A ZeRO-1/2 parameter whose bucket's all-gather is in flight; see [Note: gathers after the step]."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _op_name(func) in _METADATA:
            return super().__torch_function__(func, types, args, kwargs)
        for p in _gathering_args(args, kwargs):
            owner = _IN_FLIGHT.get(p)
            if owner is not None:
                owner[0].wait(owner[1], "access")
            if type(p) is GatheringParameter:  # a copy made while in flight (deepcopy keeps the class), no record
                p.__class__ = nn.Parameter
        # dispatched again with the plain classes: another tensor subclass among the arguments (a ZeRO-3
        # ShardedParameter) still sees the operation
        return func(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> nn.Parameter:
        # nn.Parameter's copy takes its class from the original: wait and copy a plain parameter
        owner = _IN_FLIGHT.get(self)
        if owner is not None:
            owner[0].wait(owner[1], "access")
        if type(self) is GatheringParameter:
            self.__class__ = nn.Parameter
        return self.__deepcopy__(memo)


class ParameterGathers:
    """Issues the all-gathers after a step and waits for each bucket where it is needed (see the module note)."""

    def __init__(
        self,
        buckets: list[Bucket],
        comm: Communicator,
        in_flight_numel: int,
        root: nn.Module,
        overlap: bool,
        expert_comm: Communicator | None = None,
    ) -> None:
        """``buckets``: the trainable buckets (those with ``gather_after_step`` are gathered); ``overlap``: False
        waits for every gather at the end of the step (graph mode). ``expert_comm``: the group expert buckets are
        gathered over (see [Note: expert buckets] in zero/layout.py)."""
        self.comm, self.in_flight_numel = comm, in_flight_numel
        self.expert_comm = expert_comm
        # the order the next forward needs them in: the last bucket holds the first registered parameters
        self.buckets = sorted((b for b in buckets if b.gather_after_step), key=lambda b: -b.index)
        self.overlap = overlap  # benchmarks switch it off to compare; graph mode builds it off
        self._deferrable = {b.index for b in self.buckets if all(type(s.param) is nn.Parameter for s in b.slots)}
        self._pending: dict[int, tuple[Bucket, Handle]] = {}
        self.waits: Counter[str] = Counter()  # buckets waited for while in flight, by where (tests read it)
        self._hooks = []
        if overlap:
            bucket_of = {id(s.param): b.index for b in self.buckets if b.index in self._deferrable for s in b.slots}
            for m in root.modules():
                own = sorted({bucket_of[id(p)] for p in m._parameters.values() if p is not None and id(p) in bucket_of})
                if own:
                    self._hooks.append(m.register_forward_pre_hook(self._wait_before_forward(own)))

    @property
    def pending(self) -> list[int]:
        """Indices of the buckets whose all-gather has not been waited for."""
        return list(self._pending)

    def launch(self) -> None:
        """All-gather every bucket's updated chunks into its flat buffer (after the optimizer stepped the chunks)."""
        self.wait_all("step")  # nothing should be left; a rank's chunk must not change under a gather in flight
        in_flight: list[tuple[int, Bucket, Handle]] = []
        for b in self.buckets:
            while in_flight and sum(n for n, _, _ in in_flight) + b.padded_numel > self.in_flight_numel:
                in_flight.pop(0)[2].wait()
            comm = self.expert_comm if b.expert and self.expert_comm is not None else self.comm
            h = comm.all_gather(b.flat_param, b.shard, what=f"parameter bucket {b.index}", async_op=True)
            in_flight.append((b.padded_numel, b, h))
        for _, b, h in in_flight:
            if self.overlap and b.index in self._deferrable:
                self._pending[b.index] = (b, h)
                for s in b.slots:
                    s.param.__class__ = GatheringParameter
                    _IN_FLIGHT[s.param] = (self, b.index)
            else:
                h.wait()

    def wait(self, index: int, why: str) -> None:
        """Wait for bucket ``index``'s all-gather if it is in flight; its parameters become plain again."""
        entry = self._pending.pop(index, None)
        if entry is None:
            return
        b, h = entry
        try:
            h.wait()
        finally:  # a failed gather raises once, naming the ranks; the parameters are not left switched
            for s in b.slots:
                _IN_FLIGHT.pop(s.param, None)
                if type(s.param) is GatheringParameter:
                    s.param.__class__ = nn.Parameter
        self.waits[why] += 1

    def wait_all(self, why: str) -> None:
        for index in list(self._pending):
            self.wait(index, why)

    def _wait_before_forward(self, indices: list[int]):
        """A module's forward pre-hook waiting for the buckets of its own parameters. A plain function, not a
        bound method or a partial: ``copy.deepcopy(engine.module)`` shares functions but would copy a bound
        object, and with it the process group, which cannot be copied."""

        def wait_before_forward(module: nn.Module, args: tuple) -> None:
            if self._pending:
                for index in indices:
                    self.wait(index, "forward")

        return wait_before_forward

    def remove_hooks(self) -> None:
        """Wait for what is in flight and remove the forward pre-hooks (``engine.close()``)."""
        self.wait_all("close")
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
