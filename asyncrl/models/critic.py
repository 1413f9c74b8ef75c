"""The critic of ``train.advantage.estimator: gae``: a copy of the policy's architecture whose output
layer is a scalar head.

The critic is the causal LM itself with its ``lm_head`` replaced by ``Linear(hidden, 1)`` (weights
and bias zero at the start, so every value starts at 0): the same class, the same decoder layers for
FSDP2, the same packed forward (:func:`asyncrl.learner.training.batch.value_rows` reads its one
"logit" as the value). Its body is a copy of the policy's initial weights (``critic.path`` null) or
the causal LM at ``critic.path``. With ``model.lora`` the body is the frozen base with LoRA adapters
of the critic's own; the head trains with them.

``asyncrl export --critic`` writes it as a Hugging Face token-classification model with one label
(``AutoModelForTokenClassification``: the body as ``model.*``, the head as ``score``), the usual
way a value model is shipped (TRL's, OpenRLHF's).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from .lora import is_lora

HEAD = "lm_head"  # the attribute the head replaces (a causal LM's output layer)


def language_model(model) -> torch.nn.Module:
    """The causal LM under peft's wrapper (``model`` itself without one)."""
    return model.get_base_model() if is_lora(model) else model


def add_value_head(model) -> torch.nn.Module:
    """``model`` (a causal LM, possibly under peft) with its output layer replaced by a zero
    ``Linear(hidden, 1)`` in the dtype and on the device of the layer it replaces; in place."""
    lm = language_model(model)
    old = lm.get_output_embeddings()
    if old is None:
        raise ValueError(f"{type(lm).__name__} has no output layer to put a value head in place of")
    head = torch.nn.Linear(lm.config.hidden_size, 1, bias=True, dtype=old.weight.dtype, device=old.weight.device)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    lm.set_output_embeddings(head)
    lm.config.tie_word_embeddings = False  # (a later tie_weights must not put the embedding back)
    return model


def build_critic(policy, critic_cfg, model_cfg, seed: int, device: str = "cpu") -> torch.nn.Module:
    """The critic for a run: ``critic.path``'s causal LM (with adapters of its own under
    ``model.lora``), or a copy of ``policy`` (taken before the policy trains or is wrapped), with a
    value head. Only what trains requires grad: the whole model, or the adapters and the head."""
    if critic_cfg.path:
        from .loading import load_model
        from .lora import with_adapters

        body = load_model(critic_cfg.path, model_cfg.dtype, device)
        body = with_adapters(body, model_cfg, seed, base=critic_cfg.path)
    else:
        body = copy.deepcopy(policy)
    critic = add_value_head(body)
    critic.train()
    return critic


def trainable_names(model) -> set[str]:
    """The names of ``model``'s parameters that train: what a critic checkpoint holds (the whole
    model, or with ``model.lora`` its adapters and head; the frozen base is the policy's)."""
    return {n for n, p in model.named_parameters() if p.requires_grad}


def trainable_state(model, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The entries of ``state`` (default: ``model``'s) that train (:func:`trainable_names`)."""
    names = trainable_names(model)
    state = model.state_dict() if state is None else state
    return {k: v.detach().cpu() for k, v in state.items() if k in names}


def export_critic(critic, out: Path) -> Path:
    """Write ``critic`` (one process, weights loaded) to ``out`` as a Hugging Face token-classification
    model with one label: adapters merged into the body, the head as ``score``."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    model = critic
    if is_lora(model):
        model = model.merge_and_unload()
    lm = language_model(model)
    config = AutoConfig.for_model(**{**lm.config.to_dict(), "num_labels": 1, "tie_word_embeddings": False})
    config.architectures = None
    classifier = AutoModelForTokenClassification.from_config(config)
    state = {(f"score.{k[len(HEAD) + 1 :]}" if k.startswith(HEAD + ".") else k): v for k, v in lm.state_dict().items()}
    missing, unexpected = classifier.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not m.startswith("score.")]:
        raise ValueError(
            f"the critic does not map onto {type(classifier).__name__}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    classifier.save_pretrained(out, safe_serialization=True)
    return out


def export_run_critic(
    run_dir: Path, out: Path | None = None, step: int | None = None, formats_of=None
) -> tuple[Path, Path]:
    """``asyncrl export --critic``: the critic of the newest intact checkpoint of ``run_dir`` (or
    ``step_<step>``) rebuilt as the run built it (its config: ``critic.path``'s model or the policy's
    initial weights, adapters under ``model.lora``), its trained weights loaded, written to ``out``
    (default ``<run>/export/step_<N>_critic``) by :func:`export_critic` with the policy's tokenizer.
    ``formats_of(algorithm)``: the workflow's warm-start formats, with which the embedded policy was
    built (``asyncrl.rollout.workflow``'s; none: the built-in ones). Returns ``(checkpoint, out)``. A
    checkpoint without a critic: ConfigError, one line."""
    from safetensors.torch import load_file

    from ..config import ConfigError, load_config
    from ..rundir.layout import CONFIG, CRITIC
    from .loading import load_model, load_tokenizer, resolve_model_path
    from .lora import export_paths, usual_modes, with_adapters

    run_dir = Path(run_dir)
    ckpt, out = export_paths(run_dir, out, step, suffix="_critic")
    if not (ckpt / CRITIC / "model.safetensors").exists():
        raise ConfigError(f"{ckpt} has no critic: the run did not train one (train.advantage.estimator gae)")
    cfg = load_config(str(run_dir / CONFIG), [])
    path = resolve_model_path(
        cfg.model, cfg.seed, progress=False, warmstart_formats=formats_of(cfg.algorithm) if formats_of else None
    )
    policy = with_adapters(load_model(path, cfg.model.dtype), cfg.model, cfg.seed, base=path)
    critic = build_critic(policy, cfg.critic, cfg.model, cfg.seed)
    weights = load_file(str(ckpt / CRITIC / "model.safetensors"))
    expected = trainable_names(critic)
    if set(weights) != expected:
        raise ConfigError(
            f"{ckpt / CRITIC}: its tensors do not match the critic the run's config builds (missing "
            f"{sorted(expected - set(weights))[:3]}, unexpected {sorted(set(weights) - expected)[:3]})"
        )
    critic.load_state_dict(weights, strict=False)
    out.mkdir(parents=True, exist_ok=True)
    export_critic(critic, out)
    load_tokenizer(path).save_pretrained(out)
    return ckpt, usual_modes(out)
