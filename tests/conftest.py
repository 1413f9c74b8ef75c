"""Shared fixtures and helpers: a tiny embedded model built once per session, CLI subprocesses and
their process trees, a scripted engine for workflow unit tests, and a kill/resume run harness."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


# The files that take longest, in seconds of one `make test` run (2 workers; the timeline of
# 2026-11-27): they are collected first, so that the workers (`--dist loadfile
# --no-loadscope-reorder`) start them first and no long file starts when the rest are done. A hint
# only: a file not listed runs after these, in its usual order.
SLOW_FILES = {
    "tests/e2e/test_ui.py": 250,
    "tests/e2e/test_ray.py": 200,
    "tests/e2e/test_ray_hosts.py": 330,
    "tests/e2e/test_notebooks.py": 210,
    "tests/e2e/test_durability.py": 201,
    "tests/e2e/test_faults_peers.py": 194,
    "tests/unit/models/test_lora.py": 184,
    "tests/unit/commands/test_bad_input.py": 129,
    "tests/unit/engine/test_engine_vllm.py": 123,
    "tests/e2e/test_local_users.py": 105,
    "tests/e2e/test_netns.py": 97,
    "tests/unit/envs/test_bring_envs.py": 91,
    "tests/e2e/test_lifecycle.py": 89,
    "tests/e2e/test_examples.py": 84,
    "tests/e2e/test_objectives_e2e.py": 60,
    "tests/unit/commands/test_console.py": 55,
    "tests/e2e/test_learner_group.py": 53,
    "tests/e2e/test_slurm.py": 110,
    "tests/e2e/test_hosts.py": 35,
    "tests/e2e/test_pipeline.py": 44,
    "tests/unit/envs/test_agent_env.py": 43,
    "tests/e2e/test_trackers.py": 38,
    "tests/e2e/test_critic_e2e.py": 82,
    "tests/e2e/test_reproduce.py": 140,
    "tests/e2e/test_long_batches.py": 125,
    "tests/unit/models/test_gguf.py": 60,
}


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: -SLOW_FILES.get(item.nodeid.split("::")[0], 0))  # stable: a file keeps its order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """The unit tests and the end-to-end ones (marked ``slow``: real processes, real runs) reported
    apart, so that ``make test`` says how each half went."""
    from collections import Counter

    counts: Counter = Counter()
    for outcome in ("passed", "failed", "error", "skipped"):
        for rep in terminalreporter.stats.get(outcome, []):
            if outcome == "passed" and getattr(rep, "when", "call") != "call":
                continue
            kind = "end-to-end" if "slow" in getattr(rep, "keywords", {}) else "unit"
            counts[kind, outcome] += 1
    if counts:
        for kind in ("unit", "end-to-end"):
            parts = [f"{counts[kind, o]} {o}" for o in ("passed", "failed", "error", "skipped") if counts[kind, o]]
            terminalreporter.write_line(f"{kind} tests: {', '.join(parts) or 'none'}")


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """Where the session's embedded models are built: one folder for all xdist workers of this run (a
    build is renamed into place under a file lock, so a second worker waits and reuses it:
    asyncrl.models.tiny), or the session's own without xdist."""
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "models"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tiny_overrides(model_cache) -> list[str]:
    """Overrides that select a very small embedded model (built once, cached for the session)."""
    overrides = [
        f"model.embedded.cache_dir={model_cache}",
        "model.embedded.hidden_size=32",
        "model.embedded.num_layers=1",
        "model.embedded.num_heads=2",
        "model.embedded.intermediate_size=64",
        "model.embedded.warmup_steps=20",
        "model.embedded.warmup_batch_size=16",
        "model.embedded.warmup_lr=3e-3",
        "log.episode_events=all",
    ]  # tests check every trained episode against what was sent
    from asyncrl.config import load_config
    from asyncrl.models.tiny import build_embedded_model

    cfg = load_config(None, overrides)
    build_embedded_model(cfg.model.embedded, seed=cfg.seed, progress=False)
    return overrides


@pytest.fixture(scope="module")
def tok():
    """The embedded model's character tokenizer (no model built)."""
    from asyncrl.models.tokenizer import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture(scope="module")
def random_engine(tok):
    """An HFEngine over a small randomly initialised Llama on the character tokenizer (seed 0)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from asyncrl.engine.hf import HFEngine

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=256,
            tie_word_embeddings=True,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=3,
        )
    )
    return HFEngine(model, tok)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "asyncrl", *args]


def subprocess_env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def wait_for_file(path: Path, proc: subprocess.Popen, timeout: float = 120) -> dict:
    from asyncrl.schedulers.local import wait_for_addresses

    return wait_for_addresses(path, proc, timeout)


def read_jsonl(path: Path) -> list[dict]:
    from asyncrl.rundir.runlog import read_jsonl as _read

    return _read(path)


# ---- process trees: every test that starts processes stops all of them, even when it fails ----


def _parent_map() -> dict[int, int]:
    """pid -> parent pid for every process (Linux /proc)."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            out[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])  # field 4, after "(comm)"
    return out


def descendants(pid: int) -> set[int]:
    """Live descendants of ``pid`` (children, grandchildren, ...)."""
    parents = _parent_map()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def alive(pids) -> set[int]:
    """The pids in ``pids`` that still exist and are not zombies."""
    out = set()
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.add(p)
    return out


def kill_tree(proc: subprocess.Popen, known: set[int] | None = None) -> None:
    """SIGKILL ``proc``, its process group and every descendant (plus ``known`` pids); reap it."""
    pids = {proc.pid} | descendants(proc.pid) | set(known or ())
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # started with start_new_session=True
    except (ProcessLookupError, PermissionError):
        pass
    for p in alive(pids):
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


_ZYGOTE = None


def _zygote():
    """This test process's zygote (tests/support/zygote.py), started on first use, closed at the session's end."""
    global _ZYGOTE
    if _ZYGOTE is None:
        import atexit

        from tests.support.zygote import Zygote

        status = Path(tempfile.mkdtemp(prefix="asyncrl-zygote-"))
        _ZYGOTE = Zygote(status, subprocess_env())
        atexit.register(_close_zygote)
    return _ZYGOTE


def _close_zygote() -> None:
    global _ZYGOTE
    if _ZYGOTE is not None:
        import shutil

        _ZYGOTE.close()
        shutil.rmtree(_ZYGOTE.status_dir, ignore_errors=True)
        _ZYGOTE = None


def pytest_sessionfinish(session, exitstatus):
    _close_zygote()


def start_cli(*args: str, log: Path | None = None, env: dict | None = None, **kw) -> subprocess.Popen:
    """``asyncrl ARGS`` in its own session (so :func:`kill_tree` reaches all of it); output to
    ``log`` or a pipe (text). ``asyncrl learn`` and ``serve`` with a log are forked from a preloaded
    zygote (tests/support/zygote.py: no 5 s of imports each), as ``asyncrl run`` forks its children."""
    env = env or subprocess_env()
    if log is not None and args and args[0] in ("learn", "serve") and not kw:
        proc = _zygote().start(list(args), env, log)
        if proc is not None:
            return proc
    if log is not None:
        with open(log, "w") as fh:
            return subprocess.Popen(
                cli(*args), env=env, stdout=fh, stderr=subprocess.STDOUT, text=True, start_new_session=True, **kw
            )
    return subprocess.Popen(
        cli(*args), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, **kw
    )


def run_cli(*args: str, timeout: float, **kw) -> subprocess.CompletedProcess:
    """Like ``subprocess.run(cli(*args), capture_output=True, text=True, timeout=...)``, but in its
    own session, and the whole process tree is killed when it times out or the test fails. Forked
    from the preloaded zygote (tests/support/zygote.py) unless ``kw`` asks for more than an environment."""
    env = kw.pop("env", None) or subprocess_env()
    if not kw:
        with tempfile.TemporaryDirectory(prefix="asyncrl-run-cli-") as d:
            out, err = Path(d) / "stdout", Path(d) / "stderr"
            forked = _zygote().start(list(args), env, out, stderr=err)
            if forked is not None:
                try:
                    forked.wait(timeout=timeout)
                    return subprocess.CompletedProcess(
                        cli(*args), forked.returncode, out.read_text(errors="replace"), err.read_text(errors="replace")
                    )
                finally:
                    kill_tree(forked)
    proc = subprocess.Popen(
        cli(*args), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kw
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        kill_tree(proc)


# ---- a scripted engine: workflows driven with known replies, no model ----


class ScriptedEngine:
    """An :class:`asyncrl.engine.base.Engine` without a model, for unit tests of workflows and the
    conversation loop: every prompt gets a scripted reply, tokenised by the real tokenizer, so token
    bookkeeping, rewards and advantages can be checked exactly.

    ``script(texts)`` is called once per ``generate`` call with the decoded prompts (special tokens
    dropped) and returns one reply per prompt: a text (special tokens in it, such as ``<|end|>``,
    become their token) or ``(text, stop)``, where ``stop`` appends the EOS token. The reply is
    generated whole, or cut at ``sampling.max_new_tokens`` as a real engine would with
    ``truncate=True``. ``finish_reason`` is ``"stop"`` when the last token is EOS, else ``"length"``;
    the text is the reply's tokens decoded without special tokens. Behaviour log-probs are
    ``logprob``: one value for every token, or a function of the reply length giving one per token.
    ``calls`` counts the prompts of each call and ``prompts`` keeps their texts; ``update_weights``
    takes the new version.
    """

    def __init__(self, tokenizer, script, *, version: int = 0, logprob=-0.5, truncate: bool = False):
        self.tokenizer, self.script = tokenizer, script
        self.version = version
        self.eos_ids = {tokenizer.eos_token_id}
        self.logprob, self.truncate = logprob, truncate
        self.calls: list[int] = []
        self.prompts: list[list[str]] = []
        self.weight_updates: list[int] = []

    @classmethod
    def replies(cls, tokenizer, replies: list, **kw) -> "ScriptedEngine":
        """Replies taken in order, one per prompt, across calls (running out is an error)."""
        queue = list(replies)

        def script(texts):
            if len(queue) < len(texts):
                raise AssertionError(f"ScriptedEngine: {len(texts)} prompts, {len(queue)} scripted replies left")
            return [queue.pop(0) for _ in texts]

        return cls(tokenizer, script, **kw)

    @classmethod
    def per_call(cls, tokenizer, calls: list[list], **kw) -> "ScriptedEngine":
        """Call ``k`` answers its ``i``-th prompt with ``calls[k][i % len(calls[k])]`` (e.g. turn 1's
        answers, then turn 2's confidences)."""
        done = [0]

        def script(texts):
            if done[0] >= len(calls):
                raise AssertionError(f"ScriptedEngine: call {done[0] + 1}, scripted for {len(calls)}")
            replies = calls[done[0]]
            done[0] += 1
            return [replies[i % len(replies)] for i in range(len(texts))]

        return cls(tokenizer, script, **kw)

    def generate(self, prompts, sampling, seed=None):
        texts = [self.tokenizer.decode(p, skip_special_tokens=True) for p in prompts]
        self.calls.append(len(prompts))
        self.prompts.append(texts)
        replies = self.script(texts)
        assert len(replies) == len(prompts), f"the script gave {len(replies)} replies to {len(prompts)} prompts"
        return [self._generation(r, sampling) for r in replies]

    def _generation(self, reply, sampling):
        from asyncrl.engine.base import Generation

        text, stop = (reply, False) if isinstance(reply, str) else reply
        ids = self.tokenizer.encode(text, add_special_tokens=False) + ([self.tokenizer.eos_token_id] if stop else [])
        if self.truncate:
            ids = ids[: sampling.max_new_tokens]
        logprobs = (
            self.logprob(len(ids)) if callable(self.logprob) else np.full(len(ids), self.logprob, dtype=np.float32)
        )
        return Generation(
            np.array(ids, dtype=np.int32),
            logprobs,
            self.tokenizer.decode(ids, skip_special_tokens=True),
            "stop" if ids and ids[-1] in self.eos_ids else "length",
        )

    def update_weights(self, named_tensors, version: int) -> None:
        self.version = version
        self.weight_updates.append(version)


# ---- kill and resume: a learner and an actor on loopback, the learner killed and resumed ----

# A small end-to-end run: 4 tasks x 4 rollouts a step, short replies rewarded by length, no evaluation or
# checkpoints unless a test asks (the shared settings of the process tests)
SMALL_RUN = [
    "sampling.n=4",
    "sampling.max_new_tokens=4",
    "actor.tasks_per_batch=4",
    "train.batch_tasks=4",
    "train.lr=1e-3",
    "env.reward=tests.support.plugins:short_reply_reward",
    "eval.size=8",
    "eval.every=0",
    "actor.heartbeat_s=0.2",
    "log.progress=false",
    "checkpoint.every=0",
]
# Experience replay on the multi-turn calculator, with tasks that recur
REPLAY_RUN = [
    "replay.enabled=true",
    "replay.replay_start_ratio=0.1",
    "replay.exp_ratio=0.5",
    "replay.offpolicy_trajectories_per_task=1",
    "tasks.max_operand=3",  # 16 tasks: they recur
    "env.type=calculator",
    "env.max_turns=2",
    "env.kwargs.tool_prefix=",  # two assistant turns each
    "sampling.max_new_tokens=5",
]


def initial_weights(overrides):
    """The weights of the embedded model these overrides select (built once, cached; the session's
    model cache holds other tests' models too)."""
    from safetensors.torch import load_file

    from asyncrl.config import load_config
    from asyncrl.models.tiny import build_embedded_model

    cfg = load_config(None, overrides)
    return load_file(build_embedded_model(cfg.model.embedded, seed=cfg.seed, progress=False) / "model.safetensors")


def ramp_logprobs(n: int) -> np.ndarray:
    """-0.1, -0.2, ...: a distinct behaviour log-prob for every generated token."""
    return -np.arange(1, n + 1, dtype=np.float32) / 10


def scripted_engine(tok, replies) -> ScriptedEngine:
    """The shared scripted engine (policy version 7) replaying ``(text, stop)`` replies in order."""
    return ScriptedEngine.replies(tok, replies, version=7, logprob=ramp_logprobs)


def scripted_conversation(overrides: list[str], question: str, answer, replies, max_turns: int):
    """One multi-turn conversation of the env that ``overrides`` configure, on ``question``, with the
    scripted ``replies`` (:func:`scripted_engine`): ``(tok, env, task, conversation, engine)``."""
    from asyncrl.config import load_config
    from asyncrl.envs.base import make_env
    from asyncrl.models.tokenizer import build_char_tokenizer
    from asyncrl.rollout import run_conversations, start_conversations
    from asyncrl.types import Task

    tok = build_char_tokenizer()
    cfg = load_config(None, overrides)
    env = make_env(cfg.env)
    task = Task(id=f"t:{question}", prompt=[{"role": "user", "content": question}], answer=answer)
    convs = start_conversations(tok, env, [task], 1, ["g"])
    engine = scripted_engine(tok, replies)
    run_conversations(engine, tok, env, convs, cfg.sampling, max_turns=max_turns)
    return tok, env, task, convs[0], engine


def stop_processes(procs) -> None:
    """Ask every process to stop (SIGTERM), then kill whatever is left of each process tree."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        kill_tree(p)


def wal_ids(run_dir: Path) -> set[str]:
    """Episode ids in every WAL segment of a run: what the learner acknowledged since the oldest kept
    checkpoint (a killed learner's last record may be torn: reading stops there)."""
    from asyncrl.rundir.record_file import read_frame_records
    from asyncrl.wire.codec import decode, decode_episode

    ids = set()
    for wal in (run_dir / "buffer").glob("wal-*.bin"):
        for frames in read_frame_records(wal, strict=False):
            ids.add(decode_episode(decode(frames)).id)
    return ids


def checkpoint_buffer_ids(ckpt: Path) -> set[str]:
    """Episode ids in a checkpoint's saved buffer (read strictly: a checkpoint is whole or refused)."""
    from asyncrl.rundir.record_file import read_frame_records
    from asyncrl.wire.codec import decode, decode_episode

    return {decode_episode(decode(f)).id for f in read_frame_records(ckpt / "buffer.bin")}


def effective_training(events) -> list[str]:
    """Episode ids trained in the run's surviving history: each learner life's steps up to the
    checkpoint the next life resumed from (later steps were rolled back), then the last life's."""
    lives, current = [], []
    for e in events:
        if e["kind"] == "resume":
            lives.append((current, e["step"]))
            current = []
        elif e["kind"] == "episode":
            current.append((e["step"], e["episode_id"]))
    lives.append((current, None))
    return [eid for trained, upto in lives for step, eid in trained if upto is None or step <= upto]


class ResumableRun:
    """``asyncrl learn`` and ``asyncrl serve`` as real processes on loopback, writing
    ``tmp_path/name``, for tests that kill the learner (SIGKILL) and resume it (``--resume``).

    Learner lives are numbered from 1, each logging to ``tmp_path/learner<life>.log``; actors log to
    ``tmp_path/<log>``. Waits poll the run's files against a deadline and fail early, with the log's
    tail, when the learner exits. Use it as a context manager: every process it started is stopped,
    as a process tree, when the block ends, whether the test passed or not.
    """

    def __init__(self, tmp_path: Path, name: str, overrides: list[str]):
        self.logs = Path(tmp_path)
        self.dir = self.logs / name
        self.overrides = [*overrides, f"run_root={tmp_path}", f"name={name}"]
        self.procs: list[subprocess.Popen] = []
        self.actors: list[subprocess.Popen] = []
        self.learner: subprocess.Popen | None = None
        self.group: list[subprocess.Popen] = []  # the current life's learner ranks, when more than one
        self.lives = 0

    def __enter__(self) -> "ResumableRun":
        return self

    def __exit__(self, *exc) -> None:
        stop_processes(self.procs)

    def _start(self, args: list[str], log: str) -> subprocess.Popen:
        proc = start_cli(*args, log=self.logs / log)
        self.procs.append(proc)
        return proc

    def start_learner(self, *extra: str, resume: bool = False, procs: int = 1) -> subprocess.Popen:
        """A new learner life (``--resume`` when ``resume``): one process, or a group of ``procs``
        (ranks on loopback, as ``asyncrl run --learner-procs`` starts them; rank i > 0 logs to
        ``learner<life>-rank<i>.log``). Returns rank 0."""
        self.lives += 1
        args = ["learn", *self.overrides, *extra, *(["--resume"] if resume else [])]
        self.group = []
        if procs == 1:
            self.learner = self._start(args, f"learner{self.lives}.log")
            return self.learner
        from asyncrl.schedulers.local import free_port

        group = {"WORLD_SIZE": str(procs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        for rank in range(procs):
            name = f"learner{self.lives}.log" if rank == 0 else f"learner{self.lives}-rank{rank}.log"
            proc = start_cli(
                *args,
                log=self.logs / name,
                env={**subprocess_env(), **group, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            )
            self.procs.append(proc)
            self.group.append(proc)
        self.learner = self.group[0]
        return self.learner

    def resume(self, *extra: str, procs: int = 1) -> subprocess.Popen:
        return self.start_learner(*extra, resume=True, procs=procs)

    def addresses(self, timeout: float = 120) -> dict:
        """The current learner's addresses (``addresses.json``), once it has bound its sockets."""
        return wait_for_file(self.dir / "addresses.json", self.learner, timeout)

    def start_actor(self, *extra: str, log: str = "actor.log") -> subprocess.Popen:
        """An actor connected to the current learner's control address."""
        proc = self._start(["serve", *self.overrides, *extra, "--connect", self.addresses()["control"]], log)
        self.actors.append(proc)
        return proc

    def log(self, life: int | None = None) -> str:
        return (self.logs / f"learner{life or self.lives}.log").read_text(errors="replace")

    def metrics(self) -> list[dict]:
        return read_jsonl(self.dir / "metrics.jsonl")

    def events(self, kind: str | None = None) -> list[dict]:
        return [e for e in read_jsonl(self.dir / "events.jsonl") if kind is None or e["kind"] == kind]

    def wait_for(self, condition, what: str, timeout: float = 180) -> None:
        """Return once ``condition()`` holds; fail if the learner exits first or ``timeout`` passes."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if condition():
                return
            if self.learner.poll() is not None:
                raise AssertionError(
                    f"the learner exited ({self.learner.returncode}) before {what}: {self.log()[-2000:]}"
                )
            time.sleep(0.05)
        raise AssertionError(f"no {what} after {timeout:.0f} s")

    def wait_version(self, version: int, timeout: float = 240) -> None:
        """Wait until the learner has logged a step that reached weights ``version``."""

        def reached() -> bool:
            m = self.metrics()
            return bool(m) and m[-1]["version"] >= version

        self.wait_for(reached, f"step {version}", timeout)

    def kill_learner(self) -> None:
        """SIGKILL the learner process, or every process of its group (a crash: nothing flushed,
        nothing said to the actors)."""
        for proc in self.group or [self.learner]:
            proc.send_signal(signal.SIGKILL)
        for proc in self.group or [self.learner]:
            proc.wait(timeout=10)

    def finish(self, timeout: float = 300, actor_timeout: float = 60) -> None:
        """Wait for the learner to finish its run (exit 0, else fail with its log's tail), then for
        the actors, which its stop message ends."""
        self.learner.wait(timeout=timeout)
        assert self.learner.returncode == 0, self.log()[-3000:]
        for actor in self.actors:
            actor.wait(timeout=actor_timeout)

    def wal_ids(self) -> set[str]:
        return wal_ids(self.dir)


@pytest.fixture()
def listener():
    """A TCP listener on 127.0.0.1 that records every byte it receives."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.1)
    received: list[bytes] = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(2)
                try:
                    received.append(conn.recv(1024) or b"<connected>")
                except OSError:
                    received.append(b"<connected>")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1], received
    finally:
        stop.set()
        t.join(timeout=10)
        srv.close()
