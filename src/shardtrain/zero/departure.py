"""A departure from a trusted unit order: every rank says whether it departed too, through the rendezvous store.

[Note: departures from a trusted order]
A trusted pass gathers without exchanges ([Note: unit order check]). A rank whose next gather is not the order's at that
position (or whose pass ends short of it) has departed, and cannot tell alone whether the others departed alike (a path
change on every rank: still correct) or not (a desync: they issue the order's gather, which it never joins). Before
issuing anything it 1. writes to the store the pass (a serial every rank counts alike, since trusted passes follow the
phase check), the position and the unit it needs (or none); 2. waits until every peer of its gathering groups has
written for this pass. A peer still on the order is blocked in a collective this rank never joins (gloo: in ``wait``;
NCCL: at the next phase check, a gloo exchange), whose wait runs this object's probe ([Note: probes while waiting] in
:mod:`shardtrain.distributed.communicator`); the probe writes that it did not depart there and raises, but only for a
point it has passed on the order (short of it, it may yet depart alike). A backward pass ends when ``loss.backward()``
returns, before the reducer launches its leftover buckets, which ranks in the order's gathers would never pair. 3. If
all departed at the same position for the same unit, the pass goes on checked; otherwise every rank raises
:class:`~shardtrain.errors.RankMismatchError` naming each rank's unit at the earliest departure (a departer decides once
all answered, or a second after the first differing answer), and every Communicator of those groups refuses further
collectives ([Note: no collective after a failure]). An answering rank waits briefly for the departers to read the
answers before raising (it may host the store). No data collective of a different unit is ever issued, so a desync is
named before anything mixes or aborts. Limit: a rank on the order blocked where no probe runs (a CUDA sync under NCCL,
the pairwise reduce-scatter's point-to-point waits) answers only when that wait ends; the departer then fails at the
collective timeout, naming who did not answer. Records: one store key per rank and engine, written only on a departure.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import time
from collections.abc import Sequence

from shardtrain.distributed import failure
from shardtrain.distributed.communicator import Communicator
from shardtrain.distributed.store_calls import StoreSilentError
from shardtrain.errors import CollectiveTimeoutError, PeerLostError, RankMismatchError

_KEY = "shardtrain/unit_order/{}/{}"  # engine number, global rank
_DECIDED_KEY = "shardtrain/unit_order/{}/{}/decided"  # the last pass whose answers that rank has read
GRACE_S = 1.0
"""How long a departing rank still waits for the other answers once one differs (the error is then certain)."""
_engines = itertools.count()
"""Engines built in this process; every rank builds its engines in the same order, so the number names one engine
on every rank (a second engine never reads the first one's records)."""


class OrderAgreement:
    """See [Note: departures from a trusted order]. ``comms``: the Communicators of the units' gathers, whose peers
    must agree; ``names``: the units' names by index."""

    def __init__(self, comms: Sequence[Communicator], names: Sequence[str], timeout_s: float) -> None:
        self.comms = [c for c in comms if c is not None]
        self.me = self.comms[0].global_rank
        self.peers = sorted({r for c in self.comms for r in c.peers()})
        self.names, self.timeout_s = list(names), timeout_s
        self.engine = next(_engines)
        self.serial = 0  # trusted passes begun; alike on every rank
        self.kind = ""
        self.expected: list[int] = []  # the gathers every rank was trusted to issue in this pass
        self.agreed: set[int] = set()  # passes where every rank departed alike
        self.declaring: int | None = None  # the pass whose departure this rank is settling
        self.at: int | None = None  # gathers this rank has issued in the pass begun last; None once it ended

    def begin(self, kind: str, expected: list[int]) -> None:
        """A trusted pass of ``kind`` starts; ``expected``: the unit indices of its gathers, in order."""
        self.serial += 1
        self.kind, self.expected, self.at = kind, expected, 0

    # -- the store ------------------------------------------------------------------------------
    def _write(self, position: int | None, unit: int | None) -> None:
        """This rank's record for the current pass (``position`` None: it did not depart). Never raises: a store
        that went away costs the others this rank's answer, and their error says so."""
        record = {"pid": os.getpid(), "serial": self.serial, "kind": self.kind, "position": position, "unit": unit}
        self._set(_KEY.format(self.engine, self.me), json.dumps(record))

    def _read(self, rank: int) -> dict | None:
        """``rank``'s record, or None when it wrote none (or one left by an earlier attempt's process: torchrun
        keeps its store). Raises ``ConnectionError`` when the store does not answer (in time: [Note: every wait on
        the store is bounded] in :mod:`shardtrain.distributed.store_calls`)."""
        store = failure.bounded_store()
        key = _KEY.format(self.engine, rank)
        try:
            if store is None or not store.check([key]):
                return None
            record = json.loads(store.get(key))
        except Exception as err:  # the store's host is gone (rank 0, which may have raised and exited already)
            raise ConnectionError(f"the rendezvous store no longer answers ({type(err).__name__})") from err
        known = failure._known.get(rank)
        if known is not None and known.get("pid") != record["pid"]:
            return None
        return record

    # -- a departure ------------------------------------------------------------------------------
    def declare(self, position: int, unit: int | None) -> None:
        """This rank's gather number ``position`` of the pass is ``unit`` (None: the pass ended there), not the
        order's. Returns when every rank departed alike; raises otherwise (see the Note): as soon as every peer has
        answered, or :data:`GRACE_S` after the first answer that differs (the error then names the ranks that had not
        answered), or when the store goes away."""
        self.declaring = self.serial
        self._write(position, unit)
        try:
            self._settle(position, unit)
        finally:
            self.declaring = None

    def _settle(self, position: int, unit: int | None) -> None:
        mine = (position, unit)
        start = time.monotonic()
        pause, probed, differs = 0.002, start, None
        answers: dict[int, tuple[int | None, int | None]] = {}
        silent: str | None = None  # the store did not answer in time: asked again until the collective timeout
        while len(answers) < len(self.peers):
            try:
                for r in self.peers:
                    record = self._read(r) if r not in answers else None
                    if record is not None and record["serial"] >= self.serial:
                        same_pass = record["serial"] == self.serial and record["position"] is not None
                        answers[r] = (record["position"], record["unit"]) if same_pass else (None, None)
                silent = None
            except ConnectionError as err:
                if any(a != mine for a in answers.values()):
                    break  # a peer answered differently before the store went: that decides it
                if not isinstance(err.__cause__, StoreSilentError):
                    raise self._broken(PeerLostError(f"rank {self.me}: {self._what(position, unit)}; {err}")) from err
                silent = str(err.__cause__)
            now = time.monotonic()
            if differs is None and any(a != mine for a in answers.values()):
                differs = now
            if len(answers) == len(self.peers) or (differs is not None and now - differs >= GRACE_S):
                break
            if now - probed > 1.0:
                probed = now
                down = failure.peer_down(self.me, self.peers)
                if down is not None:
                    raise self._broken(PeerLostError(f"rank {self.me}: {self._what(position, unit)}, {down}"))
            if now - start > self.timeout_s:
                unanswered = [r for r in self.peers if r not in answers]
                why = (
                    f"the rendezvous store does not answer: {silent}"
                    if silent is not None
                    else "they are blocked where no wait probe runs, or on another code path"
                )
                raise self._broken(
                    CollectiveTimeoutError(
                        f"rank {self.me}: {self._what(position, unit)}; waited {self.timeout_s:g}s (collective "
                        f"timeout) for rank(s) {unanswered} to say whether they departed too: {why} ([Note: "
                        "departures from a trusted order] in shardtrain.zero.departure)"
                    )
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        self._set(_DECIDED_KEY.format(self.engine, self.me), str(self.serial))  # the answers were read
        if len(answers) == len(self.peers) and all(a == mine for a in answers.values()):
            self.agreed.add(self.serial)
            return
        raise self._broken(self._mismatch({self.me: mine, **answers}))

    def probe(self) -> None:
        """A wait probe ([Note: probes while waiting]): raise if a peer departed from the order at a point this rank
        has passed on the order (it issued the order's gather there, or its pass ended). A departure further on in the
        pass this rank is in says nothing yet: this rank may be waiting in another collective short of that point (a
        tensor-parallel one, an earlier gather held up by a third rank) and depart there alike."""
        records: dict[int, dict] = {}
        for r in self.peers:
            try:
                record = self._read(r)
            except ConnectionError:
                return  # no store: the collective's own failure or timeout names what happened
            if record is None or record["position"] is None or record["serial"] in self.agreed:
                continue
            if record["serial"] == self.declaring:  # this rank departed there too and is settling it (the NCCL
                continue  # watchdog's thread probes while the main thread settles)
            if record["serial"] == self.serial and self.at is not None and record["position"] >= self.at:
                continue  # this rank has not reached that point of the pass yet: it may depart there alike
            records[r] = record
        if not records:
            return
        # a peer departed in a pass where this rank did not: this rank is still on the order
        self.serial = max(rec["serial"] for rec in records.values())
        self.kind = next(rec["kind"] for rec in records.values() if rec["serial"] == self.serial)
        self._write(None, None)
        departures: dict[int, tuple[int | None, int | None]] = {self.me: (None, None)}
        for r, rec in records.items():
            if rec["serial"] == self.serial:
                departures[r] = (rec["position"], rec["unit"])
        error = self._broken(self._mismatch(departures, answered=set(self.peers)))
        self._linger([r for r in departures if r != self.me])
        raise error

    def _linger(self, departed: list[int]) -> None:
        """Wait (at most :data:`GRACE_S` + 2 s) until the departed ranks have read this rank's answer: this rank may
        host the store (rank 0), and its process may exit as soon as it raises."""
        deadline = time.monotonic() + GRACE_S + 2.0
        store = failure.bounded_store()
        while departed and store is not None and time.monotonic() < deadline:
            try:
                departed = [
                    r
                    for r in departed
                    if not store.check([key := _DECIDED_KEY.format(self.engine, r)])
                    or int(store.get(key)) < self.serial
                ]
            except Exception:
                return
            time.sleep(0.01)

    def _set(self, key: str, value: str) -> None:
        store = failure.bounded_store()
        with contextlib.suppress(Exception):  # a silent store costs the others this answer; their error says so
            if store is not None:
                store.set(key, value)

    def _what(self, position: int, unit: int | None) -> str:
        where = f"gather {position + 1} ({self._name(unit)})"
        return f"departed from the ZeRO-3 unit order of the previous {self.kind} passes at {where}"

    def _name(self, unit: int | None) -> str:
        if unit is None:
            return "no unit: its pass ended there"
        return repr(self.names[unit]) if 0 <= unit < len(self.names) else f"unit {unit}"

    def _mismatch(
        self, departures: dict[int, tuple[int | None, int | None]], answered: set[int] | None = None
    ) -> RankMismatchError:
        """Each rank's unit at the earliest position where one departed: its own where it departed there, the
        order's where it answered that it did not (or departed later); ``answered``: the ranks to name as on the
        order without an answer (a probing rank, which found the departures of the peers that had written)."""
        at = min(p for p, _ in departures.values() if p is not None)
        order = self.expected[at] if at < len(self.expected) else None
        answered = set(departures) if answered is None else answered | set(departures)

        def unit_of(r: int) -> str:
            if r not in answered:
                return "no answer"
            position, unit = departures.get(r, (None, None))
            return self._name(unit) if position == at else f"{self._name(order)} (the order)"

        ranks = sorted({self.me, *self.peers})
        per_rank = ", ".join(f"rank {r}: {unit_of(r)}" for r in ranks)
        return RankMismatchError(
            f"ranks are gathering different ZeRO-3 units at the same point (gather {at + 1} of a {self.kind} pass, in "
            f"the order the previous {self.kind} passes took on every rank): {per_rank}. Every rank must run the same "
            "sequence of forward and backward passes (same modules, same number of calls)."
        )

    def _broken(self, err: Exception) -> Exception:
        for c in self.comms:  # the groups' sequences of collectives no longer match: nothing more on them
            c.break_group(err)
        return err
