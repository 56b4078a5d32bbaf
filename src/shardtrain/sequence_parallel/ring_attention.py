"""Ring attention merged by log-sum-exp: each arriving key/value chunk attended as it arrives, so that a rank never
holds a layer's whole-sequence keys and values (docs/context-parallel.md); the engine's context attention at every
cp size ([Note: which context attention] in :mod:`shardtrain.sequence_parallel.ring`). Its masks are built here, from
global positions.

[Note: masks from global positions]
Whether query ``i`` reads key ``j`` (both global positions of the whole sequence ``[0, S)``) is decided from the
positions alone, as transformers' mask functions decide it (``masking_utils``): causal ``j <= i`` (not for an
encoder); a sliding window ``j > i - w`` (causal), ``|i - j| <= w`` (bidirectional); packed documents: the same
document (only without a padding mask, as transformers); padding: key ``j`` is a real token. A query that reads no
key (a left-padded position) gets 0, as torch's SDPA gives a fully masked row. So any chunk of queries is masked
against any chunk of keys, on whichever rank either lies, with no ``S x S`` mask anywhere.

[Note: the log-sum-exp merge]
A block of queries attending to one chunk of keys gives ``o_j = softmax(s_j) v_j`` and ``lse_j = log sum exp s_j``
per query row; over the chunks, ``lse = logaddexp_j lse_j`` and ``o = sum_j exp(lse_j - lse) o_j``: exactly the
softmax over all the keys read. A row with no key read has ``lse = -inf`` and contributes 0. Forward: ``C`` steps,
the next chunk's transfer (``Communicator.ring_step(async_op=True)``) in flight while the current one is attended;
saved for backward: this rank's own keys and values, its output and ``lse`` (``1/C`` of the sequence's keys and
values, where SDPA over gathered keys and values would save the whole sequence's, repeated to every query head).
Backward (the standard ring-attention backward, FlashAttention's per block): the keys and values go around the ring
again, each rank recomputes ``p = exp(s - lse)`` for its queries against the chunk it holds, adds ``dq += ds k``,
and adds its ``dk = ds^T q``, ``dv = p^T do`` to the chunk's gradient, which travels with the chunk; after ``C``
steps each chunk's gradient comes home with one more step. Ring bytes per layer: ``C - 1`` chunk steps forward,
``2C - 1`` backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardtrain.distributed.communicator import Communicator


@dataclass
class ContextSplit:
    """What the attention of one forward needs to know of the split ([Note: masks from global positions]): the whole
    sequence's length; the document of each token ``[b, S]`` (None: one per row); which tokens are real ``[b, S]``
    (None: all); whether attention is causal (False: an encoder)."""

    length: int
    documents: torch.Tensor | None = None
    real: torch.Tensor | None = None
    causal: bool = True


def allowed(
    split: ContextSplit, queries: torch.Tensor, keys: torch.Tensor, window: int | None = None
) -> torch.Tensor | None:
    """Which key each query reads, ``[b or 1, 1, n, m]`` bool, for queries and keys at global positions ``queries``
    ``[n]`` and ``keys`` ``[m]`` ([Note: masks from global positions]); None when every query reads every key."""
    i, j = queries[:, None], keys[None, :]
    mask = (j <= i) if split.causal else None
    if window is not None:
        inside = (j > i - window) if split.causal else ((i - j).abs() <= window)
        mask = inside if mask is None else mask & inside
    mask = None if mask is None else mask[None, None]
    if split.documents is not None:
        docs = split.documents.to(queries.device)
        same = (docs[:, queries, None] == docs[:, None, keys])[:, None]  # [b, 1, n, m]
        mask = same if mask is None else mask & same
    if split.real is not None:
        real = split.real.to(queries.device)[:, keys].bool()[:, None, None, :]  # [b, 1, 1, m]
        mask = real if mask is None else mask & real
    return mask


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Blocks of bf16/fp16 inputs are attended and merged in fp32, as SDPA's kernels accumulate."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """``q [b, h, n, d]`` against ``k [b, h, m, d]`` (key heads already repeated): ``[b, h, n, m]``, -inf masked."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with the rows that read no key (-inf) at 0, so that ``exp(s - lse)`` is 0 there, not NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _additive(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """A boolean mask as the additive one (0 or -inf, of the queries' dtype) the CPU flash kernel takes: ``log`` of
    its 1s and 0s in place, exactly 0 and -inf, so that the block's one ``n x m`` float tensor is the only one made
    (zeros filled out of place with a negated mask held three, the peak of a block: docs/benchmarks.md)."""
    if mask is None:
        return None
    return mask.to(device=like.device, dtype=like.dtype).log_()


# [Note: the block kernels]
# One block (queries against one arriving chunk) is attended by torch's CPU flash kernel
# (aten._scaled_dot_product_flash_attention_for_cpu, which returns the log-sum-exp, and its backward op, which takes
# the merged output and log-sum-exp: FlashAttention's backward of a block is exactly its share of the whole
# backward); elsewhere by the same formulas in matmuls (exact, unfused). The CPU kernel gives a row that reads no
# key lse 0: set to -inf here, so that the merge weighs it 0.
FUSED_BLOCKS_ON = ("cpu",)
"""The devices whose blocks run torch's fused kernel ([Note: the block kernels]); the others run the matmuls."""


def _causal_block(mask: torch.Tensor | None, causal: bool, n: int, m: int, device) -> torch.Tensor | None:
    """The unfused kernels' mask of a block: ``mask``, or (``causal``) the lower triangle it stands for."""
    return torch.ones(n, m, dtype=torch.bool, device=device).tril()[None, None] if causal else mask


def _block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [b, h, n, d], lse [b, h, n])`` of ``q`` attending to ``k``, ``v`` (heads repeated) under ``mask``, or
    (``causal``, no mask) each query ``i`` to keys ``0..i`` of the block ([Note: plain causal blocks])."""
    if q.device.type in FUSED_BLOCKS_ON:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, is_causal=causal, attn_mask=_additive(mask, q), scale=scale
        )
        if mask is not None:
            lse = lse.masked_fill(~mask.any(-1), float("-inf"))
        return out, lse
    s = _scores(q, k, _causal_block(mask, causal, q.shape[-2], k.shape[-2], q.device), scale)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - _finite(lse)[..., None]), v), lse


def _block_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one block given the merged ``out`` and ``lse`` (finite) of the whole attention (``mask``
    and ``causal`` as :func:`_block_forward` takes them)."""
    if q.device.type in FUSED_BLOCKS_ON:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, causal, attn_mask=_additive(mask, q), scale=scale
        )
    mask = _causal_block(mask, causal, q.shape[-2], k.shape[-2], q.device)
    p = torch.exp(_scores(q, k, mask, scale) - lse[..., None])  # [b, h, n, m]; 0 where masked
    ds = p * (torch.matmul(do, v.transpose(-1, -2)) - (do * out).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k) * scale
    return dq, torch.matmul(ds.transpose(-1, -2), q) * scale, torch.matmul(p.transpose(-1, -2), do)


def _grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[b, h, m, d]`` -> ``[b, h / groups, m, d]``: each key/value head's gradient, summed over its query heads."""
    b, h, m, d = x.shape
    return x.view(b, h // groups, groups, m, d).sum(2)


def _chunks_read(
    split: ContextSplit, window: int | None, chunks: int, mine: int, theirs: int, chunk: int
) -> tuple[slice, slice] | None:
    """Which of this rank's two query chunks read which of the arriving two key chunks, as (query rows, key rows) of
    the two-chunk layouts ([Note: load-balanced chunks] in :mod:`shardtrain.sequence_parallel.ring`), from the
    chunks' places alone: a chunk of keys wholly in the future of a chunk of queries, or wholly outside its window,
    is skipped (so causal attention computes half of the blocks of another rank: the keys' head chunk, or the
    queries' tail chunk). None: no query reads any of these keys."""

    def reads(m: int, j: int) -> bool:
        if split.causal and j > m:
            return False
        nearest = 0 if m == j else (abs(m - j) - 1) * chunk + 1  # the closest query-key distance of the two chunks
        return window is None or (nearest < window if split.causal else nearest <= window)

    q_chunks, k_chunks = (mine, 2 * chunks - 1 - mine), (theirs, 2 * chunks - 1 - theirs)
    pairs = [(a, b) for a in range(2) for b in range(2) if reads(q_chunks[a], k_chunks[b])]
    if not pairs:
        return None
    rows = {a for a, _ in pairs}
    cols = {b for _, b in pairs}
    return slice(min(rows) * chunk, (max(rows) + 1) * chunk), slice(min(cols) * chunk, (max(cols) + 1) * chunk)


# [Note: plain causal blocks]
# On causal data with no packed documents, padding or window, no block needs a mask. A rank's own two chunks against
# themselves (the first ring step) are a square whose global positions rise along both sides (the head chunk, then
# the tail chunk: [Note: load-balanced chunks] in :mod:`shardtrain.sequence_parallel.ring`), so ``j <= i`` is the
# lower triangle of the block's own indices: the kernel's ``is_causal``. Against another rank's chunks,
# :func:`_chunks_read` keeps only keys wholly in the queries' past (the arriving head chunk when it comes from a lower
# rank, this rank's tail chunk when from a higher one), so every query reads every key of the block: no mask. The
# blocks wholly in the future are skipped there. So no ``(S/C) x (S/C)`` float mask is built, where a masked block
# makes one in forward and again in backward (the CPU kernel takes it additive, [Note: the block kernels]).
def _block_mask(
    split: ContextSplit, window: int | None, positions, mine: int, theirs: int, rows: slice, cols: slice
) -> tuple[torch.Tensor | None, bool]:
    """``(mask, causal)`` of the block of this rank's (``mine``) query ``rows`` against cp rank ``theirs``' key
    ``cols``: [Note: plain causal blocks] where it holds, else [Note: masks from global positions]."""
    if split.causal and window is None and split.documents is None and split.real is None:
        return None, mine == theirs
    return allowed(split, positions(mine)[rows], positions(theirs)[cols], window), False


class RingAttention(torch.autograd.Function):
    """Attention of this rank's queries ``[b, h, s, d]`` (its two chunks, positions ``mine``) to every rank's keys and
    values ``[2, b, kv, s, d]`` passed around the ring, merged by log-sum-exp: [Note: the log-sum-exp merge]."""

    @staticmethod
    def forward(ctx, query, kv, comm: Communicator, split: ContextSplit, scale: float, window, positions, what: str):
        c, r = comm.size, comm.rank
        groups, chunk = query.shape[1] // kv.shape[2], query.shape[2] // 2
        dtype = _compute_dtype(query.dtype)
        q = query.to(dtype)
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=dtype, device=q.device)
        held = kv
        for step in range(c):
            if step < c - 1:  # the next chunk in flight while this one is attended
                arriving = torch.empty_like(held)
                handle = comm.ring_step(
                    arriving, held, what=f"{what} (ring, step {step + 1} of {c - 1})", async_op=True
                )
            src = (r - step) % c
            block = _chunks_read(split, window, c, r, src, chunk)
            if block is not None:
                rows, cols = block
                mask, causal = _block_mask(split, window, positions, r, src, rows, cols)
                k, v = (t[:, :, cols].to(dtype).repeat_interleave(groups, dim=1) for t in held.unbind(0))
                block_out, block_lse = _block_forward(q[:, :, rows], k, v, mask, scale, causal)
                was, was_lse = out[:, :, rows], lse[:, :, rows]
                merged = torch.logaddexp(was_lse, block_lse)
                safe = _finite(merged)
                out[:, :, rows] = (
                    was * torch.exp(was_lse - safe)[..., None] + block_out * torch.exp(block_lse - safe)[..., None]
                )
                lse[:, :, rows] = merged
            if step < c - 1:
                handle.wait()
                held = arriving
        ctx.save_for_backward(query, kv, out, lse)
        ctx.comm, ctx.split, ctx.scale, ctx.window, ctx.positions, ctx.what = (
            comm,
            split,
            scale,
            window,
            positions,
            what,
        )
        return out.to(query.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        query, kv, out, lse = ctx.saved_tensors
        comm, split, scale, window, positions = ctx.comm, ctx.split, ctx.scale, ctx.window, ctx.positions
        c, r = comm.size, comm.rank
        groups, chunk = query.shape[1] // kv.shape[2], query.shape[2] // 2
        dtype = out.dtype
        q, do = query.to(dtype), grad_out.to(dtype)
        safe = _finite(lse)
        dq = torch.zeros_like(q)
        held, held_grad, grad_handle = kv, None, None
        for step in range(c):
            if step < c - 1:
                arriving = torch.empty_like(held)
                what = f"{ctx.what} (ring backward, step {step + 1} of {c - 1})"
                handle = comm.ring_step(arriving, held, what=what, async_op=True)
            src = (r - step) % c
            block = _chunks_read(split, window, c, r, src, chunk)
            grad = torch.zeros(held.shape, dtype=dtype, device=held.device)  # [2, b, kv, s, d]
            if block is not None:
                rows, cols = block
                mask, causal = _block_mask(split, window, positions, r, src, rows, cols)
                k, v = (t[:, :, cols].to(dtype).repeat_interleave(groups, dim=1) for t in held.unbind(0))
                q_rows, o_rows, do_rows = q[:, :, rows], out[:, :, rows], do[:, :, rows]
                lse_rows = safe[:, :, rows]
                dq_block, dk, dv = _block_backward(do_rows, q_rows, k, v, o_rows, lse_rows, mask, scale, causal)
                dq[:, :, rows] += dq_block
                grad[:, :, :, cols] = torch.stack([_grouped(dk, groups), _grouped(dv, groups)])
            if grad_handle is not None:  # the gradient this chunk gathered on the ranks before, now arrived
                grad_handle.wait()
                grad = grad + held_grad
            # the chunk's gradient goes on with the chunk: after step c - 1 it goes home (rank r + 1's own chunk)
            arriving_grad = torch.empty_like(grad)
            what = f"{ctx.what} (ring backward, the keys' and values' gradient, step {step + 1} of {c})"
            grad_handle = comm.ring_step(arriving_grad, grad, what=what, async_op=True)
            held_grad = arriving_grad
            if step < c - 1:
                handle.wait()
                held = arriving
        grad_handle.wait()
        return dq.to(query.dtype), held_grad.to(kv.dtype), None, None, None, None, None, None


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    comm: Communicator,
    split: ContextSplit,
    positions,
    scale: float | None = None,
    window: int | None = None,
    what: str = "attention",
) -> torch.Tensor:
    """This rank's queries ``[b, h, s, d]`` attending to the whole sequence's keys and values (this rank's ``[b, kv,
    s, d]``, the others' passed around the ring), merged by log-sum-exp ([Note: the log-sum-exp merge]);
    ``positions(rank)``: the global positions of a cp rank's tokens. Returns ``[b, h, s, d]``."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    kv = torch.stack([key, value]).contiguous()
    return RingAttention.apply(query, kv, comm, split, scale, window, positions, f"the keys and values of {what}")


__all__ = ["ContextSplit", "RingAttention", "allowed", "ring_attention"]
