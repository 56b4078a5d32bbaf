"""ZeRO-3's unit-order check issued one unit ahead for prefetches ([Note: unit order check] in runtime/eager.py):
the exchange is not waited for at the moment of the gather, it still precedes every data gather, and a rank whose
path departs from the committed unit still pairs its collectives with the other ranks'."""

import time

import pytest
import torch
import torch.distributed as dist

import shardtrain
from shardtrain.distributed.communicator import Communicator, Handle
from shardtrain.errors import RankMismatchError
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.testing import run_distributed

from helpers.parity import Recipe, make_optimizer

LAYERS = 4


def _engine(check: bool = True, timeout_s: float | None = None):
    """The 4-block GPT at ZeRO-3 with every block a unit, and this rank's batch: ``(model, engine, x, y)``."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=LAYERS, n_head=4))
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_gather_check": check}
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero}
    if timeout_s is not None:
        config["collective_timeout_s"] = timeout_s
    engine = shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, Recipe()))
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    return model, engine, x, torch.roll(x, -1, 1)


def _exchanges(engine) -> int:
    """Unit-id exchanges issued so far."""
    return engine.comm_stats().get("gather_check", {}).get("calls", 0)


def _train(engine, x, y, steps: int) -> None:
    for _ in range(steps):
        engine.backward(engine(x, y))
        engine.step()


def _events(check: bool, spied: int = 1, steps: int = 3) -> dict:
    """Collectives issued, unit-id exchanges waited for and blocks computed, in order, during step ``spied``; and
    the unit-id exchanges of each step."""
    model, engine, x, y = _engine(check)
    events: list[tuple[str, str]] = []
    all_gather, wait = Communicator.all_gather, Handle.wait

    def spy_all_gather(self, out, inp, *, what, async_op=False, kind="all_gather"):
        if kind in ("all_gather", "gather_check"):
            events.append((kind, what.split("'")[1]))
        return all_gather(self, out, inp, what=what, async_op=async_op, kind=kind)

    def spy_wait(self):
        if self.kind == "gather_check" and self._work is not None:
            events.append(("check waited", self.what.split("'")[1]))
        return wait(self)

    # compute markers: registered after the runtime's hooks, so they run after its gathers and prefetches; a block's
    # backward pre-hook runs before autograd unpacks what the block saved (which gathers for backward)
    model.tok.register_forward_pre_hook(lambda *_: events.append(("compute", "tok")))
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda *_, i=i: events.append(("compute", f"blocks.{i}")))
        block.register_full_backward_pre_hook(lambda *_, i=i: events.append(("compute", f"blocks.{i} backward")))
    losses, exchanges = [], []
    for step in range(steps):
        if step == spied:
            Communicator.all_gather, Handle.wait = spy_all_gather, spy_wait
        before = _exchanges(engine)
        try:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        finally:
            Communicator.all_gather, Handle.wait = all_gather, wait
        losses.append(loss.item())
        exchanges.append(_exchanges(engine) - before)
    gathers = sum(u.gathers for u in engine._runtime.units)
    return {"events": events, "losses": losses, "gathers": gathers, "exchanges": exchanges}


def test_prefetch_checks_are_issued_one_unit_ahead_and_still_precede_their_gathers():
    """The second step: its passes follow the first's order, not yet trusted (that takes two alike), so every gather
    is checked, prefetches one unit ahead."""
    on, off = run_distributed(_events, 2, True), run_distributed(_events, 2, False)
    assert on[0]["losses"] == off[0]["losses"]  # the check moves no number
    assert on[0]["gathers"] == off[0]["gathers"]
    for r in on:
        events = r["events"]
        gathers = [(i, unit) for i, (kind, unit) in enumerate(events) if kind == "all_gather"]
        checks = [(i, unit) for i, (kind, unit) in enumerate(events) if kind == "gather_check"]
        # one exchange per data gather, each issued and waited for before its gather, in the same order
        assert [u for _, u in checks] == [u for _, u in gathers], events
        assert all(c < g for (c, _), (g, _) in zip(checks, gathers)), events
        waited = [i for i, (kind, _) in enumerate(events) if kind == "check waited"]
        assert len(waited) == len(gathers) and all(c < w < g for (c, _), w, (g, _) in zip(checks, waited, gathers))
        # a prefetch's exchange is issued a block's compute before it is waited for; only the gathers a pass starts
        # from (the root, the first prefetch of forward and of backward) wait at once
        ahead = [u for (c, u), w in zip(checks, waited) if any(k == "compute" for k, _ in events[c:w])]
        assert ahead == ["blocks.1", "blocks.2", "blocks.3", "blocks.1", "blocks.0"], events  # forward, backward
        at_once = [u for (c, u), w in zip(checks, waited) if w == c + 1]
        assert at_once == ["<root>", "blocks.0", "blocks.2"], events  # root, forward's first, backward's first


def test_trusted_passes_gather_without_exchanges_and_move_no_number():
    """Once two passes of a kind gathered alike, the next ones issue their gathers without any exchange (no host
    rendezvous per gather), and the numbers are those without the check, bitwise."""
    on, off = run_distributed(_events, 2, True, 4, 6), run_distributed(_events, 2, False, 4, 6)
    assert on[0]["losses"] == off[0]["losses"] and on[0]["gathers"] == off[0]["gathers"]
    for r in on:
        # every gather of the first steps is checked (17 a step: the root, 4 blocks forward, 3 backward... see the
        # spied second step above); from the fourth step on, none
        assert r["exchanges"][0] > 0 and r["exchanges"][1] > 0, r["exchanges"]
        assert r["exchanges"][3:] == [0, 0, 0], r["exchanges"]
        gathers = [u for kind, u in r["events"] if kind == "all_gather"]
        assert gathers == [u for kind, u in off[0]["events"] if kind == "all_gather"] and len(gathers) > 0
        assert not any(kind.startswith("check") or kind == "gather_check" for kind, _ in r["events"]), r["events"]


def _departs_from_the_committed_unit(rank_departs: int, steady: int = 2, again: bool = False) -> str:
    """Steady training, then one rank runs its blocks in reverse order: its first block is not the one whose
    exchange was issued ahead. Both ranks must fail at once with the units named, not hang or abort in gloo.
    ``again``: the error caught, every rank calls the engine once more (the error of that call follows a newline)."""
    model, engine, x, y = _engine(timeout_s=20)
    _train(engine, x, y, steady)
    if dist.get_rank() == rank_departs:
        model.blocks = torch.nn.ModuleList(list(model.blocks)[::-1])
    try:
        engine.backward(engine(x, y))
        engine.step()
    except RankMismatchError as err:
        if not again:
            return str(err)
        try:
            engine(x, y)
        except RankMismatchError as then:
            return f"{err}\n{then}"
        return f"{err}\nno error"
    return "no error"


@pytest.mark.parametrize("steady", [1, 4])
@pytest.mark.parametrize("rank_departs", [0, 1])
def test_a_rank_departing_from_the_order_fails_naming_both_units(rank_departs, steady):
    """After 1 step (the second is checked: [Note: unit order check]) and after 4 (trusted: [Note: departures from a
    trusted order]), one rank runs its blocks in reverse: both ranks fail at once naming the units, never hang or
    abort."""
    t0 = time.monotonic()
    for message in run_distributed(_departs_from_the_committed_unit, 2, rank_departs, steady, timeout=120):
        assert "ranks are gathering different ZeRO-3 units" in message, message
        if steady == 1:
            # the departing rank first honoured the committed gather of blocks.1, then checked its own blocks.3
            # against the exchange the other rank had issued ahead for blocks.2
            assert f"rank {rank_departs}: 'blocks.3'" in message and f"rank {1 - rank_departs}: 'blocks.2'" in message
        else:
            # trusted: gathers 1-2 (the root, blocks.0 prefetched) were the order's on both; at gather 3 the
            # departing rank needs blocks.3 where the order (the other rank) has blocks.1
            assert "gather 3 of a forward pass" in message, message
            assert f"rank {rank_departs}: 'blocks.3'" in message, message
            assert f"rank {1 - rank_departs}: 'blocks.1' (the order)" in message, message
    assert time.monotonic() - t0 < 20  # well inside the collective timeout (20 s): named, not timed out


def _departs_at_world(rank_departs: int) -> str:
    return _departs_from_the_committed_unit(rank_departs, 4)


def test_a_rank_departing_from_a_trusted_order_at_world_3_fails_on_every_rank():
    """Two ranks on the order (each blocked in the order's gather, each answering through its wait probe), one
    departing: all three fail naming the departing rank's unit and the order's."""
    for rank, message in enumerate(run_distributed(_departs_at_world, 3, 1, timeout=120)):
        assert "ranks are gathering different ZeRO-3 units" in message, message
        assert "rank 1: 'blocks.3'" in message, message
        # the departing rank decides a second after the first answer that differs: a slow rank may not have answered
        others = ["rank 0: 'blocks.1' (the order)", "rank 2: 'blocks.1' (the order)"]
        if rank == 1:
            assert any(o in message for o in others), message
            assert all(o in message or o.split(":")[0] + ": no answer" in message for o in others), message
        else:
            assert all(o in message for o in others), message


def _backward_ends_short(rank_departs: int) -> str:
    """Trusted steps, then the same forward on every rank, but one rank's loss no longer reaches the first blocks
    (their output is detached there): its backward gathers fewer units than the order. The reducer would then launch
    the buckets left over, collectives the other rank (waiting in the order's next gather) never pairs."""
    model, engine, x, y = _engine(timeout_s=20)
    _train(engine, x, y, 4)
    if dist.get_rank() == rank_departs:
        model.blocks[1].register_forward_hook(lambda _m, _a, out: out.detach())
    try:
        engine.backward(engine(x, y))
        engine.step()
    except RankMismatchError as err:
        return str(err)
    return "no error"


def test_a_trusted_backward_that_ends_short_on_one_rank_fails_before_the_leftover_reductions():
    """The rank whose trusted backward ends short settles it before the reducer launches what is left ([Note:
    departures from a trusted order]): every rank fails naming the pass's end and the order's unit, well inside the
    collective timeout, instead of both waiting in collectives that never pair."""
    t0 = time.monotonic()
    for message in run_distributed(_backward_ends_short, 2, 1, timeout=120):
        assert "ranks are gathering different ZeRO-3 units" in message and "of a backward pass" in message, message
        assert "rank 1: no unit: its pass ended there" in message, message
        assert "rank 0: 'blocks." in message and "(the order)" in message, message
    assert time.monotonic() - t0 < 20  # the collective timeout (20 s): named, not timed out


def _departs_then_calls_again(rank_departs: int) -> str:
    return _departs_from_the_committed_unit(rank_departs, 4, again=True)


def test_after_a_trusted_departure_no_collective_is_issued_on_the_broken_group():
    """After the error, the unmatched gather of the ranks on the order is still in flight on the group; another
    collective there (the next call's phase check, over the same gloo group) would meet it instead of its peers'
    and abort the process in gloo: it is refused on every rank ([Note: no collective after a failure])."""
    for message in run_distributed(_departs_then_calls_again, 2, 1, timeout=120):
        first, then = message.split("\n")
        assert "ranks are gathering different ZeRO-3 units" in first, first
        assert "not issued, since an earlier collective of this group failed" in then, then
        assert "ranks are gathering different ZeRO-3 units" in then, then


def _one_rank_steps_inside_an_except_clause(steps: int, inside: bool = True) -> dict:
    """Rank 1 runs its third step from inside an ``except`` clause (the exception handled is its caller's, not the
    pass's; ``inside=False``: as the others do); the losses and the unit-id exchanges of each step."""
    _, engine, x, y = _engine(timeout_s=20)
    losses, exchanges = [], []

    def train_step() -> None:
        before = _exchanges(engine)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        exchanges.append(_exchanges(engine) - before)

    for step in range(steps):
        if inside and step == 2 and dist.get_rank() == 1:
            try:
                raise KeyError("a batch this rank skipped")
            except KeyError:
                train_step()
        else:
            train_step()
    return {"losses": losses, "exchanges": exchanges}


def test_a_step_run_inside_an_except_clause_is_not_an_unwinding_pass():
    """A pass ends while an exception unwinds it only if that exception is not the one its caller was handling when
    the pass began: else the rank would drop its trusted order alone and check its next gathers with exchanges while
    the others issue their data gathers (gloo pairs the two and aborts)."""
    inside = run_distributed(_one_rank_steps_inside_an_except_clause, 2, 5, timeout=120)
    plain = run_distributed(_one_rank_steps_inside_an_except_clause, 2, 5, False, timeout=120)
    for r, p in zip(inside, plain, strict=True):
        assert r == p, (r, p)  # the same losses, bitwise, and the same exchanges
        assert r["exchanges"][3:] == [0, 0], r  # trusted on both ranks from the fourth step on, as without it
