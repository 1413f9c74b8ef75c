"""``asyncrl run --scheduler ray``: the learner group and the actors as Ray actors on a cluster.

Ray is the control plane only: it places the processes (:class:`asyncrl.schedulers.procs.ProcSupervisor`,
one per asyncrl command, each starting ``asyncrl learn`` / ``serve`` / ``relay`` on its node),
restarts lost actors and tells this driver where everything is. Episodes, acknowledgements, credits
and weights go over asyncrl's ZeroMQ protocol, as on one machine.

- **Cluster.** ``launch.ray.address`` or ``RAY_ADDRESS`` is joined (a closed address fails within
  ``launch.ray.connect_timeout_s``, in one line); without either, a local cluster of the run's own is
  started (even where another Ray cluster runs on this host) and stopped with the run: bound to
  127.0.0.1, no dashboard web UI (``launch.ray.dashboard``), Ray's token authentication on
  (``RAY_AUTH_MODE=token`` with a fresh token unless one is set), its files under a private (0700)
  directory. A loopback address pins this driver to 127.0.0.1 too (Ray would otherwise dial the
  machine's interface).
- **Placement.** The learner's processes go to one node: the driver's, or with custom resources in
  ``launch.learner.resources``, a STRICT_PACK placement group of one bundle per process; the run
  directory lives there (no shared filesystem is assumed: configs and keys travel as text through
  Ray, every process's log is collected under ``<run>/logs/``). Ranks meet on 127.0.0.1. Each actor
  asks for ``launch.actor`` (CPUs, GPUs, custom resources), packed or spread
  (``launch.spread_actors``). A request no node can ever meet fails at once, naming what is missing;
  one that is not granted within ``launch.ray.start_timeout_s`` fails then.
- **Addresses and keys.** Actors get the learner's addresses from rank 0's supervisor, not from a
  file. When the cluster has nodes on other hosts (``launch.ray.secure``), the learner binds its
  node's address with CURVE keys made on its node; each actor receives its own bundle (never the
  server's secret). On one host the learner's sockets are private ipc files (no TCP at all).
- **One copy of the weights per node** (``launch.ray.relay``): the driver starts a relay
  (:mod:`asyncrl.weights.relay`) on each node that holds actors; the learner sends each version once
  per node and the actors there read it from shared memory (``sync.type=ipc`` on the actors). Off
  one host each relay has a CURVE key of its own. A relay that dies is said in one line and
  restarted by Ray (``launch.ray.max_restarts``); its node's actors take weights from the learner
  within ``actor.relay_timeout_s`` (:meth:`asyncrl.actor.link.ActorLink.check_relay`).
- **Failures.** A lost actor (its node, or its process failing) is restarted by Ray up to
  ``launch.ray.max_restarts`` times and re-joins through the session/ack protocol: nothing
  acknowledged is lost, nothing trained twice. A lost learner ends the run with one line
  (``--resume`` continues it). SIGINT/SIGTERM stops every process on every node (the learner
  checkpoints first).
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from ..config import Config, dump_config
from ..wire.sockets import is_loopback, private_dir
from . import SchedulerError
from .local import STOP_GRACE_S, StopRequested, StopSignals, resume_command
from .procs import ProcSupervisor, relay_name

_POLL_S = 0.5
_CALL_TIMEOUT_S = 30.0


def _import_ray():
    try:
        import ray
    except ImportError:
        raise SchedulerError(
            "launch.scheduler=ray needs Ray, which is not installed: pip install 'asyncrl[ray]' (or pip install ray)"
        ) from None
    return ray


def _say(text: str) -> None:
    print(f"[asyncrl] {text}", flush=True)


def _reachable(address: str, timeout_s: float) -> None:
    host, _, port = address.rpartition(":")
    try:
        port_n = int(port)
    except ValueError:
        raise SchedulerError(
            f"Ray address {address!r} (launch.ray.address / RAY_ADDRESS): expected host:port of the head node"
        ) from None
    deadline = time.monotonic() + timeout_s
    last: OSError | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port_n), timeout=min(2.0, timeout_s)):
                return
        except OSError as e:
            last = e
            time.sleep(0.3)
    raise SchedulerError(
        f"cannot reach the Ray cluster at {address} (launch.ray.address / RAY_ADDRESS) within "
        f"{timeout_s:g} s ({last}): start it with `ray start --head` there, or leave both unset "
        f"to run on a local cluster"
    )


def connect(cfg: Config):
    """Join the configured cluster or start a local one; returns (ray, started_here). Ray reads its
    environment when it is imported, so everything is set before."""
    if "ray" in sys.modules:
        raise SchedulerError("Ray was imported before the scheduler set it up; start the run with `asyncrl run`")
    rc = cfg.launch.ray
    address = rc.address or os.environ.get("RAY_ADDRESS") or None
    kwargs = {"logging_level": "WARNING", "log_to_driver": False}
    if address and address != "auto":
        _reachable(address, rc.connect_timeout_s)
        if is_loopback(address.rpartition(":")[0]):
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # (Ray would dial the interface address)
            kwargs["_node_ip_address"] = "127.0.0.1"
        ray = _import_ray()
        ray.init(address=address, **kwargs)
        return ray, False
    if address == "auto":
        ray = _import_ray()
        ray.init(address="auto", **kwargs)
        return ray, False
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    if os.environ["RAY_AUTH_MODE"] == "token" and not os.environ.get("RAY_AUTH_TOKEN_PATH"):
        os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    ray = _import_ray()
    need_cpu = cfg.launch.learner.cpus + cfg.actor.num * cfg.launch.actor.cpus
    custom: dict[str, float] = {}
    for res, n in [(cfg.launch.learner.resources, 1), (cfg.launch.actor.resources, cfg.actor.num)]:
        for k, v in res.items():
            custom[k] = custom.get(k, 0.0) + v * n
    # address "local": a cluster of this run's own, even where another one runs on this host (Ray would
    # otherwise join the cluster it finds in /tmp/ray, perhaps another user's); its files under a private
    # directory of this user's (Ray makes its own temp dir mode 0777; the 0700 parent keeps others out)
    private = private_dir(Path(tempfile.gettempdir()) / f"ray-asyncrl-{os.geteuid()}")
    ray.init(
        address="local",
        _temp_dir=str(private / "r"),
        _node_ip_address="127.0.0.1",
        include_dashboard=rc.dashboard,
        num_cpus=max(os.cpu_count() or 1, int(need_cpu + 0.999)),
        resources=custom or None,
        **kwargs,
    )
    return ray, True


def _demand(res) -> dict[str, float]:
    out = {"CPU": res.cpus, "GPU": res.gpus, **res.resources}
    return {k: v for k, v in out.items() if v}


def check_feasible(ray, cfg: Config) -> None:
    """Fail at once when no alive node could ever host a learner process or an actor."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    for what, need in (
        ("a learner process (launch.learner)", _demand(cfg.launch.learner)),
        ("an actor (launch.actor)", _demand(cfg.launch.actor)),
    ):
        if any(all(n["Resources"].get(k, 0) >= v for k, v in need.items()) for n in nodes):
            continue
        offers = "; ".join(
            f"{n['NodeManagerAddress']}: "
            + ", ".join(
                f"{k}={v:g}"
                for k, v in sorted(n["Resources"].items())
                if not k.startswith(("node:", "memory", "object"))
            )
            for n in nodes
        )
        missing = sorted(k for k, v in need.items() if not any(n["Resources"].get(k, 0) >= v for n in nodes))
        raise SchedulerError(
            f"no node of the Ray cluster can host {what}: it needs {need}, and no node has "
            f"{', '.join(missing) or 'all of them at once'} (nodes: {offers})"
        )


class RayRun:
    """One run on a cluster: the processes it placed and how to watch and stop them."""

    def __init__(self, ray, cfg: Config, learner_procs: int):
        self.ray, self.cfg, self.procs_n = ray, cfg, learner_procs
        self.token = secrets.token_hex(4)
        self.Proc = ray.remote(ProcSupervisor)
        self.run_dir = str(Path(cfg.run_dir).resolve())
        self.learner: list = []
        self.actors: list = []
        self.actor_nodes: list[str | None] = [None] * cfg.actor.num
        self.relays: dict[str, object] = {}
        self.relays_down: set[str] = set()  # nodes whose relay was said to be gone
        self.actor_files: dict[str, dict[str, bytes]] = {}
        self.run_overrides: dict = {}
        self.said_restarting: set[int] = set()
        self.printed = 0

    # -- specs ------------------------------------------------------------------------------------
    def _spec(self, name: str, args: list[str], overrides: dict, **extra) -> dict:
        cfg = self.cfg.model_copy(deep=True)
        for key, value in overrides.items():
            obj = cfg
            *path, last = key.split(".")
            for part in path:
                obj = getattr(obj, part)
            setattr(obj, last, value)
        return {
            "name": name,
            "args": args,
            "config": dump_config(cfg),
            "cwd": os.getcwd(),
            "run_dir": self.run_dir,
            **extra,
        }

    # -- start ------------------------------------------------------------------------------------
    def start_learner(self) -> dict:
        ray, lc = self.ray, self.cfg.launch
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

        opts = {
            "num_cpus": lc.learner.cpus,
            "num_gpus": lc.learner.gpus,
            "resources": lc.learner.resources,
            "max_restarts": 0,
        }
        if lc.learner.resources:
            pg = ray.util.placement_group([_demand(lc.learner)] * self.procs_n, strategy="STRICT_PACK")
            try:
                ray.get(pg.ready(), timeout=lc.ray.start_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise SchedulerError(
                    f"the learner's resources {_demand(lc.learner)} x {self.procs_n} on one node were "
                    f"not granted within {lc.ray.start_timeout_s:g} s (launch.learner, "
                    f"launch.ray.start_timeout_s)"
                ) from None
            strategies = [
                PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i) for i in range(self.procs_n)
            ]
        else:  # the driver's node: the run directory is where the run was started
            here = ray.get_runtime_context().get_node_id()
            strategies = [NodeAffinitySchedulingStrategy(here, soft=False)] * self.procs_n
        # (rank 0 collects every process's log; the others find it by its name: an actor handle among a
        # restartable actor's constructor arguments is a reference Ray cannot rebuild, and Ray says so)
        self.sink_name = f"asyncrl-logs-{self.token}"
        self.learner = [
            self.Proc.options(
                scheduling_strategy=strategies[rank], **opts, **({"name": self.sink_name} if rank == 0 else {})
            ).remote({"name": f"learner-rank{rank}", "start": False})
            for rank in range(self.procs_n)
        ]
        rank0 = self.learner[0]
        node = self.learner_node = self._call(rank0.node.remote())
        overrides = {"run_root": str(Path(self.run_dir).parent), "name": Path(self.run_dir).name}
        self.run_overrides = dict(overrides)
        secure = self._secure(node["ip"])
        if secure:  # keys made on the learner's node; actors get their own bundle, never the server's secret
            names = [str(i) for i in range(self.cfg.actor.num)]
            self.actor_files = self._call(rank0.make_keys.remote(str(Path(self.run_dir) / "keys"), names))
            overrides.update({"wire.host": node["ip"], "wire.curve_dir": str(Path(self.run_dir) / "keys")})
        if lc.ray.relay:
            overrides["sync.type"] = "zmq"  # (the relays take frames; the actors read shared memory)
        env = {}
        if self.procs_n > 1:
            env = {
                "WORLD_SIZE": str(self.procs_n),
                "LOCAL_WORLD_SIZE": str(self.procs_n),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(self._call(rank0.free_port.remote())),
                "ASYNCRL_STORE_SECRET": secrets.token_hex(16),
            }
        for rank, sup in enumerate(self.learner):
            spec = self._spec(f"learner-rank{rank}", ["learn"], overrides, sink=None if rank == 0 else self.sink_name)
            self._call(sup.set_spec.remote(spec))
            self._call(sup.start.remote({**env, "RANK": str(rank), "LOCAL_RANK": str(rank)} if env else {}))
        _say(
            f"learner: {self.procs_n} process(es) on node {node['ip']} ({node['host']}, id {node['node_id'][:12]}); "
            f"run directory {self.run_dir} there; " + ("CURVE keys on" if secure else "loopback only")
        )
        return node

    def _secure(self, learner_ip: str) -> bool:
        mode = self.cfg.launch.ray.secure
        if mode != "auto":
            return mode == "always"
        ips = {n["NodeManagerAddress"] for n in self.ray.nodes() if n.get("Alive")}
        return any(ip != learner_ip and not (is_loopback(ip) and is_loopback(learner_ip)) for ip in ips)

    def wait_addresses(self, stop: StopSignals) -> dict:
        import json

        path = str(Path(self.run_dir) / "addresses.json")
        t0 = last = time.monotonic()
        rank0 = self.learner[0]
        while True:
            stop.check()
            self.print_learner_output()
            data = self._call(rank0.read_file.remote(path))
            if data:
                try:
                    return json.loads(data)
                except ValueError:
                    pass
            code = self._call(rank0.poll.remote())
            if code is not None:
                raise SchedulerError(
                    f"the learner exited with code {code} before binding its sockets; its output:\n"
                    f"{self._call(rank0.tail.remote())}"
                )
            if time.monotonic() - last > 60:
                last = time.monotonic()
                _say(f"the learner is still starting after {last - t0:.0f} s; waiting")
            time.sleep(0.2)

    def start_actors(self, addrs: dict) -> None:
        lc = self.cfg.launch
        self.addrs = addrs
        for i in range(self.cfg.actor.num):
            name = f"actor-{i}"
            args = ["serve", "--connect", addrs["control"], "--actor-id", name, "--index", str(i)]
            files = self.actor_files.get(name, {})
            if files:
                args += ["-o", f"wire.curve_dir={{files}}/{name}"]
            overrides = dict(self.run_overrides)
            if lc.ray.relay:
                overrides["sync.type"] = "ipc"
                args += ["--weights-address", "{relay}"]
            spec = self._spec(
                name,
                args,
                overrides,
                files=files,
                restart_on_failure=True,
                sink=self.sink_name,
                relay=f"asyncrl-relay-{self.token}" if lc.ray.relay else None,
                relay_timeout_s=lc.ray.start_timeout_s,
            )
            # (by value, inlined in the actor's creation task: a restart never depends on an object that could
            # be lost, and Ray does not warn that one might be; a spec is a few kB of config and keys)
            self.actors.append(
                self.Proc.options(
                    num_cpus=lc.actor.cpus,
                    num_gpus=lc.actor.gpus,
                    resources=lc.actor.resources,
                    max_restarts=lc.ray.max_restarts,
                    max_task_retries=0,
                    scheduling_strategy="SPREAD" if lc.spread_actors else "DEFAULT",
                ).remote(spec)
            )

    # -- watching ---------------------------------------------------------------------------------
    def _call(self, ref, timeout: float = _CALL_TIMEOUT_S):
        return self.ray.get(ref, timeout=timeout)

    def print_learner_output(self) -> None:
        try:
            data = self._call(self.learner[0].read_log.remote(self.printed))
        except Exception:  # noqa: BLE001 - the learner's node is gone: the supervise loop says so
            return
        if data:
            self.printed += len(data)
            sys.stdout.write(data.decode("utf-8", "replace"))
            sys.stdout.flush()

    def ensure_relays(self, node_id: str) -> None:
        """A relay on ``node_id`` (where an actor landed), owned by this driver: it ends with the run."""
        if not self.cfg.launch.ray.relay or node_id in self.relays:
            return
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        name = f"relay-{node_id[:12]}"
        args = ["relay", "--learner-weights", self.addrs["weights"], "--relay-id", node_id[:12]]
        files = {}
        if self.actor_files:  # off one host: a key of its own (the learner admits it as this relay only)
            files = self._call(self.learner[0].make_keys.remote(str(Path(self.run_dir) / "keys"), [name]))[name]
            args += ["-o", f"wire.curve_dir={{files}}/{name}"]
        spec = self._spec(
            name,
            args,
            {**self.run_overrides, "sync.type": "zmq"},
            files=files,
            sink=self.sink_name,
            restart_on_failure=True,
        )
        self.relays[node_id] = self.Proc.options(  # (the spec by value, as the actors')
            name=relay_name(f"asyncrl-relay-{self.token}", node_id),
            num_cpus=0,
            max_restarts=self.cfg.launch.ray.max_restarts,
            max_task_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(spec)
        _say(f"weights relay on node {node_id[:12]}: the learner sends each version once for this node's actors")

    def watch_relays(self) -> None:
        """Say, once each, when a node's relay is gone (its actors take weights from the learner after
        ``actor.relay_timeout_s``; Ray restarts it, ``launch.ray.max_restarts``) and when it is back."""
        ray = self.ray
        for node_id, sup in self.relays.items():
            try:
                code = ray.get(sup.poll.remote(), timeout=5.0)
                gone = None if code is None else f"its process exited with code {code}"
            except ray.exceptions.GetTimeoutError:
                continue
            except (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnschedulableError) as e:
                gone = f"gone for good ({str(e).splitlines()[0][:200]})"  # (e.g. its node was removed)
            except ray.exceptions.RayError:  # unavailable while Ray restarts it, or any other trouble
                gone = "unavailable"
            if gone and node_id not in self.relays_down:
                self.relays_down.add(node_id)
                _say(
                    f"the weights relay on node {node_id[:12]} is {gone}: its actors take weights from the learner "
                    f"(after actor.relay_timeout_s={self.cfg.actor.relay_timeout_s:g} s); Ray restarts it "
                    f"(launch.ray.max_restarts {self.cfg.launch.ray.max_restarts})"
                )
            elif not gone and node_id in self.relays_down:
                self.relays_down.discard(node_id)
                _say(
                    f"the weights relay on node {node_id[:12]} runs again (actors started on that node from now on "
                    f"use it)"
                )

    def watch_actors(self) -> str | None:
        """Where each actor is, restarts noticed, relays for new nodes; a line ending the run, or None.
        Every actor is asked at once (a slow one, still starting on a busy node, is asked again next time)."""
        ray = self.ray
        asked = [(sup.node.remote(), sup.poll.remote()) for sup in self.actors]
        deadline = time.monotonic() + 5.0
        for i, (node_ref, code_ref) in enumerate(asked):
            try:
                left = max(deadline - time.monotonic(), 0.01)
                node, code = ray.get(node_ref, timeout=left), ray.get(code_ref, timeout=left)
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.ActorDiedError as e:
                return (
                    f"actor-{i} is gone for good after {self.cfg.launch.ray.max_restarts} restart(s) "
                    f"(launch.ray.max_restarts): {self._last_words(f'actor-{i}', e)}"
                )
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError):
                if i not in self.said_restarting:
                    self.said_restarting.add(i)
                    _say(
                        f"actor-{i} is unavailable (its node lost, or its process failed); Ray restarts it "
                        f"(launch.ray.max_restarts {self.cfg.launch.ray.max_restarts})"
                    )
                continue
            self.said_restarting.discard(i)
            if isinstance(code, str):
                return f"actor-{i} could not start: {code}"
            if node["node_id"] != self.actor_nodes[i]:
                self.ensure_relays(node["node_id"])
                again = self.actor_nodes[i] is not None
                self.actor_nodes[i] = node["node_id"]
                _say(
                    f"actor-{i} {'restarted' if again else 'started'} on node {node['ip']} ({node['host']}, "
                    f"id {node['node_id'][:12]})"
                )
        return None

    def learner_code(self) -> int | None:
        try:
            code = self._call(self.learner[0].poll.remote(), timeout=10.0)
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError) as e:
            raise SchedulerError(
                f"the learner's node {self.learner_node['ip']} (id "
                f"{self.learner_node['node_id'][:12]}) was lost ({type(e).__name__}); the run ends. "
                f"`asyncrl run --scheduler ray --resume` on the same cluster continues it from its "
                f"last checkpoint"
            ) from None
        for rank, sup in enumerate(self.learner[1:], start=1):
            c = self._call(sup.poll.remote(), timeout=10.0)
            if c not in (None, 0):
                raise SchedulerError(f"learner rank {rank} exited with code {c}; see {self.run_dir}/logs/")
        return code

    # -- stopping ---------------------------------------------------------------------------------
    def _last_words(self, name: str, error) -> str:
        """What a process that Ray gave up on said last (its log's last line, on the learner's node), and
        where its log is; Ray's own reason where that log has nothing."""
        log = f"{self.run_dir}/logs/{name}.log"
        try:
            line = self._call(self.learner[0].last_error_line.remote(name))
        except Exception:  # noqa: BLE001 - the learner's node is gone too
            line = ""
        if line and not line.startswith("("):  # (not "(no log)", "(its log is empty)")
            return f"{line}; its log: {log} (on the learner's node)"
        return f"{str(error).splitlines()[0][:300]}; its log: {log} (on the learner's node)"

    def say_stop_reason(self, line: str) -> None:
        """Give the learner, about to be stopped, ``line`` as its stop reason (summary, learner_stop
        event, exit code 1), as a run on one machine does; never raises."""
        try:
            self._call(self.learner[0].write_stop_reason.remote(line))
        except Exception:  # noqa: BLE001 - the learner's node is gone: the console line is said anyway
            pass

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop the learner first (it checkpoints and tells the actors to stop), then everything else;
        never raises."""
        ray = self.ray
        for group in (self.learner, self.actors, list(self.relays.values())):
            refs = []
            for sup in group:
                try:
                    refs.append(sup.stop.remote(grace_s))
                except Exception:  # noqa: BLE001
                    pass
            try:
                ray.wait(refs, num_returns=len(refs), timeout=grace_s + 5)
            except Exception:  # noqa: BLE001
                pass
        self.print_learner_output()
        everyone = [*self.learner, *self.actors, *self.relays.values()]
        try:
            ray.wait([sup.cleanup.remote() for sup in everyone], num_returns=len(everyone), timeout=10)
        except Exception:  # noqa: BLE001
            pass
        for sup in everyone:
            try:
                ray.kill(sup, no_restart=True)
            except Exception:  # noqa: BLE001
                pass


def launch(cfg: Config, config_path: str | None, overrides: list[str], ui: bool = False, learner_procs: int = 1) -> int:
    if ui:
        raise SchedulerError("--ui with --scheduler ray: start `asyncrl ui --run <run dir>` on the learner's node")
    stop = StopSignals()
    stop.install()
    ray, started = connect(cfg)
    run: RayRun | None = None
    code = 1
    try:
        check_feasible(ray, cfg)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        _say(f"Ray cluster: {len(nodes)} node(s) ({'started here, 127.0.0.1' if started else 'joined'})")
        run = RayRun(ray, cfg, learner_procs)
        run.start_learner()  # (a resume is in the config: checkpoint.resume)
        addrs = run.wait_addresses(stop)
        run.start_actors(addrs)
        _say(f"learner at {addrs['control']}, {cfg.actor.num} actor(s) placed by Ray; logs in {run.run_dir}/logs")
        while True:
            stop.check()
            run.print_learner_output()
            learner = run.learner_code()
            if learner is not None:
                code = learner
                break
            ended = run.watch_actors()
            run.watch_relays()
            if ended:
                _say(ended)
                run.say_stop_reason(ended)
                code = 1
                break
            time.sleep(_POLL_S)
    except StopRequested:
        code = stop.exit_code
        _say(f"stopping ({signal.Signals(stop.signum).name}); the learner checkpoints first")
    except SchedulerError as e:
        _say(str(e))
        code = 1
    finally:
        if run is not None:
            run.stop(grace_s=5.0 if stop.count >= 2 else STOP_GRACE_S)
            if stop.count and run.learner:  # (the checkpoint is in the run directory, on the learner's node)
                print(
                    f"[asyncrl] stopped; the learner checkpointed in {run.run_dir} on node "
                    f"{getattr(run, 'learner_node', {}).get('ip', '?')}. Resume with (the same cluster):\n"
                    f"  {resume_command()}",
                    file=sys.stderr,
                    flush=True,
                )
        ray.shutdown()
    return code
