"""Endpoint overhead: completions/s through the actor's OpenAI-compatible endpoint (env.type=agent,
an agent making one chat call per rollout with the ``openai`` client) against the direct engine call
(env.type=single_turn), on the quick-start task and model, same batches, same engine.

    python bench/bench_endpoint.py [--rounds 5] [--batches 4] [--threads 2] [KEY=VALUE ...]

KEY=VALUE overrides apply to both paths (e.g. ``sampling.max_new_tokens=64`` for longer completions).

``--per-call`` prints where an endpoint call's time goes instead: the endpoint's own CPU per call
(its event loop thread plus the serving thread, less the engine), with bare-socket clients on 64
threads of the same process and then in a process of their own (in the same process the clients'
threads and the server take turns at one interpreter lock, and each turn costs the server CPU too),
then the milliseconds per call of 64
concurrent rollouts with each kind of client (a bare socket, httpx, the openai client on threads,
the async openai client, one shared by all rollouts, then one each as ``env.type=agent`` lends them)
against the same endpoint and engine, one new token per call.

Rounds alternate the two paths (direct first, then endpoint) on the same warm engine; each prints
its completions/s, and the summary gives the median of the per-round ratios (noisy machine: compare
ratios from one run, not absolute figures)."""

from __future__ import annotations

import argparse
import statistics
import time


def answer_agent(task, client, model):
    """One chat call, the arithmetic reward: what the quick start's single_turn env computes."""
    from asyncrl.envs.arithmetic import arithmetic_reward

    reply = client.chat.completions.create(model=model, messages=[dict(m) for m in task.prompt])
    return arithmetic_reward(task, reply.choices[0].message.content or "")


async def answer_agent_async(task, client, model):
    """``answer_agent`` with the async client (all rollouts on one event loop, no thread per agent)."""
    from asyncrl.envs.arithmetic import arithmetic_reward

    reply = await client.chat.completions.create(model=model, messages=[dict(m) for m in task.prompt])
    return arithmetic_reward(task, reply.choices[0].message.content or "")


def bare_call(port: int, token: str, body: bytes, local) -> None:
    """One chat call on a bare socket, kept alive per thread (as a pooled HTTP client holds it)."""
    import socket

    c = getattr(local, "conn", None)
    if c is None:
        c = local.conn = socket.create_connection(("127.0.0.1", port))
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    c.sendall(
        (
            f"POST /s/{token}/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        + body
    )
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = c.recv(65536)
        if not chunk:
            raise ConnectionError("the endpoint closed the connection")
        got += chunk
    header, _, rest = got.partition(b"\r\n\r\n")
    if not header.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"the endpoint answered {header.splitlines()[0]!r}")
    length = int(
        next(line.split(b":", 1)[1] for line in header.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    )
    while len(rest) < length:
        rest += c.recv(65536)


def bare_client(port: int) -> None:
    """``--bare-client PORT``: the bench's clients in a process of their own. Each line of stdin
    holds the session tokens of one round; all its calls go at once (a thread each), then ``ok``."""
    import json
    import sys
    import threading
    from concurrent.futures import ThreadPoolExecutor

    body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "12+34="}]}).encode()
    local = threading.local()
    with ThreadPoolExecutor(64) as pool:
        for line in sys.stdin:
            tokens = line.split()
            if not tokens:
                break
            list(pool.map(lambda t: bare_call(port, t, body, local), tokens))
            print("ok", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", type=int, default=4, help="actor batches per path per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--per-call", action="store_true", help="per-call cost by client kind (see the doc)")
    ap.add_argument("--bare-client", type=int, metavar="PORT", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="config overrides for both paths")
    args = ap.parse_args()
    if args.bare_client:
        return bare_client(args.bare_client)
    if args.per_call:
        return per_call(args)

    import torch

    from asyncrl.config import load_config
    from asyncrl.engine.hf import HFEngine
    from asyncrl.envs.base import make_env
    from asyncrl.envs.tasks import task_stream
    from asyncrl.lifecycle import freeze_startup_heap
    from asyncrl.models.loading import load_policy
    from asyncrl.rollout.workflow import RolloutContext, get_workflow

    torch.set_num_threads(args.threads)
    direct_cfg = load_config(args.config, args.overrides)
    agent_cfg = load_config(
        args.config, [*args.overrides, "env.type=agent", "env.agent=bench.bench_endpoint:answer_agent"]
    )
    async_cfg = load_config(
        args.config, [*args.overrides, "env.type=agent", "env.agent=bench.bench_endpoint:answer_agent_async"]
    )
    model, tok, _ = load_policy(direct_cfg.model, seed=direct_cfg.seed, prompt_format=direct_cfg.tasks.prompt_format)
    engine = HFEngine(model, tok)
    freeze_startup_heap()  # the model and libraries out of the collector's walks (as asyncrl serve does)
    paths = {
        name: (get_workflow("grpo", cfg), make_env(cfg.env), cfg)
        for name, cfg in (("direct", direct_cfg), ("endpoint", agent_cfg), ("async", async_cfg))
    }
    stream = task_stream(direct_cfg.tasks, 0)
    per = direct_cfg.actor.tasks_per_batch
    batches = [[next(stream) for _ in range(per)] for _ in range(args.batches)]

    def run(name: str) -> tuple[float, float]:
        wf, env, cfg = paths[name]
        t0, done, reward = time.perf_counter(), 0, 0.0
        for i, tasks in enumerate(batches):
            eps = wf.rollout(tasks, RolloutContext(engine, tok, env, cfg, "bench", 1000 + i))
            rows = [t for ep in eps for t in ep.trajectories]
            done += len(rows)
            reward += sum(t.reward for t in rows)
        return done / (time.perf_counter() - t0), reward / max(done, 1)

    for name in paths:  # warm every path (the endpoint's server, the agents' thread pool and loop)
        run(name)
    ratios: dict[str, list[float]] = {"endpoint": [], "async": []}
    print(
        f"{'round':>5} {'direct c/s':>11} {'sync agent':>11} {'ratio':>6} {'async agent':>12} {'ratio':>6}  "
        f"(reward direct / sync / async)"
    )
    for r in range(args.rounds):
        d, rd = run("direct")
        e, re_ = run("endpoint")
        a, ra = run("async")
        ratios["endpoint"].append(e / d)
        ratios["async"].append(a / d)
        print(
            f"{r:>5} {d:>11.1f} {e:>11.1f} {e / d:>6.2f} {a:>12.1f} {a / d:>6.2f}  ({rd:.3f} / {re_:.3f} / {ra:.3f})",
            flush=True,
        )
    for name, label in (("endpoint", "sync openai client"), ("async", "async openai client")):
        rs = ratios[name]
        print(
            f"endpoint ({label}) / direct completions/s: median {statistics.median(rs):.2f} (min {min(rs):.2f}, "
            f"max {max(rs):.2f}) over {args.rounds} rounds of {args.batches} batches x "
            f"{per * direct_cfg.sampling.n} completions"
        )


def per_call(args, concurrency: int = 64, rounds: int = 5) -> None:
    """Milliseconds per call by client kind, and the endpoint's own CPU per call: its event loop
    thread's and the serving thread's CPU clocks, less the engine's ``generate`` (each measured with
    its thread's CPU clock), over bare-socket rounds, with the clients in this process and then in a
    process of their own. Works on any version of the endpoint that has ``Endpoint(...)``, ``open``,
    ``wait_batch``, ``serve``, ``close`` and ``server.thread``."""
    import asyncio
    import json
    import subprocess
    import sys
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import openai
    import torch

    from asyncrl.config import SamplingConfig, load_config
    from asyncrl.endpoint.core import Endpoint
    from asyncrl.engine.hf import HFEngine
    from asyncrl.envs.agent import _ClientPool
    from asyncrl.models.loading import load_policy
    from asyncrl.prompts import render_tokens

    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.overrides)
    model, tok, _ = load_policy(cfg.model, seed=cfg.seed, prompt_format=cfg.tasks.prompt_format)
    engine = HFEngine(model, tok)
    ep = Endpoint(tok, "policy", SamplingConfig(max_new_tokens=1), engine.eos_ids, None, 60)
    stop = threading.Event()
    engine_cpu = [0.0]

    class TimedEngine:  # the engine, with the CPU its generate calls take counted apart
        def __getattr__(self, name):
            return getattr(engine, name)

        def generate(self, *a, **kw):
            t0 = time.thread_time()
            try:
                return engine.generate(*a, **kw)
            finally:
                engine_cpu[0] += time.thread_time() - t0

    timed_engine = TimedEngine()

    def serve():
        while not stop.is_set():
            calls = ep.wait_batch(concurrency, 0.1)
            if calls:
                ep.serve(timed_engine, calls, 0)

    serving = threading.Thread(target=serve, daemon=True)
    serving.start()
    body = {"model": "policy", "messages": [{"role": "user", "content": "12+34="}]}
    data = json.dumps(body).encode()
    pool = ThreadPoolExecutor(concurrency)
    local = threading.local()

    def bare():
        s = ep.open(None)
        bare_call(ep.port, s.token, data, local)
        s.close()

    client = subprocess.Popen(
        [sys.executable, __file__, "--bare-client", str(ep.port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def in_process_round():
        list(pool.map(lambda _: bare(), range(concurrency)))

    def out_of_process_round():
        sessions = [ep.open(None) for _ in range(concurrency)]
        client.stdin.write(" ".join(s.token for s in sessions) + "\n")
        client.stdin.flush()
        if client.stdout.readline().strip() != "ok":
            raise RuntimeError("the client process failed (see its error above)")
        for s in sessions:
            s.close()

    clocks = (time.pthread_getcpuclockid(ep.server.thread.ident), time.pthread_getcpuclockid(serving.ident))

    def own_cpu(one_round) -> tuple[float, float]:
        """(the event loop thread's, the serving thread's less the engine's) CPU ms per call."""
        one_round()  # warm
        engine_cpu[0], c0 = 0.0, [time.clock_gettime(c) for c in clocks]
        for _ in range(20 * rounds):
            one_round()
        calls = 20 * rounds * concurrency
        loop, serving_cpu = ((time.clock_gettime(c) - t) / calls * 1e3 for c, t in zip(clocks, c0))
        return loop, serving_cpu - engine_cpu[0] / calls * 1e3

    print(
        f"the endpoint's own CPU per call (bare sockets, kept-alive connections, {20 * rounds * concurrency} calls, "
        f"{concurrency} at once): its event loop thread + the serving thread less the engine",
        flush=True,
    )
    try:
        for label, one_round in (
            ("clients on threads of this process", in_process_round),
            ("clients in a process of their own", out_of_process_round),
        ):
            loop, rest = own_cpu(one_round)
            print(f"  {label:<36} {loop:.3f} + {rest:.3f} = {loop + rest:.3f} ms", flush=True)
    finally:
        client.stdin.close()
        client.wait(30)

    sync_client = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="-", max_retries=0)
    http = httpx.Client()
    lent = _ClientPool()  # what env.type=agent lends each running rollout: a client of its own

    def with_httpx():
        s = ep.open(None)
        http.post(f"{s.base_url}/chat/completions", content=data, headers={"Content-Type": "application/json"})
        s.close()

    def with_openai():
        s = ep.open(None)
        sync_client.with_options(base_url=s.base_url, api_key=s.token).chat.completions.create(**body)
        s.close()

    def with_lent_openai():
        c = getattr(local, "lent", None)
        if c is None:
            c = local.lent = lent.lease((False, 60.0))
        s = ep.open(None)
        c.with_options(base_url=s.base_url, api_key=s.token).chat.completions.create(**body)
        s.close()

    def threaded(fn):
        list(pool.map(lambda _: fn(), range(concurrency)))  # warm
        t0 = time.perf_counter()
        for _ in range(rounds):
            list(pool.map(lambda _: fn(), range(concurrency)))
        return (time.perf_counter() - t0) / (rounds * concurrency) * 1e3

    async def async_openai(each: bool):
        shared = openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="-", max_retries=0)
        clients = [lent.lease((True, 60.0)) if each else shared for _ in range(concurrency)]

        async def one(client):
            s = ep.open(None)
            await client.with_options(base_url=s.base_url, api_key=s.token).chat.completions.create(**body)
            s.close()

        await asyncio.gather(*[one(c) for c in clients])
        t0 = time.perf_counter()
        for _ in range(rounds):
            await asyncio.gather(*[one(c) for c in clients])
        return (time.perf_counter() - t0) / (rounds * concurrency) * 1e3

    t0 = time.perf_counter()
    for _ in range(rounds):
        engine.generate([render_tokens(tok, body["messages"])] * concurrency, SamplingConfig(max_new_tokens=1))
    gen_ms = (time.perf_counter() - t0) / (rounds * concurrency) * 1e3
    print(f"ms per call, {concurrency} concurrent rollouts, one new token each (engine alone: {gen_ms:.2f} ms):")
    for name, fn in (
        ("bare socket, threads", lambda: threaded(bare)),
        ("httpx, threads", lambda: threaded(with_httpx)),
        ("openai client, threads", lambda: threaded(with_openai)),
        ("openai async client, one event loop", lambda: asyncio.run(async_openai(False))),
        ("openai client each (as lent), threads", lambda: threaded(with_lent_openai)),
        ("openai async client each (as lent)", lambda: asyncio.run(async_openai(True))),
    ):
        print(f"  {name:<38} {fn():6.2f}", flush=True)
    stop.set()
    ep.close()


if __name__ == "__main__":
    main()
