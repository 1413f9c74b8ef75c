"""``asyncrl serve``: a rollout actor.

The actor connects to the learner's control address, is told the other addresses (``welcome``),
and then loops: take work credits -> make sure its weights are at least the credit's version ->
run the workflow on a batch of tasks -> push the episodes. New weights are applied only between
generation batches, and every trajectory records the version that produced it.

Delivery: each episode is kept until the learner acknowledges that it is in its write-ahead log.
When the learner comes back with a new session (it restarted), everything unacknowledged is
resent; the learner de-duplicates by episode id.
"""

from __future__ import annotations

import os
import signal
import time
from collections import OrderedDict, deque

import torch
import zmq

from ..algos.base import RolloutContext, get_workflow
from ..config import Config
from ..engine.hf import HFEngine
from ..envs.base import make_env, task_stream
from ..models.loading import load_policy
from ..types import Task
from ..learner.weights_fs import load_weights_file
from ..wire.codec import WireError, decode, decode_weights, encode_episode, encode_msg
from ..wire.sockets import apply_curve_client, connect


class Actor:
    def __init__(self, cfg: Config, control_address: str, actor_id: str, index: int = 0):
        self.cfg = cfg
        self.actor_id = actor_id
        self.seed = cfg.seed * 1_000_003 + 7919 * (index + 1)
        torch.set_num_threads(cfg.actor.threads)
        torch.manual_seed(self.seed)
        model, self.tokenizer, _ = load_policy(cfg.model, cfg.seed, cfg.engine.device, cfg.tasks.prompt_format)
        self.engine = self._make_engine(model)
        self.env = make_env(cfg.env)
        self.tasks = task_stream(cfg.tasks, self.seed)
        self.workflow = get_workflow(cfg.algorithm, cfg)
        self.ctx = zmq.Context.instance()
        self.control = self._socket(zmq.DEALER, control_address)
        self.episodes = self.weights = None
        self.session = None
        self.unacked: OrderedDict[str, list] = OrderedDict()
        self.credits = 0
        self.min_version = 0
        self.stopping = False
        self.batches = 0
        self.weight_updates = 0
        self._last_status = 0.0
        self._gen_s = 0.0
        # experience replay: tasks the learner assigned (task, fresh rollouts, replayed k), generated
        # before fresh ones, and task ids withheld from the fresh stream (the learner's skip set)
        self.assigned: deque[tuple[Task, int, int]] = deque()
        self.withheld: set[str] = set()

    def _make_engine(self, model):
        if self.cfg.engine.type == "vllm":
            try:
                from ..engine.vllm import VLLMEngine  # noqa: PLC0415 (optional GPU extra)
            except ImportError as e:
                raise SystemExit(f"engine.type=vllm is not available: {e}. Install the GPU extra "
                                 f"(pip install 'asyncrl[vllm]') on a CUDA machine, or use engine.type=hf") from None
            return VLLMEngine(self.cfg, model)
        return HFEngine(model, self.tokenizer, device=self.cfg.engine.device)

    def _socket(self, kind, address):
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 2000)
        if kind == zmq.DEALER:
            sock.setsockopt(zmq.IDENTITY, f"{self.actor_id}:{os.getpid()}".encode())
        if kind == zmq.PUSH:
            sock.setsockopt(zmq.SNDHWM, self.cfg.wire.hwm)
        if self.cfg.wire.curve_dir:
            apply_curve_client(sock, self.cfg.wire.curve_dir)
        connect(sock, address)
        return sock

    # -- control --------------------------------------------------------------------------------
    def hello(self) -> None:
        self.control.send_multipart(encode_msg("hello", actor_id=self.actor_id,
                                               capacity=self.cfg.actor.tasks_per_batch,
                                               version=self.engine.version, pid=os.getpid()), copy=False)

    def handle_control(self, timeout_ms: int) -> None:
        if not self.control.poll(timeout_ms):
            return
        while True:
            try:
                frames = self.control.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = decode(frames)
            except WireError as e:
                print(f"[{self.actor_id}] dropped a bad control message: {e}", flush=True)
                continue
            self._on_control(msg)

    def _on_control(self, msg) -> None:
        body = msg.body
        if msg.kind == "welcome":
            self._on_welcome(body)
        elif msg.kind == "ack":
            for eid in body.get("ids", []):
                self.unacked.pop(eid, None)
        elif msg.kind == "credit":
            self.credits += int(body["n"])
            self.min_version = max(self.min_version, int(body.get("min_version", 0)))
            self._on_replay_work(body)
        elif msg.kind == "stop":
            self.stopping = True

    def _on_welcome(self, body: dict) -> None:
        new_session = body["session"] != self.session
        self.session = body["session"]
        if self.episodes is None:
            addrs = body["addresses"]
            self.episodes = self._socket(zmq.PUSH, addrs["episodes"])
            self.weights = self._socket(zmq.DEALER, addrs["weights"])
        if new_session:
            self.credits = 0
            self.assigned.clear()  # the learner lost its assignments; it resends its skip set too
            self.withheld = set()
            self.min_version = 0  # a resumed learner may be at an older version than we last saw
            self.weights.send_multipart(encode_msg("subscribe", actor_id=self.actor_id,
                                                   have=self.engine.version), copy=False)
            for frames in self.unacked.values():  # the learner restarted: resend what it never acked
                self.episodes.send_multipart(frames, copy=False)

    # -- weights --------------------------------------------------------------------------------
    def apply_weights(self, timeout_ms: int = 0) -> bool:
        """Apply the newest weights that have arrived (waiting up to ``timeout_ms`` for some)."""
        if self.weights is None or not self.weights.poll(timeout_ms):
            return False
        newest = None
        while True:
            try:
                newest = self.weights.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
        try:
            msg = decode(newest)
            if msg.body.get("path"):  # filesystem sync: the message names a safetensors file
                version, tensors = int(msg.body["version"]), load_weights_file(msg.body["path"])
            else:
                version, tensors = decode_weights(msg)
        except (WireError, OSError) as e:
            print(f"[{self.actor_id}] dropped bad weights: {e}", flush=True)
            return False
        if version == self.engine.version and self.weight_updates:
            return False  # (an older version is applied: the learner resumed from a checkpoint)
        self.engine.update_weights(tensors, version)
        self.weight_updates += 1
        return True

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "stopping", True))
        self.hello()
        next_hello = time.time() + 1.0
        while not self.stopping:
            self.handle_control(timeout_ms=0 if self.credits else 100)
            if self.session is None:
                if time.time() > next_hello:  # learner not up yet (or lost our hello): say it again
                    self.hello()
                    next_hello = time.time() + 1.0
                continue
            self.apply_weights(0)
            self.status()
            if self.credits <= 0:
                continue
            if self.engine.version < self.min_version:
                self.apply_weights(100)
                continue
            self.generate_batch()
        self.status(force=True)
        self.close()

    def _on_replay_work(self, body: dict) -> None:
        """Replay fields of a credit message: assigned tasks and skip-set changes. A malformed item
        is reported and dropped (the credit itself still counts)."""
        items = body.get("replay_tasks") or []
        if items and not getattr(self.workflow, "supports_replay", False):
            print(f"[{self.actor_id}] the learner assigned replay tasks but workflow "
                  f"{self.cfg.algorithm!r} cannot take per-task rollout counts; generating them fresh",
                  flush=True)
        for i, item in enumerate(items if isinstance(items, list) else []):
            try:
                task = Task.from_dict(item["task"])
                n, k = int(item["n"]), int(item["k"])
                if not 1 <= n <= self.cfg.sampling.n or k < 0:
                    raise ValueError(f"n={n}, k={k}; expected 1 <= n <= sampling.n ({self.cfg.sampling.n})")
            except (KeyError, TypeError, ValueError) as e:
                print(f"[{self.actor_id}] dropped replay task {i} of a credit message: {e!r}; expected "
                      f"{{task: {{id, prompt, answer, metadata}}, n: int, k: int}}", flush=True)
                continue
            self.assigned.append((task, n, k))
        if body.get("withhold_reset"):
            self.withheld = set()
        self.withheld.update(str(x) for x in body.get("withhold_add") or [])
        self.withheld.difference_update(str(x) for x in body.get("withhold_remove") or [])

    def _fresh_task(self) -> Task:
        """The next task of the stream that the learner does not withhold (fully solved); after
        1000 withheld ones in a row, the next one anyway (a small dataset may be all solved)."""
        for _ in range(1000):
            task = next(self.tasks)
            if task.id not in self.withheld:
                return task
        return next(self.tasks)

    def generate_batch(self) -> None:
        k = min(self.credits, self.cfg.actor.tasks_per_batch)
        replay = getattr(self.workflow, "supports_replay", False)
        tasks, counts, ks = [], [], []
        while self.assigned and len(tasks) < k:
            task, n, kk = self.assigned.popleft()
            tasks.append(task)
            counts.append(n if replay else self.cfg.sampling.n)
            ks.append(kk if replay else None)
        while len(tasks) < k:
            tasks.append(self._fresh_task())
            counts.append(self.cfg.sampling.n)
            ks.append(None)
        t0 = time.time()
        ctx = RolloutContext(self.engine, self.tokenizer, self.env, self.cfg, self.actor_id,
                             seed=self.seed + 100_003 * self.batches)
        if any(kk is not None for kk in ks):
            episodes = self.workflow.rollout(tasks, ctx, counts=counts)
            for ep, n, kk in zip(episodes, counts, ks):
                if kk is not None:
                    ep.decision["replay"] = {"k": kk, "fresh": n}
        else:
            episodes = self.workflow.rollout(tasks, ctx)
        self._gen_s += time.time() - t0
        self.batches += 1
        self.credits -= k
        for ep in episodes:
            frames = encode_episode(ep)
            self.unacked[ep.id] = frames
            self.episodes.send_multipart(frames, copy=False)

    def status(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last_status < self.cfg.actor.heartbeat_s:
            return
        self._last_status = now
        self.control.send_multipart(encode_msg(
            "status", actor_id=self.actor_id, capacity=self.cfg.actor.tasks_per_batch,
            version=self.engine.version, batches=self.batches,
            weight_updates=self.weight_updates, unacked=len(self.unacked), credits=self.credits,
            generate_s=self._gen_s, stopping=self.stopping), copy=False)

    def close(self) -> None:
        for s in (self.control, self.episodes, self.weights):
            if s is not None:
                s.close()
