"""``asyncrl replay RUN [--to STEP] [KEY=VALUE ...]``: train a run's archived episodes again, with no
actors (the run needs ``log.archive_episodes: true``; :mod:`asyncrl.learner.archive`).

The model, the trainer and the learner's thread count are built as the run's learner built them,
then each archived step's episodes are collated and trained in their order. With the run's own
config the weights at every checkpoint the run kept are compared with the run's, bit for bit (on
the same machine and versions they are equal; the report says which tensors differ if not). With
overrides (another ``train.policy_loss``, estimator, correction, ...) it is an offline "what if" on
exactly the episodes the run saw.

The replay is a run directory of its own beside the run (``<run>-replay`` or ``--name``): its
``config.yaml``, ``metrics.jsonl`` (each step's training figures), the weights at the run's
checkpoint steps (``checkpoints/step_<k>/model``) and ``replay.json`` (the source, the overrides, the
label and the comparison), so that the UI's runs table shows it beside the run.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from ..config import ConfigError, deterministic_torch, load_config
from ..rundir.layout import CONFIG, checkpoint_dir, checkpoint_step, list_checkpoints

REPLAY = "replay.json"


def compare_states(mine: dict, theirs: dict) -> dict:
    """Bit-for-bit comparison of two state dicts over the tensors ``theirs`` holds."""
    import torch

    differ, worst = [], 0.0
    for name, t in theirs.items():
        m = mine.get(name)
        if m is None or m.shape != t.shape or m.dtype != t.dtype or not torch.equal(m.cpu(), t):
            differ.append(name)
            if m is not None and m.shape == t.shape:
                worst = max(worst, float((m.cpu().double() - t.double()).abs().max()))
    return {"identical": not differ, "tensors": len(theirs), "differing": differ[:20], "max_abs_diff": worst}


def _plan(run: Path, to: int | None, overrides: list[str], name: str | None, overwrite: bool):
    from ..learner.archive import archived_steps, read_meta, verify_steps

    meta = read_meta(run)
    if meta.get("distributed", "none") != "none":
        raise ConfigError(
            f"{run} was trained by a learner group (train.distributed={meta['distributed']}); asyncrl "
            f"replay trains in one process, which does not reproduce a group's reductions bit for bit"
        )
    if not (run / CONFIG).exists():
        raise ConfigError(f"{run / CONFIG} is missing: not a run directory")
    cfg = load_config(run / CONFIG, [*overrides, "log.archive_episodes=false"])
    steps = archived_steps(run)
    end = (max(steps) + 1 if steps else 0) if to is None else to
    missing = sorted(set(range(end)) - set(steps))
    if end < 1 or missing:
        raise ConfigError(
            f"{run}: the archive holds steps {steps[0] if steps else '-'}..{steps[-1] if steps else '-'}"
            f"{f', missing {missing[:5]}' if missing else ''}; cannot replay up to step {end}"
        )
    verify_steps(run, range(end))  # a damaged record stops the replay before it starts
    out = run.parent / (name or (f"{run.name}-replay" if not overrides else f"{run.name}-whatif"))
    if out.exists():
        if not overwrite:
            raise ConfigError(f"{out} exists; pass --name for another directory or --overwrite to replace it")
        shutil.rmtree(out)
    return meta, cfg, end, out


def replay(
    run: Path,
    to: int | None = None,
    overrides: list[str] | None = None,
    name: str | None = None,
    overwrite: bool = False,
    say=print,
) -> dict:
    """Replay ``run`` up to step ``to`` (default: every archived step); returns the report."""
    import torch

    from ..learner.archive import read_step
    from ..learner.checkpoint import read_checkpoint
    from ..learner.ingest.staleness import StalenessPolicy
    from ..learner.training.ranks import Ranks, load_trainable
    from ..rollout.workflow import workflow_class
    from ..rundir.runlog import RunLog

    overrides = list(overrides or [])
    meta, cfg, end, out = _plan(Path(run), to, overrides, name, overwrite)
    torch.manual_seed(cfg.seed)  # as the learner does before it builds the model
    torch.set_num_threads(int(meta["threads"]))
    deterministic_torch(cfg)
    workflow = workflow_class(cfg.algorithm)
    model, tokenizer, _ = load_trainable(cfg)  # as the learner loads it
    staleness = StalenessPolicy.from_config(cfg)
    ranks = Ranks(None, "none")
    trainer = ranks.start(cfg, model, tokenizer, staleness)
    saved = {checkpoint_step(p): p for p in list_checkpoints(run)}
    label = "replay" if not overrides else "what-if: " + " ".join(overrides)
    out.mkdir(parents=True)
    (out / CONFIG).write_text((run / CONFIG).read_text() if not overrides else _dump(cfg))
    log = RunLog(out)
    report = {"source": str(run), "overrides": overrides, "label": label, "steps": end, "checkpoints": []}
    t0 = time.time()
    for version in range(end):
        episodes, keep_rows = read_step(run, version)
        batch = trainer.make_batch(episodes) if any(ep.trajectories for ep in episodes) else None
        truncated = staleness.truncate(batch, version) if batch is not None else 0
        result = ranks.step(batch, keep_rows=keep_rows, version=version) if batch is not None else None
        rewards = [t.reward for ep in episodes for t in ep.trajectories if workflow.counts_for_reward(t)]
        log.metric(
            version + 1,
            {
                "version": version + 1,
                "reward_mean": sum(rewards) / max(len(rewards), 1),
                "batch_trajectories": batch.batch_size if batch is not None else 0,
                "staleness/tokens_truncated": truncated,
                **(result.stats if result else {}),
            },
        )
        if version + 1 in saved:
            report["checkpoints"].append(_check(version + 1, saved[version + 1], ranks.plain, out, read_checkpoint))
        if (version + 1) % 10 == 0 or version + 1 == end:
            say(f"[replay] step {version + 1}/{end} ({time.time() - t0:.0f} s)", flush=True)
    report["identical"] = all(c["identical"] for c in report["checkpoints"]) if report["checkpoints"] else None
    log.event("replay", end, **report)
    log.close()
    (out / REPLAY).write_text(json.dumps(report, indent=1))
    return {**report, "out": str(out)}


def _check(step: int, path: Path, model, out: Path, read_checkpoint) -> dict:
    """Compare the replay's weights at ``step`` with the run's checkpoint there; save the replay's."""
    from ..models.lora import adapter_state, is_lora

    theirs, _, _ = read_checkpoint(path, model)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    mine = adapter_state(state) if is_lora(model) else state
    done = {"step": step, **compare_states(mine, theirs)}
    model.save_pretrained(checkpoint_dir(out, step) / "model", state_dict=state, safe_serialization=True)
    return done


def _dump(cfg) -> str:
    import yaml

    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
