"""The learning maths, in one place: advantage estimators (:mod:`.advantages`), policy losses
(:mod:`.losses`), off-policy corrections (:mod:`.corrections`), aggregation (:mod:`.aggregation`) and
per-token log-probs, entropy and KL (:mod:`.logprobs`). Imported by the learner and by workflows that
normalise on the actor (RLCR). Each name table is a :class:`asyncrl.registry.Registry`: adding an
estimator, a loss or a correction is one registered function in one of these files.

Shapes: ``N`` trajectories, ``B`` rows of a batch (one per trajectory), ``T`` target positions. Every
``[B, T]`` tensor is aligned to the targets of :class:`asyncrl.learner.training.batch.TrainBatch`
(position ``j`` scores token ``j + 1`` of the padded sequence). Masks are float 0/1.
"""
