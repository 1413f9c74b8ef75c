"""``asyncrl probe``: will GRPO have anything to learn from on this model and these tasks?

Before spending an hour of training, sample the run's model on some of its training tasks exactly as an
actor would (the run's sampling settings, environment and reward), and greedily as the evaluation does,
and say what a group-relative method can use: a group of ``sampling.n`` replies teaches only when its
rewards differ. A task set where almost every group is all-wrong (or all-right) gives GRPO nothing; one
where the model starts around 0.2-0.6 gives it the most.
"""

from __future__ import annotations

import time

from ..config import Config, SamplingConfig


def probe(cfg: Config, num_tasks: int = 32, out=print) -> dict:
    """Sample ``num_tasks`` training tasks ``sampling.n`` times and greedily; print and return the figures."""
    import torch

    from ..engine import make_engine
    from ..envs.base import make_env
    from ..learner.evaluate import GREEDY_TEMPERATURE
    from ..models.loading import load_model, load_tokenizer, resolve_model_path
    from ..objectives.advantages import one_per_rollout
    from ..rollout.conversation import run_conversations, scored_trajectories, start_conversations
    from ..rollout.workflow import get_workflow

    torch.manual_seed(cfg.seed)
    workflow = get_workflow(cfg.algorithm, cfg)
    path = resolve_model_path(cfg.model, cfg.seed, warmstart_formats=type(workflow).warmstart_formats)
    tokenizer = load_tokenizer(path, cfg.tasks.prompt_format)
    engine = make_engine(cfg, path, tokenizer, lambda: load_model(path, cfg.model.dtype, cfg.engine.device))
    env = make_env(cfg.env, stop_on_failures=False)
    tasks = _training_tasks(cfg, num_tasks)
    n, s = cfg.sampling.n, cfg.sampling
    out(
        f"[probe] {path.name}: {len(tasks)} training tasks x {n} samples (temperature {s.temperature:g}, "
        f"{s.max_new_tokens} new tokens), then greedy"
    )

    def run(k: int, sampling: SamplingConfig, seed: int):
        convs = start_conversations(tokenizer, env, tasks, k, group_ids=[t.id for t in tasks])
        t0 = time.time()
        run_conversations(engine, tokenizer, env, convs, sampling, cfg.env.max_turns, seed=seed)
        trajs, failures = scored_trajectories(convs, env, 0)
        return one_per_rollout(trajs), failures, time.time() - t0

    sampled, failed, sample_s = run(n, s, cfg.seed)
    greedy_cfg = SamplingConfig(
        n=1, temperature=GREEDY_TEMPERATURE, top_p=1.0, max_new_tokens=s.max_new_tokens, stop=s.stop
    )
    greedy, _, greedy_s = run(1, greedy_cfg, cfg.seed + 1)
    result = _figures(tasks, n, sampled, failed, greedy, sample_s, greedy_s)
    _say(result, n, sampled, failed, out)
    return result


def _training_tasks(cfg: Config, num_tasks: int) -> list:
    """Up to ``num_tasks`` distinct training tasks (never the held-out ones)."""
    from ..envs.tasks import task_stream

    tasks, seen = [], set()
    for task in task_stream(cfg.tasks, cfg.seed):
        if task.id not in seen:
            seen.add(task.id)
            tasks.append(task)
        if len(tasks) >= num_tasks or len(seen) > 50 * num_tasks:
            break
    return tasks


def _figures(tasks: list, n: int, sampled: list, failed: list, greedy: list, sample_s: float, greedy_s: float) -> dict:
    """What GRPO can use: rewards, the groups whose rewards differ, pass@n, greedy accuracy, stops."""
    from ..learner.evaluate import pass_at_k

    by_task: dict[str, list[float]] = {t.id: [] for t in tasks}
    for t in sampled:
        by_task[t.group_id].append(t.reward)
    groups = [r for r in by_task.values() if r]
    mixed = sum(len(set(r)) > 1 for r in groups)
    right = [sum(x >= 1.0 for x in r) for r in groups]
    tokens = sum(len(t.token_ids) - int((t.loss_mask == 0).sum()) for t in sampled)
    result = {
        "tasks": len(tasks),
        "samples": len(sampled),
        "failures": len(failed),
        "groups": len(groups),
        "groups_mixed": mixed,
        "sampled_reward": sum(t.reward for t in sampled) / max(len(sampled), 1),
        "sampled_accuracy": sum(t.reward >= 1.0 for t in sampled) / max(len(sampled), 1),
        "groups_with_signal": mixed / max(len(groups), 1),
        f"pass@{n}": sum(pass_at_k(len(r), c, len(r)) for r, c in zip(groups, right)) / max(len(groups), 1),
        "greedy_accuracy": sum(t.reward >= 1.0 for t in greedy) / max(len(greedy), 1),
        "stopped_share": sum((t.metadata.get("finish_reasons") or ["length"])[-1] == "stop" for t in sampled)
        / max(len(sampled), 1),
        "tokens_per_s": tokens / max(sample_s, 1e-9),
        "sample_s": sample_s,
        "greedy_s": greedy_s,
    }
    return result


def _say(result: dict, n: int, sampled: list, failed: list, out) -> None:
    """The figures in four lines, three samples to read, and a verdict."""
    mixed, groups, sample_s, greedy_s = result["groups_mixed"], result["groups"], result["sample_s"], result["greedy_s"]
    out(
        f"[probe] sampled: reward {result['sampled_reward']:.3f}, accuracy {result['sampled_accuracy']:.3f}, "
        f"pass@{n} {result[f'pass@{n}']:.3f}; greedy accuracy {result['greedy_accuracy']:.3f}"
    )
    out(
        f"[probe] groups whose {n} rewards differ (what GRPO learns from): {mixed} of {groups} "
        f"({100 * result['groups_with_signal']:.0f}%); replies that ended (EOS or a stop string) "
        f"{100 * result['stopped_share']:.0f}%, the rest hit sampling.max_new_tokens"
    )
    out(
        f"[probe] {len(sampled)} samples in {sample_s:.0f} s ({result['tokens_per_s']:.0f} generated tokens/s), "
        f"greedy in {greedy_s:.0f} s" + (f"; {len(failed)} rollouts failed" if failed else "")
    )
    for t in sampled[:: max(1, len(sampled) // 3)][:3]:
        out(f"[probe]   e.g. reward {t.reward:g}: {t.text[:120]!r}")
    share = result["groups_with_signal"]
    verdict = (
        "little to learn from: most groups are all wrong (an easier task, a longer sampling.max_new_tokens, "
        "a clearer answer format in the prompt or the reward) or all right (a harder task)"
        if share < 0.25
        else "GRPO has signal here"
        if share >= 0.5
        else "some signal: expect slow progress; a task where more groups mix right and wrong learns faster"
    )
    out(f"[probe] {verdict}")
