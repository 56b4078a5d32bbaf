"""Context attention alone (sequence_parallel/ring_attention.py, ring.py): every cp rank's queries against the whole
sequence's keys and values, by the log-sum-exp-merged ring (the engine's at every cp), in float64 against torch's SDPA
on the whole sequence with the mask transformers builds there (causal, packed documents, padding, sliding windows,
bidirectional encoders): outputs and the gradients of queries, keys and values. And what each path holds."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardtrain.testing import run_distributed

B, H, KV, D = 2, 4, 2, 8


def _whole_mask(kind: str, length: int) -> tuple[dict, torch.Tensor | None]:
    """(the ContextSplit's fields, the whole sequence's boolean mask ``[b, 1, S, S]`` as transformers makes it: from
    its own mask functions, so that the two are checked against transformers' rules, not against each other)."""
    from transformers import masking_utils as mu

    from shardtrain.sequence_parallel.context_inputs import documents_of

    causal = "bidirectional" not in kind
    window = 3 if "window" in kind else None
    base = mu.causal_mask_function if causal else mu.bidirectional_mask_function
    if window is not None:
        overlay = mu.sliding_window_overlay(window) if causal else mu.sliding_window_bidirectional_overlay(window)
        base = mu.and_masks(base, overlay)
    fields: dict = {"causal": causal}
    padding = None
    if "padding" in kind:  # row 0 left-padded (its first queries read no key), row 1 right-padded
        padding = torch.ones(B, length, dtype=torch.bool)
        padding[0, :3], padding[1, -5:] = False, False
        fields["real"] = padding
        base = mu.and_masks(base, mu.padding_mask_function(padding))
    if "documents" in kind:  # documents crossing the chunks' and the ranks' boundaries
        positions = torch.stack([torch.cat([torch.arange(3), torch.arange(length - 3)]), torch.arange(length)])
        positions[1, length // 2 :] = torch.arange(length - length // 2)
        fields["documents"] = documents_of(positions)
        base = mu.and_masks(base, mu.packed_sequence_mask_function(fields["documents"]))
    mask = mu.sdpa_mask(batch_size=B, q_length=length, kv_length=length, mask_function=base, allow_is_causal_skip=False)
    return {**fields, "window": window}, mask


def _inputs(length: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(B, n, length, D, generator=g, dtype=torch.float64) for n in (H, KV, KV, H))
    return q, k, v, grad


def _attend_on_rank(kind: str, length: int) -> dict:
    """This cp rank's output and gradients (its tokens' rows), and the bytes its attention saved for backward."""
    from shardtrain.distributed.communicator import Communicator
    from shardtrain.sequence_parallel.ring import context_attention, positions_of
    from shardtrain.sequence_parallel.ring_attention import ContextSplit

    comm = Communicator(dist.group.WORLD, 60.0)
    fields, _ = _whole_mask(kind, length)
    window = fields.pop("window")
    split = ContextSplit(length, **fields)
    mine = positions_of(length, comm.size, comm.rank)
    q, k, v, grad = (t[:, :, mine].clone() for t in _inputs(length))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    saved: list[int] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size() if t.dtype == torch.float64 else 0)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = context_attention(q, k, v, comm, split, what="test", window=window)
    out.backward(grad)
    return {
        "out": out.detach(),
        "dq": q.grad,
        "dk": k.grad,
        "dv": v.grad,
        "saved": sum(saved),
        "ring": comm.stats().get("ring", {}).get("calls", 0),
    }


def _reference(kind: str, length: int) -> dict:
    _, mask = _whole_mask(kind, length)
    q, k, v, grad = (t.clone().requires_grad_() for t in _inputs(length))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out.backward(grad)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _every_kind_on_rank(kinds: list[str], length: int) -> dict:
    """Each mask's results on this rank (one process group for all; the ring's blocks by the CPU's fused kernel, and
    again by the matmuls other devices run), and one causal attention over a longer sequence, for the bytes it saves
    for backward."""
    from shardtrain.sequence_parallel import ring_attention

    out = {kind: _attend_on_rank(kind, length) for kind in kinds}
    ring_attention.FUSED_BLOCKS_ON = ()
    out.update({f"{kind} unfused": _attend_on_rank(kind, length) for kind in kinds})
    ring_attention.FUSED_BLOCKS_ON = ("cpu",)
    out["saved"] = _attend_on_rank("causal", 96)["saved"]
    return out


def _check(kinds: list[str], cp: int) -> list[dict]:
    from shardtrain.sequence_parallel.ring import positions_of

    length = 4 * cp
    results = run_distributed(_every_kind_on_rank, cp, kinds, length)
    for kind in [*kinds, *(f"{k} unfused" for k in kinds)]:
        want = _reference(kind.removesuffix(" unfused"), length)
        for name in ("out", "dq", "dk", "dv"):
            got = torch.empty_like(want[name])
            for r, result in enumerate(results):
                got[:, :, positions_of(length, cp, r)] = result[kind][name]
            err = (got - want[name]).abs().max().item()
            assert err < 1e-10, f"{kind}, cp {cp}: {name} off by {err}"
    return results


KINDS = [
    "causal",
    "documents",
    "padding",
    "window",
    "window documents",
    "bidirectional padding",
    "bidirectional window",
]


def _saved_for_backward(cp: int, length: int = 96) -> int:
    """What one rank's ring attention saves for backward (float64): its own keys and values (``1/cp`` of the
    sequence's), its queries, output and log-sum-exp; no mask, no other rank's chunk."""
    per_token = B * D * 8  # one head of one token, float64
    own_kv = 2 * KV * (length // cp) * per_token
    queries_out = 2 * H * (length // cp) * per_token
    return own_kv + queries_out + B * H * (length // cp) * 8


def test_merged_ring_is_whole_sequence_attention():
    """The log-sum-exp merge at cp 3 (each rank's two chunks far apart; a left-padded query reads no key) equals one
    process's masked SDPA (transformers' mask functions on the whole sequence) to 1e-10 in float64, for every mask,
    gradients included: the backward is exact. And the bytes one rank's attention saves for backward (a sequence of
    96) are 1/cp of what it would save on one process."""
    cp = 3
    results = _check(KINDS, cp)
    for kind in KINDS:  # forward: 2 chunk steps; backward: 2 chunk steps and 3 steps of the chunks' gradients
        assert [r[kind]["ring"] for r in results] == [7, 7, 7], kind
    assert [r["saved"] for r in results] == [_saved_for_backward(cp)] * cp


def test_a_window_that_matters():
    """The window changes the attention (so the tests above would fail with it ignored)."""
    full, windowed = _reference("causal", 12), _reference("window", 12)
    assert (full["out"] - windowed["out"]).abs().max().item() > 1e-2


def test_a_masked_block_makes_one_float_mask():
    """A masked block on the CPU's fused kernel: its peak (measured by torch's MemTracker) above its inputs is the one
    ``n x m`` float mask the kernel takes, plus the block's output; building it as zeros filled out of place with a
    negated mask held three ``n x m`` tensors at once (the longest sequence within a budget: docs/benchmarks.md)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from shardtrain.sequence_parallel.ring_attention import _block_forward

    n, heads, d = 512, 2, 16
    q, k, v = (torch.randn(1, heads, n, d) for _ in range(3))
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    tracker = MemTracker()
    with tracker:
        out, _ = _block_forward(q, k, v, mask, d**-0.5)
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]
    float_mask, outputs = n * n * 4, out.nbytes + heads * n * 4  # the mask; the output and its log-sum-exp
    assert peak <= float_mask + 2 * outputs, (peak, float_mask, outputs)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d**-0.5)
    assert torch.allclose(out, want, atol=1e-6)


def test_a_plain_causal_block_makes_no_float_mask():
    """[Note: plain causal blocks]: the diagonal block of plain causal data runs the fused kernel's ``is_causal``, no
    mask: its peak above its inputs (MemTracker) stays below the one ``n x n`` float mask the masked call makes, and
    forward (output, log-sum-exp) and backward (dq, dk, dv) equal the masked call's to 1e-6."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from shardtrain.sequence_parallel.ring_attention import _block_backward, _block_forward

    n, heads, d = 512, 2, 16
    q, k, v, do = (torch.randn(1, heads, n, d) for _ in range(4))
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    float_mask = n * n * 4

    def peak_of(call):
        tracker = MemTracker()
        with tracker:
            result = call()
        return next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"], result

    masked_peak, (masked_out, masked_lse) = peak_of(lambda: _block_forward(q, k, v, mask, d**-0.5))
    peak, (out, lse) = peak_of(lambda: _block_forward(q, k, v, None, d**-0.5, causal=True))
    assert masked_peak > float_mask, masked_peak  # the masked call does make the mask this test is about
    assert peak < float_mask, (peak, float_mask)
    assert torch.allclose(out, masked_out, atol=1e-6) and torch.allclose(lse, masked_lse, atol=1e-6)

    masked_peak, masked_grads = peak_of(lambda: _block_backward(do, q, k, v, out, lse, mask, d**-0.5))
    peak, grads = peak_of(lambda: _block_backward(do, q, k, v, out, lse, None, d**-0.5, causal=True))
    assert peak < float_mask < masked_peak, (peak, float_mask, masked_peak)
    for got, want in zip(grads, masked_grads):
        assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()


def test_merged_ring_at_cp_2_is_whole_sequence_attention():
    """cp 2 runs the merged ring too ([Note: which context attention]): every mask, fused and unfused blocks,
    outputs and gradients equal one process's to 1e-10 in float64 (plain causal through [Note: plain causal blocks]),
    and a rank saves for backward 1/2 of what one process saves (the gathered path that ran at cp 2 saved every
    chunk's keys and values, repeated to every query head, and its float mask)."""
    results = _check(KINDS, 2)
    for kind in KINDS:  # forward: 1 chunk step; backward: 1 chunk step and 2 steps of the chunks' gradients
        assert [r[kind]["ring"] for r in results] == [4, 4], kind
    assert [r["saved"] for r in results] == [_saved_for_backward(2)] * 2
