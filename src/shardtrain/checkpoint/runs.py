"""Run arithmetic, vectorized: the element maps between global tensors, stored pieces and the slices a rank reads.

[Note: runs] Every slice kind reduces to *runs*: ``(global_start, piece_start, length)`` triples in flattened
(row-major) element indices of the global tensor and of the piece. A :class:`RunTable` holds them as three int64
tensors, sorted by ``global_start`` (and therefore by ``piece_start``: every slice kind keeps the global order), no
run empty, no two overlapping. Coverage checks, reads and layout changes use only run tables, so a new slice kind
needs only a ``run_table`` method.

A column block of an (R, C) matrix is R runs; everything here is tensor arithmetic over the runs (no Python loop per
run), and copies are strided views or one gather per chunk of a stored piece (no Python loop per element or run).
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from typing import NamedTuple

import torch

_I64 = torch.int64


class RunTable(NamedTuple):
    """Runs as parallel int64 tensors (see [Note: runs])."""

    global_start: torch.Tensor
    piece_start: torch.Tensor
    length: torch.Tensor

    @staticmethod
    def of(global_start: list[int], piece_start: list[int], length: list[int]) -> RunTable:
        return RunTable(*(torch.tensor(v, dtype=_I64) for v in (global_start, piece_start, length)))

    @property
    def count(self) -> int:
        return self.length.numel()


class Segments(NamedTuple):
    """Where elements of one stored piece go in a target: ``out[target_start + i] = piece[piece_start + i]`` for
    ``i < length``; sorted by ``piece_start``, adjacent segments merged."""

    target_start: torch.Tensor
    piece_start: torch.Tensor
    length: torch.Tensor

    @property
    def count(self) -> int:
        return self.length.numel()


def block_runs(
    shape: tuple[int, ...], dim: int, index: int, count: int, stride: int, lo: int, hi: int | None
) -> RunTable:
    """Runs of elements ``[lo, hi)`` of the row-major flattening of a tensor-parallel block (``hi=None``: to its end).

    The block (see ``format.BlockSlice``) flattens to ``outer * stride`` runs of ``rows * inner`` elements each:
    run ``k`` is group ``k % stride`` of outer index ``k // stride``, and starts at ``k * rows * inner`` in the piece.
    Only the runs that ``[lo, hi)`` touches are built, clipped to it; piece offsets count from ``lo``.
    """
    outer, size, inner = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])
    rows = size // (count * stride)  # rows of one block of one group
    run = rows * inner
    total = outer * stride * run
    hi = total if hi is None else hi
    if run == 0 or hi <= lo:
        return RunTable.of([], [], [])
    k = torch.arange(lo // run, -(-hi // run), dtype=_I64)
    outer_index, group = k // stride, k % stride
    global_start = (outer_index * size + group * (size // stride) + index * rows) * inner
    start = k * run
    clipped_start = start.clamp(min=lo)
    clipped_end = (start + run).clamp(max=hi)
    return RunTable(global_start + (clipped_start - start), clipped_start - lo, clipped_end - clipped_start)


def flat_index(element: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The multi-index of flattened element ``element`` of a tensor of ``shape`` (for error messages)."""
    out = []
    for size in reversed(shape):
        element, rest = divmod(element, size) if size else (element, 0)
        out.append(rest)
    return tuple(reversed(out))


def coverage_problem(numel: int, tables: list[RunTable]) -> tuple[str, int, int, int, int] | None:
    """The first element that the runs of ``tables`` cover twice or not at all, or ``None`` when they cover
    ``[0, numel)`` exactly once.

    Returns ``("overlap", element, element + 1, table_a, table_b)`` or ``("gap", first, end, table_before, -1)``
    (``table_before`` is -1 at the start of the tensor)."""
    if not tables:
        return None if numel == 0 else ("gap", 0, numel, -1, -1)
    g = torch.cat([t.global_start for t in tables])
    n = torch.cat([t.length for t in tables])
    owner = torch.cat([torch.full((t.count,), i, dtype=_I64) for i, t in enumerate(tables)])
    order = torch.argsort(g, stable=True)
    g, n, owner = (v.index_select(0, order) for v in (g, n, owner))
    end = g + n
    previous_end = torch.cat([torch.zeros(1, dtype=_I64), end[:-1]])
    bad = torch.nonzero(g != previous_end)
    if bad.numel():
        i = int(bad[0])
        start, before = int(g[i]), int(previous_end[i])
        if start < before:
            return ("overlap", start, start + 1, int(owner[i - 1]), int(owner[i]))
        return ("gap", before, start, int(owner[i - 1]) if i else -1, -1)
    last = int(end[-1]) if end.numel() else 0
    if last != numel:
        return ("gap", last, numel, int(owner[-1]) if owner.numel() else -1, -1)
    return None


def spans_coverage_problem(numel: int, spans: list[tuple[int, int]]) -> tuple[str, int, int, int, int] | None:
    """:func:`coverage_problem` for ``(start, length)`` spans, one per slice, in plain Python: for ZeRO fragments
    (one run each) building tensors would cost 20x more than the check, on every tensor of every manifest read."""
    pos, previous = 0, -1
    for start, length, i in sorted((s, n, i) for i, (s, n) in enumerate(spans) if n):
        if start < pos:
            return ("overlap", start, start + 1, previous, i)
        if start > pos:
            return ("gap", pos, start, previous, -1)
        pos, previous = start + length, i
    return None if pos == numel else ("gap", pos, numel, previous, -1)


def intersect(target: RunTable, stored: RunTable) -> Segments:
    """The elements a target slice shares with a stored piece, as segments (both tables sorted and disjoint).

    For each target run, the stored runs overlapping it are a contiguous range found by binary search; the pairs
    are expanded and clipped in one pass. The result has at most ``target.count + stored.count`` segments."""
    a_start, a_end = target.global_start, target.global_start + target.length
    b_start, b_end = stored.global_start, stored.global_start + stored.length
    first = torch.searchsorted(b_end, a_start, right=True)  # first stored run ending after the target run starts
    stop = torch.searchsorted(b_start, a_end)  # first stored run starting at or after the target run ends
    pairs = (stop - first).clamp(min=0)
    total = int(pairs.sum())
    if total == 0:
        empty = torch.zeros(0, dtype=_I64)
        return Segments(empty, empty, empty)
    # index_select, not t[i]: advanced indexing was 1000x slower here (8 ms for 8192 elements, torch 2.13 CPU).
    i = torch.repeat_interleave(torch.arange(target.count, dtype=_I64), pairs)
    j = (first - (torch.cumsum(pairs, 0) - pairs)).index_select(0, i) + torch.arange(total, dtype=_I64)
    a_s, b_s = a_start.index_select(0, i), b_start.index_select(0, j)
    s = torch.maximum(a_s, b_s)
    e = torch.minimum(a_end.index_select(0, i), b_end.index_select(0, j))
    t = target.piece_start.index_select(0, i) + (s - a_s)
    p = stored.piece_start.index_select(0, j) + (s - b_s)
    n = e - s
    if total > 1 and not bool((p[1:] > p[:-1]).all()):  # every slice kind keeps the global order; be safe anyway
        order = torch.argsort(p)
        t, p, n = (v.index_select(0, order) for v in (t, p, n))
    # Merge segments contiguous in both the target and the piece (e.g. whole rows of a matrix).
    new = torch.ones(total, dtype=torch.bool)
    new[1:] = (t[1:] != t[:-1] + n[:-1]) | (p[1:] != p[:-1] + n[:-1])
    group = torch.cumsum(new, 0) - 1
    merged = torch.zeros(int(group[-1]) + 1, dtype=_I64).index_add_(0, group, n)
    return Segments(t.masked_select(new), p.masked_select(new), merged)


class SegmentCopier:
    """A ``stream_tensor`` sink: copies each chunk of a stored piece into ``out`` (flat) along ``segments``.

    Per chunk: the segments it touches are found by binary search; the first and last (clipped by the chunk) are
    copied as slices; the ones between, when they are regular (equal lengths, constant steps in the chunk and in
    ``out``, e.g. the rows of a column block), as one strided view, otherwise with one gather and one scatter.
    Memory: index tensors of at most one chunk, and only on the irregular path.

    :meth:`direct` lets ``stream_tensor`` read long segments straight into ``out`` instead (no chunk buffer, no
    copy): the common reads (a ZeRO fragment, a whole tensor, a row block) are one segment per piece."""

    _FEW = 4  # segments copied one by one below this
    _LISTS = 8  # up to this many segments are also kept as Python lists: tensor ops cost more than they save
    DIRECT_MIN_BYTES = 1 << 20  # shorter segments go through the chunk buffer: one read per segment would cost more

    def __init__(self, out: torch.Tensor, segments: Segments) -> None:
        self.out = out
        self.seg = segments
        self.piece_end = segments.piece_start + segments.length
        self._bytes: memoryview | None = None
        self._lists: tuple[list[int], list[int], list[int]] | None = None
        if segments.count <= self._LISTS:
            self._lists = (segments.target_start.tolist(), segments.piece_start.tolist(), self.piece_end.tolist())

    @classmethod
    def one_run(cls, out: torch.Tensor, target_start: int, piece_start: int, length: int) -> SegmentCopier:
        """``out[target_start + i] = piece[piece_start + i]`` for ``i < length``, without building tensors: a flat
        range read from a flat piece (a ZeRO fragment), where tensor ops per read would cost more than the copy of
        a small fragment."""
        self = cls.__new__(cls)
        self.out, self._bytes = out, None
        self._lists = ([target_start], [piece_start], [piece_start + length])
        return self

    def _segment(self, i: int) -> tuple[int, int, int]:
        """(target start, piece start, piece end) of segment ``i``."""
        if self._lists is not None:
            return self._lists[0][i], self._lists[1][i], self._lists[2][i]
        return int(self.seg.target_start[i]), int(self.seg.piece_start[i]), int(self.piece_end[i])

    def _first_ending_after(self, offset: int) -> int:
        if self._lists is not None:
            return bisect_right(self._lists[2], offset)
        return int(torch.searchsorted(self.piece_end, offset, right=True))

    def direct(self, offset: int, n: int) -> tuple[int, memoryview | None]:
        """For ``stream_tensor``: how many of the next ``n`` elements (from ``offset`` in the piece) to read next,
        and the bytes of ``out`` to read them into, or ``None`` for the chunk buffer (then passed to this sink).

        Only valid when ``out`` is in host memory with the stored dtype (the caller checks). A chunk that would run
        into a long segment is cut at its start, so that the segment is read directly from its first element."""
        i = self._first_ending_after(offset)
        if i == (len(self._lists[2]) if self._lists is not None else self.seg.count):
            return n, None
        t, start, end = self._segment(i)
        size = self.out.element_size()
        if start > offset:  # a gap (elements only read for the checksum) before segment i
            long = (end - start) * size >= self.DIRECT_MIN_BYTES
            return (min(n, start - offset) if long else n), None
        m = min(n, end - offset)
        if m < n and m * size < self.DIRECT_MIN_BYTES:
            return n, None
        if self._bytes is None:
            self._bytes = memoryview(self.out.view(torch.uint8).numpy())
        t += offset - start
        return m, self._bytes[t * size : (t + m) * size]

    def __call__(self, offset: int, chunk: torch.Tensor) -> None:
        end = offset + chunk.numel()
        if self._lists is not None:
            targets, starts, ends = self._lists
            for i in range(bisect_right(ends, offset), bisect_left(starts, end)):
                p = max(starts[i], offset)
                ti, ni = targets[i] + p - starts[i], min(ends[i], end) - p
                self.out[ti : ti + ni].copy_(chunk[p - offset : p - offset + ni])
            return
        lo = int(torch.searchsorted(self.piece_end, offset, right=True))
        hi = int(torch.searchsorted(self.seg.piece_start, end))
        if lo >= hi:
            return
        p = self.seg.piece_start[lo:hi].clamp(min=offset)
        t = self.seg.target_start[lo:hi] + (p - self.seg.piece_start[lo:hi])
        n = self.piece_end[lo:hi].clamp(max=end) - p
        p = p - offset
        if n.numel() <= self._FEW:
            for ti, pi, ni in zip(t.tolist(), p.tolist(), n.tolist()):
                self.out[ti : ti + ni].copy_(chunk[pi : pi + ni])
            return
        for k in (0, n.numel() - 1):
            ti, pi, ni = int(t[k]), int(p[k]), int(n[k])
            self.out[ti : ti + ni].copy_(chunk[pi : pi + ni])
        self._copy_middle(chunk, t[1:-1], p[1:-1], n[1:-1])

    def _copy_middle(self, chunk: torch.Tensor, t: torch.Tensor, p: torch.Tensor, n: torch.Tensor) -> None:
        length = int(n[0])
        regular = bool((n == length).all())
        if regular and t.numel() > 1:
            t_step, p_step = t[1] - t[0], p[1] - p[0]
            steps = torch.arange(t.numel(), dtype=_I64)
            regular = bool((t == t[0] + steps * t_step).all() and (p == p[0] + steps * p_step).all())
        if regular:
            rows = t.numel()
            t_step = int(t[1] - t[0]) if rows > 1 else length
            p_step = int(p[1] - p[0]) if rows > 1 else length
            dst = self.out.as_strided((rows, length), (t_step, 1), self.out.storage_offset() + int(t[0]))
            src = chunk.as_strided((rows, length), (p_step, 1), chunk.storage_offset() + int(p[0]))
            dst.copy_(src)
            return
        # Irregular (e.g. a strided block meeting a block of another dim): element indices for this chunk only.
        base = torch.cumsum(n, 0) - n
        within = torch.arange(int(n.sum()), dtype=_I64)
        src = torch.repeat_interleave(p - base, n) + within
        dst = torch.repeat_interleave(t - base, n) + within
        self.out.index_copy_(0, dst, chunk.index_select(0, src).to(self.out.dtype))
