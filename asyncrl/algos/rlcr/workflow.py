"""The RLCR workflow: one Episode per task carrying its confidence tree; calibration evaluation."""

from __future__ import annotations

import time

from ...config import validate_section
from ...envs.answer_checks import require_math_verify
from ...rollout.workflow import RolloutContext, Workflow, register_workflow
from ...types import Episode, Task, new_id
from .calibration import calibration_report
from .config import RLCRConfig
from .trees import assign_advantages, grow_trees, score_tree, tree_metrics, tree_record, tree_trajectories
from .warmstart import rlcr_warmstart_example


# --------------------------------------------------------------------------------------- workflow
@register_workflow("rlcr")
class RLCRWorkflow(Workflow):
    """One Episode per task carrying its confidence tree (``Episode.decision``)."""

    per_task = True  # each task's confidence tree is its own episode
    warmstart_formats = {"rlcr": rlcr_warmstart_example}  # tags: answer, then confidence
    reward_metrics = ("rlcr/answer_reward_mean", "rlcr/confidence_reward_mean")
    algo_config = RLCRConfig
    tables = {"rlcr_nodes": "asyncrl.algos.rlcr.analysis:rlcr_nodes_frame"}
    views = ("asyncrl.algos.rlcr.ui:ConfidenceTreesView",)

    @staticmethod
    def counts_for_reward(traj) -> bool:
        return traj.sample_type != "confidence" and not traj.is_replay  # the answers

    def __init__(self, cfg):
        super().__init__(cfg)
        self.algo: RLCRConfig = validate_section(self.algo_config, cfg.algo, "algo")
        if self.algo.verifier == "math":
            require_math_verify()  # fail at start-up, not on the first batch

    def rollout(self, tasks: list[Task], ctx: RolloutContext) -> list[Episode]:
        version = ctx.engine.version
        trees = grow_trees(ctx.engine, ctx.tokenizer, ctx.env, tasks, self.algo, self.cfg.sampling, ctx.seed)
        episodes = []
        for tree in trees:
            score_tree(tree, self.algo.verifier)
            assign_advantages(tree, self.algo, self.cfg.train.advantage.estimator)
            eid = new_id()
            trajs = tree_trajectories(tree, version, eid)
            episodes.append(
                Episode(
                    trajectories=trajs,
                    actor_id=ctx.actor_id,
                    task=tree.task,
                    id=eid,
                    decision=tree_record(tree, trajs),
                    metrics=tree_metrics(tree),
                    created_at=time.time(),
                )
            )
        return episodes

    def evaluate(self, engine, tokenizer, env, tasks: list[Task], sampling, cfg) -> dict:
        """One answer and one confidence per held-out task (the evaluator's sampling, greedy by
        default). An unparsable confidence counts as 0 and is reported as ``confidence_parse_fail``.
        ECE bins follow ``algo.ece_bins`` (by default the reference's (b/10, (b+1)/10]); the record
        names the convention (``ece_bins``)."""
        trees = grow_trees(engine, tokenizer, env, tasks, self.algo, sampling, cfg.seed, g_a=1, g_c=1)
        conf, correct, answer_fail, conf_fail = [], [], 0, 0
        for tree in trees:
            score_tree(tree, self.algo.verifier)
            a = tree.answers[0]
            c = a.confidences[0]
            conf.append(c.parsed.value if c.parsed.ok else 0.0)
            correct.append(a.reward)
            answer_fail += not a.parsed.ok
            conf_fail += not c.parsed.ok
        report = calibration_report(conf, correct, right_closed=self.algo.ece_bins == "right_closed")
        report.update(
            reward_mean=report["accuracy"],
            ece_bins=self.algo.ece_bins,
            answer_format_fail=answer_fail / max(len(trees), 1),
            confidence_parse_fail=conf_fail / max(len(trees), 1),
        )
        return report
