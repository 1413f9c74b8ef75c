"""Thread counts chosen from the machine (train.threads / actor.threads: auto) and the episode
event detail level (log.episode_events)."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl import config as config_mod
from asyncrl.config import ConfigError, cpu_threads, load_config
from asyncrl.learner.telemetry import Telemetry
from asyncrl.types import Episode, Task, Trajectory


@pytest.mark.parametrize(
    "cores, actors, world, learner, actor",
    [
        (2, 1, 1, 1, 1),  # this machine: one core each
        (1, 1, 1, 1, 1),  # never 0
        (16, 1, 1, 8, 8),
        (16, 3, 1, 8, 2),  # the actors split the other half
        (16, 1, 2, 4, 8),  # a learner group splits its half
        (7, 2, 1, 3, 2),
    ],
)
def test_auto_threads_split_the_usable_cores(monkeypatch, cores, actors, world, learner, actor):
    monkeypatch.setattr(config_mod, "usable_cores", lambda: cores)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    cfg = load_config(None, [f"actor.num={actors}"])
    assert cfg.train.threads == cfg.actor.threads == "auto"
    assert (cpu_threads(cfg, "learner"), cpu_threads(cfg, "actor")) == (learner, actor)


def test_set_threads_win_and_the_actor_share_follows_a_set_learner(monkeypatch):
    monkeypatch.setattr(config_mod, "usable_cores", lambda: 16)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = load_config(None, ["train.threads=12"])
    assert (cpu_threads(cfg, "learner"), cpu_threads(cfg, "actor")) == (12, 4)
    cfg = load_config(None, ["train.threads=3", "actor.threads=5"])
    assert (cpu_threads(cfg, "learner"), cpu_threads(cfg, "actor")) == (3, 5)


@pytest.mark.parametrize("value", ["0", "many", "-2"])
def test_bad_thread_counts_are_refused_at_load(value):
    with pytest.raises(ConfigError, match="train.threads"):
        load_config(None, [f"train.threads={value}"])


class _Log:
    def __init__(self):
        self.events = []

    def event(self, kind, step, **fields):
        self.events.append((kind, fields))

    def metric(self, step, values):
        pass


def _episode(i: int, decision: dict) -> Episode:
    task = Task(id=f"t{i}", prompt=[{"role": "user", "content": "1+1="}], answer=2)
    traj = Trajectory(
        token_ids=np.arange(4),
        loss_mask=np.array([0, 0, 1, 1.0]),
        behavior_logprobs=np.zeros(4),
        policy_version=0,
        reward=1.0,
        task_id=task.id,
        text="2",
    )
    return Episode(trajectories=[traj], actor_id="a", task=task, decision=decision)


@pytest.mark.parametrize(
    "mode, every, expected",
    [
        ("all", 10, list(range(25))),
        # sampled: the 1st, 11th and 21st plain episode (0, 12, 23) and every one with a decision (3, 7, 17)
        ("sampled", 10, [0, 3, 7, 12, 17, 23]),
        ("sampled", 1, list(range(25))),
        ("none", 10, []),
    ],
)
def test_episode_events_follow_the_detail_level(mode, every, expected):
    cfg = load_config(None, [f"log.episode_events={mode}", f"log.episode_events_every={every}", "log.sample_every=0"])
    log = _Log()
    tel = Telemetry(cfg, log, lambda record: None, model=None, tokenizer=None)
    decided = {3, 7, 17}
    eps = [_episode(i, {"kind": "test"} if i in decided else {}) for i in range(25)]
    for start in range(0, 25, 5):  # five steps of five episodes
        tel._log_episodes(start // 5 + 1, eps[start : start + 5], [0] * 5)
    written = [int(f["task_id"][1:]) for kind, f in log.events if kind == "episode"]
    assert written == expected
