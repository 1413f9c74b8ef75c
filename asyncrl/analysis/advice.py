"""What to change, from a run's measured rates (issue 67): which side holds the run back, in plain
words, with the numbers it is based on.

Over the logged steps of the last ``window_s`` seconds (default 30; at least the last 3 steps):
- the learner's *wait share*: time waiting for episodes over its step time (``wait_s`` against
  ``wait_s + train_s``);
- each actor's *idle share* over the same span: 1 - (generating time / time up) between its first
  and last status in the span (its heartbeat's ``generate_s`` and ``up_s``);
- the share of delivered episodes dropped as too old (``dropped_stale`` against ``episodes_acked``);
- each actor's share of its time waiting for weights its credits need (the heartbeat's ``states``:
  seconds per state, :mod:`asyncrl.timeline`).

The verdicts:
- **actor-bound**: the learner waits most of the time (>= 50%) while the actors generate most of
  theirs (idle < 30%): add actors (each makes about the samples/s measured), or make a rollout
  cheaper; with ``actor.weight_update: batch``, in-flight updates keep actors generating across a
  weight update;
- **learner-bound**: the learner hardly waits (< 20%) while the actors sit idle (>= 40%): more actors
  will not help; a faster learner will (its processes, micro-batch size, shorter rows), or a larger
  ``buffer.max_staleness`` lets actors run further ahead (more credits in flight);
- **staleness**: more than 10% of delivered episodes were dropped as stale: raise
  ``buffer.max_staleness`` (or make actors faster, so that fewer arrive late);
- **weight sync**: the actors waited for new weights more than 20% of their time: the sync is slow
  for this step rate (``sync.every``, a faster ``sync.type``), or a larger ``buffer.max_staleness``
  lets them start on older weights;
- otherwise **balanced**.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

WAIT_ACTOR_BOUND, IDLE_ACTOR_BOUND = 0.5, 0.3
WAIT_LEARNER_BOUND, IDLE_LEARNER_BOUND = 0.2, 0.4
STALE_DROPPED = 0.1
WAITING_FOR_WEIGHTS = 0.2


@dataclass
class Advice:
    verdict: str  # actor-bound, learner-bound, balanced, or "too early"
    lines: list[str] = field(default_factory=list)  # what to change, in plain words, with its numbers
    numbers: dict[str, float] = field(default_factory=dict)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and x == x  # (not None, not NaN: a metrics frame's missing value)


def _count(m: dict, key: str) -> float:
    x = m.get(key)
    return float(x) if _number(x) else 0.0


def _actor_idle(statuses: list[dict], t_from: float) -> dict[str, float]:
    """Each actor's idle share over its statuses since ``t_from`` (unix time)."""
    by_actor: dict[str, list[dict]] = {}
    for s in statuses:
        if s.get("t", 0) >= t_from and s.get("up_s") is not None:
            by_actor.setdefault(s.get("actor_id", "?"), []).append(s)
    out = {}
    for actor, ss in by_actor.items():
        first, last = ss[0], ss[-1]
        up = float(last.get("up_s", 0)) - float(first.get("up_s", 0))
        gen = float(last.get("generate_s", 0)) - float(first.get("generate_s", 0))
        if up > 0:
            out[actor] = min(max(1.0 - gen / up, 0.0), 1.0)
    return out


def _state_share(statuses: list[dict], t_from: float, state: str) -> float | None:
    """The actors' mean share of their time in ``state`` since ``t_from`` (from the cumulative
    ``states`` of their first and last status there); None when no actor reports states."""
    by_actor: dict[str, list[dict]] = {}
    for s in statuses:
        if s.get("t", 0) >= t_from and isinstance(s.get("states"), dict) and s.get("states"):
            by_actor.setdefault(s.get("actor_id", "?"), []).append(s)
    shares = []
    for ss in by_actor.values():
        first, last = ss[0]["states"], ss[-1]["states"]
        total = sum(float(v) for v in last.values()) - sum(float(v) for v in first.values())
        if total > 0:
            shares.append((float(last.get(state, 0.0)) - float(first.get(state, 0.0))) / total)
    return float(np.mean(shares)) if shares else None


def _window(metrics: list[dict], window_s: float) -> list[dict]:
    """The steps with timings logged in the last ``window_s`` seconds, at least the last 3."""
    usable = [m for m in metrics if _number(m.get("train_s")) and _number(m.get("wait_s"))]
    if not usable:
        return []
    end = usable[-1].get("t", 0.0)
    recent = [m for m in usable if m.get("t", 0.0) >= end - window_s]
    return recent if len(recent) >= 3 else usable[-3:]


def advise(metrics: list[dict], statuses: list[dict], config: dict | None = None, window_s: float = 30.0) -> Advice:
    """:class:`Advice` from the run's metrics lines and ``actor_status`` events (module docstring)."""
    config = config or {}
    rows = _window(metrics, window_s)
    if len(rows) < 3:
        return Advice("too early", ["Fewer than 3 steps logged: nothing to judge yet."])
    wait = float(sum(m["wait_s"] for m in rows))
    train = float(sum(m["train_s"] for m in rows))
    wait_share = wait / max(wait + train, 1e-9)
    span_from = rows[0].get("t", 0.0)
    idle = _actor_idle(statuses, span_from)
    idle_mean = float(np.mean(list(idle.values()))) if idle else float("nan")
    acked = _count(rows[-1], "episodes_acked") - _count(rows[0], "episodes_acked")
    stale = _count(rows[-1], "dropped_stale") - _count(rows[0], "dropped_stale")
    stale_share = stale / acked if acked > 0 else 0.0
    seconds = max(rows[-1].get("t", 0.0) - span_from, 1e-9)
    samples = sum(_count(m, "batch_trajectories") for m in rows[1:])
    per_actor = samples / seconds / max(len(idle), 1)
    numbers = {
        "steps": float(len(rows)),
        "learner_wait_share": wait_share,
        "actor_idle_share": idle_mean,
        "actors": float(len(idle)),
        "stale_dropped_share": stale_share,
        "samples_per_s_per_actor": per_actor,
    }
    said = f"over the last {len(rows)} steps the learner waited for episodes {wait_share:.0%} of its time" + (
        f"; the {len(idle)} actor(s) were idle {idle_mean:.0%} of theirs" if idle else "; no actor status yet"
    )
    lines: list[str] = []
    staleness = (config.get("buffer") or {}).get("max_staleness")
    if stale_share > STALE_DROPPED:
        lines.append(
            f"{stale_share:.0%} of the delivered episodes were dropped as too old: raise buffer.max_staleness"
            + (f" (now {staleness})" if staleness is not None else "")
            + ", or make the actors faster so that fewer arrive late."
        )
    waiting = _state_share(statuses, span_from, "waiting for weights")
    if waiting is not None:
        numbers["actor_waiting_for_weights_share"] = waiting
        if waiting > WAITING_FOR_WEIGHTS:
            lines.append(
                f"The actors waited for new weights {waiting:.0%} of their time: the weight sync is slow for this "
                "step rate (sync.every, a faster sync.type), or a larger buffer.max_staleness"
                + (f" (now {staleness})" if staleness is not None else "")
                + " lets them start on older weights."
            )
    verdict, line = _verdict(wait_share, idle_mean if idle else None, per_actor, said, config)
    lines.insert(0, line)
    return Advice(verdict, lines, numbers)


def _verdict(wait_share: float, idle_mean: float | None, per_actor: float, said: str, config: dict) -> tuple[str, str]:
    """The verdict and its line (module docstring); ``idle_mean`` None: no actor status yet."""
    idle = idle_mean is not None
    staleness = (config.get("buffer") or {}).get("max_staleness")
    if idle and wait_share >= WAIT_ACTOR_BOUND and idle_mean < IDLE_ACTOR_BOUND:
        verdict = "actor-bound"
        mode = (config.get("actor") or {}).get("weight_update", "batch")
        line = (
            f"Actor-bound: {said}. Add actors (each makes about {per_actor:.1f} samples/s here), or make a "
            "rollout cheaper (sampling.max_new_tokens, sampling.n)"
            + (
                "; actor.weight_update=inflight keeps actors generating across weight updates."
                if mode == "batch"
                else "."
            )
        )
    elif idle and wait_share < WAIT_LEARNER_BOUND and idle_mean >= IDLE_LEARNER_BOUND:
        verdict = "learner-bound"
        line = (
            f"Learner-bound: {said}. More actors will not help. A faster learner will (more learner processes, "
            "a larger train.micro_batch_tokens, shorter rows), or a larger buffer.max_staleness"
            + (f" (now {staleness})" if staleness is not None else "")
            + " lets the actors run further ahead."
        )
    else:
        verdict = "balanced"
        line = f"Balanced: {said}. Nothing to change for throughput."
    return verdict, line
