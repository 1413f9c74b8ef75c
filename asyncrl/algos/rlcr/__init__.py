"""RLCR: accuracy plus calibrated confidence, on two-turn answer -> confidence trees
(Damani et al. 2025, "Beyond Binary Rewards: Training LMs to Reason About Their Uncertainty").

One prompt grows one tree, sent as one Episode:

    prompt ──> answer k = 1..G_a            turn 1: <think>...</think><answer>...</answer>
                 └─> confidence h = 1..G_c  turn 2, after a user message asking for a confidence:
                                            [<analysis>...</analysis>]<confidence>c</confidence>

All turn-1 generations of a batch are one engine call, all turn-2 generations another.

Rewards (last tag wins; format or parse failure gives 0):
``acc_reward[k] = verify(gold, answer[k])`` in {0, 1} and ``conf_reward[k, h] = 1 - (acc_reward[k] -
c[k, h])^2`` (Brier), always against the accuracy of the very answer the confidence is about.

Rows: each answer is a trajectory (``sample_type="answer"``: prompt + turn 1) that learns on the
think+answer span; each confidence another (``"confidence"``: prompt + answer + user turn + turn 2)
that learns on the analysis+confidence span only. Prompts and inserted user turns are never learned.
An output whose tags cannot be found learns on its whole turn, so that its zero reward can push it
away. The span ends at the closing tag (plus the EOS token right after it).

Advantages are computed here and carried on ``Trajectory.advantage``: answers are normalised among
the prompt's G_a answers, confidences among the G_c siblings of the same answer and never across
answers (a confidence about a wrong answer must not be baselined against ones about a right
answer); scaled by ``lambda_ans`` and ``lambda_conf``. The learner's loss then runs over each row's
own mask with any ``loss_agg_mode``.

``evaluate`` reports calibration on held-out tasks (accuracy, Brier, ECE, AUROC, reliability bins).
The workflow also declares the embedded model's ``rlcr`` warm-start format (``warmstart.py``): the
tag format with uninformative confidences, so that calibration has to be learned by RL.
"""

from .calibration import calibration_report
from .config import RLCRConfig
from .parsing import Parsed, brier_reward, parse_answer, parse_confidence
from .trees import ConfidenceTree, grow_trees, tree_advantages
from .warmstart import rlcr_warmstart_example
from .workflow import RLCRWorkflow

__all__ = [
    "ConfidenceTree",
    "Parsed",
    "RLCRConfig",
    "RLCRWorkflow",
    "brier_reward",
    "calibration_report",
    "grow_trees",
    "parse_answer",
    "parse_confidence",
    "rlcr_warmstart_example",
    "tree_advantages",
]
