"""Endpoint overhead: completions/s through the actor's OpenAI-compatible endpoint (env.type=agent,
an agent making one chat call per rollout with the ``openai`` client) against the direct engine call
(env.type=single_turn), on the quick-start task and model, same batches, same engine.

    python bench/bench_endpoint.py [--rounds 5] [--batches 4] [--threads 2] [KEY=VALUE ...]

KEY=VALUE overrides apply to both paths (e.g. ``sampling.max_new_tokens=64`` for longer completions).

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
    ap.add_argument("overrides", nargs="*", help="config overrides for both paths")
    args = ap.parse_args()

    import torch

    from asyncrl.config import load_config
    from asyncrl.engine.hf import HFEngine
    from asyncrl.envs.base import make_env
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


if __name__ == "__main__":
    main()
