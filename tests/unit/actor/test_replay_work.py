"""The actor's side of experience replay: the replay tasks and the withheld set a credit message
carries, checked as they arrive, and the fresh task stream that skips what is withheld."""

from __future__ import annotations

import msgspec
import pytest

from asyncrl.algos.grpo import GRPOWorkflow
from asyncrl.config import load_config
from asyncrl.types import Task


def test_actor_takes_assigned_tasks_and_skips_withheld(capsys):
    from collections import Counter, deque

    from asyncrl.actor.actor import Actor
    from asyncrl.wire.codec import WireError, decode, encode_msg

    a = Actor.__new__(Actor)  # no model or sockets: only the replay bookkeeping of credit messages
    a.cfg, a.actor_id = load_config(None, ["sampling.n=4"]), "actor-0"
    from asyncrl.actor.link import ActorLink

    a.net = ActorLink.__new__(ActorLink)  # (only its report of bad messages)
    a.net.actor_id, a.net.bad = a.actor_id, Counter()
    a.workflow, a.assigned, a.withheld, a.dealt = GRPOWorkflow(a.cfg), deque(), set(), deque()
    a.tasks = iter([Task(i, [{"role": "user", "content": i}], 0) for i in ("x", "y", "z")])
    task = Task("p", [{"role": "user", "content": "1+1="}], 2)
    credit = decode(
        encode_msg(
            "credit",
            n=2,
            min_version=0,
            withhold={"reset": True, "add": ["x", "z"]},
            replay=[
                {"task": msgspec.to_builtins(task), "n": 3, "k": 1},
                {"task": msgspec.to_builtins(task), "n": 9, "k": 1},
            ],
        )
    ).body
    a._on_replay_work(credit)
    assert list(a.assigned) == [(task, 3, 1)]
    assert "replay task 1: n=9, expected at most sampling.n (4)" in capsys.readouterr().out
    with pytest.raises(WireError, match=r"field 'replay\[0\].task': object missing required field 'id'"):
        encode_msg("credit", n=1, min_version=0, replay=[{"task": {}, "n": 3, "k": 1}])  # typed: never sent
    assert a._fresh_task().id == "y"
    a._on_replay_work(decode(encode_msg("credit", n=1, min_version=0, withhold={"remove": ["z"]})).body)
    assert a.withheld == {"x"} and a._fresh_task().id == "z"
