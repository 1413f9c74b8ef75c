"""The learner as a group of processes (issue 15): rank 0 is the learner, the other ranks train with it.

``asyncrl learn`` under ``torchrun`` / ``accelerate launch`` (configs/accelerate/) or
``asyncrl run --learner-procs N`` starts N processes with RANK/WORLD_SIZE set. Rank 0 runs
:class:`asyncrl.learner.learner.Learner` as in one process: it alone owns the sockets, the buffer
and its write-ahead log, events, metrics, evaluation and checkpoints. The other ranks run
:func:`follow`: they hold the model (a DDP replica or their FSDP2 shards) and its optimizer, and do
what rank 0 announces on the control channel (:class:`asyncrl.learner.training.distributed.Control`: the
``group.*`` bodies of :mod:`asyncrl.wire.messages` through the wire codec, tensors in one byte
bucket packed by :mod:`asyncrl.wire.tensors`):

- ``GroupStart``: build the model and the trainer (the wrap is itself a collective);
- ``GroupLoad``: receive a checkpoint's model and optimizer state from rank 0 (each rank its shards),
  and the critic's (``train.advantage.estimator: gae``) when it says so;
- ``GroupStep``: the collated batch; every rank trains on its rows of each mini-batch
  (:class:`asyncrl.learner.training.trainer.PolicyTrainer`), gradients combined over the ranks;
- ``GroupState``: join the gathering of the full parameters (FSDP2: for publishing and evaluation);
- ``GroupCheckpoint``: join the gathering of the full model and optimizer states (and the critic's), which rank 0
  writes in the one-process format (so either kind of run resumes the other's checkpoints);
- ``GroupStop``: exit 0.

:class:`Ranks` is rank 0's side of the same protocol; with one process it calls the trainer
directly and announces nothing. A follower ignores SIGINT/SIGTERM (rank 0 decides when the group
stops: it checkpoints first, with the followers' help) and exits when rank 0 is gone: the control
channel's connection closes and its wait fails.
"""

from __future__ import annotations

import dataclasses
import signal

import torch

from ...config import cpu_threads
from ...objectives.losses import LossConfig
from ...wire.codec import WireError
from ...wire.messages import Body, GroupCheckpoint, GroupLoad, GroupStart, GroupState, GroupStep, GroupStop
from ..ingest.staleness import StalenessPolicy
from . import distributed as dist_learner
from .batch import TrainBatch
from .trainer import PolicyTrainer, TrainStepResult

_LIST_FIELDS = ("sample_types", "group_ids")


def load_trainable(cfg):
    """``(model, tokenizer, model_dir)``: the policy a learner trains, as every rank and a replay load
    it: the run's model (built or found, in its prompt format) with ``model.lora``'s adapters on it."""
    from ...models.loading import load_policy
    from ...models.lora import with_adapters
    from ...rollout.workflow import workflow_class

    model, tokenizer, path = load_policy(
        cfg.model,
        cfg.seed,
        cfg.train.device,
        cfg.tasks.prompt_format,
        warmstart_formats=workflow_class(cfg.algorithm).warmstart_formats,
    )
    return with_adapters(model, cfg.model, cfg.seed, base=path), tokenizer, path


def make_trainer(cfg, model, tokenizer, mode: str, staleness: StalenessPolicy) -> PolicyTrainer:
    """The learner's trainer for ``cfg`` (every rank builds the same one); ``staleness``: the process's
    one policy (built where the process starts: the learner, a follower rank, a replay)."""
    return PolicyTrainer(
        model,
        tokenizer,
        cfg.train,
        cfg.sampling.temperature,
        loss_cfg=LossConfig.from_config(cfg.train, cfg.replay),
        use_recorded_logprobs=cfg.replay.exp_is_correct,
        distributed=mode,
        staleness=staleness,
        critic_cfg=cfg.critic,
        model_cfg=cfg.model,
        seed=cfg.seed,
    )


def critic_states(trainer: PolicyTrainer) -> tuple[dict, dict] | None:
    """The critic's full ``(trainable state, optimizer state by name)`` (a collective in a group:
    rank 0 receives them, the others empty dicts); None without a critic."""
    if trainer.critic is None:
        return None
    from ...models.critic import trainable_state

    model = trainer.critic.model
    full = dist_learner.full_state_dict(model)
    return (
        trainable_state(dist_learner.unwrap(model), full) if full else {},
        dist_learner.optimizer_state(model, trainer.critic.optimizer),
    )


def load_critic(trainer: PolicyTrainer, states: tuple[dict, dict] | None) -> None:
    """A checkpoint's critic states into the critic (a collective in a group: rank 0 passes them)."""
    weights, optim = states if states is not None else ({}, {})
    dist_learner.load_states(trainer.critic.model, trainer.critic.optimizer, dict(weights), optim)


def step_message(batch: TrainBatch, keep_rows: bool, version: int) -> tuple[GroupStep, dict[str, torch.Tensor]]:
    """A batch as a ``group.step`` body and its tensors."""
    tensors = {
        f.name: getattr(batch, f.name)
        for f in dataclasses.fields(batch)
        if f.name not in _LIST_FIELDS and getattr(batch, f.name) is not None  # (routing: None without replay)
    }
    return GroupStep(
        keep_rows=keep_rows, version=version, **{name: list(getattr(batch, name)) for name in _LIST_FIELDS}
    ), tensors


def batch_from(body: GroupStep, tensors: dict[str, torch.Tensor], device: str) -> TrainBatch:
    return TrainBatch(
        **{k: v.to(device) for k, v in tensors.items()}, **{name: list(getattr(body, name)) for name in _LIST_FIELDS}
    )


class Ranks:
    """Rank 0's handle on the training group; the trainer itself when there is one process.

    ``plain`` is rank 0's unsharded model, the one that is published, evaluated and saved: the
    trainer's own module in one process and under DDP (a replica), a separate full copy under FSDP2
    that :meth:`step` refreshes from the shards after every update."""

    def __init__(self, control: dist_learner.Control | None, mode: str):
        self.control, self.mode = control, mode
        self.trainer: PolicyTrainer | None = None
        self.plain: torch.nn.Module | None = None

    @property
    def world(self) -> int:
        return torch.distributed.get_world_size() if self.control is not None else 1

    def _say(self, body: Body, tensors: dict | None = None) -> None:
        if self.control is not None:
            self.control.send(body, tensors)

    def start(self, cfg, model, tokenizer, staleness: StalenessPolicy) -> PolicyTrainer:
        """Build the trainer on every rank (rank 0 passes its loaded model)."""
        self._say(GroupStart())
        if self.mode == "fsdp2":  # the shards replace the module's parameters: keep a full copy to publish
            import copy

            self.plain = copy.deepcopy(model)
        else:
            self.plain = model
        self.trainer = make_trainer(cfg, model, tokenizer, self.mode, staleness)
        return self.trainer

    def load(self, weights: dict, optim_state: dict, critic: tuple[dict, dict] | None = None) -> None:
        """A checkpoint's full model and optimizer state into every rank's model and optimizer; ``critic``:
        its critic's states, for a run with a critic (none: the critic starts afresh)."""
        with_critic = critic is not None and self.trainer.critic is not None
        self._say(GroupLoad(critic=with_critic))
        if self.mode == "fsdp2":  # first: loading into the shards turns the dict's tensors into DTensors
            self.plain.load_state_dict(weights, strict=False)
        dist_learner.load_states(self.trainer.model, self.trainer.optimizer, dict(weights), optim_state)
        if with_critic:
            load_critic(self.trainer, critic)

    def step(self, batch: TrainBatch, keep_rows: bool, version: int) -> TrainStepResult:
        if self.control is not None:
            self._say(*step_message(batch, keep_rows, version))
        result = self.trainer.step(batch, keep_rows=keep_rows, version=version)
        if self.mode == "fsdp2":
            self._refresh_plain()
        return result

    def _refresh_plain(self) -> None:
        self._say(GroupState())
        full = dist_learner.full_state_dict(self.trainer.model)
        with torch.no_grad():
            for name, p in self.plain.named_parameters():
                p.copy_(full[name])

    def checkpoint_states(self) -> tuple[tuple[dict, dict] | None, tuple[dict, dict] | None]:
        """``(policy, critic)`` states for a checkpoint: the policy's full ``(model state, optimizer
        state)`` gathered from the group (rank 0's; None in one process, where the checkpoint takes
        them from the model and optimizer itself), and the critic's (:func:`critic_states`; None
        without a critic)."""
        if self.control is None:
            return None, critic_states(self.trainer)
        self._say(GroupCheckpoint())
        model_state = dist_learner.full_state_dict(self.trainer.model)
        states = model_state, dist_learner.optimizer_state(self.trainer.model, self.trainer.optimizer)
        return states, critic_states(self.trainer)

    def stop(self) -> None:
        """Release the other ranks (they exit 0). Never raises: it is called on the way out."""
        if self.control is None:
            return
        try:
            self._say(GroupStop())
        except Exception as e:  # a follower already gone: nothing to release
            print(f"[learner] could not tell the other learner ranks to stop: {e}", flush=True)
        else:
            dist_learner.leave_group()
        self.control = None


def follow(cfg, control: dist_learner.Control, mode: str) -> int:
    """A rank other than 0: do what rank 0 announces until it says stop (exit code 0) or is gone
    (exit code 1, one line)."""
    rank = torch.distributed.get_rank()
    for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 decides when the group stops
        signal.signal(sig, signal.SIG_IGN)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cpu_threads(cfg, "learner"))
    trainer: PolicyTrainer | None = None
    staleness = StalenessPolicy.from_config(cfg)  # (this process's one policy, as rank 0's)
    steps = 0
    try:
        while True:
            body, tensors = control.recv()
            if isinstance(body, GroupStop):
                print(f"[learner rank {rank}] stopping after {steps} step(s)", flush=True)
                dist_learner.leave_group()
                return 0
            if isinstance(body, GroupStart):
                model, tokenizer, _ = load_trainable(cfg)
                trainer = make_trainer(cfg, model, tokenizer, mode, staleness)
                print(f"[learner rank {rank}] ready ({mode}, {torch.distributed.get_world_size()} ranks)", flush=True)
            elif trainer is None:
                raise RuntimeError(f"rank 0 sent {body.KIND!r} before 'group.start'")
            elif isinstance(body, GroupLoad):
                dist_learner.load_states(trainer.model, trainer.optimizer, {}, {})
                if body.critic:
                    load_critic(trainer, None)
            elif isinstance(body, GroupStep):
                batch = batch_from(body, tensors, cfg.train.device)
                trainer.step(batch, keep_rows=body.keep_rows, version=body.version)
                steps += 1
            elif isinstance(body, GroupState):
                dist_learner.full_state_dict(trainer.model)
            elif isinstance(body, GroupCheckpoint):
                dist_learner.full_state_dict(trainer.model)
                dist_learner.optimizer_state(trainer.model, trainer.optimizer)
                critic_states(trainer)
            else:
                raise RuntimeError(f"rank 0 sent an unknown operation {body.KIND!r}")
    except WireError as e:  # (rank 0 runs the same code: a version mismatch between the ranks' installs)
        print(f"[learner rank {rank}] cannot read rank 0's announcement after {steps} step(s): {e}", flush=True)
        return 1
    except RuntimeError as e:  # gloo: the connection to rank 0 closed (it exited or was killed)
        print(
            f"[learner rank {rank}] rank 0 is gone or the group failed after {steps} step(s): "
            f"{str(e).splitlines()[0][:300]}",
            flush=True,
        )
        return 1
