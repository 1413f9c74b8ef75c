"""Where each process waits (issue 67): the state clock's spans and totals, the heartbeat that carries
them (a real msgpack round trip, bounds checked), and the shares and lanes the UI draws from a log."""

import time

import pytest

from asyncrl.analysis import RunStore
from asyncrl.analysis.timeline import state_shares, timeline_spans, window
from asyncrl.app import timeline as TL
from asyncrl.timeline import MAX_SPANS, StateClock
from asyncrl.wire.codec import WireError, decode, encode
from asyncrl.wire.messages import Status


def test_the_clock_keeps_spans_totals_and_absorbs_blips():
    clock = StateClock("a", min_span_s=0.05)
    clock.since = t = time.time() - 10.0  # (ten seconds ago: the spans below end before now)
    clock.enter("b", at=t + 1.0)
    clock.enter("c", at=t + 1.01)  # 10 ms of b: drawn as part of a
    clock.enter("a", at=t + 2.0)
    clock.enter("a", at=t + 2.5)  # (the same state: nothing changes)
    spans = clock._spans
    assert [s[0] for s in spans] == ["a", "c"] and spans[0][1:] == [t, t + 1.01] and spans[1][1:] == [t + 1.01, t + 2.0]
    assert clock.totals == pytest.approx({"a": 1.0, "b": 0.01, "c": 0.99})  # the totals stay exact
    assert clock.enter("d", at=t) == "a" and clock.since == t + 2.0  # (never before the current state's start)
    taken, totals = clock.take()
    assert [s[0] for s in taken] == ["a", "c", "d"] and taken[-1][2] >= taken[-1][1] and clock._spans == []
    assert totals["d"] == pytest.approx(taken[-1][2] - taken[-1][1], abs=2e-3)
    clock.put_back(taken)  # (a heartbeat that could not go: they go with the next)
    assert [s[0] for s in clock.take()[0]][:3] == ["a", "c", "d"]
    with clock.during("e"):
        assert clock.state == "e"
    assert clock.state == "d"


def test_the_clock_keeps_at_most_its_bound_between_takes():
    clock = StateClock("x", min_span_s=0.0, max_spans=10)
    clock.since = t = time.time() - 100.0
    for i in range(1, 40):
        clock.enter("x" if i % 2 else "y", at=t + i)
    assert len(clock._spans) == 10 and clock._spans[-1][2] == t + 39
    assert sum(clock.totals.values()) == pytest.approx(39.0)


def test_status_carries_spans_and_refuses_too_many():
    now = time.time()
    body = Status(
        actor_id="a",
        identity="a:1:x",
        capacity=1,
        version=0,
        spans=[("generating", now, now + 1)],
        states={"generating": 1.0},
    )
    got = decode(encode("status", body), kinds=("status",)).body
    assert got.spans == [("generating", now, now + 1)] and got.states == {"generating": 1.0}
    too_many = Status(actor_id="a", identity="a:1:x", capacity=1, version=0, spans=[("g", now, now)] * (MAX_SPANS + 1))
    with pytest.raises(WireError, match="spans"):
        decode(encode("status", too_many), kinds=("status",))


def _store() -> RunStore:
    store = RunStore()
    t = 1000.0
    store.add_events(
        [
            {
                "kind": "timeline",
                "step": 1,
                "t": t + 10,
                "process": "learner",
                "spans": [["training", t, t + 6], ["waiting for episodes", t + 6, t + 10]],
            },
            {
                "kind": "actor_status",
                "step": 1,
                "t": t + 10,
                "actor_id": "actor-0",
                "spans": [
                    ["generating", t + 2, t + 9],
                    ["waiting for credits", t + 9, t + 10],
                    ["bad", t + 3, float("nan")],
                ],
            },
        ]
    )
    return store


def test_shares_and_lanes_from_a_log():
    store = _store()
    spans = timeline_spans(store)
    assert len(spans) == 4 and set(spans["process"]) == {"learner", "actor-0"}  # (the NaN span is left out)
    t_from, t_to = window(spans, minutes=3)
    assert (t_from, t_to) == (1000.0, 1010.0)
    shares = state_shares(spans, t_from, t_to)
    assert shares.loc["learner", "training"] == pytest.approx(0.6)
    assert shares.loc["actor-0", "generating"] == pytest.approx(7 / 8)  # over the time it reported
    cut = state_shares(spans, 1005.0, 1010.0)
    assert cut.loc["learner", "training"] == pytest.approx(0.2)
    html = TL.timeline_html(store)
    assert 'id="timeline-table"' in html and "60.0%" in html and "87.5%" in html
    assert TL.has_timeline(store) and not TL.has_timeline(RunStore())
    assert "No timeline" in TL.timeline_html(RunStore())
    fig = TL.timeline_figure(store)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["learner", "actor-0"]
