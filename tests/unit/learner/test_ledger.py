"""The task ledger (asyncrl.learner.ledger) in process: dealing, first delivery wins, drops dealt
again or counted as used by reason, lost actors' tasks dealt again, and a kill between two
checkpoints: the record is rolled back to the checkpoint and every task of an epoch is still
trained exactly once."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from asyncrl.analysis.ledger import ledger_report, read_ledger
from asyncrl.learner.ledger import TaskLedger, parse_ticket
from asyncrl.types import Episode, Task

N = 10


def _tasks() -> list[Task]:
    return [Task(f"t{i}", [{"role": "user", "content": str(i)}], i) for i in range(N)]


def _ledger(run_dir, requeue=("stale", "rejected")) -> TaskLedger:
    ledger = TaskLedger(_tasks(), None, seed=3, run_dir=run_dir, requeue=list(requeue), grace_s=0.0)
    return ledger


def _actor(name="actor-0", pid=1):
    return SimpleNamespace(identity=f"{name}:{pid}:x".encode(), actor_id=name)


def _episode(dealt, actor="actor-0") -> Episode:
    return Episode(trajectories=[], actor_id=actor, task=dealt.task, ticket=dealt.ticket)


def test_each_task_of_an_epoch_once_duplicates_never_trained_drops_by_reason(tmp_path):
    ledger = _ledger(tmp_path)
    ledger.open_log(0)
    a, b = _actor("actor-0"), _actor("actor-1", 2)
    first = ledger.credit_work(a, 4, 0)["deal"]
    assert [parse_ticket(d.ticket) for d in first] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert len({d.task.id for d in first}) == 4
    eps = [_episode(d) for d in first]
    assert all(ledger.arrived(ep, 0) for ep in eps)
    assert not ledger.arrived(_episode(first[0], "actor-1"), 0)  # the same ticket again: a duplicate
    ledger.dropped(eps[1], "stale", 0)  # dealt again (tasks.requeue)
    ledger.dropped(eps[2], "filtered", 0)  # used
    ledger.after_step([eps[0], eps[3]], None, 0)
    again = ledger.credit_work(b, 2, 1)["deal"]
    assert parse_ticket(again[0].ticket) == (0, 1) and again[0].task.id == first[1].task.id  # requeued first
    assert parse_ticket(again[1].ticket) == (0, 4)
    # an actor that says hello again without a ticket it was dealt: that slot is dealt again
    ledger.hello("actor-1", b.identity, [again[1].ticket], 1)
    assert list(ledger.requeued) == [(0, 1)]
    ledger.close()
    epochs, _ = read_ledger(tmp_path)
    e0 = epochs[0]
    assert sorted(e0.trained) == [0, 3] and dict(e0.used) == {2: ["filtered"]}
    assert e0.requeued == {"stale": 1, "actor_lost": 1} and e0.duplicates == 1 and not e0.twice


def test_a_gone_actors_tasks_are_dealt_again_and_its_late_episode_wins_only_if_first(tmp_path):
    ledger = _ledger(tmp_path)
    ledger.open_log(0)
    gone, other = _actor("actor-0"), _actor("actor-1", 2)
    dealt = ledger.credit_work(gone, 2, 0)["deal"]
    ledger._last_sweep = 0.0
    ledger.sweep({other.identity}, 0)  # actor-0 is not in the table: its slots are dealt again
    redealt = ledger.credit_work(other, 2, 0)["deal"]
    assert [parse_ticket(d.ticket) for d in redealt] == [parse_ticket(d.ticket) for d in dealt]
    assert ledger.arrived(_episode(dealt[0]), 0)  # the old ticket came after all, first: it wins
    assert not ledger.arrived(_episode(redealt[0], "actor-1"), 0)  # the new deal's episode is the duplicate
    assert ledger.arrived(_episode(redealt[1], "actor-1"), 0)
    assert not ledger.arrived(_episode(dealt[1]), 0)


@pytest.mark.parametrize("seed", range(20))
def test_kills_between_checkpoints_roll_the_record_back_and_train_each_task_once(tmp_path, seed):
    """A run driven at random (deal, deliver, drop, train, checkpoint), killed at random points and
    resumed from its last checkpoint (the state a checkpoint holds, the record cut back), many
    times: every closed epoch has each task trained exactly once or counted as used."""
    rng = random.Random(seed)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    ledger, version, saved_version, buffer = _ledger(tmp_path), 0, 0, []
    ledger.open_log(0)
    actor = _actor()
    kills = 0
    for _ in range(400):
        roll = rng.random()
        if roll < 0.35:
            buffer += [_episode(d) for d in ledger.credit_work(actor, rng.randint(1, 4), version).get("deal", [])]
        elif roll < 0.45 and buffer:
            ledger.dropped(buffer.pop(rng.randrange(len(buffer))), rng.choice(["stale", "filtered"]), version)
        elif roll < 0.75 and buffer:
            batch = [buffer.pop(0) for _ in range(min(len(buffer), 3))]
            batch = [ep for ep in batch if ledger.arrived(ep, version)]
            ledger.after_step(batch, None, version)
            version += 1
        elif roll < 0.85:
            ledger.save(ckpt)
            saved_version = version
        elif roll < 0.92:  # SIGKILL: the in-memory state is gone; resume from the checkpoint
            ledger.close()
            ledger = _ledger(tmp_path)
            ledger.load(ckpt, saved_version)
            ledger.open_log(saved_version)
            version, buffer, kills = saved_version, [], kills + 1
            ledger.hello(actor.actor_id, actor.identity, [], version)  # the actor lost its batch too
        else:
            ledger._last_sweep = 0.0
            ledger.sweep({actor.identity}, version)
    ledger.close()
    text, ok = ledger_report(tmp_path)
    assert ok, text
    epochs, resumes = read_ledger(tmp_path)
    assert kills >= 3 and resumes  # (a resume's own record is rolled back by a kill before the next checkpoint)
    closed = [e for e in epochs.values() if e.closed]
    assert closed, text
    for e in closed:
        assert sorted(set(e.trained) | set(e.used)) == list(range(N)), (e.epoch, text)
        assert not e.twice


def test_an_endless_stream_is_drawn_once_and_resolved_positions_are_forgotten(tmp_path):
    """The arithmetic source is one endless epoch: the ledger draws each task once from one stream
    (never from the start again: that made every step slower than the last) and keeps only the
    tasks of unresolved positions."""
    made = []

    def stream():
        made.append(1)
        i = 0
        while True:
            yield Task(f"s{i}", [{"role": "user", "content": str(i)}], i)
            i += 1

    ledger = TaskLedger(None, stream, seed=0, run_dir=tmp_path, requeue=["stale"], grace_s=5.0)
    ledger.open_log(0)
    actor = _actor()
    for v in range(300):
        eps = [_episode(d) for d in ledger.credit_work(actor, 8, v)["deal"]]
        assert [ep.task.id for ep in eps] == [f"s{8 * v + i}" for i in range(8)]
        for ep in eps:
            ledger.arrived(ep, v)
        assert not ledger.arrived(eps[0], v)  # a duplicate of a position: recorded with its task id
        ledger.after_step(eps, None, v)
    ledger.close()
    assert len(made) == 1 and ledger.stream_tasks == {}
    assert ledger.low == {0: 2400} and ledger.done == {0: set()}  # (memory does not grow with the run)
    epochs, _ = read_ledger(tmp_path)
    assert len(epochs[0].trained) == 2400 and epochs[0].duplicates == 300 and not epochs[0].twice
