"""Everything that can be wrong with a run's set-up, found before anything is built or written.

``asyncrl run``, ``learn`` and ``serve`` call :func:`preflight` right after the config loads and
before a model is built, a process is started or a file is written, so a mistake costs a second and
one line instead of a traceback after minutes of model building and a half-written run directory:

- the algorithm and its ``algo.*`` section (each algorithm validates its own section);
- ``env.type`` / ``env.reward`` import paths and the environment's construction; an agent function's
  own check (``fn.preflight()``, e.g. that the OpenEnv server it plays answers);
- the task source: every record of a task file (or of an import-path source) and the held-out split
  (``asyncrl.envs.tasks``);
- ``model.path`` (a Hugging Face directory) and the prompt format against its tokenizer;
- the prompt lengths of task files against ``tasks.max_prompt_tokens`` (default: the model's
  context length minus ``sampling.max_new_tokens``); import-path sources (e.g. Absolute Zero's
  seed programs) may hold text the workflow turns into prompts of its own, so they are not measured;
- experience replay's need for a workflow that takes per-task rollout counts;
- ``model.lora.target_modules`` against the model's linear layers; with ``engine.type=vllm`` what vLLM
  cannot honour (``sampling.top_p < 1``, a LoRA rank above vLLM's largest);
- the advantage estimator and policy loss names (``asyncrl.objectives.advantages``, ``asyncrl.objectives.losses``).

Every problem is a :class:`ConfigError` whose message is one line naming the field, file or
function and what was expected.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..config import Config, ConfigError


@dataclass
class Preflight:
    heldout: str  # one line: what the held-out set is (``asyncrl.envs.tasks.describe_heldout``)
    num_train_tasks: int | None  # None: a generated (endless) source
    num_heldout_tasks: int


def preflight(cfg: Config) -> Preflight:
    from ..envs.base import make_env
    from ..envs.tasks import describe_heldout, split_tasks
    from ..rollout.workflow import get_workflow

    workflow = get_workflow(cfg.algorithm, cfg)
    if cfg.replay.enabled and not workflow.supports_replay:
        raise ConfigError(
            f"replay.enabled needs a workflow that takes per-task rollout counts; algorithm "
            f"{cfg.algorithm!r} does not: use algorithm grpo or set replay.enabled=false"
        )
    env = make_env(cfg.env)
    if callable(getattr(env, "preflight", None)):
        env.preflight()
    train, heldout = split_tasks(cfg.tasks)  # holdout_fraction <= 0.9 always leaves training tasks
    if not cfg.model.embedded_default or cfg.tasks.type == "file":  # the user's model, or the user's prompts
        _check_model_and_prompts(cfg, (train or []) + heldout if cfg.tasks.type == "file" else [])
    if cfg.model.lora is not None:
        _check_lora(cfg)
    if cfg.engine.type == "vllm":  # what vLLM cannot honour exactly (nucleus log-probs, LoRA ranks)
        from ..engine.vllm import check_engine_config

        check_engine_config(cfg)
    return Preflight(describe_heldout(cfg.tasks, heldout, train), None if train is None else len(train), len(heldout))


def _check_lora(cfg: Config) -> None:
    """``model.lora.target_modules`` against the model's linear layers (a meta-device model: no weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..models.tiny import embedded_llama_config
    from ..models.tokenizer import build_char_tokenizer
    from ..weights.adapters import targeted

    if cfg.model.embedded_default:
        config = embedded_llama_config(cfg.model.embedded, len(build_char_tokenizer()))
    else:
        from ..models.loading import resolve_model_path

        config = AutoConfig.from_pretrained(resolve_model_path(cfg.model))
    with torch.device("meta"):
        targeted(AutoModelForCausalLM.from_config(config), cfg.model.lora)


def _check_model_and_prompts(cfg: Config, tasks: list) -> None:
    from ..prompts import render_tokens, set_prompt_format

    tokenizer, context, where = _tokenizer_and_context(cfg)
    set_prompt_format(tokenizer, cfg.tasks.prompt_format, where=where)
    limit = cfg.tasks.max_prompt_tokens
    if limit is None and context is not None:
        limit = context - cfg.sampling.max_new_tokens
        if limit < 1:
            raise ConfigError(
                f"sampling.max_new_tokens ({cfg.sampling.max_new_tokens}) leaves no room for a prompt "
                f"in the model's context of {context} tokens{where}"
            )
    if limit is None:
        return
    for task in tasks:
        n = len(render_tokens(tokenizer, task.prompt))
        if n > limit:
            source = (
                "tasks.max_prompt_tokens"
                if cfg.tasks.max_prompt_tokens
                else f"the model's context ({context}) minus sampling.max_new_tokens ({cfg.sampling.max_new_tokens})"
            )
            raise ConfigError(
                f"task {task.id}: its prompt is {n:,} tokens, more than {limit:,} ({source}); "
                f"shorten it or drop it from the task file"
            )


def _tokenizer_and_context(cfg: Config):
    """``(tokenizer, context length or None, ' in <where>')`` without loading any weights."""
    if cfg.model.embedded_default:
        from ..models.tokenizer import build_char_tokenizer

        return build_char_tokenizer(), cfg.model.embedded.max_positions, " of the embedded model"
    from transformers import AutoTokenizer

    from ..models.loading import resolve_model_path

    try:
        path = resolve_model_path(cfg.model)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad directory
        raise ConfigError(f"model.path {path}: cannot load its tokenizer ({type(e).__name__}: {e})") from None
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"model.path {path}: config.json is unreadable ({e})") from None
    context = next(
        (
            config[k]
            for k in ("max_position_embeddings", "n_positions", "max_seq_len")
            if isinstance(config.get(k), int)
        ),
        None,
    )
    return tokenizer, context, f" in {path}"
