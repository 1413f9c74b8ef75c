"""Schedulers: where ``asyncrl run`` starts its processes (``launch.scheduler``, ``--scheduler``).

A scheduler starts the same commands everywhere (``asyncrl learn``, ``asyncrl serve``, ``asyncrl
relay``) and stops them together; episodes, acknowledgements, credits and weights always go over
asyncrl's own ZeroMQ protocol, never through the scheduler. Each is a function ``launch(cfg,
config_path, overrides, ui=False, learner_procs=1) -> exit code``:

- ``local``: child processes of ``asyncrl run`` on this machine (:mod:`asyncrl.schedulers.local`);
- ``ray``: Ray actors on a cluster, joined or started (:mod:`asyncrl.schedulers.ray`);
- ``slurm``: a batch job; outside an allocation :func:`asyncrl.schedulers.slurm.submit` writes and
  submits it instead (:mod:`asyncrl.schedulers.slurm`).
"""

from __future__ import annotations

from ..registry import Registry

SCHEDULERS: Registry = Registry("scheduler")
SCHEDULERS.add("local", "asyncrl.schedulers.local:launch")
SCHEDULERS.add("ray", "asyncrl.schedulers.ray:launch")
SCHEDULERS.add("slurm", "asyncrl.schedulers.slurm:launch")


class SchedulerError(RuntimeError):
    """A scheduler cannot start the run (missing package, unreachable cluster, resources nobody has);
    the text says what is missing, in one line."""


def launch(cfg, config_path, overrides, ui: bool = False, learner_procs: int = 1) -> int:
    name = cfg.launch.scheduler
    return SCHEDULERS.resolve(name, "launch.scheduler")(cfg, config_path, overrides, ui=ui, learner_procs=learner_procs)
