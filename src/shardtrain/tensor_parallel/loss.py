"""Megatron's vocab-parallel cross-entropy: the loss of a column-parallel LM head without gathering its logits.

Each rank holds the logits of its block of the vocabulary, ``[..., V/N]``. The softmax normalizer needs the
maximum and the sum of exponentials over the whole vocabulary, and the target's logit lives on one rank only;
each of these is a reduction over the group of a per-token scalar, so full logits ``[..., V]`` never exist on
any rank (Megatron-Core ``tensor_parallel/cross_entropy.py``). Two all-reduces of ``[tokens]`` and
``[2, tokens]`` floats per call, computed in fp32 whatever the logits' dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from shardtrain.between_graphs import between_graphs
from shardtrain.distributed.communicator import Communicator, Reduce
from shardtrain.errors import LayoutError
from shardtrain.tensor_parallel.rng import RegionRNG


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss ``log(sum_v exp(z_v)) - z_target`` from vocab-split logits; ignored tokens give 0."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, comm: Communicator, ignore_index: int):
        # logits: [T, V/N] fp32, this rank's vocabulary block [start, start + V/N); targets: [T] global ids
        per = logits.shape[-1]
        start = comm.rank * per
        row_max = logits.max(dim=-1).values  # [T]
        if torch.compiler.is_compiling():  # traced into the one graph of ZeRO stage 3 (see .communication)
            row_max = comm.graph_all_reduce(row_max, Reduce.MAX)
        else:
            comm.all_reduce(row_max, Reduce.MAX, what="vocab-parallel cross-entropy max")
        shifted = logits - row_max.unsqueeze(-1)  # [T, V/N], <= 0 for numerical safety
        valid = targets != ignore_index  # [T]
        mine = valid & (targets >= start) & (targets < start + per)  # [T] target on this rank
        local_targets = (targets - start).masked_fill(~mine, 0)  # [T]
        target_logit = shifted.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)  # [T]
        exp = shifted.exp()  # [T, V/N]
        sums = torch.stack([exp.sum(dim=-1), target_logit])  # [2, T]
        if torch.compiler.is_compiling():
            sums = comm.graph_all_reduce(sums)
        else:
            comm.all_reduce(sums, what="vocab-parallel cross-entropy sums")
        sum_exp, target_logit = sums[0], sums[1]
        loss = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)  # [T]
        softmax = exp.div_(sum_exp.unsqueeze(-1))  # [T, V/N], this rank's block of the softmax
        ctx.save_for_backward(softmax, local_targets, mine, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):  # grad_loss: [T]
        softmax, local_targets, mine, valid = ctx.saved_tensors
        g = grad_loss * valid  # [T], ignored tokens get no gradient
        grad = softmax * g.unsqueeze(-1)  # d loss / d z_v = softmax_v - [v == target]
        grad.scatter_add_(-1, local_targets.unsqueeze(-1), (-g * mine).unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor, targets: torch.Tensor, comm: Communicator, *, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy over the tokens whose target is not ``ignore_index`` (as ``F.cross_entropy``).

    ``local_logits [..., V/N]``: this rank's block of the vocabulary (rank r holds ids ``[r V/N, (r+1) V/N)``);
    ``targets [...]``: global ids, the same on every rank. Returns a replicated fp32 scalar; the gradient of
    ``local_logits`` is this rank's block of the full gradient. Ids outside ``[0, V)`` other than
    ``ignore_index`` are not checked (they would count as a zero target logit).
    """
    logits = local_logits.float().reshape(-1, local_logits.shape[-1])  # [T, V/N]
    flat_targets = targets.reshape(-1)  # [T]
    losses = _vocab_parallel_losses(logits, flat_targets, comm, ignore_index)  # [T]
    return losses.sum() / (flat_targets != ignore_index).sum()


# its all-reduces: between graph pieces in graph mode, traced at ZeRO stage 3 ([Note: one graph, no splits])
@between_graphs("vocab-parallel cross-entropy", traced_in_one_graph=True)
def _vocab_parallel_losses(logits: torch.Tensor, targets: torch.Tensor, comm: Communicator, ignore_index: int):
    return _VocabParallelCrossEntropy.apply(logits, targets, comm, ignore_index)


class VocabParallelCrossEntropy(nn.Module):
    """``forward(local_logits, targets) -> mean loss``: :func:`vocab_parallel_cross_entropy` as a module.

    It takes the place of a model's loss module (a module with ``forward(logits, targets)`` that computes the
    mean cross-entropy, such as ``nn.CrossEntropyLoss()``) behind a column-parallel head that keeps its output
    split. The loss is replicated, so it closes any open RNG region ([Note: tensor-parallel RNG]).
    """

    def __init__(self, comm: Communicator, *, ignore_index: int = -100, rng: RegionRNG | None = None) -> None:
        super().__init__()
        self.comm, self.ignore_index, self.rng = comm, ignore_index, rng

    @classmethod
    def from_module(
        cls, module: nn.Module, comm: Communicator, *, rng: RegionRNG | None = None, name: str = ""
    ) -> VocabParallelCrossEntropy:
        """The replacement for ``module``; its ``ignore_index`` is kept, options it cannot honour refused."""
        if any(True for _ in module.parameters()):
            raise LayoutError(
                f"{name or 'the loss'} has parameters; vocab_parallel_loss replaces parameter-free losses"
            )
        if isinstance(module, nn.CrossEntropyLoss) and (
            module.weight is not None or module.label_smoothing != 0.0 or module.reduction != "mean"
        ):
            raise LayoutError(
                f"{name or 'the loss'}: vocab_parallel_loss computes the plain mean cross-entropy; class weights, "
                "label smoothing and reductions other than 'mean' are not supported."
            )
        return cls(comm, ignore_index=getattr(module, "ignore_index", -100), rng=rng)

    def forward(self, local_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.rng is not None:
            self.rng.exit()
        return vocab_parallel_cross_entropy(local_logits, targets, self.comm, ignore_index=self.ignore_index)

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, tp={self.comm.size}"
