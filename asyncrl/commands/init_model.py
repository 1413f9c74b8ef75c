"""``asyncrl init-model``: build (or find in the cache) the embedded model and say how good it is."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..config import Config, SamplingConfig
from ..engine.hf import HFEngine
from ..envs.arithmetic import arithmetic_reward
from ..models.loading import load_model, load_policy, load_tokenizer
from ..models.tiny import build_embedded_model, heldout_tasks, read_model_info
from ..rollout.workflow import workflow_class
from ..types import Task


def init_model(cfg: Config) -> Path:
    """``asyncrl init-model``: build (or find) the embedded model and print what it is, with the
    accuracy of the format it was warm-started for: plain arithmetic (``a+b=``) from the build's
    sampled (T=1) and greedy replies to the build's held-out problems; any other format (e.g. RLCR's tags) measured as the run will measure it, with
    the config's held-out evaluation at version 0 (``asyncrl.learner.evaluate.Evaluator``)."""
    path = build_embedded_model(
        cfg.model.embedded,
        seed=cfg.seed,
        progress=cfg.log.progress,
        formats=workflow_class(cfg.algorithm).warmstart_formats,
    )
    info = read_model_info(path)
    formats = list(cfg.model.embedded.warmstart_formats)
    print(f"embedded model: {path}")
    print(f"  parameters: {info.get('num_parameters', 0):,}")
    print(
        f"  warm-start steps: {info.get('steps')}  (built in {info.get('build_seconds')} s; formats: "
        f"{', '.join(formats)})"
    )
    if made := info.get("built_with"):  # (another machine's kernels build another model: see models/tiny.py)
        print(
            f"  built with: {made['cpu_kernels']} CPU kernels, torch {made['torch']}, "
            f"transformers {made['transformers']}"
        )
    nan = float("nan")
    if "arithmetic" in formats:
        model, tokenizer = load_model(path, "float32", "cpu"), load_tokenizer(path)
        sampled = evaluate_accuracy(model, tokenizer, heldout_tasks(), 1.0, cfg.seed)
        greedy = evaluate_accuracy(model, tokenizer, heldout_tasks(), 1e-6, cfg.seed)
        print(
            f"  held-out accuracy, plain arithmetic (a+b=): sampled (T=1) {sampled:.3f} "
            f"(expected {info.get('expected_accuracy', nan):.3f}), greedy {greedy:.3f}"
        )
    if formats != ["arithmetic"]:
        print(f"  {_initial_evaluation_line(cfg)}")
    return path


def evaluate_accuracy(
    model, tokenizer, tasks: list[Task], temperature: float, seed: int, max_new_tokens: int = 8
) -> float:
    """Fraction of ``tasks`` answered exactly right, sampling one reply each at ``temperature``.

    A temperature of ~1e-6 is greedy decoding. Uses its own seeded generator (no global RNG use).
    """
    engine = HFEngine(model, tokenizer, device=str(next(model.parameters()).device))
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(t.prompt, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        for t in tasks
    ]
    sampling = SamplingConfig(n=1, temperature=temperature, max_new_tokens=max_new_tokens)
    gens = engine.generate(prompts, sampling, seed=seed)
    return float(np.mean([arithmetic_reward(t, g.text) for t, g in zip(tasks, gens)]))


def _initial_evaluation_line(cfg: Config) -> str:
    """The run's held-out evaluation of the freshly built model (version 0), as one line."""
    from ..learner.evaluate import Evaluator

    model, tokenizer, _ = load_policy(
        cfg.model, cfg.seed, cfg.train.device, cfg.tasks.prompt_format, workflow_class(cfg.algorithm).warmstart_formats
    )
    evaluator = Evaluator(cfg, tokenizer)
    result = evaluator.maybe_run(model, 0, force=True)
    if not result:
        return "held-out accuracy: not measured (no held-out tasks: eval.size or tasks.eval_size is 0)"
    how = "greedy" if result.get("greedy") else f"T={cfg.eval.temperature:g}"
    line = (
        f"held-out accuracy as a {cfg.algorithm} run measures it ({result.get('size', len(evaluator.tasks))} "
        f"tasks, {how}): {result['accuracy']:.3f}"
    )
    if "confidence_parse_fail" in result:  # RLCR: the calibration the run starts from
        from ..analysis import NA, calibration_summary

        c = calibration_summary(result)
        ece, brier = (NA if c[k] is None else f"{c[k]:.3f}" for k in ("ece", "brier"))
        line += (
            f"; ECE {ece}, Brier {brier} ({c['parsed']} of {c['size']} confidences parsed; "
            f"answer format failures {result.get('answer_format_fail', 0):.0%})"
        )
    return line
