"""Loading the policy: the embedded tiny model or any local Hugging Face causal-LM directory."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from packaging.version import Version
from transformers import AutoModelForCausalLM, AutoTokenizer

transformers.utils.logging.disable_progress_bar()  # per-process "Loading weights" bars clutter run logs

from ..config import Config, ModelConfig
from .prompts import set_prompt_format
from .tiny import build_embedded_model, read_model_info

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# transformers renamed ``torch_dtype`` to ``dtype`` in 4.56
_DTYPE_KW = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


def resolve_model_path(model_cfg: ModelConfig, seed: int = 0, progress: bool = True) -> Path:
    """The model directory: ``model_cfg.path``, or the embedded model (built on first use)."""
    if model_cfg.path is None:
        return build_embedded_model(model_cfg.embedded, seed=seed, progress=progress)
    path = Path(model_cfg.path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model.path {str(path)!r} is not a directory; give a local Hugging Face model directory "
            f"(with config.json), or leave model.path empty for the embedded model")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model.path {str(path)!r} has no config.json; it is not a Hugging "
                                f"Face model directory")
    return path


def load_policy(model_cfg: ModelConfig, seed: int = 0, device: str = "cpu", prompt_format: str = "auto"):
    """Load ``(model, tokenizer, path)``; the model is in ``model_cfg.dtype`` on ``device``, eval mode.

    A tokenizer without a pad token gets its EOS token as pad. ``prompt_format`` (``tasks.prompt_format``)
    decides how prompts are rendered for the tokenizer (``asyncrl.models.prompts.set_prompt_format``).
    """
    path = resolve_model_path(model_cfg, seed=seed)
    model = AutoModelForCausalLM.from_pretrained(path, **{_DTYPE_KW: _DTYPES[model_cfg.dtype]})
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"the tokenizer in {path} has neither a pad nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    set_prompt_format(tokenizer, prompt_format, where=f" in {path}")
    return model.to(device).eval(), tokenizer, path


def init_model(cfg: Config) -> Path:
    """``asyncrl init-model``: build (or find) the embedded model and print what it is, with the
    accuracy of the format it was warm-started for: plain arithmetic (``a+b=``) from the build's
    own measurement; any other format (e.g. RLCR's tags) measured as the run will measure it, with
    the config's held-out evaluation at version 0 (``asyncrl.learner.evaluate.Evaluator``)."""
    path = build_embedded_model(cfg.model.embedded, seed=cfg.seed, progress=cfg.log.progress)
    info = read_model_info(path)
    formats = list(cfg.model.embedded.warmstart_formats)
    print(f"embedded model: {path}")
    print(f"  parameters: {info.get('num_parameters', 0):,}")
    print(f"  warm-start steps: {info.get('steps')}  (built in {info.get('build_seconds')} s; formats: "
          f"{', '.join(formats)})")
    nan = float("nan")
    if "arithmetic" in formats:
        print(f"  held-out accuracy, plain arithmetic (a+b=): sampled (T=1) {info.get('sampled_accuracy', nan):.3f} "
              f"(expected {info.get('expected_accuracy', nan):.3f}), greedy {info.get('greedy_accuracy', nan):.3f}")
    if formats != ["arithmetic"]:
        print(f"  {_initial_evaluation_line(cfg)}")
    return path


def _initial_evaluation_line(cfg: Config) -> str:
    """The run's held-out evaluation of the freshly built model (version 0), as one line."""
    from ..learner.evaluate import Evaluator

    model, tokenizer, _ = load_policy(cfg.model, cfg.seed, cfg.train.device, cfg.tasks.prompt_format)
    evaluator = Evaluator(cfg, tokenizer)
    result = evaluator.maybe_run(model, 0, force=True)
    if not result:
        return "held-out accuracy: not measured (no held-out tasks: eval.size or tasks.eval_size is 0)"
    how = "greedy" if result.get("greedy") else f"T={cfg.eval.temperature:g}"
    line = (f"held-out accuracy as a {cfg.algorithm} run measures it ({result.get('size', len(evaluator.tasks))} "
            f"tasks, {how}): {result['accuracy']:.3f}")
    if "confidence_parse_fail" in result:  # RLCR: the calibration the run starts from
        from ..analysis import NA, calibration_summary

        c = calibration_summary(result)
        ece, brier = (NA if c[k] is None else f"{c[k]:.3f}" for k in ("ece", "brier"))
        line += (f"; ECE {ece}, Brier {brier} ({c['parsed']} of {c['size']} confidences parsed; "
                 f"answer format failures {result.get('answer_format_fail', 0):.0%})")
    return line
