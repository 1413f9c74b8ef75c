"""Absolute Zero self-play: one policy as proposer and solver (Zhao et al. 2025, "Absolute Zero:
Reinforced Self-play Reasoning with Zero Data"; its unified mode adds the learnability filter).

Per seed prompt (one task in, one Episode out):

1. propose: the policy, prompted as proposer, samples ``questions_per_prompt`` questions; each
   proposer conversation is kept (tokens and behaviour log-probs) as a proposer trajectory and
   each output is parsed by the domain into a solver task, or rejected with a reason;
2. solve: every valid question gets ``rollout_n`` solver conversations through the domain's
   environment (reset / step up to ``max_steps`` / evaluate -> named scores);
3. unified reward and filter: solver reward per response, learnability per question, and the
   group status (``filter.compute_unified_reward_and_filter``);
4. repropose: a group that is all learnable or all not learnable is proposed again, only that
   group, up to ``max_repropose_attempts`` times; each attempt replaces that group's data;
5. keep: a mixed group keeps one learnable question, drawn with a seeded RNG, and its
   ``rollout_n`` responses (group id ``<episode>/solver``); a group that never became mixed keeps
   no solver rows (the Episode may then hold no trajectories at all);
6. proposer rows (``mode: joint``): rewards 1.0 learnable / 0.0 not / -0.5 never mixed, advantage
   scaled by ``proposer_weight`` (``Trajectory.advantage_scale``). ``proposer_update: sampled`` (the
   seed) keeps one row per prompt, normalised against the other prompts' proposer rows in the
   batch (group ``absolute_zero/proposer``); ``group`` keeps every question of the final group,
   normalised within the group (``<episode>/proposer``).

The Episode's ``decision`` is the full record (every attempt's questions, ratios, thresholds,
flags, reasons, the sampled index and proposer rewards); ``metrics`` use the seeds' names.
"""

from .config import AbsoluteZeroConfig, DimensionConfig
from .workflow import PROPOSER_BATCH_GROUP, WARMSTART_FORMAT, AbsoluteZeroWorkflow, propose_warmstart_example

__all__ = [
    "PROPOSER_BATCH_GROUP",
    "WARMSTART_FORMAT",
    "AbsoluteZeroConfig",
    "AbsoluteZeroWorkflow",
    "DimensionConfig",
    "propose_warmstart_example",
]
