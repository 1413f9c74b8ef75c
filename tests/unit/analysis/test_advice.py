"""What to change (issue 67): the verdict from the learner's wait share and the actors' idle share,
with the numbers it is based on; too few steps say so."""

from asyncrl.analysis.advice import advise


def _metrics(n: int, wait_s: float, train_s: float, stale_every: int = 0) -> list[dict]:
    out, t = [], 1000.0
    for i in range(n):
        t += wait_s + train_s
        out.append(
            {
                "step": i + 1,
                "t": t,
                "wait_s": wait_s,
                "train_s": train_s,
                "batch_trajectories": 32,
                "episodes_acked": 8 * (i + 1),
                "dropped_stale": (i // stale_every) * 2 if stale_every else 0,
            }
        )
    return out


def _statuses(t0: float, t1: float, busy: float, actors=("actor-0", "actor-1")) -> list[dict]:
    return [
        {"actor_id": a, "t": t, "up_s": t - t0, "generate_s": busy * (t - t0)}
        for t in (t0, (t0 + t1) / 2, t1)
        for a in actors
    ]


def test_actor_bound_learner_bound_and_stale():
    m = _metrics(20, wait_s=0.8, train_s=0.2)
    a = advise(m, _statuses(m[0]["t"], m[-1]["t"], busy=0.95), {"actor": {"weight_update": "batch"}})
    assert a.verdict == "actor-bound" and "Add actors" in a.lines[0] and "inflight" in a.lines[0]
    assert round(a.numbers["learner_wait_share"], 2) == 0.8 and round(a.numbers["actor_idle_share"], 2) == 0.05

    m = _metrics(20, wait_s=0.01, train_s=0.99)
    a = advise(m, _statuses(m[0]["t"], m[-1]["t"], busy=0.3), {"buffer": {"max_staleness": 1}})
    assert a.verdict == "learner-bound" and "More actors will not help" in a.lines[0] and "(now 1)" in a.lines[0]

    m = _metrics(20, wait_s=0.3, train_s=0.7, stale_every=2)
    a = advise(m, _statuses(m[0]["t"], m[-1]["t"], busy=0.8), {"buffer": {"max_staleness": 1}})
    assert a.verdict == "balanced" and any("dropped as too old" in x and "(now 1)" in x for x in a.lines)
    assert a.numbers["stale_dropped_share"] > 0.1

    assert advise(_metrics(2, 0.5, 0.5), []).verdict == "too early"
    assert advise(_metrics(20, 0.9, 0.1), []).verdict == "balanced"  # no actor status: not blamed on actors


def test_actors_waiting_for_weights_are_told_to_look_at_the_sync():
    m = _metrics(20, wait_s=0.5, train_s=0.5)
    t0, t1 = m[0]["t"], m[-1]["t"]
    statuses = _statuses(t0, t1, busy=0.5)
    for s in statuses:  # half of their time waiting for weights, a quarter generating
        up = s["up_s"]
        s["states"] = {"generating": 0.25 * up, "waiting for weights": 0.5 * up, "waiting for credits": 0.25 * up}
    a = advise(m, statuses, {"buffer": {"max_staleness": 2}})
    assert round(a.numbers["actor_waiting_for_weights_share"], 2) == 0.5
    assert any("waited for new weights 50%" in line and "now 2" in line for line in a.lines)
    for s in statuses:
        s["states"]["waiting for weights"] = 0.0
    a = advise(m, statuses, {})
    assert a.numbers["actor_waiting_for_weights_share"] == 0.0 and not any("new weights" in x for x in a.lines)
    assert "actor_waiting_for_weights_share" not in advise(m, _statuses(t0, t1, busy=0.5), {}).numbers
