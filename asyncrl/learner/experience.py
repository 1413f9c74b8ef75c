"""Experience replay on the learner (ExGRPO, Zhan et al. 2025; the reference design in docs/algorithms/replay.md): the ExperiencePool.

State (the reference design's ``difficulty2task_dict``, ``task2trajectories`` and ``skip_uid_set``):

- ``buckets``: success count -> task ids. It indexes the pool: every pooled task lives
  in exactly one bucket, keyed by its latest on-policy success count, and moves when that changes.
- ``stored``: task id -> stored successful trajectories, each with its recorded learner
  log-probs (``Trajectory.recorded_logprobs``, per token, NaN where none was recorded), its response
  mask (``loss_mask``), the policy version that generated it (``policy_version``), the version whose
  log-probs were recorded (``metadata['recorded_version']``) and its mean token entropy
  (``metadata['entropy']``).
- ``solved``: tasks whose fresh rollouts were all successful. They leave the pool and the
  buckets, are withheld from the actors' fresh task streams, and come back out of the set as soon as
  a later group of theirs is not fully solved.

A task enters the pool only when ``experience_lbound < successes < experience_rbound``; its best
successful trajectory by entropy (``exp_select_mode``) is stored. Once pooled it stays (moving
between buckets) until it is fully solved: a task the policy now fails is exactly where replaying an
old success helps.

Async flow: the learner hands replay tasks to actors with their work credits (``assign``); an actor
generates ``n - k`` fresh rollouts for one; when its episode is taken for training, ``attach`` adds
``k`` stored trajectories (``is_replay``, recorded log-probs, ``exp_mask`` = the assistant tokens)
to the same GRPO group before advantages are computed. After the learner's log-prob pass, ``record``
updates buckets, skip set and pool from the batch's fresh rollouts (the reference design's step [8]).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import msgspec
import numpy as np

from ..types import Episode, Task, Trajectory, new_id
from .ingest.staleness import StalenessPolicy

STATE_FILE = "replay.json"
POOL_FILE = "replay_pool.bin"
STATE_FORMAT = 1


# ----------------------------------------------------------------------------------------------
# log-prob alignment (seed 6.4)


# checkpoints written before the state took the project's names (the reference design's names)
_OLD_KEYS = {"difficulty2task_dict": "buckets", "task2trajectories": "stored", "skip_uid_set": "solved"}


def compact_logprobs(token_logprobs: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    """The reference design's storage form: the values at generated positions (``loss_mask == 1``), in order.

    ``token_logprobs[T]`` and ``loss_mask[T]`` are aligned to the trajectory's tokens.
    """
    return np.asarray(token_logprobs, dtype=np.float32)[np.asarray(loss_mask).astype(bool)]


def align_recorded_logprobs(recorded: np.ndarray | list | None, loss_mask: np.ndarray) -> np.ndarray:
    """Per-token recorded log-probs ``[T]`` from the compact list of a trajectory's generated tokens.

    The ``i``-th recorded value goes to the ``i``-th position with ``loss_mask == 1``. As the reference design
    says: a longer list is truncated; a shorter one leaves the remaining generated positions without
    a recorded value (NaN here; the trainer uses the current policy's old log-prob there); a missing
    list (None) leaves every generated position without one. Positions that are not generated hold 0.
    """
    mask = np.asarray(loss_mask).astype(bool)
    out = np.zeros(mask.shape[0], dtype=np.float32)
    idx = np.flatnonzero(mask)
    out[idx] = np.nan
    if recorded is None:
        return out
    vals = np.asarray(recorded, dtype=np.float32).reshape(-1)[: len(idx)]
    out[idx[: len(vals)]] = vals
    return out


def rows_to_tokens(row: np.ndarray, n: int) -> np.ndarray:
    """A batch row over target positions (``row[j]`` scores token ``j + 1``) -> per token ``[n]``."""
    out = np.zeros(n, dtype=np.float32)
    if n > 1:
        out[1:n] = np.asarray(row[: n - 1], dtype=np.float32)
    return out


def mean_entropy(token_entropy: np.ndarray, loss_mask: np.ndarray) -> float:
    """Mean entropy over the generated tokens (0 when there are none)."""
    sel = np.asarray(token_entropy, dtype=np.float64)[np.asarray(loss_mask).astype(bool)]
    return float(sel.mean()) if sel.size else 0.0


# ----------------------------------------------------------------------------------------------


class ExperiencePool:
    """The replay pool and its bookkeeping. ``cfg`` is a ``ReplayConfig``; ``n`` is ``sampling.n``."""

    def __init__(self, cfg, n: int, total_steps: int, staleness: StalenessPolicy, seed: int = 0):
        self.cfg = cfg
        self.n = int(n)
        self.k = int(cfg.offpolicy_trajectories_per_task)
        self.total_steps = int(total_steps)
        self.staleness = staleness
        self.lbound = int(cfg.experience_lbound)
        self.rbound = int(cfg.experience_rbound if cfg.experience_rbound is not None else n)
        self.buckets: dict[int, list[str]] = {}
        self.stored: dict[str, list[Trajectory]] = {}
        self.solved: set[str] = set()
        self.tasks: dict[str, dict[str, Any]] = {}  # task id -> a pooled Task as builtins (msgspec.to_builtins)
        self.active = False
        self.rng = random.Random(seed * 7_919 + 17)
        self._ratio_carry = 0.0
        self._outstanding: dict[str, int] = {}  # task id -> version it was assigned at
        self._step_stats: dict[str, float] = {}

    # ------------------------------------------------------------------ the reference design's operations
    def bucket_of(self, task_id: str) -> int | None:
        for d, ids in self.buckets.items():
            if task_id in ids:
                return d
        return None

    def _remove_from_buckets(self, task_id: str) -> None:
        for d in list(self.buckets):
            ids = self.buckets[d]
            if task_id in ids:
                ids.remove(task_id)
                if not ids:
                    del self.buckets[d]

    def move_to_bucket(self, task_id: str, successes: int) -> None:
        """Put ``task_id`` in the bucket of ``successes``, moving it out of its old one."""
        old = self.bucket_of(task_id)
        if old == successes:
            return
        if old is not None:
            self._remove_from_buckets(task_id)
        self.buckets.setdefault(int(successes), []).append(task_id)

    def _drop_task(self, task_id: str) -> None:
        self._remove_from_buckets(task_id)
        self.stored.pop(task_id, None)
        self.tasks.pop(task_id, None)

    def update_solved(self, groups: dict[str, list[Trajectory]]) -> list[Trajectory]:
        """Seed 3.1.5 plus the bucket update (2.5). ``groups``: task id -> that task's fresh rollouts
        in this batch, each with ``metadata['entropy']``. Fully solved tasks go into the skip set
        (and out of pool and buckets); a skipped task that is not fully solved comes back out;
        pooled tasks move bucket; for each task within the bounds the best successful trajectory
        by entropy is returned, to be saved with :meth:`store`."""
        to_save = []
        for task_id, trajs in groups.items():
            if not trajs:
                continue
            succ = [t for t in trajs if self.is_success(t)]
            s = len(succ)
            if s == len(trajs):  # every fresh rollout correct: fully solved
                self.solved.add(task_id)
                self._drop_task(task_id)
                continue
            self.solved.discard(task_id)
            pooled = task_id in self.stored
            if pooled:
                self.move_to_bucket(task_id, s)
            if self.lbound < s < self.rbound and succ:
                to_save.append(self._select_best(succ))
                if not pooled:
                    self.move_to_bucket(task_id, s)
        return to_save

    def _tidy(self) -> None:
        """Keep buckets == pool: a pooled task has its task dict and a bucket, a bucketed task has
        stored trajectories (a task without a Task to hand to actors cannot be replayed)."""
        for tid in list(self.stored):
            if tid not in self.tasks or not self.stored[tid]:
                self._drop_task(tid)
        for d in list(self.buckets):
            ids = [t for t in self.buckets[d] if t in self.stored]
            if ids:
                self.buckets[d] = ids
            else:
                del self.buckets[d]

    def _select_best(self, succ: list[Trajectory]) -> Trajectory:
        mode = self.cfg.exp_select_mode
        if mode == "argmin":
            return min(succ, key=lambda t: t.metadata.get("entropy", math.inf))
        if mode == "argmax":
            return max(succ, key=lambda t: t.metadata.get("entropy", -math.inf))
        return self.rng.choice(succ)

    def store(self, trajectories: list[Trajectory]) -> None:
        """Seed 3.1.3: append, or when the task's list is full replace by ``exp_select_mode``."""
        cap = self.cfg.max_trajectories_per_task
        for traj in trajectories:
            stored = self.stored.setdefault(traj.task_id, [])
            if len(stored) < cap:
                stored.append(traj)
                continue
            ents = [t.metadata.get("entropy", math.inf) for t in stored]
            e = traj.metadata.get("entropy", math.inf)
            mode = self.cfg.exp_select_mode
            if mode == "argmin":
                if e < max(ents):
                    stored[ents.index(max(ents))] = traj
            elif mode == "argmax":
                if e > min(ents):
                    stored[ents.index(min(ents))] = traj
            else:  # FIFO
                stored.pop(0)
                stored.append(traj)

    def stored_copies(self, task_id: str, num: int, group_id: str) -> list[Trajectory]:
        """Up to ``num`` stored trajectories of ``task_id`` as replay trajectories in ``group_id``
        (each in a group of its own with ``isolate_replay_groups``).

        ``replay.retrieval``: ``top_k`` (ours) takes the ``num`` lowest-entropy ones (argmin), the
        highest (argmax) or a random sample without replacement (random); ``sample`` (the reference
        design: its sort by entropy is followed by ``random.choices``, so the order does not matter)
        draws ``min(num, stored)`` uniformly with replacement, whatever ``exp_select_mode``."""
        avail = list(self.stored.get(task_id, []))
        if not avail or num <= 0:
            return []
        mode = self.cfg.exp_select_mode
        if getattr(self.cfg, "retrieval", "top_k") == "sample":
            chosen = self.rng.choices(avail, k=min(num, len(avail)))
        elif mode == "argmin":
            chosen = sorted(avail, key=lambda t: t.metadata.get("entropy", math.inf))[:num]
        elif mode == "argmax":
            chosen = sorted(avail, key=lambda t: -t.metadata.get("entropy", -math.inf))[:num]
        else:
            chosen = self.rng.sample(avail, min(num, len(avail)))
        out = []
        for s in chosen:
            gid = f"replay:{new_id()}" if self.cfg.isolate_replay_groups else group_id
            out.append(make_replay_trajectory(s, gid))
        return out

    def sample_tasks(self, num: int, exclude: set[str] | None = None) -> list[str]:
        """Up to ``num`` distinct pooled task ids: per task, a bucket is drawn (uniformly among the
        non-empty ones, or by ExGRPO's Gaussian weight over its success rate), then a task in it."""
        exclude = exclude or set()
        avail = {
            d: [t for t in ids if t not in exclude and self.stored.get(t) and t in self.tasks]
            for d, ids in self.buckets.items()
        }
        avail = {d: ids for d, ids in avail.items() if ids}
        out: list[str] = []
        while len(out) < num and avail:
            buckets = sorted(avail)
            if self.cfg.bucket_sampling == "gaussian":
                w = [self.bucket_weight(d) for d in buckets]
                d = self.rng.choices(buckets, weights=w, k=1)[0]
            else:
                d = self.rng.choice(buckets)
            tid = self.rng.choice(avail[d])
            out.append(tid)
            avail[d].remove(tid)
            if not avail[d]:
                del avail[d]
        return out

    def bucket_weight(self, successes: int) -> float:
        """ExGRPO's bucket weight: a Gaussian over the success rate ``s / n`` centred at 0.5."""
        x = successes / self.n
        return math.exp(-((x - 0.5) ** 2) / (2 * self.cfg.bucket_sigma**2))

    def is_success(self, t: Trajectory) -> bool:
        return float(t.reward) >= self.cfg.success_threshold

    # ------------------------------------------------------------------ learner integration
    def maybe_activate(self, version: int, solve_rate: float | None = None) -> bool:
        if not self.active:
            if self.cfg.start == "progress":
                self.active = version >= self.cfg.replay_start_ratio * self.total_steps
            elif solve_rate is not None and solve_rate >= self.cfg.start_solve_rate:
                self.active = True
        return self.active

    def assign(self, credits: int, version: int) -> list[dict[str, Any]]:
        """Replay tasks for ``credits`` new units of work: ``exp_ratio`` of them (fractions carried
        over between grants), as many as the pool can give. Each is ``{"task", "n", "k"}``: the
        task dict, its fresh rollouts ``n - k`` and the ``k`` trajectories that will be replayed."""
        self.maybe_activate(version)
        if not self.active or credits <= 0 or self.cfg.exp_ratio <= 0:
            return []
        self._ratio_carry += self.cfg.exp_ratio * credits
        want = min(credits, int(self._ratio_carry + 1e-9))
        self._ratio_carry -= want
        horizon = version - (self.staleness.max_staleness + 2)
        self._outstanding = {t: v for t, v in self._outstanding.items() if v >= horizon}
        out = []
        for tid in self.sample_tasks(want, exclude=set(self._outstanding)):
            k = min(self.k, len(self.stored[tid]))
            self._outstanding[tid] = version
            out.append({"task": self.tasks[tid], "n": self.n - k, "k": k})
        return out

    def withheld_update(self, sent: set[str] | None) -> tuple[dict[str, Any], set[str]]:
        """Skip-set changes for an actor that was last sent ``sent`` (None: never): the credit
        message fields and the new ``sent``."""
        if not self.cfg.withhold_solved:
            return {}, set() if sent is None else sent
        cur = self.solved
        if sent is None:
            return {"withhold_reset": True, "withhold_add": sorted(cur)}, set(cur)
        add, remove = sorted(cur - sent), sorted(sent - cur)
        body = {}
        if add:
            body["withhold_add"] = add
        if remove:
            body["withhold_remove"] = remove
        return body, set(cur)

    def attach(self, episodes: list[Episode]) -> int:
        """Add the replayed trajectories to every replay-task episode (its ``decision['replay']``
        holds ``k``), in the group of its fresh rollouts. Returns how many were added."""
        added = 0
        for ep in episodes:
            info = ep.decision.get("replay") if isinstance(ep.decision, dict) else None
            fresh = [t for t in ep.trajectories if not t.is_replay]
            if not isinstance(info, dict) or not fresh:
                continue
            task_id = fresh[0].task_id
            self._outstanding.pop(task_id, None)
            k = int(info.get("k", self.k))
            replayed = self.stored_copies(task_id, k, fresh[0].group_id)
            info["replayed"] = len(replayed)
            ep.trajectories.extend(replayed)
            added += len(replayed)
        return added

    def record(
        self, episodes: list[Episode], logprobs: np.ndarray | None, entropy: np.ndarray | None, version: int
    ) -> dict[str, float]:
        """The reference design's step [8] after the learner's log-prob pass over ``episodes``' trajectories.

        ``logprobs``/``entropy``: ``[B, T-1]`` rows in the batch order (every trajectory of every
        episode, replayed ones included), aligned as ``TrainBatch``. Fresh successful trajectories
        get their log-probs, response mask, entropy and versions recorded; then buckets, skip set
        and pool are updated. Returns this step's metrics."""
        groups: dict[str, list[Trajectory]] = defaultdict(list)
        task_of: dict[str, Task] = {}
        row = 0
        fresh_total = fresh_succ = replayed = 0
        for ep in episodes:
            for t in ep.trajectories:
                i, row = row, row + 1
                if t.is_replay:
                    replayed += 1
                    continue
                if not t.task_id:
                    continue
                fresh_total += 1
                ok = self.is_success(t)
                fresh_succ += ok
                n_tok = len(t.token_ids)
                if ok and logprobs is not None:
                    tok_lp = rows_to_tokens(logprobs[i], n_tok)
                    rec = align_recorded_logprobs(compact_logprobs(tok_lp, t.loss_mask), t.loss_mask)
                    ent = mean_entropy(rows_to_tokens(entropy[i], n_tok), t.loss_mask) if entropy is not None else 0.0
                    t = _stored_copy(t, rec, ent, version)
                groups[t.task_id].append(t)
                if ep.task is not None:
                    task_of[t.task_id] = ep.task
        to_save = self.update_solved(groups)
        to_save = [t for t in to_save if t.task_id in task_of]
        for t in to_save:
            self.tasks[t.task_id] = msgspec.to_builtins(task_of[t.task_id])
        self.store(to_save)
        self._tidy()
        solve_rate = fresh_succ / fresh_total if fresh_total else 0.0
        self.maybe_activate(version, solve_rate)
        total = fresh_total + replayed
        self._step_stats = {
            "replay/replayed_trajectories": float(replayed),
            "replay/replayed_share": replayed / total if total else 0.0,
            "replay/fresh_solve_rate": solve_rate,
            "replay/saved_trajectories": float(len(to_save)),
        }
        return self.metrics()

    # ------------------------------------------------------------------ observability
    def bucket_sizes(self) -> dict[str, int]:
        return {str(d): len(ids) for d, ids in sorted(self.buckets.items())}

    def pool_trajectories(self) -> int:
        return sum(len(v) for v in self.stored.values())

    def metrics(self) -> dict[str, float]:
        out = {
            "replay/pool_tasks": float(len(self.stored)),
            "replay/skip_tasks": float(len(self.solved)),
            "replay/pool_trajectories": float(self.pool_trajectories()),
            "replay/active": float(self.active),
            **self._step_stats,
        }
        for d in range(self.n + 1):
            out[f"replay/bucket_{d}"] = float(len(self.buckets.get(d, [])))
        return out

    def state_event(self) -> dict[str, Any]:
        """Fields of the ``replay_state`` event."""
        return {
            "buckets": self.bucket_sizes(),
            "pool_tasks": len(self.stored),
            "skip_tasks": len(self.solved),
            "pool_trajectories": self.pool_trajectories(),
            "active": self.active,
        }

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """Everything but the stored arrays (those go to ``replay_pool.bin``), JSON-ready."""
        v, internal, gauss = self.rng.getstate()
        return {
            "format": STATE_FORMAT,
            "buckets": {str(d): list(ids) for d, ids in self.buckets.items()},
            "solved": sorted(self.solved),
            "stored": {tid: [t.id for t in ts] for tid, ts in self.stored.items()},
            "tasks": self.tasks,
            "active": self.active,
            "ratio_carry": self._ratio_carry,
            "rng_state": [v, list(internal), gauss],
        }

    def digest(self) -> str:
        """A hash of the whole state (stored arrays included): equal iff the states are identical."""
        h = hashlib.sha256(
            json.dumps({k: v for k, v in self.state_dict().items() if k != "rng_state"}, sort_keys=True).encode()
        )
        for tid in sorted(self.stored):
            for t in self.stored[tid]:
                h.update(
                    json.dumps(
                        [
                            t.id,
                            t.policy_version,
                            t.reward,
                            t.metadata.get("entropy"),
                            t.metadata.get("recorded_version"),
                        ]
                    ).encode()
                )
                for arr in (t.token_ids, t.loss_mask, t.behavior_logprobs, t.recorded_logprobs):
                    if arr is not None:
                        h.update(np.ascontiguousarray(arr).tobytes())
        return h.hexdigest()

    def save(self, directory: Path) -> None:
        """Write ``replay.json`` and ``replay_pool.bin`` (one wire-encoded Episode per pooled task)
        into a checkpoint directory."""
        from ..rundir.record_file import write_frames
        from ..wire.codec import encode_episode

        directory = Path(directory)
        (directory / STATE_FILE).write_text(json.dumps(self.state_dict()))
        with open(directory / POOL_FILE, "wb") as f:
            for tid, trajs in self.stored.items():
                task = msgspec.convert(self.tasks[tid], Task) if tid in self.tasks else None
                write_frames(f, encode_episode(Episode(trajectories=list(trajs), task=task, id=tid)))

    def load(self, directory: Path) -> bool:
        """Restore from a checkpoint directory; False (state untouched) when it holds no replay state."""
        from ..rundir.record_file import read_frame_records
        from ..wire.codec import decode, decode_episode

        directory = Path(directory)
        path = directory / STATE_FILE
        if not path.exists():
            return False
        state = {_OLD_KEYS.get(k, k): v for k, v in json.loads(path.read_text()).items()}
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"{path}: replay state format {state.get('format')!r}, expected {STATE_FORMAT}")
        pool: dict[str, list[Trajectory]] = {}
        pool_path = directory / POOL_FILE
        if pool_path.exists():
            for frames in read_frame_records(pool_path):
                ep = decode_episode(decode(frames), copy=True)
                pool[ep.id] = ep.trajectories
        order = state["stored"]
        for tid, ids in order.items():
            got = [t.id for t in pool.get(tid, [])]
            if got != ids:
                raise ValueError(
                    f"{pool_path}: task {tid!r} holds trajectories {got}, expected {ids} (the checkpoint is damaged)"
                )
        self.buckets = {int(d): list(ids) for d, ids in state["buckets"].items()}
        self.solved = set(state["solved"])
        self.stored = {tid: pool[tid] for tid in order}
        self.tasks = dict(state["tasks"])
        self.active = bool(state["active"])
        self._ratio_carry = float(state.get("ratio_carry", 0.0))
        v, internal, gauss = state["rng_state"]
        self.rng.setstate((v, tuple(internal), gauss))
        self._outstanding = {}
        return True


def _stored_copy(t: Trajectory, recorded: np.ndarray, entropy: float, version: int) -> Trajectory:
    """What the pool keeps of a fresh successful trajectory (own arrays, not views into frames)."""
    return Trajectory(
        token_ids=np.array(t.token_ids),
        loss_mask=np.array(t.loss_mask),
        behavior_logprobs=np.array(t.behavior_logprobs),
        policy_version=t.policy_version,
        token_versions=None if t.token_versions is None else np.array(t.token_versions),
        reward=t.reward,
        scores=dict(t.scores),
        sample_type=t.sample_type,
        group_id=t.group_id,
        task_id=t.task_id,
        rollout_id=t.rollout_id,
        recorded_logprobs=recorded,
        text=t.text,
        metadata={**t.metadata, "entropy": float(entropy), "recorded_version": int(version)},
        id=t.id,
    )


def make_replay_trajectory(stored: Trajectory, group_id: str) -> Trajectory:
    """A replay copy of a stored trajectory: ``is_replay``, ``exp_mask`` = its generated (assistant)
    tokens, the recorded log-probs (NaN where none: the trainer then uses the current policy's),
    in ``group_id``. The stored one is left untouched."""
    rec = stored.recorded_logprobs
    if rec is None:
        rec = align_recorded_logprobs(None, stored.loss_mask)
    return Trajectory(
        token_ids=stored.token_ids,
        loss_mask=stored.loss_mask,
        behavior_logprobs=stored.behavior_logprobs,
        policy_version=stored.policy_version,
        token_versions=stored.token_versions,
        reward=stored.reward,
        scores=dict(stored.scores),
        sample_type=stored.sample_type,
        group_id=group_id,
        task_id=stored.task_id,
        rollout_id=stored.rollout_id,
        is_replay=True,
        recorded_logprobs=np.array(rec, dtype=np.float32),
        exp_mask=np.array(stored.loss_mask, dtype=np.uint8),
        text=stored.text,
        metadata={**stored.metadata, "replay_of": stored.id},
    )


# ----------------------------------------------------------------------------------------------
# the learner hook (asyncrl.learner.hooks)

_STAT_NAMES = {
    "on_pg_loss": "replay/on_pg_loss",
    "off_pg_loss": "replay/off_pg_loss",
    "on_clipfrac": "replay/on_clipfrac",
    "off_clipfrac": "replay/off_clipfrac",
    "off_token_ratio": "replay/off_token_ratio",
    "off_ratio_mean": "replay/ratio_mean",
    "off_ratio_min": "replay/ratio_min",
    "off_ratio_max": "replay/ratio_max",
    "recorded_vs_current_logprob_diff": "replay/recorded_vs_current_logprob_diff",
}


class ReplayHook:
    """Experience replay as a learner hook: stored trajectories join their replay tasks' batches,
    each step's fresh successes are recorded with the learner's log-probs and entropies, credits
    carry replay assignments and skip-set changes, and the pool goes into checkpoints. The
    policy loss's on/off-policy statistics are reported as ``replay/*`` (``replay/ratio_*`` is
    the importance ratio on replayed tokens)."""

    needs_rows = True
    owned_stats = frozenset(_STAT_NAMES)

    def __init__(self, manager: ExperiencePool, state_event_every: int, event: Callable[..., None]):
        self.manager, self.every, self.event = manager, state_event_every, event

    def before_batch(self, episodes: list[Episode], version: int) -> None:
        if any(ep.trajectories for ep in episodes):  # a filter (Absolute Zero) may have dropped all
            self.manager.attach(episodes)

    def after_step(self, episodes: list[Episode], result, version: int) -> dict[str, float]:
        rows = (
            (None, None)
            if result is None or result.row_logprobs is None
            else (result.row_logprobs.float().numpy(), result.row_entropy.float().numpy())
        )
        out = self.manager.record(episodes, rows[0], rows[1], version)
        stats = result.stats if result is not None else {}
        out.update({_STAT_NAMES[k]: v for k, v in stats.items() if k in _STAT_NAMES})
        out.setdefault("replay/off_token_ratio", 0.0)
        if (version + 1) % self.every == 0:
            self.event("replay_state", version + 1, reason="step", **self.manager.state_event())
        return out

    def credit_work(self, actor, n: int, version: int) -> dict[str, Any]:
        """Typed replay assignments and the changes of the skip set (withheld task ids) since the
        actor was last told."""
        from ..wire.messages import ReplayTask, Withhold

        delta, actor.withheld_sent = self.manager.withheld_update(actor.withheld_sent)
        work: dict[str, Any] = {
            "replay": [
                ReplayTask(task=msgspec.convert(t["task"], Task), n=t["n"], k=t["k"])
                for t in self.manager.assign(n, version)
            ]
        }
        if delta:
            work["withhold"] = Withhold(
                reset=delta.get("withhold_reset", False),
                add=delta.get("withhold_add", []),
                remove=delta.get("withhold_remove", []),
            )
        return work

    def save(self, directory: Path) -> None:
        self.manager.save(directory)

    def load(self, directory: Path, version: int) -> None:
        if self.manager.load(directory):
            self.event(
                "replay_state", version, reason="resume", digest=self.manager.digest(), **self.manager.state_event()
            )

    def checkpoint_saved(self, path: Path, version: int) -> None:
        self.event(
            "replay_state",
            version,
            reason="checkpoint",
            checkpoint=str(path),
            digest=self.manager.digest(),
            **self.manager.state_event(),
        )
