"""LoRA (``model.lora``, issue 32): the learner trains the adapters only, weight sync carries only
them through every transport, the HF engine merges them in place, checkpoints hold them and
``asyncrl export --merge`` writes a plain model with them merged.

The tiny embedded model, real PolicyTrainer steps, the real transports' frames through the wire
codec, a real learner and actor over loopback (``slow``) with the collective (gloo) transport.
DDP/FSDP2 with LoRA: tests/unit/learner/test_distributed_learner.py (case ``lora``); vLLM: tests/unit/engine/test_engine_vllm.py.
"""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import torch

from asyncrl.config import ConfigError, load_config
from asyncrl.engine.hf import HFEngine
from asyncrl.learner.checkpoint import read_checkpoint, save_checkpoint
from asyncrl.learner.ingest.buffer import EpisodeQueue
from asyncrl.learner.training.batch import collate, compute_logprobs
from asyncrl.learner.training.trainer import PolicyTrainer
from asyncrl.models.loading import load_model, load_policy
from asyncrl.models.lora import export_run, with_adapters
from asyncrl.rundir.layout import CheckpointError, list_checkpoints
from asyncrl.types import Trajectory
from asyncrl.weights import make_publisher, make_receiver
from asyncrl.weights.adapters import adapter_tensors, is_adapter_name
from asyncrl.wire.codec import decode
from tests.conftest import SMALL_RUN, read_jsonl, run_cli
from tests.support.dist_step_worker import trajectories

COMMON = [*SMALL_RUN, "sync.type=ipc"]

RANK = 4
STEPS = 3


class _Episode:
    def __init__(self, rows):
        self.trajectories = rows


@pytest.fixture(scope="module")
def trained(tiny_overrides):
    """A LoRA policy after ``STEPS`` real training steps: ``(cfg, peft model, tokenizer, base dir,
    base state before, adapters before, trainer)``."""
    cfg = load_config(None, [*tiny_overrides, f"model.lora.rank={RANK}", "train.lr=1e-2"])
    base, tok, path = load_policy(cfg.model, cfg.seed)
    original = {k: v.detach().clone() for k, v in base.state_dict().items()}
    model = with_adapters(base, cfg.model, cfg.seed, base=path)
    before = {k: v.detach().clone() for k, v in model.named_parameters() if is_adapter_name(k)}
    trainer = PolicyTrainer(model, tok, cfg.train, 1.0)
    for _ in range(STEPS):
        trainer.step(trainer.make_batch([_Episode(trajectories(len(tok)))]))
    model.eval()
    return cfg, model, tok, path, original, before, trainer


def _plain_name(peft_name: str) -> str:
    return peft_name.replace("base_model.model.", "", 1).replace(".base_layer.", ".")


def test_training_changes_every_adapter_and_no_base_weight(trained):
    cfg, model, _, _, original, before, trainer = trained
    adapters = {n: p for n, p in model.named_parameters() if is_adapter_name(n)}
    assert len(adapters) == 2 * 7 * cfg.model.embedded.num_layers  # A and B of the 7 default targets per layer
    for name, p in model.named_parameters():
        if name in adapters:
            assert p.requires_grad and not torch.equal(p.detach(), before[name]), f"{name} did not change"
        else:
            assert not p.requires_grad
            assert torch.equal(p.detach(), original[_plain_name(name)]), f"base weight {name} changed"
    # the optimizer holds the adapters, and state for them alone
    params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert {id(p) for p in params} == {id(p) for p in adapters.values()}
    assert {id(p) for p in trainer.optimizer.state} == {id(p) for p in adapters.values()}


def _learner_logprobs(model, tok, prompt, gen) -> np.ndarray:
    ids = np.array(list(prompt) + gen.token_ids.tolist(), dtype=np.int32)
    mask = np.r_[np.zeros(len(prompt)), np.ones(len(gen.token_ids))].astype(np.uint8)
    batch = collate([Trajectory(ids, mask, np.zeros(len(ids), np.float32), 0)], torch.zeros(1), tok.pad_token_id)
    with torch.no_grad():
        logp, _ = compute_logprobs(model, batch, 1.0)
    return logp[0, len(prompt) - 1 :].numpy()


def _prompts(tok) -> list[list[int]]:
    return [tok(t)["input_ids"] for t in ("<|user|>12+34=<|end|><|assistant|>", "<|user|>7+5=<|end|><|assistant|>")]


def test_the_actor_after_a_sync_samples_from_the_learners_merged_model(trained):
    cfg, model, tok, path, _, _, _ = trained
    state = adapter_tensors({n: p.detach().clone() for n, p in model.named_parameters()})
    engine = HFEngine(load_model(path), tok, lora=cfg.model.lora)
    engine.update_weights(state, STEPS)
    merged = copy.deepcopy(model).merge_and_unload().eval()  # peft's own merge of the learner's model
    sampling = cfg.sampling.model_copy(update={"max_new_tokens": 12, "temperature": 1.0})
    prompts = _prompts(tok)
    gens = engine.generate(prompts, sampling, seed=0)
    for prompt, gen in zip(prompts, gens):
        assert len(gen.token_ids) > 0
        ref = _learner_logprobs(merged, tok, prompt, gen)
        assert np.abs(gen.logprobs - ref).max() <= 1e-5, np.abs(gen.logprobs - ref).max()
        unmerged = _learner_logprobs(model, tok, prompt, gen)  # and the learner's own (adapters unmerged)
        assert np.abs(gen.logprobs - unmerged).max() <= 1e-5
    # a second version replaces the first (merged from the kept base weights, not on top of it)
    engine.update_weights({k: torch.zeros_like(v) for k, v in state.items()}, STEPS + 1)
    for name, m in engine.adapters.modules.items():
        assert torch.equal(m.weight, engine.adapters.base[name]), name


def test_wrong_updates_are_refused_before_any_weight_changes(trained):
    cfg, model, tok, path, _, _, _ = trained
    engine = HFEngine(load_model(path), tok, lora=cfg.model.lora)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    state = adapter_tensors(dict(model.named_parameters()))
    full = {k: v.detach() for k, v in load_model(path).named_parameters()}
    with pytest.raises(ValueError, match="LoRA adapters expected"):
        engine.update_weights(full, 1)  # full weights sent to a LoRA actor
    some = dict(list(state.items())[:-1])
    with pytest.raises(ValueError, match="missing"):
        engine.update_weights(some, 1)
    name = next(iter(state))
    with pytest.raises(ValueError, match="adapter shapes differ"):
        engine.update_weights({**state, name: torch.zeros(RANK + 1, state[name].shape[1])}, 1)
    for k, v in engine.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert engine.version == 0


@pytest.mark.parametrize("transport", ["zmq", "filesystem", "ipc"])
def test_each_version_carries_the_adapters_alone(trained, transport, tmp_path):
    """Bytes per version: exactly the adapter tensors (A: r x in, B: out x r per targeted layer), bit-exact
    through the transport's real frames and the wire codec. (``nccl``: the slow run below.)"""
    cfg, model, tok, path, _, _, _ = trained
    state = {k: v.detach().clone().contiguous() for k, v in adapter_tensors(dict(model.named_parameters())).items()}
    h, inter, layers = (
        cfg.model.embedded.hidden_size,
        cfg.model.embedded.intermediate_size,
        cfg.model.embedded.num_layers,
    )
    # q, k, v, o: h -> h; gate, up: h -> inter; down: inter -> h; 4-byte floats
    expected = 4 * RANK * layers * (4 * 2 * h + 2 * (h + inter) + (inter + h))
    sent = sum(t.numel() * t.element_size() for t in state.values())
    assert sent == expected
    full = sum(p.numel() * p.element_size() for p in load_model(path).parameters())
    assert sent < full
    sync = load_config(None, [f"sync.type={transport}", f"sync.dir={tmp_path}"]).sync
    pub, rec = make_publisher(sync, tmp_path), make_receiver(sync)
    try:
        frames = pub.frames(state, 5)
        if transport == "zmq":  # the tensors travel in the message itself
            wire = sum(len(memoryview(f)) for f in frames)
            assert sent <= wire <= sent + 16384, (sent, wire)
        version, got = rec.tensors(decode(frames))
    finally:
        rec.close()
        pub.close()
    assert version == 5 and set(got) == set(state)
    for k, t in state.items():
        assert torch.equal(got[k], t), k
    engine = HFEngine(load_model(path), tok, lora=cfg.model.lora)
    engine.update_weights(got, version)  # what the actor loads
    assert engine.version == 5


def _buffer(run_dir):
    buf = EpisodeQueue(run_dir / "buffer", 100)
    buf.open_wal(0)
    return buf


def test_checkpoint_holds_adapters_naming_the_base_and_export_merges_them(trained, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg, model, tok, path, _, _, trainer = trained
    run_dir = tmp_path / "run"
    (run_dir).mkdir()
    (run_dir / "config.yaml").write_text(json.dumps(cfg.model_dump(mode="json")))
    ckpt = save_checkpoint(run_dir, STEPS, model, tok, trainer.optimizer, _buffer(run_dir), {}, keep=2)
    files = sorted(p.name for p in (ckpt / "model").iterdir())
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files
    config = json.loads((ckpt / "model" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(path) and config["r"] == RANK
    # it loads back into a fresh LoRA model: the same adapters and the optimizer state by name
    fresh = with_adapters(load_model(path), cfg.model, cfg.seed + 1, base=path)
    weights, optim, state = read_checkpoint(ckpt, fresh)
    assert state["version"] == STEPS
    assert set(weights) == {n for n, _ in model.named_parameters() if is_adapter_name(n)}
    for n, p in model.named_parameters():
        if n in weights:
            assert torch.equal(weights[n], p.detach()), n
    assert set(optim["state"]) == set(weights)
    # peft itself reads the checkpoint's adapter directory
    peft_model = PeftModel.from_pretrained(load_model(path), ckpt / "model").eval()
    # export: refused without --merge, then a plain Hugging Face model
    with pytest.raises(ConfigError, match="--merge"):
        export_run(run_dir)
    _, out, merged = export_run(run_dir, merge=True)
    assert merged and not (out / "adapter_config.json").exists()
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    gens = HFEngine(exported, tok).generate(
        _prompts(tok), cfg.sampling.model_copy(update={"max_new_tokens": 10}), seed=1
    )
    for prompt, gen in zip(_prompts(tok), gens):
        ref = _learner_logprobs(model, tok, prompt, gen)
        assert np.abs(gen.logprobs - ref).max() <= 1e-5
        assert np.abs(_learner_logprobs(peft_model, tok, prompt, gen) - ref).max() <= 1e-5


def test_lora_settings_that_cannot_work_are_refused_in_one_line(tiny_overrides, trained, tmp_path):
    from asyncrl.commands.preflight import preflight

    cfg = load_config(None, [*tiny_overrides, "model.lora.target_modules=[q_proj,qkv]"])
    with pytest.raises(ConfigError, match=r"'qkv' names no linear layer of the model; it has .*q_proj"):
        preflight(cfg)
    with pytest.raises(ConfigError, match="rank"):
        load_config(None, ["model.lora.rank=0"])
    with pytest.raises(ConfigError, match="model.lora.ranks"):
        load_config(None, ["model.lora.ranks=8"])
    # a full-weight checkpoint does not resume a LoRA run (or the other way), said in one line
    cfg, model, tok, path, _, _, trainer = trained
    ckpt = save_checkpoint(tmp_path, 1, model, tok, trainer.optimizer, _buffer(tmp_path), {}, keep=1)
    with pytest.raises(CheckpointError, match="holds LoRA adapters; this run has model.lora off"):
        read_checkpoint(ckpt, load_model(path))


@pytest.mark.slow
def test_a_lora_run_over_collective_sync_resumes_and_exports(tmp_path, tiny_overrides):
    """A real learner and actor with model.lora over ``sync.type=nccl`` (gloo): every version's message
    carries the adapters alone, the actor trains on new versions, the run resumes from its adapter
    checkpoint, and ``asyncrl export --merge`` writes a model that loads with from_pretrained."""
    from transformers import AutoModelForCausalLM

    common = [o for o in COMMON if not o.startswith(("sync.type", "checkpoint.every"))]
    args = [
        *tiny_overrides,
        *common,
        "sync.type=nccl",
        "sync.backend=gloo",
        f"run_root={tmp_path}",
        "name=lora",
        f"model.lora.rank={RANK}",
        "checkpoint.every=2",
    ]
    res = run_cli("run", *args, "train.total_steps=4", timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    run = tmp_path / "lora"
    events = read_jsonl(run / "events.jsonl")
    published = [e for e in events if e["kind"] == "weights_published"]
    h, inter, layers = 32, 64, 1  # tiny_overrides' model
    adapters = 4 * RANK * layers * (4 * 2 * h + 2 * (h + inter) + (inter + h))
    assert published and {e["bytes"] for e in published} == {adapters}
    episodes = [e for e in events if e["kind"] == "episode"]
    assert max(e["policy_version"] for e in episodes) >= 1  # generated with broadcast adapters
    assert "weight sync" not in res.stderr
    res = run_cli("run", *args, "train.total_steps=6", "--resume", timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    resumed = [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == "resume"]
    assert resumed and resumed[-1]["step"] == 4
    assert [p.name for p in list_checkpoints(run)][-1].endswith("6")
    res = run_cli("export", str(run), "--merge", timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    model = AutoModelForCausalLM.from_pretrained(run / "export" / list_checkpoints(run)[-1].name)
    assert sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.slow
def test_the_quick_start_with_lora_learns(tmp_path, model_cache):
    """``configs/quickstart.yaml`` (the default embedded model) with ``model.lora`` on, 150 steps at lr 1e-3
    (adapters take a higher rate than full weights; the README's 800-step figures are at 5e-5 and 5e-4): the
    batch reward of the last 10% of steps is above the first 10%'s (three seeds measured 0.438 -> 0.618,
    0.372 -> 0.507, 0.336 -> 0.564)."""
    res = run_cli(
        "run",
        "-c",
        "configs/quickstart.yaml",
        f"model.embedded.cache_dir={model_cache}",
        "model.lora.rank=16",
        "train.total_steps=150",
        "train.lr=1e-3",
        f"run_root={tmp_path}",
        "name=qs-lora",
        "eval.every=0",
        "checkpoint.every=0",
        "log.progress=false",
        timeout=1200,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])["summary"]
    assert summary["steps_trained"] == 150
    assert summary["reward_last_10pct"] > summary["reward_first_10pct"] + 0.03, summary
    published = [e for e in read_jsonl(tmp_path / "qs-lora" / "events.jsonl") if e["kind"] == "weights_published"]
    assert published[-1]["bytes"] == 4 * 16 * 4 * (4 * 2 * 128 + 2 * (128 + 512) + (512 + 128))  # adapters only


def test_a_bfloat16_merge_equals_pefts(trained):
    """The engines' merge (``asyncrl.weights.adapters.merged_weight``) of a bfloat16 base rounds as peft's
    ``merge_and_unload`` does: the float32 product added to the base, rounded once."""
    from asyncrl.weights.adapters import MergedAdapters

    cfg, model, tok, path, _, _, _ = trained
    state = adapter_tensors({n: p.detach().clone() for n, p in model.named_parameters()})
    peft_bf16 = copy.deepcopy(model)
    for name, p in peft_bf16.named_parameters():
        if not is_adapter_name(name):
            p.data = p.data.to(torch.bfloat16)
    merged = peft_bf16.merge_and_unload()
    plain = load_model(path, "bfloat16")
    MergedAdapters(plain, cfg.model.lora).apply(state)
    ours = dict(plain.named_parameters())
    for name, p in merged.named_parameters():
        if p.dtype == torch.bfloat16 and name in ours:
            assert torch.equal(p, ours[name]), (name, float((p.float() - ours[name].float()).abs().max()))
    assert any(
        not torch.equal(ours[n].float(), load_model(path, "bfloat16").state_dict()[n].float())
        for n in ours
        if "q_proj" in n
    )


def test_export_of_a_full_weight_run_is_its_model(trained, tmp_path):
    """Without LoRA a checkpoint's model is already a Hugging Face directory: export copies it (and
    refuses to write into a non-empty directory)."""
    from transformers import AutoModelForCausalLM

    _, _, tok, path, _, _, _ = trained
    model = load_model(path)
    opt = torch.optim.AdamW(model.parameters())
    save_checkpoint(tmp_path, 2, model, tok, opt, _buffer(tmp_path), {}, keep=1)
    ckpt, out, merged = export_run(tmp_path, tmp_path / "out")
    assert ckpt.name.endswith("2") and not merged
    umask = os.umask(0)
    os.umask(umask)  # 42.8: the weights file had mode 0600, the rest 0644
    assert {f.stat().st_mode & 0o777 for f in out.rglob("*") if f.is_file()} == {0o666 & ~umask}
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for (n, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n
    with pytest.raises(ConfigError, match="not empty"):
        export_run(tmp_path, tmp_path / "out")
    with pytest.raises(ConfigError, match="no such checkpoint"):
        export_run(tmp_path, step=7)


def test_the_kl_reference_of_a_lora_policy_is_its_base_model(trained):
    """``train.kl_coef > 0`` with LoRA: no copy of the model is made; the reference is the policy with its
    adapters disabled. The step's ``kl`` equals k3(policy, base model) over the response tokens, computed
    here from the base model loaded afresh."""
    from asyncrl.objectives.aggregation import masked_mean
    from asyncrl.objectives.logprobs import kl_penalty

    cfg, model, tok, path, _, _, _ = trained
    policy = copy.deepcopy(model)
    kl_cfg = load_config(
        None, [f"model.lora.rank={RANK}", "train.kl_coef=0.1", "train.lr=1e-9", "train.recompute_proximal=false"]
    )
    trainer = PolicyTrainer(policy, tok, kl_cfg.train, 1.0)
    assert trainer.ref_model is None and trainer.ref_is_base
    batch = trainer.make_batch([_Episode(trajectories(len(tok)))])
    with torch.no_grad():
        logp, _ = compute_logprobs(policy.eval(), batch, 1.0)
        ref, _ = compute_logprobs(load_model(path), batch, 1.0)
    expected = float(masked_mean(kl_penalty(logp, ref, kl_cfg.train.kl_type), batch.response_mask))
    assert expected > 1e-4  # the trained adapters moved the policy away from the base
    stats = trainer.step(batch).stats
    assert stats["kl"] == pytest.approx(expected, rel=1e-4)
    # and the adapters are on again after the step: the policy is not the base model
    with torch.no_grad():
        again, _ = compute_logprobs(policy.eval(), batch, 1.0)
    assert float((again - ref).abs().max()) > 1e-3
