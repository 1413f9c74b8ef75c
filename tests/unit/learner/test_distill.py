"""On-policy distillation (``train.distill``, issue 68): the teacher's log-probs of the student's own
sampled tokens give each trained token ``coef * (log pi_teacher - log pi_behaviour)`` beside
``task_coef`` times the task advantage."""

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaForCausalLM

from asyncrl.config import EmbeddedModelConfig, load_config
from asyncrl.learner.training.trainer import PolicyTrainer
from asyncrl.models.tiny import embedded_llama_config
from asyncrl.models.tokenizer import build_char_tokenizer
from asyncrl.objectives.advantages import trajectory_advantages
from tests.unit.learner.test_packing import VOCAB, _model, _rows

MULTI_TURN = 8  # _rows: the row with environment tokens


def _episodes(rows):
    return [SimpleNamespace(id=f"ep{i}", actor_id="actor-0", trajectories=[r]) for i, r in enumerate(rows)]


def _sampled_by(trainer, rows) -> None:
    """Set ``rows``' behaviour log-probs to the trainer's current policy's (on-policy samples)."""
    probe = trainer.make_batch(_episodes(rows))
    with torch.no_grad():
        own = trainer.logprobs(trainer.model, probe)
    for b, r in enumerate(rows):
        n = len(r.token_ids)
        r.behavior_logprobs[1:n] = torch.where(probe.response_mask[b, : n - 1] > 0, own[b, : n - 1], 0.0).numpy()


def _trainer(overrides, model=None):
    cfg = load_config(None, ["train.lr=1e-2", *overrides])
    return PolicyTrainer(model or _model(), build_char_tokenizer(), cfg.train, 1.0), cfg


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("teacher") / "model"
    _model(seed=7).save_pretrained(path)
    return path


def test_the_distillation_advantage_is_the_negative_reverse_kl_at_each_trained_token(teacher_dir):
    coef, task = 0.5, 0.3
    trainer, cfg = _trainer(
        [f"train.distill.teacher={teacher_dir}", f"train.distill.coef={coef}", f"train.distill.task_coef={task}"]
    )
    rows = _rows()
    batch = trainer.make_batch(_episodes(rows))
    teacher = LlamaForCausalLM.from_pretrained(teacher_dir).float().eval()
    with torch.no_grad():
        teacher_lp = trainer.logprobs(teacher, batch)
    task_adv = trajectory_advantages(rows, cfg.train.advantage, trainer.estimator)
    on = batch.response_mask > 0
    expected = task * task_adv[:, None].float() * on - coef * torch.where(
        on, batch.behavior_logprobs - teacher_lp, torch.zeros_like(teacher_lp)
    )
    assert torch.allclose(batch.advantages, expected, atol=1e-5)
    assert (batch.advantages[~on] == 0).all()  # prompt and environment tokens get nothing
    env = (batch.response_mask[MULTI_TURN] == 0) & (torch.arange(batch.response_mask.shape[1]) >= 7)
    assert (batch.advantages[MULTI_TURN][env] == 0).all()
    stats = trainer.shaping_stats
    assert stats["distill/tokens"] == float(on.sum())
    assert stats["distill/reverse_kl"] == pytest.approx(
        float((batch.behavior_logprobs - teacher_lp)[on].mean()), abs=1e-5
    )
    row = batch.advantages.sum(1) / on.sum(1).clamp(min=1)
    assert torch.allclose(batch.row_advantages, row, atol=1e-6)


def test_a_teacher_equal_to_the_sampler_adds_nothing(tmp_path):
    """Teacher = student and behaviour log-probs = the student's own: the reverse KL is 0 on every
    token, so the advantages are the task's alone (task_coef 1)."""
    student = _model(seed=3)
    student.save_pretrained(tmp_path / "same")
    plain, _ = _trainer([], model=_model(seed=3))
    distilled, _ = _trainer([f"train.distill.teacher={tmp_path / 'same'}"], model=student)
    rows = _rows()
    _sampled_by(plain, rows)
    want = plain.make_batch(_episodes(rows))
    got = distilled.make_batch(_episodes(rows))
    assert torch.allclose(got.advantages, want.advantages, atol=1e-5)
    assert abs(distilled.shaping_stats["distill/reverse_kl"]) < 1e-5


def test_distilling_alone_moves_the_student_towards_the_teacher(teacher_dir):
    """task_coef 0: steps on the same samples raise the teacher-student agreement (the reverse KL at the
    sampled tokens, measured with fresh student log-probs, falls)."""
    trainer, _ = _trainer([f"train.distill.teacher={teacher_dir}", "train.distill.task_coef=0", "train.lr=3e-3"])
    teacher = LlamaForCausalLM.from_pretrained(teacher_dir).float().eval()
    rows = _rows()

    def gap() -> float:
        batch = trainer.make_batch(_episodes(rows))
        with torch.no_grad():
            s, t = trainer.logprobs(trainer.model, batch), trainer.logprobs(teacher, batch)
        on = batch.response_mask > 0
        return float((s - t)[on].abs().mean())

    before = gap()
    for _ in range(15):
        _sampled_by(trainer, rows)  # on-policy: the sampler is the current student
        trainer.step(trainer.make_batch(_episodes(rows)), version=0)
    assert gap() < 0.8 * before


def test_a_teacher_with_another_vocabulary_or_no_model_is_refused_clearly(tmp_path):
    other = LlamaForCausalLM(
        embedded_llama_config(
            EmbeddedModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), VOCAB + 5
        )
    )
    other.save_pretrained(tmp_path / "other")
    trainer, _ = _trainer([f"train.distill.teacher={tmp_path / 'other'}"])
    with pytest.raises(ValueError, match=rf"vocabulary of {VOCAB + 5} tokens, the student {VOCAB}.*same tokenizer"):
        trainer.make_batch(_episodes(_rows()))
    trainer, _ = _trainer([f"train.distill.teacher={tmp_path / 'nothing'}"])
    with pytest.raises(ValueError, match="no model in .*nothing.*config.json"):
        trainer.make_batch(_episodes(_rows()))


def test_distillation_with_a_critic_is_refused_at_load():
    with pytest.raises(ValueError, match="train.distill.teacher with train.advantage.estimator=gae"):
        load_config(None, ["train.distill.teacher=/x", "train.advantage.estimator=gae"])


def test_distilling_a_lora_student_with_packed_micro_batches(teacher_dir):
    """model.lora and packing: the teacher scores the packed micro-batches as the padded forward does
    (the same advantages), and a step on the distillation advantage alone moves only the adapters."""
    from asyncrl.models.lora import with_adapters

    def trainer_for(overrides):
        cfg = load_config(
            None,
            ["model.lora.rank=4", f"train.distill.teacher={teacher_dir}", "train.distill.task_coef=0", *overrides],
        )
        model = with_adapters(_model(), cfg.model, seed=0)
        return PolicyTrainer(model, build_char_tokenizer(), cfg.train, 1.0), model

    padded, _ = trainer_for(["train.packing=false"])
    packed, model = trainer_for(["train.packing=true", "train.micro_batch_tokens=20"])
    rows = _rows()
    _sampled_by(packed, rows)  # on-policy (else the behaviour clip blocks every token: _rows' log-probs are -0.5)
    want = padded.make_batch(_episodes(rows))
    got = packed.make_batch(_episodes(rows))
    assert torch.allclose(got.advantages, want.advantages, atol=1e-5)
    assert (got.advantages[got.response_mask > 0] != 0).any()
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    packed.step(got, version=0)
    moved = {k for k, p in model.named_parameters() if not torch.equal(p.detach(), before[k])}
    assert moved and all("lora_" in k for k in moved)
