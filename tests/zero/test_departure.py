"""The settling of a departure from a trusted ZeRO-3 unit order ([Note: departures from a trusted order] in
shardtrain.zero.departure), on an in-process store: what a departing rank decides from its peers' records, and what
a rank on the order's wait probe does with them."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from shardtrain.distributed import failure
from shardtrain.errors import RankMismatchError
from shardtrain.zero import departure
from shardtrain.zero.departure import OrderAgreement

NAMES = ["<root>", "blocks.0", "blocks.1", "blocks.2"]
ORDER = [0, 1, 2, 3]


class FakeComm:
    """A Communicator as the agreement sees it: rank ``me`` of a group with ``peers``."""

    def __init__(self, me: int, peers: list[int]) -> None:
        self.global_rank, self._peers, self.failure = me, peers, None

    def peers(self) -> list[int]:
        return self._peers

    def break_group(self, err: Exception) -> None:
        if self.failure is None:
            self.failure = err


@pytest.fixture
def store(monkeypatch):
    store = dist.HashStore()
    monkeypatch.setattr(failure, "_default_store", lambda: store)
    monkeypatch.setattr(departure, "GRACE_S", 0.05)
    return store


def _agreement(me: int = 0, peers: tuple[int, ...] = (1,)) -> tuple[OrderAgreement, FakeComm]:
    comm = FakeComm(me, list(peers))
    agreement = OrderAgreement([comm], NAMES, timeout_s=5.0)
    agreement.begin("forward", ORDER)
    return agreement, comm


def _record(store, agreement: OrderAgreement, rank: int, position: int | None, unit: int | None) -> None:
    record = {"pid": 1, "serial": agreement.serial, "kind": "forward", "position": position, "unit": unit}
    store.set(departure._KEY.format(agreement.engine, rank), json.dumps(record))


def test_every_rank_departing_alike_goes_on(store):
    agreement, comm = _agreement()
    _record(store, agreement, 1, 2, 3)
    agreement.declare(2, 3)  # returns: the pass goes on checked
    assert agreement.agreed == {1} and comm.failure is None
    agreement.probe()  # the peer's record of an agreed pass is not a departure from this rank's order


def test_a_peer_on_the_order_makes_the_departure_an_error_on_both(store):
    agreement, comm = _agreement()
    _record(store, agreement, 1, None, None)  # the peer's probe answered: it did not depart
    with pytest.raises(RankMismatchError) as err:
        agreement.declare(2, 3)
    message = str(err.value)
    assert "gather 3 of a forward pass" in message
    assert "rank 0: 'blocks.2'" in message and "rank 1: 'blocks.1' (the order)" in message
    assert comm.failure is err.value  # nothing more is issued on the group


def test_a_probe_names_a_peer_departure_and_answers_it(store):
    agreement, comm = _agreement()
    _record(store, agreement, 1, 1, 3)
    agreement.at = 2  # this rank issued the order's gather 2 ('blocks.0') and waits in it
    agreement.declaring = agreement.serial  # this rank is settling its own departure of the same pass: not yet
    agreement.probe()
    agreement.declaring = None
    store.set(departure._DECIDED_KEY.format(agreement.engine, 1), str(agreement.serial))  # it read the answers
    with pytest.raises(RankMismatchError) as err:
        agreement.probe()
    assert "rank 0: 'blocks.0' (the order)" in str(err.value) and "rank 1: 'blocks.2'" in str(err.value)
    mine = json.loads(store.get(departure._KEY.format(agreement.engine, 0)))
    assert mine["serial"] == agreement.serial and mine["position"] is None  # the answer the departed rank reads
    assert comm.failure is err.value


def test_an_unanswered_peer_is_named_once_another_answer_differs(store):
    agreement, _ = _agreement(peers=(1, 2))
    _record(store, agreement, 1, None, None)
    with pytest.raises(RankMismatchError) as err:
        agreement.declare(2, 3)  # rank 2 never answers: decided GRACE_S after rank 1's answer
    assert "rank 1: 'blocks.1' (the order)" in str(err.value) and "rank 2: no answer" in str(err.value)


def _departed(store, agreement: OrderAgreement, rank: int, position: int | None, unit: int | None) -> None:
    """``rank`` departed at ``position`` and has read the answers (the probing rank does not linger)."""
    _record(store, agreement, rank, position, unit)
    store.set(departure._DECIDED_KEY.format(agreement.engine, rank), str(agreement.serial))


def test_a_departure_further_on_in_the_pass_is_not_a_mismatch_yet(store):
    """The peer departed at gather 3; this rank has issued fewer gathers and waits in another collective (a tensor-
    parallel one, or a gather a third rank holds up): it may depart there alike, so its probe must not raise."""
    agreement, comm = _agreement()
    _departed(store, agreement, 1, 2, 3)
    for issued in (1, 2):  # short of gather 3
        agreement.at = issued
        agreement.probe()
        assert comm.failure is None
    agreement.at = 3  # this rank issued the order's gather 3 ('blocks.1') and waits in it
    with pytest.raises(RankMismatchError) as err:
        agreement.probe()
    assert "gather 3 of a forward pass" in str(err.value), err.value
    assert "rank 0: 'blocks.1' (the order)" in str(err.value) and "rank 1: 'blocks.2'" in str(err.value)
    assert comm.failure is err.value


def test_a_departure_in_a_pass_this_rank_ended_is_a_mismatch(store):
    """The peer's pass ended short (no unit); this rank's ended on the order: it waits beyond the pass."""
    agreement, _ = _agreement()
    _departed(store, agreement, 1, 3, None)
    agreement.at = None
    with pytest.raises(RankMismatchError, match="rank 1: no unit: its pass ended there"):
        agreement.probe()
