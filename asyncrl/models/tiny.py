"""The embedded default policy: a tiny character-level Llama, warm-started on arithmetic.

``build_embedded_model`` builds a ``LlamaForCausalLM`` from an ``EmbeddedModelConfig`` and trains it
briefly (supervised, loss on the assistant completion only) until its *sampled* (temperature 1.0)
accuracy on held-out two-digit additions reaches ``cfg.target_accuracy``, so that RL starts from
partial accuracy. The stopping test uses the exact expected sampled accuracy (a teacher-forced pass,
no sampling noise); the saved metadata also records a real sampled and a greedy measurement.

Deterministic on one machine, not across machines: the same config, seed, CPU instruction set and
torch build give the same weights, but matrix products round differently with AVX-512 and AVX2
kernels (float64 as well as float32) and the warm start amplifies that into another stopping step
(here: 425 steps with AVX-512, 530 with AVX2 forced). The metadata records the kernels and library
versions a build was made with (``built_with``); ``bench/quickstart_spread.py`` measures what that
does to the quick start.

The result is cached under ``cfg.cache_dir`` in a directory named after a hash of everything that
determines the weights; a build is written to a temporary directory and renamed into place, under a
file lock, so concurrent callers never see (or redo) a half-written model.

Warm-start data is a mixture of named formats, ``fn(rng) -> (messages, completion)``: the prompt is
``messages`` rendered with the chat template plus the generation prompt, the target is
``completion + "<|end|>"``. ``arithmetic`` and ``calculator`` are built in; an algorithm adds its own
by declaring them (``Workflow.warmstart_formats``), and the process that loads the model passes them
to :func:`build_embedded_model` (this package never imports the algorithms).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from filelock import FileLock
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from ..config import EmbeddedModelConfig, TasksConfig
from ..envs.arithmetic import make_problem
from ..plugins import resolve_import
from ..prompts import render_tokens, set_prompt_format
from ..registry import Registry
from ..rundir.layout import replace_dir
from ..types import Task
from .tokenizer import build_char_tokenizer

BUILD_VERSION = 2  # bump when the build procedure changes: it is part of the cache key
META_FILE = "asyncrl_model.json"
EVAL_EVERY = 25  # steps between held-out evaluations
EVAL_EVERY_NEAR = 5  # ... once accuracy has reached half the target
EVAL_SIZE = 200  # held-out problems
EVAL_SEED = 1_000_003  # the held-out set does not depend on the build seed
LR_WARMUP_STEPS = 20
# RoPE base. Llama's 10000 leaves most rotary frequencies nearly constant over these ~15-token
# sequences; with 100 every frequency turns and the digit-alignment attention forms far sooner
# (units digit learned by ~300 warm-start steps instead of not at all in 600).
ROPE_THETA = 100.0

Messages = list[dict[str, str]]
WarmstartFormat = Callable[[random.Random], "tuple[Messages, str]"]


def _arithmetic_format(rng: random.Random) -> tuple[Messages, str]:
    task = make_problem(rng, TasksConfig())
    return task.prompt, str(task.answer)


def _calculator_format(rng: random.Random) -> tuple[Messages, str]:
    from ..envs.calculator import calculator_warmstart_example

    return calculator_warmstart_example(rng)


# ``fn(rng) -> (chat messages, assistant completion text)``: the completion is the text of the final
# assistant turn without the ``<|end|>`` EOS (the builder adds it); earlier turns go in ``messages``.
BUILTIN_FORMATS: Registry[WarmstartFormat] = Registry(
    "warm-start format", {"arithmetic": _arithmetic_format, "calculator": _calculator_format}
)  # calculator: the multi-turn env


# --------------------------------------------------------------------------------------- model
def tiny_moe(
    vocab_size: int,
    layers: int = 3,
    experts: int = 8,
    top_k: int = 2,
    hidden: int = 64,
    seed: int = 0,
    init: float = 0.2,
    norm_topk_prob: bool = True,
):
    """A small randomly initialised mixture-of-experts model from transformers (Qwen2-MoE: ``layers``
    layers of ``experts`` experts, ``top_k`` per token, a shared expert), float32, in eval mode: for
    trying routing replay (``model.routing_replay``) on a CPU. ``init`` is the initializer range
    (larger: sharper router scores)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2MoeConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        shared_expert_intermediate_size=hidden,
        num_experts=experts,
        num_experts_per_tok=top_k,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=init,
        norm_topk_prob=norm_topk_prob,
    )
    return Qwen2MoeForCausalLM(cfg).float().eval()


def embedded_llama_config(cfg: EmbeddedModelConfig, vocab_size: int) -> LlamaConfig:
    """The ``LlamaConfig`` of the embedded model (ids: pad 0, bos 2, eos 3 as in the tokenizer)."""
    if cfg.hidden_size % cfg.num_heads:
        raise ValueError(
            f"model.embedded.hidden_size ({cfg.hidden_size}) must be divisible by "
            f"model.embedded.num_heads ({cfg.num_heads})"
        )
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
        rope_theta=ROPE_THETA,
    )


def count_parameters(cfg: EmbeddedModelConfig) -> int:
    """Parameters of the embedded model for ``cfg`` (tied weights once), without allocating it."""
    llama = embedded_llama_config(cfg, len(build_char_tokenizer()))
    with torch.device("meta"):
        model = LlamaForCausalLM(llama)
    return sum(p.numel() for p in model.parameters())


def cache_key(cfg: EmbeddedModelConfig, seed: int) -> str:
    """Directory name for a build: readable shape + hash of all weight-determining settings."""
    fields = cfg.model_dump(mode="json", exclude={"cache_dir"})
    for key, default in (("prompt_format", "chat"), ("heldout_size", EVAL_SIZE)):
        if fields[key] == default:  # the defaults: keys (and cached builds) from before these options
            del fields[key]
    blob = json.dumps({"cfg": fields, "seed": seed, "build": BUILD_VERSION}, sort_keys=True)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:16]
    return f"tiny-llama-h{cfg.hidden_size}-l{cfg.num_layers}-s{seed}-{digest}"


def _formats(cfg: EmbeddedModelConfig, formats: dict[str, WarmstartFormat] | None) -> dict[str, WarmstartFormat]:
    """The warm-start formats ``cfg`` names: built-in, the algorithm's (``formats``), or an import
    path ``pkg.module:fn`` (your own); a ValueError naming the unknown ones."""
    available = {**BUILTIN_FORMATS, **(formats or {})}
    for name in cfg.warmstart_formats:
        if name not in available and ":" in name:
            available[name] = resolve_import(name, "model.embedded.warmstart_formats")
    unknown = [f for f in cfg.warmstart_formats if f not in available]
    if unknown:
        raise ValueError(
            f"model.embedded.warmstart_formats: unknown {unknown}; available here: "
            f"{sorted(available)} (an algorithm's own formats come with algorithm: <it>; your own "
            f"as pkg.module:fn)"
        )
    return available


def build_embedded_model(
    cfg: EmbeddedModelConfig, seed: int = 0, progress: bool = True, formats: dict[str, WarmstartFormat] | None = None
) -> Path:
    """Build (or return from the cache) the embedded model; returns its directory.

    The directory holds ``save_pretrained`` output for model and tokenizer plus ``asyncrl_model.json``
    (config, seed, steps, measured accuracies). Deterministic for a given ``cfg`` and ``seed``.
    ``formats`` adds warm-start formats to the built-in ones (an algorithm's, by name).
    """
    available = _formats(cfg, formats)
    root = Path(cfg.cache_dir).expanduser()
    final = root / cache_key(cfg, seed)
    if (final / META_FILE).exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{final.name}.lock"):
        if (final / META_FILE).exists():  # another process built it while we waited
            return final
        _remove_orphans(root, final.name)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
        t0 = time.monotonic()
        print(
            f"[asyncrl] building the embedded model: a warm start of {cfg.warmup_steps} steps on "
            f"{', '.join(cfg.warmstart_formats) or 'its tasks'} (once; cached in {final})",
            flush=True,
        )
        try:
            _build_into(tmp, cfg, seed, progress, available)
            replace_dir(tmp, final)  # (a final without metadata: a crashed build from elsewhere, swapped out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"[asyncrl] the embedded model is built ({time.monotonic() - t0:.0f} s)", flush=True)
    return final


def read_model_info(path: str | Path) -> dict:
    """The ``asyncrl_model.json`` of a built embedded model ({} for other model directories)."""
    meta = Path(path) / META_FILE
    return json.loads(meta.read_text()) if meta.exists() else {}


def _file_lock(path: Path) -> FileLock:
    """An exclusive inter-process lock on ``path`` (the ``filelock`` package)."""
    return FileLock(str(path))


def _remove_orphans(root: Path, name: str) -> None:
    """Delete temporary build directories of ``name`` left by killed builds (we hold the lock)."""
    for tmp in root.glob(f".{name}.*"):
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------------------- build
@dataclass
class _Example:
    prompt_ids: list[int]
    target_ids: list[int]  # completion + EOS


def _build_into(
    out: Path, cfg: EmbeddedModelConfig, seed: int, progress: bool, formats: dict[str, WarmstartFormat]
) -> None:
    """Initialise, warm-start (to an expected accuracy) and save the model into ``out``."""
    start = time.perf_counter()
    with _deterministic(seed, threads=2):
        tokenizer = build_char_tokenizer()
        if cfg.prompt_format == "raw":
            tokenizer.chat_template = None
        set_prompt_format(tokenizer, cfg.prompt_format)
        model = LlamaForCausalLM(embedded_llama_config(cfg, len(tokenizer))).float()
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        result = warm_start(model, tokenizer, cfg, seed, progress, formats)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    info = {
        "build_version": BUILD_VERSION,
        "seed": seed,
        "config": cfg.model_dump(mode="json"),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "build_seconds": round(time.perf_counter() - start, 2),
        "built_with": built_with(),
        **result,
    }
    (out / META_FILE).write_text(json.dumps(info, indent=2))


def built_with() -> dict[str, str]:
    """What else decides a build's weights: the CPU kernels torch dispatches to and the library versions."""
    import transformers

    return {
        "cpu_kernels": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


@contextlib.contextmanager
def _deterministic(seed: int, threads: int) -> Iterator[None]:
    """Seed torch/numpy/random and fix the torch thread count for the duration."""
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)


def heldout_tasks(n: int = EVAL_SIZE) -> list[Task]:
    """``n`` distinct held-out two-digit addition problems (fixed, independent of the build seed)."""
    rng, seen, tasks = random.Random(EVAL_SEED), set(), []
    while len(tasks) < n:
        task = make_problem(rng, TasksConfig(ops=["+"]))
        if task.prompt[0]["content"] not in seen:
            seen.add(task.prompt[0]["content"])
            tasks.append(task)
    return tasks


def warm_start(
    model,
    tokenizer,
    cfg: EmbeddedModelConfig,
    seed: int,
    progress: bool,
    formats: dict[str, WarmstartFormat] | None = None,
) -> dict:
    """Supervised steps until held-out sampled accuracy >= ``cfg.target_accuracy`` (or the cap).

    The stopping criterion is the *expected* sampled accuracy (exact, see ``expected_accuracy``),
    evaluated every ``EVAL_EVERY`` steps (every ``EVAL_EVERY_NEAR`` once past half the target).
    Returns ``{"steps", "expected_accuracy", "history": [[step, expected accuracy], ...]}``.
    """
    evalset = heldout_tasks(cfg.heldout_size)
    excluded = {_prompt_key(t.prompt) for t in evalset}
    available = _formats(cfg, formats)
    examples = _example_stream(tokenizer, [available[f] for f in cfg.warmstart_formats], random.Random(seed), excluded)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warmup_lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / LR_WARMUP_STEPS))
    acc, step = expected_accuracy(model, tokenizer, evalset), 0
    history = [[0, acc]]
    bar = tqdm(total=cfg.warmup_steps, desc="warm-start", disable=not progress, leave=False)
    while step < cfg.warmup_steps and acc < cfg.target_accuracy:
        loss = _train_step(model, opt, sched, [next(examples) for _ in range(cfg.warmup_batch_size)])
        step += 1
        bar.update(1)
        every = EVAL_EVERY_NEAR if acc >= cfg.target_accuracy / 2 else EVAL_EVERY
        if step % every == 0 or step == cfg.warmup_steps:
            acc = expected_accuracy(model, tokenizer, evalset)
            history.append([step, acc])
            bar.set_postfix(loss=f"{loss:.3f}", acc=f"{acc:.3f}")
    if acc >= cfg.target_accuracy:  # reached the target early: the bar ends as done, not stopped part-way
        bar.set_description(f"warm-start: target {cfg.target_accuracy:g} reached at step {step}")
        bar.total = bar.n
        bar.refresh()
    bar.close()
    return {"steps": step, "expected_accuracy": acc, "history": history}


def _prompt_key(messages: Messages) -> str:
    return json.dumps(messages, sort_keys=True)


def _example_stream(
    tokenizer, formats: list[WarmstartFormat], rng: random.Random, excluded: set[str]
) -> Iterator[_Example]:
    """Endless tokenised examples drawn uniformly from ``formats``, skipping held-out prompts."""
    eos = tokenizer.eos_token_id
    while True:
        messages, completion = rng.choice(formats)(rng)
        if _prompt_key(messages) in excluded:
            continue
        yield _Example(
            render_tokens(tokenizer, messages), tokenizer.encode(completion, add_special_tokens=False) + [eos]
        )


def collate_examples(examples: list[_Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: ``input_ids``, ``attention_mask``, ``labels`` long [B, S].

    ``labels`` is -100 on prompt and padding tokens, so the loss covers the completion only.
    """
    width = max(len(e.prompt_ids) + len(e.target_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        seq, n_prompt = e.prompt_ids + e.target_ids, len(e.prompt_ids)
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, n_prompt : len(seq)] = torch.tensor(e.target_ids)
        mask[i, : len(seq)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _train_step(model, opt, sched, examples: list[_Example]) -> float:
    """One AdamW step on the completion-token cross-entropy; returns the loss."""
    model.train()
    loss = model(**collate_examples(examples, pad_id=0)).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss.item()


def expected_accuracy(model, tokenizer, tasks: list[Task]) -> float:
    """Exact expected accuracy of temperature-1 sampling: mean over ``tasks`` of
    ``prod_j p(answer_j | prompt, answer_<j)`` over the answer's tokens and the EOS.

    One teacher-forced forward pass over a right-padded batch (``[N, S]``); no sampling noise.
    """
    eos = tokenizer.eos_token_id
    examples = []
    for t in tasks:
        examples.append(
            _Example(
                render_tokens(tokenizer, t.prompt), tokenizer.encode(str(t.answer), add_special_tokens=False) + [eos]
            )
        )
    batch = collate_examples(examples, pad_id=0)
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    model.train(was_training)
    labels = batch["labels"][:, 1:]  # [N, S-1]: token t+1 is predicted at position t
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    token_logp = logp.gather(2, labels.clamp(min=0)[..., None])[..., 0] * (labels != -100)
    return float(token_logp.sum(1).exp().mean())
