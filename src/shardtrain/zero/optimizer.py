"""The optimizer step on shards: any ``torch.optim`` optimizer, stepping only this rank's fragments.

[Note: optimizer fragments]
The user's optimizer object is kept (an LR scheduler built on it keeps working, param groups and their
hyperparameters are preserved); only the tensors in its param groups are replaced. At stage 0 they stay
the module's parameters. At stages 1 and 2 each parameter is replaced by its *fragment*: a 1-D view of
this rank's chunk of the flat parameter buffer (see [Note: bucket layout]). With fp32 parameters the
fragment *is* the master weight, so the step updates the flat buffer in place and the all-gather that
follows writes every other rank's updated chunks next to it. Optimizer state (moments, step counts) is
therefore allocated for fragments only: sharded by construction. Every rank holds a fragment for every
parameter (possibly empty) so param-group indexing is identical on all ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from shardtrain.comm import Communicator
from shardtrain.errors import OptimizerError
from shardtrain.zero.layout import Bucket
from shardtrain.zero.reducer import GradientReducer


class ShardedOptimizer:
    """Steps ``optimizer`` on this rank's fragments; ``initialize`` has already run :func:`check_optimizer`."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        module: nn.Module,
        buckets: list[Bucket],
        reducer: GradientReducer,
        stage: int,
        comm: Communicator,
        allgather_bucket_numel: int,
    ) -> None:
        self.optimizer, self.buckets, self.reducer = optimizer, buckets, reducer
        self.stage, self.comm, self.allgather_bucket_numel = stage, comm, allgather_bucket_numel
        # (fragment tensor, bucket, slot index) for every trainable parameter, keyed by the parameter
        self._frag: dict[int, tuple[torch.Tensor, Bucket, int]] = {}
        for b in buckets:
            for i, (slot, f) in enumerate(zip(b.slots, b.fragments)):
                t = slot.param if stage == 0 else b.shard[f.shard_offset : f.shard_offset + f.length]
                self._frag[id(slot.param)] = (t, b, i)
        if stage > 0:
            for group in optimizer.param_groups:
                group["params"] = [self._frag[id(p)][0] if id(p) in self._frag else p for p in group["params"]]

    def fragment_of(self, p: torch.Tensor) -> tuple[torch.Tensor, Bucket, int] | None:
        """(fragment tensor, bucket, slot index) of a trainable parameter; None for anything else."""
        return self._frag.get(id(p))

    def _fragment_grads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(fragment, its reduced gradient) for every trainable parameter."""
        pairs = []
        for t, b, i in self._frag.values():
            if self.stage == 0:
                pairs.append((t, t.grad))
                continue
            f = b.fragments[i]
            g = self.reducer.shard_grad(b)
            pairs.append((t, g[f.shard_offset : f.shard_offset + f.length]))
        return pairs

    def step(self, max_norm: float) -> float:
        """Clip by the global norm, step the fragments, re-gather parameters; returns the norm before clipping."""
        pairs = self._fragment_grads()
        grads = [g for _, g in pairs if g is not None and g.numel() > 0]
        if grads:
            norms = torch._foreach_norm(grads)
            local_sq = torch.linalg.vector_norm(torch.stack(norms)) ** 2
        else:
            local_sq = torch.zeros((), device=self.buckets[0].flat_param.device if self.buckets else "cpu")
        local_sq = local_sq.to(torch.float32)
        if self.stage > 0:  # fragments are disjoint: the squares add up across ranks
            self.comm.all_reduce(local_sq, "sum", what="squared gradient norm")
        total_norm = float(local_sq.sqrt())
        if max_norm > 0 and grads:
            # identical to torch.nn.utils.clip_grad_norm_: scale by max_norm/(norm+1e-6), never up
            coef = torch.clamp(max_norm / (local_sq.sqrt() + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef)
        if self.stage == 0:  # the parameters are the fragments and already hold their gradients
            self.optimizer.step()
            return total_norm
        for t, g in pairs:
            t.grad = g
        self.optimizer.step()
        for t, _ in pairs:
            t.grad = None
        self._all_gather_params()
        return total_norm

    def _all_gather_params(self) -> None:
        """Every rank's updated chunks into the full flat buffers, at most ``allgather_bucket_numel``
        elements in flight."""
        in_flight: list[tuple[int, object]] = []
        for b in (b for b in self.buckets if b.gather_after_step):
            while in_flight and sum(n for n, _ in in_flight) + b.padded_numel > self.allgather_bucket_numel:
                in_flight.pop(0)[1].wait()
            h = self.comm.all_gather(b.flat_param, b.shard, what=f"parameter bucket {b.index}", async_op=True)
            in_flight.append((b.padded_numel, h))
        for _, h in in_flight:
            h.wait()

    def state_bytes(self) -> int:
        total = 0
        for st in self.optimizer.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    total += v.numel() * v.element_size()
        return total


def check_optimizer(optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise OptimizerError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if any(len(s) for s in optimizer.state.values()):
        raise OptimizerError("the optimizer already holds state (it has taken a step); pass a freshly built optimizer")
    names = {id(p): n for n, p in module.named_parameters()}
    seen: dict[int, int] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if id(p) not in names:
                raise OptimizerError(
                    f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}) is not a parameter of the "
                    "model passed to initialize(); build the optimizer over model.parameters()"
                )
            if id(p) in seen:
                raise OptimizerError(
                    f"parameter {names[id(p)]!r} is in param groups {seen[id(p)]} and {gi}; list it once"
                )
            seen[id(p)] = gi
    missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise OptimizerError(
            f"trainable parameters not in any optimizer param group: {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}; add them to the optimizer or set requires_grad=False"
        )
