"""64.8: a learning-rate schedule (train.lr_warmup_steps, lr_schedule, lr_min_ratio): a function of the
policy version alone, set on the optimizer before each step and logged as the metric ``lr``."""

import math

import pytest

from asyncrl.config import load_config
from asyncrl.learner.training.optim import lr_at
from asyncrl.learner.training.trainer import PolicyTrainer
from asyncrl.models.tokenizer import build_char_tokenizer
from tests.unit.learner.test_packing import _batch, _model


def test_warm_up_then_decay():
    cfg = load_config(
        None,
        [
            "train.lr=1e-3",
            "train.total_steps=14",
            "train.lr_warmup_steps=4",
            "train.lr_schedule=cosine",
            "train.lr_min_ratio=0.1",
        ],
    ).train
    lrs = [lr_at(cfg, v) for v in range(15)]
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert lrs[4] == pytest.approx(1e-3) and lrs[9] == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert lrs[14] == pytest.approx(1e-4) and all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    linear = cfg.model_copy(update={"lr_schedule": "linear"})
    assert lr_at(linear, 9) == pytest.approx(1e-4 + 0.9e-3 * 0.5)
    assert lr_at(load_config(None, ["train.lr=1e-3"]).train, 50) == 1e-3  # the default: constant, no warm-up


def test_the_trainer_steps_with_the_versions_rate():
    cfg = load_config(None, ["train.lr=1e-3", "train.lr_warmup_steps=4"])
    trainer = PolicyTrainer(_model(), build_char_tokenizer(), cfg.train, 1.0)
    stats = trainer.step(_batch(), version=1).stats
    assert stats["lr"] == pytest.approx(5e-4) and trainer.optimizer.param_groups[0]["lr"] == pytest.approx(5e-4)
    assert trainer.step(_batch(), version=7).stats["lr"] == pytest.approx(1e-3)
