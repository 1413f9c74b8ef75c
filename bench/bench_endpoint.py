"""Endpoint overhead: completions/s through the actor's OpenAI-compatible endpoint (env.type=agent,
an agent making one chat call per rollout with the ``openai`` client) against the direct engine call
(env.type=single_turn), on the quick-start task and model, same batches, same engine.

    python bench/bench_endpoint.py [--rounds 5] [--batches 4] [--threads 2] [KEY=VALUE ...]

KEY=VALUE overrides apply to both paths (e.g. ``sampling.max_new_tokens=64`` for longer completions).

``--per-call`` prints where an endpoint call's time goes instead: the endpoint's own CPU per call
(the process's CPU less the clients' and the engine's), then the milliseconds per call of 64
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", type=int, default=4, help="actor batches per path per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--per-call", action="store_true", help="per-call cost by client kind (see the doc)")
    ap.add_argument("overrides", nargs="*", help="config overrides for both paths")
    args = ap.parse_args()
    if args.per_call:
        return per_call(args)

    import torch

    from asyncrl.config import load_config
    from asyncrl.engine.hf import HFEngine
    from asyncrl.envs.base import make_env
    from asyncrl.lifecycle import freeze_startup_heap
    from asyncrl.envs.tasks import task_stream
    from asyncrl.models.loading import load_policy
    from asyncrl.rollout.workflow import RolloutContext, get_workflow

    torch.set_num_threads(args.threads)
    direct_cfg = load_config(args.config, args.overrides)
    agent_cfg = load_config(args.config, [*args.overrides, "env.type=agent", "env.agent=bench.bench_endpoint:answer_agent"])
    async_cfg = load_config(args.config, [*args.overrides, "env.type=agent",
                                          "env.agent=bench.bench_endpoint:answer_agent_async"])
    model, tok, _ = load_policy(direct_cfg.model, seed=direct_cfg.seed, prompt_format=direct_cfg.tasks.prompt_format)
    engine = HFEngine(model, tok)
    freeze_startup_heap()  # the model and libraries out of the collector's walks (as asyncrl serve does)
    paths = {name: (get_workflow("grpo", cfg), make_env(cfg.env), cfg) for name, cfg in
             (("direct", direct_cfg), ("endpoint", agent_cfg), ("async", async_cfg))}
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
    print(f"{'round':>5} {'direct c/s':>11} {'sync agent':>11} {'ratio':>6} {'async agent':>12} {'ratio':>6}  "
          f"(reward direct / sync / async)")
    for r in range(args.rounds):
        d, rd = run("direct")
        e, re_ = run("endpoint")
        a, ra = run("async")
        ratios["endpoint"].append(e / d)
        ratios["async"].append(a / d)
        print(f"{r:>5} {d:>11.1f} {e:>11.1f} {e / d:>6.2f} {a:>12.1f} {a / d:>6.2f}  ({rd:.3f} / {re_:.3f} / {ra:.3f})",
              flush=True)
    for name, label in (("endpoint", "sync openai client"), ("async", "async openai client")):
        rs = ratios[name]
        print(f"endpoint ({label}) / direct completions/s: median {statistics.median(rs):.2f} (min {min(rs):.2f}, "
              f"max {max(rs):.2f}) over {args.rounds} rounds of {args.batches} batches x "
              f"{per * direct_cfg.sampling.n} completions")


def per_call(args, concurrency: int = 64, rounds: int = 5) -> None:
    """Milliseconds per call by client kind, and the endpoint's own CPU per call: the process's CPU
    time less what the clients' threads and the engine's ``generate`` spent (each measured with its
    thread's CPU clock), over the bare-socket rounds. Works on any version of the endpoint that has
    ``Endpoint(...)``, ``open``, ``wait_batch``, ``serve`` and ``close``."""
    import asyncio
    import json
    import socket
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import openai
    import torch

    from asyncrl.config import SamplingConfig, load_config
    from asyncrl.engine.hf import HFEngine
    from asyncrl.models.loading import load_policy
    from asyncrl.envs.prompts import render_tokens
    from asyncrl.envs.endpoint import Endpoint

    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.overrides)
    model, tok, _ = load_policy(cfg.model, seed=cfg.seed, prompt_format=cfg.tasks.prompt_format)
    engine = HFEngine(model, tok)
    ep = Endpoint(tok, "policy", SamplingConfig(max_new_tokens=1), engine.eos_ids, None, 60)
    stop = threading.Event()
    cpu = {"engine": 0.0, "clients": 0.0}
    cpu_lock = threading.Lock()

    def serve():
        while not stop.is_set():
            calls = ep.wait_batch(concurrency, 0.1)
            if calls:
                ep.serve(timed_engine, calls, 0)

    class TimedEngine:  # the engine, with the CPU its generate calls take counted apart
        def __getattr__(self, name):
            return getattr(engine, name)

        def generate(self, *a, **kw):
            t0 = time.thread_time()
            try:
                return engine.generate(*a, **kw)
            finally:
                cpu["engine"] += time.thread_time() - t0

    timed_engine = TimedEngine()
    serving = threading.Thread(target=serve, daemon=True)
    serving.start()
    body = {"model": "policy", "messages": [{"role": "user", "content": "12+34="}]}
    data = json.dumps(body).encode()
    pool = ThreadPoolExecutor(concurrency)

    local = threading.local()

    def bare():  # one kept-alive connection per client thread, as a pooled HTTP client holds
        t0 = time.thread_time()
        s = ep.open(None)
        head = (f"POST /s/{s.token}/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        c = getattr(local, "conn", None)
        if c is None:
            c = local.conn = socket.create_connection(("127.0.0.1", ep.port))
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c.sendall(head + data)
        got = b""
        while b"\r\n\r\n" not in got:
            got += c.recv(65536)
        header, _, rest = got.partition(b"\r\n\r\n")
        length = int(next(line.split(b":", 1)[1] for line in header.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        while len(rest) < length:
            rest += c.recv(65536)
        s.close()
        with cpu_lock:
            cpu["clients"] += time.thread_time() - t0

    sync_client = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="-", max_retries=0)
    http = httpx.Client()

    def with_httpx():
        s = ep.open(None)
        http.post(f"{s.base_url}/chat/completions", content=data, headers={"Content-Type": "application/json"})
        s.close()

    def with_openai():
        s = ep.open(None)
        sync_client.with_options(base_url=s.base_url, api_key=s.token).chat.completions.create(**body)
        s.close()

    from asyncrl.envs.agent import _ClientPool

    lent = _ClientPool()  # what env.type=agent lends each running rollout: a client of its own

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
        engine.generate([render_tokens(tok, body["messages"])] * concurrency,
                        SamplingConfig(max_new_tokens=1))
    gen_ms = (time.perf_counter() - t0) / (rounds * concurrency) * 1e3
    list(pool.map(lambda _: bare(), range(concurrency)))  # warm
    calls = 20 * rounds * concurrency
    cpu.update(engine=0.0, clients=0.0)
    server = getattr(getattr(ep, "server", None), "thread", None)  # the ASGI server's event loop thread
    clocks = {"server": time.pthread_getcpuclockid(server.ident) if server is not None else None,
              "serving": time.pthread_getcpuclockid(serving.ident)}
    c0 = {k: time.clock_gettime(v) for k, v in clocks.items() if v is not None}
    p0 = time.process_time()
    for _ in range(20 * rounds):
        list(pool.map(lambda _: bare(), range(concurrency)))
    own = (time.process_time() - p0 - cpu["engine"] - cpu["clients"]) / calls * 1e3
    used = {k: (time.clock_gettime(clocks[k]) - c0[k]) / calls * 1e3 for k in c0}
    print(f"endpoint's own CPU per call (bare socket, kept-alive connections, {calls} calls, {concurrency} at once):\n"
          f"  process CPU less the clients' and the engine's: {own:.3f} ms  [engine {cpu['engine'] / calls * 1e3:.3f} ms, "
          f"clients {cpu['clients'] / calls * 1e3:.3f} ms per call]", flush=True)
    if "server" in used:
        print(f"  the server's event loop thread {used['server']:.3f} ms + the serving thread less the engine "
              f"{used['serving'] - cpu['engine'] / calls * 1e3:.3f} ms = "
              f"{used['server'] + used['serving'] - cpu['engine'] / calls * 1e3:.3f} ms", flush=True)
    print(f"ms per call, {concurrency} concurrent rollouts, one new token each (engine alone: {gen_ms:.2f} ms):")
    for name, fn in (("bare socket, threads", lambda: threaded(bare)), ("httpx, threads", lambda: threaded(with_httpx)),
                     ("openai client, threads", lambda: threaded(with_openai)),
                     ("openai async client, one event loop", lambda: asyncio.run(async_openai(False))),
                     ("openai client each (as lent), threads", lambda: threaded(with_lent_openai)),
                     ("openai async client each (as lent)", lambda: asyncio.run(async_openai(True)))):
        print(f"  {name:<38} {fn():6.2f}", flush=True)
    stop.set()
    ep.close()


if __name__ == "__main__":
    main()
