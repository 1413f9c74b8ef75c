"""On-policy distillation (``train.distill``, issue 68): the student samples, a teacher scores the
student's own tokens, and each trained token's advantage gets ``coef * (log pi_teacher(y_t) - log
pi_behaviour(y_t))``: the negative reverse KL at the sampled token (the on-policy distillation recipe:
Agarwal et al. 2024, "On-Policy Distillation of Language Models"; Thinking Machines 2025, per-token
reverse KL with no discount). ``task_coef`` weighs the task reward's advantage beside it (0:
distillation alone).

The teacher runs on the learner, in :meth:`PolicyTrainer.make_batch`, over the rows about to be trained
(so its scores are for exactly the tokens trained, whatever their staleness), through the trainer's
own forward (packing, micro-batches of the token budget). It needs the student's vocabulary.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from . import distributed as dist_learner


class Distiller:
    def __init__(self, cfg, student):
        """``cfg``: ``train.distill``; ``student``: the policy (its dtype, device and vocabulary)."""
        self.cfg, self.student = cfg, student
        self._teacher = None

    def teacher(self):
        """The teacher model, loaded on first use (frozen, eval mode, the student's dtype and device)."""
        if self._teacher is None:
            from transformers import AutoModelForCausalLM

            from ...models.dtypes import DTYPE_KW

            path = Path(self.cfg.teacher).expanduser()
            if not (path / "config.json").is_file():
                raise ValueError(
                    f"train.distill.teacher: no model in {path} (expected a Hugging Face model directory with "
                    f"config.json, e.g. a run's checkpoints/step_N/model)"
                )
            student = dist_learner.unwrap(self.student)
            ref = next(student.parameters())
            teacher = AutoModelForCausalLM.from_pretrained(path, **{DTYPE_KW: ref.dtype}).to(ref.device).eval()
            teacher.requires_grad_(False)
            mine = student.get_input_embeddings().num_embeddings
            theirs = teacher.get_input_embeddings().num_embeddings
            if mine != theirs:
                raise ValueError(
                    f"train.distill.teacher: {path} has a vocabulary of {theirs} tokens, the student {mine}: on-policy "
                    f"distillation scores the student's own tokens, so both need the same tokenizer"
                )
            self._teacher = teacher
        return self._teacher

    @torch.no_grad()
    def apply(self, trainer, batch) -> dict[str, float]:
        """Add the distillation advantage to ``batch.advantages`` in place; returns ``distill/*``."""
        # (the student's recorded experts are not the teacher's: a mixture-of-experts teacher routes on its own)
        teacher_lp, _ = trainer._chunked_logprobs(self.teacher(), dataclasses.replace(batch, routing=None))
        on = batch.response_mask > 0
        reverse_kl = torch.where(on, batch.behavior_logprobs - teacher_lp, torch.zeros_like(teacher_lp))
        batch.advantages = self.cfg.task_coef * batch.advantages - self.cfg.coef * reverse_kl
        n_row = on.sum(1)  # each row's advantage (the trace, the episode log): the mean over its trained tokens
        batch.row_advantages = torch.where(n_row > 0, batch.advantages.sum(1) / n_row.clamp(min=1), 0.0)
        n = int(n_row.sum())
        if not n:
            return {}
        return {
            "distill/reverse_kl": float(reverse_kl[on].double().mean()),
            "distill/teacher_logprob_mean": float(teacher_lp[on].double().mean()),
            "distill/tokens": float(n),
        }
