"""The ``asyncrl`` command. Thin: parse arguments, load the config, call the library."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from asyncrl.app.args import add_ui_arguments

from ..config import ConfigError, load_config
from ..lifecycle import freeze_startup_heap, tolerate_closed_output, warn_once_per_message, watch_parent
from ..rundir import layout
from ..rundir.claim import check_writable
from ..rundir.runlog import check_trackers
from ..wire.sockets import WireSecurityError
from .preflight import preflight

CONFIG_KEYS_HELP = "every config key, its value and what it does: asyncrl config -c FILE [KEY=VALUE ...] [--diff]"


def _add_config_args(p: argparse.ArgumentParser) -> None:
    if p.epilog is None and p.prog.split()[-1] != "config":
        p.epilog = CONFIG_KEYS_HELP
    p.add_argument("--config", "-c", help="YAML config file (configs/*.yaml); defaults if omitted")
    p.add_argument(
        "-o",
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. -o train.lr=1e-5 (repeatable)",
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="more overrides")


def _load(args) -> tuple:
    overrides = list(args.override) + list(args.overrides)
    return load_config(args.config, overrides), overrides


def cmd_init_model(args) -> int:
    from .init_model import init_model

    cfg, _ = _load(args)
    init_model(cfg)
    return 0


def _add_start_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in the run dir from its newest intact checkpoint (checkpoint.resume=true)",
    )
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the previous run's files in the run dir first, then start fresh",
    )


def _start_refused(args, error: Exception) -> int:
    """A start refused by the run directory's state (asyncrl.rundir.claim) or an unusable checkpoint/WAL."""
    print(f"asyncrl {args.command}: {error}", file=sys.stderr, flush=True)
    return 2


def _start_errors() -> tuple[type[Exception], ...]:
    from ..rundir.claim import RunDirError
    from ..rundir.layout import CheckpointError
    from ..rundir.record_file import RecordError

    return RunDirError, CheckpointError, RecordError


def cmd_learn(args) -> int:
    from ..learner.learner import Learner

    if args.resume:
        args.override.append("checkpoint.resume=true")
    cfg, _ = _load(args)
    preflight(cfg)  # before anything is built or written: one-line ConfigErrors
    if os.environ.get("RANK", "0") == "0":
        check_writable(cfg.run_dir)
    ranks = _learner_group(cfg)
    if isinstance(ranks, int):  # a rank other than 0: it trained with rank 0 and has exited
        return ranks
    try:
        learner = Learner(cfg, overwrite=args.overwrite, ranks=ranks)
    except _start_errors() as e:
        ranks.stop()
        return _start_refused(args, e)
    except BaseException:
        ranks.stop()
        raise
    freeze_startup_heap()  # a process of its own from here on: see asyncrl.lifecycle
    summary = learner.run()
    print(json.dumps({"summary": summary}))
    return 0


def _learner_group(cfg):
    """Under torchrun / accelerate launch / ``asyncrl run --learner-procs`` (WORLD_SIZE > 1): join
    the group; rank 0 gets its :class:`asyncrl.learner.training.ranks.Ranks`, any other rank trains with it
    here and gets its exit code. One process: a ``Ranks`` of one."""
    from ..learner.training import distributed
    from ..learner.training.ranks import Ranks, follow

    world = distributed.launched_world()
    mode = distributed.resolve_mode(cfg.train.distributed, world)
    if world == 1:
        if cfg.train.distributed != "none":
            print(
                f"[learner] train.distributed={cfg.train.distributed} but one learner process: training as one "
                f"process (start several with asyncrl run --learner-procs N, torchrun or accelerate launch)",
                flush=True,
            )
        return Ranks(None, "none")
    if cfg.train.device == "cuda":  # one GPU per rank
        cfg.train.device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    rank, _ = distributed.init_from_env(cfg.train.distributed_timeout_s, curve_dir=cfg.wire.curve_dir)
    control = distributed.Control()
    if rank == 0:
        print(
            f"[learner] {world} learner processes ({mode}); rank 0 owns the sockets, buffer and checkpoints", flush=True
        )
        return Ranks(control, mode)
    return follow(cfg, control, mode)


def _check_weights_address(address: str | None) -> None:
    """``--weights-address``: a node's weights relay, ``ipc://`` and the absolute path of its socket."""
    if address is None:
        return
    path = address[len("ipc://") :] if address.startswith("ipc://") else None
    if not path or not os.path.isabs(path) or "\0" in path:
        raise ConfigError(
            f"--weights-address {address!r}: expected ipc:// and the absolute path of a weights relay's "
            f"socket (asyncrl run passes it; leave it out to take weights from the learner)"
        )


def cmd_serve(args) -> int:
    from ..actor.actor import Actor
    from ..envs.guard import TooManyFailures

    cfg, _ = _load(args)
    _check_weights_address(args.weights_address)
    from ..schedulers.slurm import BUNDLE_ENV, materialize_bundle

    if os.environ.get(BUNDLE_ENV):  # (started by the SLURM scheduler on another node: its own CURVE bundle)
        cfg.wire.curve_dir = materialize_bundle(os.environ.pop(BUNDLE_ENV))
    preflight(cfg)
    control = args.connect or _wait_for_control(layout.addresses(Path(args.run_dir or cfg.run_dir)))
    try:
        actor = Actor(cfg, control, args.actor_id, args.index, weights_address=args.weights_address)
        freeze_startup_heap()  # as for the learner: full collections skip the model and libraries
        actor.run()
    except TooManyFailures as e:
        print(f"asyncrl serve ({args.actor_id}): stopping: {e}", file=sys.stderr, flush=True)
        return 3
    return 0


def _wait_for_control(addr_file: Path, report_s: float = 60.0) -> str:
    """The learner's control address from ``addr_file`` (its ``addresses.json``), waiting for a
    learner that is still starting (said once, then every ``report_s`` seconds) until Ctrl-C."""
    t0 = said = None
    while True:
        try:
            return json.loads(addr_file.read_text())["control"]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # not written yet, or being written
        now = time.monotonic()
        if t0 is None:
            t0 = said = now
            print(
                f"asyncrl serve: waiting for the learner's addresses in {addr_file} (start `asyncrl learn` "
                f"with the same run name, or give --connect ADDRESS); Ctrl-C stops",
                flush=True,
            )
        elif now - said >= report_s:
            said = now
            print(f"asyncrl serve: still waiting for {addr_file} after {now - t0:.0f} s", flush=True)
        time.sleep(0.2)


def cmd_relay(args) -> int:
    from ..weights.relay import main as relay_main

    cfg, _ = _load(args)
    return relay_main(cfg, args.learner_weights, args.relay_id, args.sock_dir)


def cmd_run(args) -> int:
    from ..rundir.claim import prepare
    from ..schedulers import SchedulerError, launch

    if args.resume:  # the learner child gets the same overrides, so it resumes too
        args.override.append("checkpoint.resume=true")
    cfg, overrides = _load(args)
    if args.actors is not None or args.scheduler is not None:
        overrides += [f"actor.num={args.actors}"] if args.actors is not None else []
        overrides += [f"launch.scheduler={args.scheduler}"] if args.scheduler is not None else []
        cfg = load_config(args.config, overrides)
    heldout = preflight(cfg).heldout  # (checks the tasks; printed once nothing refuses the run)
    if cfg.launch.scheduler == "slurm" and (args.dry_run or not os.environ.get("SLURM_JOB_ID")):
        from ..schedulers.slurm import submit  # (the run directory is claimed by the job, on its first node)

        try:
            return submit(cfg, dry_run=args.dry_run, overwrite=args.overwrite, learner_procs=args.learner_procs)
        except SchedulerError as e:
            print(f"asyncrl run: {e}", file=sys.stderr, flush=True)
            return 2
    check_writable(cfg.run_dir)
    check_trackers(cfg.log.trackers)  # the learner's trackers: a missing library stops here, in one line
    if args.dry_run:  # (local or Ray: the checks above and a word on what would start; nothing written)
        return _dry_run(cfg, heldout, args)
    try:  # before anything starts: the lock, fresh/resume/overwrite, damaged checkpoints, frozen keys
        prepare(cfg, overwrite=args.overwrite)
    except _start_errors() as e:
        return _start_refused(args, e)
    if args.learner_procs < 1:
        raise SystemExit(f"asyncrl run: --learner-procs {args.learner_procs}; expected 1 or more processes")
    print(f"[asyncrl] {heldout}", flush=True)
    try:
        return launch(cfg, args.config, overrides, ui=args.ui, learner_procs=args.learner_procs)
    except SchedulerError as e:
        print(f"asyncrl run: {e}", file=sys.stderr, flush=True)
        return 2


def _dry_run(cfg, heldout: str, args) -> int:
    """``asyncrl run --dry-run`` with the local or Ray scheduler: the config and its set-up checked
    (preflight), what the run directory would do (start fresh, resume, or refuse), and the command
    that starts it; nothing is started or written. Exit code 2 when the start would be refused."""
    from ..rundir.claim import RunDirError, plan_start, state_found  # (both only read)
    from ..schedulers.local import this_command

    run_dir = Path(cfg.run_dir).resolve()
    where = "on a Ray cluster" if cfg.launch.scheduler == "ray" else "on this machine"
    print(f"[asyncrl] {heldout}", flush=True)
    print(
        f"[asyncrl] dry run: the config and its set-up passed the checks; nothing was started or written. It "
        f"would start {args.learner_procs} learner process(es) and {cfg.actor.num} actor(s) {where} for "
        f"{cfg.train.total_steps} steps, in {run_dir}",
        flush=True,
    )
    code, state = 0, state_found(cfg.run_dir)
    if args.overwrite and state:
        print(f"[asyncrl] --overwrite would delete what {run_dir} holds ({'; '.join(state)})", flush=True)
    elif not args.overwrite:
        try:
            plan = plan_start(cfg)
            if plan.mode == "resume":
                print(f"[asyncrl] it would resume from step {plan.step}", flush=True)
        except RunDirError as e:
            print(f"[asyncrl] the start would be refused: {e}", flush=True)
            code = 2
    print(f"[asyncrl] start it with:\n  {this_command(lambda a: a == '--dry-run')}", flush=True)
    return code


def cmd_probe(args) -> int:
    from .probe import probe

    cfg, _ = _load(args)
    preflight(cfg)
    result = probe(cfg, num_tasks=args.tasks)
    if args.json:
        print(json.dumps(result))
    return 0


def cmd_config(args) -> int:
    from ..analysis.config_view import show_config

    cfg, _ = _load(args)
    print(show_config(cfg, diff=args.diff))
    return 0


def cmd_keys(args) -> int:
    from ..wire.sockets import make_curve_keys

    names = args.names or [str(i) for i in range(args.actors)]
    bundles = make_curve_keys(args.out, names)
    server = bundles.pop("server")
    print(
        f"CURVE keys in {args.out}:\n  {server}  the learner's pair and the actor keys it admits "
        f"(stays on the learner's machine): -o wire.curve_dir={server}"
    )
    for name, path in bundles.items():
        print(
            f"  {path}  {name}'s pair and the learner's public key (copy to that actor's machine): "
            f"-o wire.curve_dir={path}"
        )
    print(
        f"On one machine (asyncrl run), -o wire.curve_dir={args.out} gives each process its own bundle. "
        f"Run this again with more --names to add actors; the server pair is kept."
    )
    return 0


def cmd_export(args) -> int:
    from ..models.lora import export_run

    if args.critic:
        from ..models.critic import export_run_critic
        from ..rollout.workflow import workflow_class

        ckpt, out = export_run_critic(
            Path(args.run),
            Path(args.out) if args.out else None,
            step=args.step,
            formats_of=lambda algorithm: workflow_class(algorithm).warmstart_formats,
        )
        print(
            f"asyncrl export: the critic of {ckpt} -> {out} (a Hugging Face token-classification model with one "
            f"label, the value: AutoModelForTokenClassification.from_pretrained({str(out)!r}))"
        )
        return 0
    done = export_run(Path(args.run), Path(args.out) if args.out else None, merge=args.merge, step=args.step)
    how = (
        ", LoRA adapters merged into the base model"
        if done.merged
        else ", full weights copied (the run trained no adapters: --merge had nothing to merge)"
        if args.merge
        else ""
    )
    print(
        f"asyncrl export: {done.checkpoint} -> {done.out} (a Hugging Face model directory{how}: "
        f"AutoModelForCausalLM.from_pretrained({str(done.out)!r}))"
    )
    return 0


def cmd_replay(args) -> int:
    from .replay import replay

    report = replay(Path(args.run), to=args.to, overrides=args.overrides, name=args.name, overwrite=args.overwrite)
    checks = report["checkpoints"]
    same = [c["step"] for c in checks if c["identical"]]
    differ = [c for c in checks if not c["identical"]]
    print(f"asyncrl replay ({report['label']}): {report['steps']} steps of {args.run} -> {report['out']}")
    if not checks:
        print("  no checkpoint of the run within the replayed steps to compare with")
    elif not differ:
        print(f"  weights identical bit for bit to the run's at every checkpoint: steps {same}")
    else:
        for c in differ:
            print(
                f"  step {c['step']}: {len(c['differing'])} of {c['tensors']} tensors differ from the run's "
                f"(max |diff| {c['max_abs_diff']:.3g}; e.g. {c['differing'][:3]})"
            )
    return 0 if report["overrides"] or not differ else 1


def cmd_ledger(args) -> int:
    from ..analysis.ledger import ledger_report

    try:
        text, ok = ledger_report(Path(args.run))
    except FileNotFoundError as e:
        print(f"asyncrl ledger: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0 if ok else 1


def cmd_ui(args) -> int:
    try:
        from asyncrl.app.main import main as ui_main
    except ImportError as e:
        raise SystemExit(f"asyncrl ui: the app is not available ({e})") from None
    return ui_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncrl", description="Asynchronous actor-learner RL for LMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("init-model", help="build (or find in the cache) the embedded tiny model")
    _add_config_args(p)
    p.set_defaults(fn=cmd_init_model)
    _add_process_commands(sub)
    _add_run_command(sub)
    _add_tool_commands(sub)
    return parser


def _add_process_commands(sub) -> None:
    """``learn``, ``serve``, ``relay``: the processes a run is made of, each startable by hand."""
    p = sub.add_parser("learn", help="run the learner")
    _add_config_args(p)
    _add_start_args(p)
    p.set_defaults(fn=cmd_learn)
    p = sub.add_parser("serve", help="run a rollout actor")
    _add_config_args(p)
    p.add_argument(
        "--connect",
        help="the learner's control address (addresses.json 'control': ipc://PATH on "
        "its host, tcp://HOST:PORT with CURVE keys)",
    )
    p.add_argument("--run-dir", help="read the learner's addresses from RUN_DIR/addresses.json")
    p.add_argument("--actor-id", default="actor-0")
    p.add_argument("--index", type=int, default=0, help="actor index (seeds its task stream)")
    p.add_argument(
        "--weights-address",
        help="take weights from this node's relay (asyncrl relay: the ipc:// "
        "address it prints) instead of the learner; use with -o sync.type=ipc",
    )
    p.set_defaults(fn=cmd_serve)
    p = sub.add_parser("relay", help="one weights copy per node: relay the learner's weights to this node's actors")
    _add_config_args(p)
    p.add_argument("--learner-weights", required=True, help="the learner's weights address (addresses.json 'weights')")
    p.add_argument("--relay-id", default="0", help="its name (and CURVE bundle name, off loopback)")
    p.add_argument(
        "--sock-dir",
        help="private directory (made mode 0700) of the ipc socket this node's actors "
        "connect to (default: a new temporary one)",
    )
    p.set_defaults(fn=cmd_relay)


def _add_run_command(sub) -> None:
    """``run``: the learner and actors together, on a scheduler."""
    from ..schedulers import SCHEDULERS

    p = sub.add_parser("run", help="run the learner and actors together")
    _add_config_args(p)
    p.add_argument("--actors", type=int, help="number of actor processes (actor.num)")
    _add_start_args(p)
    p.add_argument("--ui", action="store_true", help="also start the Gradio app")
    p.add_argument(
        "--scheduler",
        choices=list(SCHEDULERS),
        help="where the processes run (launch.scheduler): local child processes (default), a Ray cluster, "
        "or a SLURM job (submitted; inside an allocation, run there)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="check the config and set-up (preflight) and say what would "
        "start, starting nothing; with --scheduler slurm, write the sbatch script and say how to submit it",
    )
    p.add_argument(
        "--learner-procs",
        type=int,
        default=1,
        metavar="N",
        help="learner processes (default 1): N > 1 trains with DDP, or FSDP2 with "
        "train.distributed=fsdp2 (rank 0 owns the sockets, buffer and checkpoints)",
    )
    p.set_defaults(fn=cmd_run)


def _add_tool_commands(sub) -> None:
    """``config``, ``keys``, ``export``, ``ui``: commands that start no run."""
    p = sub.add_parser(
        "config",
        help="print the resolved config (every key, with its description)",
        description="The config a run would use (the file, then the overrides, over the defaults), "
        "as YAML with each key's description. --diff: only the keys that differ from "
        "the defaults.",
    )
    _add_config_args(p)
    p.add_argument("--diff", action="store_true", help="only the keys that differ from the defaults")
    p.set_defaults(fn=cmd_config)
    p = sub.add_parser(
        "probe",
        help="sample the model on some training tasks: does GRPO have signal there?",
        description="Sample the run's model on training tasks as an actor would (sampling.n each) "
        "and greedily, and say how many groups mix right and wrong replies (what GRPO "
        "learns from). Trains nothing, starts no process.",
    )
    _add_config_args(p)
    p.add_argument("--tasks", type=int, default=32, help="training tasks to sample (default 32)")
    p.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    p.set_defaults(fn=cmd_probe)
    p = sub.add_parser("keys", help="make ZeroMQ CURVE keys for non-loopback addresses")
    p.add_argument("--out", required=True, help="directory for the key bundles (DIR/server, DIR/actor-<name>)")
    p.add_argument("--actors", type=int, default=1, help="make bundles actor-0 .. actor-(N-1) (default 1)")
    p.add_argument("--names", nargs="+", metavar="NAME", help="make bundles actor-NAME instead")
    p.set_defaults(fn=cmd_keys)
    p = sub.add_parser("export", help="write a run's checkpoint as a plain Hugging Face model directory")
    p.add_argument("run", help="the run directory (runs/<name>)")
    p.add_argument("--merge", action="store_true", help="merge LoRA adapters (model.lora) into the base model")
    p.add_argument("--out", help="output directory (default <run>/export/step_<N>)")
    p.add_argument("--step", type=int, help="this checkpoint (default: the newest intact one)")
    p.add_argument(
        "--critic",
        action="store_true",
        help=(
            "export the run's critic (train.advantage.estimator gae) instead, as a token-classification model "
            "with one label (default --out: <run>/export/step_<N>_critic)"
        ),
    )
    p.set_defaults(fn=cmd_export)
    p = sub.add_parser("replay", help="train a run's archived episodes again (log.archive_episodes), no actors")
    p.add_argument("run", help="the run directory (runs/<name>)")
    p.add_argument("--to", type=int, help="replay up to this step (default: every archived step)")
    p.add_argument("--name", help="the replay's directory name beside the run (default <run>-replay or <run>-whatif)")
    p.add_argument("--overwrite", action="store_true", help="replace that directory if it exists")
    p.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides (another loss, estimator, ...)")
    p.set_defaults(fn=cmd_replay)
    p = sub.add_parser(
        "ledger", help="a run's task ledger: per epoch, tasks trained once, dropped and why, dealt again, open"
    )
    p.add_argument("run", help="the run directory (runs/<name>)")
    p.set_defaults(fn=cmd_ledger)
    p = sub.add_parser("ui", help="open the Gradio app on a run (finished or live)")
    add_ui_arguments(p)
    p.set_defaults(fn=cmd_ui)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # KEY=VALUE overrides may come before and after options (`run name=x -c cfg.yaml train.lr=1e-5`)
    if extra and hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    watch_parent()  # started by `asyncrl run`: die with it (asyncrl.lifecycle)
    tolerate_closed_output()  # `asyncrl run ... | tee log` and Ctrl-C: tee dies first; training goes on
    if args.command in ("learn", "serve", "init-model"):  # the ones that load a model library
        warn_once_per_message()
    if args.command in ("run", "learn", "serve", "relay", "replay"):  # every file of a run is this user's alone
        os.umask(0o077)  # (their child processes inherit it)
    try:
        return int(args.fn(args) or 0)
    except ConfigError as e:
        print(f"asyncrl {args.command}: {e}", file=sys.stderr)
        return 2
    except WireSecurityError as e:
        print(f"asyncrl {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
