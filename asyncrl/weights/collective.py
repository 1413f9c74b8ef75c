"""Collective weight sync (``sync.type: nccl``): a torch.distributed broadcast from the learner to
its actors, with the ``nccl`` backend between GPUs or ``gloo`` (``sync.backend``) on CPUs; the same
code either way.

Membership, over the rendezvous store the learner serves (``sync.group_host:group_port``,
:class:`asyncrl.weights.rendezvous.StoreServer`: bound to that host alone, CURVE off loopback, bounded, and
answering only requests that carry its secret, which reaches the actors in the learner's ``weights``
message; a plain ``TCPStore`` would listen on every interface and take anyone's registrations):

- an actor *registers* (``reg`` counter plus ``reg/<n>`` = its token) when it first hears of the
  group and again whenever its group fails;
- the learner forms a new group (an *epoch*) when registrations arrive: members are the members
  of the last epoch plus the new registrations, ranks 1..N (the learner is rank 0), announced as
  ``epoch/<e>`` and ``latest``; every member builds its process group under the store prefix
  ``pg<e>`` and a newcomer gets the current version at once;
- a broadcast that fails or passes ``sync.timeout_s`` (a killed or hung actor) is reported in one
  line, the group is dropped (an empty epoch is announced), and the learner goes on; the actors
  still alive see they were dropped and register again, so the next epoch holds exactly them. A
  member that never came to a group's rendezvous (it set no ``ready/<e>/<token>``) is never waited
  for again. No call waits without a bound.

Each version is announced by a doorbell (``bell/<e>``, a count) and then sent as two broadcasts in
the epoch's group: a header ``[version, nbytes]`` and one flat byte bucket holding every tensor at
the offsets of :func:`asyncrl.wire.tensors.plan_layout` (the layout travels in the epoch
announcement). On the actor a background thread watches the store and enters a broadcast only
when the bell rings (so it can always be stopped between versions), receiving into one of three
buffers (receiving, ready, in use by the engine): generation never waits for a transfer. The
``weights`` message (version and the store's address) tells the actor's main loop to take the
newest ready version between generation batches.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import sys
import threading
import time

import msgspec
import torch
import torch.distributed as dist

from ..wire.codec import Message, encode
from ..wire.messages import TensorSpec, Weights
from ..wire.tensors import pack, plan_layout, unpack
from .base import Publisher, Receiver, WeightsError
from .rendezvous import StoreClient, StoreServer

_POLL_S = 0.05  # waiting for an epoch
_RING_WAIT_S = 0.2  # a member waiting for the bell (the store answers as soon as it rings)
_MAX_PENDING = 1024  # registrations waiting for the next epoch, at most


def _group(backend: str, store, prefix: str, rank: int, size: int, timeout_s: float):
    """A process group of its own (not torch's default group: the learner may train in one)."""
    store = dist.PrefixStore(prefix, store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _broadcast(pg, tensor: torch.Tensor) -> None:
    pg.broadcast([tensor], dist.BroadcastOptions()).wait()


def _abort(pg) -> None:
    """End a group at once: its members' pending collectives fail instead of waiting."""
    if pg is not None:
        try:
            pg.abort()
        except Exception:  # noqa: BLE001 - already broken: nothing left to end
            pass


class CollectivePublisher(Publisher):
    """The learner's side (rank 0 of every epoch)."""

    needs_snapshot = True  # a newcomer is sent the last published version, kept as it was

    def __init__(self, sync_cfg, run_dir=None, wire_cfg=None):
        self.backend, self.timeout_s = sync_cfg.backend, float(sync_cfg.timeout_s)
        self.host = sync_cfg.group_host
        self.server = StoreServer(self.host, int(sync_cfg.group_port), curve_dir=getattr(wire_cfg, "curve_dir", None))
        self.store = self.server.local(self.timeout_s)  # (kept: a process group holds it by reference)
        self.address = self.server.address
        self.epoch, self.members, self.pg, self.bell = 0, [], None, 0
        self._regs_seen = 0
        self._unread: dict[int, float] = {}  # registration number -> when first counted, token not yet read
        self._pending: list[str] = []
        self.never_came: set[str] = set()  # members that missed a rendezvous: never waited for again
        self._last: tuple[int, dict] | None = None  # (version, state) last published
        self._bucket: torch.Tensor | None = None
        self.last_error: str | None = None

    @property
    def _device(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"

    # -- membership -----------------------------------------------------------------------------
    def poll(self) -> None:
        """Form a new epoch if actors registered since the last one (then send them the current
        version). Called by the learner's loop and before every publish."""
        regs, now = int(self.store.add("reg", 0)), time.monotonic()
        for n in range(max(self._regs_seen, regs - _MAX_PENDING) + 1, regs + 1):
            self._unread.setdefault(n, now)  # (bounded: a count pushed far ahead costs _MAX_PENDING reads)
        self._regs_seen = max(self._regs_seen, regs)
        for n, since in sorted(self._unread.items()):
            # a registration is two requests (add "reg", then set "reg/<n>"): one whose token is not
            # written yet is read again at the next poll, and given up only after timeout_s
            token = self.server.table.values([f"reg/{n}"])[0]
            if token is None and now - since < self.timeout_s:
                continue
            del self._unread[n]
            self.store.delete_key(f"reg/{n}")  # (the store holds only what is still to be read)
            if token and token.decode(errors="replace") not in self.never_came and len(self._pending) < _MAX_PENDING:
                self._pending.append(token.decode(errors="replace"))
        while len(self._unread) > _MAX_PENDING:
            self._unread.pop(min(self._unread))
        if not self._pending or self._last is None:
            return
        newcomers, self._pending = self._pending, []
        self._form([m for m in self.members if m not in newcomers] + newcomers)
        if self.pg is not None:
            self._send(*self._last)

    def _announce(self, members: list[str], layout: list | None = None) -> None:
        old = self.epoch
        self.pg, self.epoch, self.bell = None, self.epoch + 1, 0
        info = {"members": members, "layout": layout or [], "backend": self.backend}
        self.store.set(f"epoch/{self.epoch}", json.dumps(info))
        self.store.set(f"bell/{self.epoch}", "0")
        self.store.set("latest", str(self.epoch))
        if old > 1:  # what a member may still read is the newest epoch and the one before
            self._forget(old - 1)

    def _forget(self, epoch: int) -> None:
        for key in (f"epoch/{epoch}", f"bell/{epoch}"):
            self.store.delete_key(key)
        self.server.table.drop(f"pg{epoch}/", f"ready/{epoch}/")

    def _form(self, members: list[str]) -> None:
        layout, _ = plan_layout(self._last[1])
        self._announce(members, msgspec.to_builtins(layout))
        try:
            self.pg = _group(self.backend, self.store, f"pg{self.epoch}", 0, len(members) + 1, self.timeout_s)
            self.members = members
        except Exception as e:  # noqa: BLE001 - a member that never came: report, go on without a group
            absent = [m for m in members if not self.store.check([f"ready/{self.epoch}/{m}"])]
            self.never_came.update(absent)
            self.server.table.cancel(f"pg{self.epoch}/")  # the members that came stop waiting now
            self._fail(
                f"forming weight-sync group {self.epoch} with {members}"
                + (f" ({len(absent)} never came and will not be waited for again: {absent[:4]})" if absent else ""),
                e,
            )

    def _fail(self, what: str, err: Exception) -> None:
        self.last_error = (
            f"{what} failed ({type(err).__name__}: {str(err).splitlines()[0][:200]}); "
            f"training goes on, live actors rejoin"
        )
        print(f"[learner] weight sync: {self.last_error}", file=sys.stderr, flush=True)
        _abort(self.pg)
        self.members = []
        self._announce([])  # the members still alive see they were dropped and register again

    # -- versions -------------------------------------------------------------------------------
    def frames(self, state: dict[str, torch.Tensor], version: int, digest: str | None = None) -> list:
        self._last = (int(version), state)
        self.poll()
        if self.pg is not None:
            self._send(int(version), state)
        return encode(
            "weights", Weights(version=int(version), group=self.address, group_key=self.server.secret, digest=digest)
        )

    def _send(self, version: int, state: dict[str, torch.Tensor]) -> None:
        layout, size = plan_layout(state)
        if self._bucket is None or self._bucket.numel() != size:  # one buffer, reused every version
            self._bucket = torch.empty(size, dtype=torch.uint8, device=self._device)
        bucket = self._bucket
        pack(bucket, layout, state)
        self.bell += 1
        self.store.set(f"bell/{self.epoch}", str(self.bell))
        try:
            _broadcast(self.pg, torch.tensor([version, size], dtype=torch.int64, device=self._device))
            _broadcast(self.pg, bucket)
        except Exception as e:  # noqa: BLE001 - a dead or stuck actor: bounded by timeout_s, then reported
            self._fail(f"broadcasting version {version} to {self.members}", e)

    def close(self) -> None:
        _abort(self.pg)
        self.pg = None
        self.server.close()


class _Dropped(Exception):
    """This actor is not in the learner's newest epoch: register again."""


class CollectiveReceiver(Receiver):
    """The actor's side: a thread joins epochs and receives versions; ``tensors`` hands the
    newest one to the engine."""

    def __init__(self, sync_cfg=None, wire_cfg=None, actor_id: str | None = None):
        self.timeout_s = float(sync_cfg.timeout_s) if sync_cfg is not None else 30.0
        self._curve = (getattr(wire_cfg, "curve_dir", None), actor_id)
        self._lock = threading.Condition()
        self._buffers: list[torch.Tensor | None] = [None, None, None]
        self._ready: tuple[int, int, list[TensorSpec]] | None = None  # (version, buffer index, layout)
        self._taken: tuple[int, int, list[TensorSpec]] | None = None  # the one the engine was given
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.epoch = 0
        self._member_of_current = False
        self.error: str | None = None

    def tensors(self, msg: Message) -> tuple[int, dict[str, torch.Tensor]]:
        group = msg.body.group
        if not group:
            raise WeightsError(
                "the learner sent no weight-sync group but this actor expects sync.type=nccl; "
                "use the same sync.type on both sides"
            )
        if not msg.body.group_key:
            raise WeightsError(
                "the learner's weights message names a weight-sync group but no group_key; "
                "learner and actor must run the same asyncrl version"
            )
        if self._thread is None:
            host, port = group.rsplit(":", 1)
            self._thread = threading.Thread(
                target=self._run, args=(host, int(port), msg.body.group_key), daemon=True, name="weights-collective"
            )
            self._thread.start()
            atexit.register(self.close)
        want = msg.body.version
        with self._lock:  # a newcomer waits for its first version (the learner sends it on joining)
            self._lock.wait_for(
                lambda: (
                    (self._ready is not None and self._ready[0] >= want)
                    or (self._taken is not None and self._taken[0] >= want)
                ),
                timeout=self.timeout_s,
            )
            if self._ready is not None:
                self._taken, self._ready = self._ready, None
            elif self._taken is None:
                raise WeightsError(
                    f"no weights from the group at {group} within {self.timeout_s:.0f} s"
                    + (f" ({self.error})" if self.error else "")
                )
            version, index, layout = self._taken  # (the version it holds again: the actor skips it)
        return version, unpack(self._buffers[index], layout)

    # -- the thread -----------------------------------------------------------------------------
    def _run(self, host: str, port: int, secret: str) -> None:
        try:
            store = StoreClient(
                host, port, secret, timeout_s=self.timeout_s, curve_dir=self._curve[0], actor_id=self._curve[1]
            )
            self._store = store  # (kept alive while process groups use it)
        except Exception as e:  # noqa: BLE001
            self.error = f"cannot reach the weight-sync store at {host}:{port}: {e}"
            return
        token = None
        while not self._stop.is_set():
            if token is None:  # (again when dropped: the learner counts only who registers)
                n = int(store.add("reg", 1))
                token = f"{os.getpid()}-{n}"
                store.set(f"reg/{n}", token)
            try:
                info = self._wait_for_epoch(store, token)
                while info is not None:  # the next epoch that names this actor, until stopped
                    info = self._serve_epoch(store, token, info)
            except Exception as e:  # noqa: BLE001 - dropped, or the group failed: register again
                self.error, token = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}", None

    def _newer_epoch(self, store, token: str) -> dict | None:
        """The newest epoch if it is newer than the one served; _Dropped if it leaves this actor out
        after it was a member."""
        if not store.check(["latest"]):
            return None
        epoch = int(store.get("latest"))
        if epoch <= self.epoch:
            return None
        info = json.loads(store.get(f"epoch/{epoch}"))
        if token not in info["members"]:
            if self.epoch and self._member_of_current:
                raise _Dropped(f"not in the learner's weight-sync group {epoch}")
            self.epoch = epoch  # formed before this registration was seen: wait for the next
            return None
        self.epoch = epoch
        return info

    def _wait_for_epoch(self, store, token: str) -> dict | None:
        self._member_of_current = False
        while not self._stop.is_set():
            info = self._newer_epoch(store, token)
            if info is not None:
                return info
            time.sleep(_POLL_S)
        return None

    def _serve_epoch(self, store, token: str, info: dict) -> dict | None:
        """Receive the versions of one epoch; returns the next epoch that names this actor (None
        when stopped)."""
        members, epoch = info["members"], self.epoch
        store.set(f"ready/{epoch}/{token}", "1")  # (a member that never sets it is not waited for again)
        pg = _group(info["backend"], store, f"pg{epoch}", members.index(token) + 1, len(members) + 1, self.timeout_s)
        self._member_of_current = True
        layout = [msgspec.convert(t, TensorSpec) for t in info["layout"]]
        device = "cuda" if info["backend"] == "nccl" else "cpu"
        done = 0
        seen: list = [None, None]
        while not self._stop.is_set():
            seen = store.wait_change([f"bell/{epoch}", "latest"], seen, _RING_WAIT_S)
            bell = int(seen[0] or 0)
            while done < bell:  # one header + bucket per ring, in order
                header = torch.zeros(2, dtype=torch.int64, device=device)
                _broadcast(pg, header)
                version, size = (int(x) for x in header.tolist())
                index = self._free_buffer(size, device)
                _broadcast(pg, self._buffers[index][:size])
                with self._lock:
                    self._ready = (version, index, layout)
                    self._lock.notify_all()
                done += 1
            newer = self._newer_epoch(store, token)
            if newer is not None:
                return newer
        return None

    def _free_buffer(self, size: int, device: str) -> int:
        with self._lock:
            busy = {self._taken[1] if self._taken else None, self._ready[1] if self._ready else None}
        index = next(i for i in range(3) if i not in busy)
        buf = self._buffers[index]
        if buf is None or buf.numel() < size or str(buf.device.type) != device:
            self._buffers[index] = torch.empty(size, dtype=torch.uint8, device=device)
        return index

    def close(self) -> None:
        """Stop the thread (between versions; a transfer in progress ends within timeout_s)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s)
