"""Typed wire messages: one msgspec Struct per message kind (docs/design/events.md, "Wire messages").

Every message body is a :class:`Body` subclass named on the wire by its ``KIND``. Decoding a body
(:func:`asyncrl.wire.codec.decode`) checks every field's type and bounds and rejects unknown and
missing fields, all inside msgspec's C decoder. Free-form fields (an episode's ``decision``, task
metadata, ...) are :data:`Json`: null, bool, int, float, str, lists and string-keyed maps nested at
most ``JSON_MAX_DEPTH`` levels; bytes, msgpack extension types and deeper nesting are refused. A
message that fails is a WireError naming the message kind, the field and what was expected;
nothing downstream ever sees it.

Channels and who sends what (the learner binds, actors connect):

====================  ==========  ==================================================================
kind                  direction   meaning
====================  ==========  ==================================================================
``hello``             A -> L      admit me with ``capacity`` (capped by ``wire.max_capacity``)
``welcome``           L -> A      you are admitted (again): the learner holds no credits of yours
``credit``            L -> A      generate ``n`` more episodes with weights >= ``min_version``
``ack``               L -> A      these episodes are in the write-ahead log; these were rejected
``status``            A -> L      heartbeat (from the actor's heartbeat socket): renews the lease
``alive``             L -> A      answer to ``status``: the learner (``session``) is alive
``stop``              L -> A      the run is over
``episode``           A -> L      trajectories, columnar, with raw array frames
``subscribe``         A -> L      weights channel: I have ``have``; send anything newer (also the
                                  acknowledgement that lets the next version go out)
``weights``           L -> A      ``version`` as tensor frames, ``path`` to a safetensors file, or a
                                  shared-memory ``segment`` and ``layout``
``event``             L -> UI     one run-log record on the events channel
====================  ==========  ==================================================================
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, get_type_hints

import msgspec

from ..timeline import MAX_SPANS
from ..types import (  # noqa: F401 (JSON_MAX_DEPTH, Json, Task: the wire's names for them, imported from here)
    JSON_MAX_DEPTH,
    PER_TOKEN,
    Count,
    Episode,
    Id,
    Json,
    JsonMap,
    Name,
    Seconds,
    Task,
    Version,
    new_id,
    trajectory_columns,
)


class Body(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A message body; ``KIND`` is its name on the wire."""

    KIND: ClassVar[str] = ""


# --- actors <-> learner: admission, credits, acknowledgements, heartbeats ---------------------


class Hello(Body):
    """``holding``: the tickets of the dealt tasks this actor will still deliver (unacknowledged
    episodes, the batch it is generating); the learner deals the others again."""

    KIND = "hello"
    actor_id: Name
    capacity: Annotated[int, msgspec.Meta(ge=1)]
    version: Version = -1
    pid: Count = 0
    holding: list[Id] = []


class Welcome(Body):
    """``deals``: the learner deals every fresh task with the credits (its ledger); the actor then
    generates only what it was dealt, never from a stream of its own."""

    KIND = "welcome"
    session: Name
    addresses: dict[str, Name]
    lease_s: Seconds
    deals: bool = False


class ReplayTask(Body):
    """An experience-replay assignment: generate ``n`` fresh rollouts of ``task``; the learner
    adds ``k`` stored trajectories to them (docs/algorithms/replay.md)."""

    task: Task
    n: Annotated[int, msgspec.Meta(ge=1)]
    k: Count


class Withhold(Body):
    """Changes of the learner's skip set (task ids withheld from the fresh stream): ``reset``
    first empties the actor's copy."""

    reset: bool = False
    add: list[Id] = []
    remove: list[Id] = []


class Dealt(Body):
    """A fresh task the learner's ledger dealt, and its ``ticket``, which the episode carries back."""

    task: Task
    ticket: Id


class Credit(Body):
    KIND = "credit"
    n: Annotated[int, msgspec.Meta(ge=1)]
    min_version: Count
    replay: list[ReplayTask] = []
    withhold: Withhold | None = None
    deal: list[Dealt] = []


class Rejected(Body):
    """An episode the learner refused (not written, not to be sent again) and why."""

    id: Id
    reason: Name


class Ack(Body):
    KIND = "ack"
    ids: list[Id]
    rejected: list[Rejected] = []


class Status(Body):
    """The actor's heartbeat. ``identity`` is the actor's control socket identity (the heartbeat
    comes from a socket of its own, so that a long generation batch never silences it)."""

    KIND = "status"
    actor_id: Name
    identity: Name
    capacity: Annotated[int, msgspec.Meta(ge=1)]
    version: Version
    pid: Count = 0
    batches: Count = 0
    weight_updates: Count = 0
    unacked: Count = 0
    credits: Count = 0
    generate_s: Seconds = 0.0  # time spent generating (inflight: in decode steps)
    tokens: Count = 0  # tokens its engine has generated since it started: progress within a long batch
    up_s: Seconds = 0.0  # time since the actor started (1 - generate_s / up_s: its idle share)
    stopping: bool = False
    weights_digest: Name = ""  # the digest of the weights its engine holds (checked against what it received)
    holding: list[Id] = []  # as in Hello: a learner that admits it from a heartbeat deals the others again
    # where its time went (asyncrl.timeline): the spans (state, start, end in unix time) since the last
    # status, and the seconds per state since it started
    spans: Annotated[list[tuple[Name, float, float]], msgspec.Meta(max_length=MAX_SPANS)] = []
    states: Annotated[dict[Name, Seconds], msgspec.Meta(max_length=32)] = {}


class Alive(Body):
    KIND = "alive"
    session: Name
    version: Count


class Stop(Body):
    KIND = "stop"
    reason: Name = ""


# --- episodes ---------------------------------------------------------------------------------


def _on_wire(name: str, typ: Any, default: Any) -> tuple:
    """A field of a generated wire struct: required where the model field has no default or its
    default is a fresh id (an identity must be sent); otherwise it may be missing (a message written
    before the field existed) and takes the model's default."""
    if default is msgspec.NODEFAULT or default is new_id:
        return (name, typ)
    if callable(default):
        return (name, typ, msgspec.field(default_factory=default))
    return (name, typ, default)


_EPISODE_HINTS = get_type_hints(Episode, include_extras=True)
EpisodeHead = msgspec.defstruct(
    "EpisodeHead",
    [
        _on_wire(f.name, _EPISODE_HINTS[f.name], f.default if f.default is not msgspec.NODEFAULT else f.default_factory)
        for f in msgspec.structs.fields(Episode)
        if f.name != "trajectories"
    ],
    bases=(Body,),
    module=__name__,
    kw_only=True,
)
EpisodeHead.__doc__ = (
    "An Episode's own fields (generated from :class:`asyncrl.types.Episode`; its trajectories travel as Columns)."
)

COLUMN_DEFAULTS: dict[str, Any] = {
    name: default
    for name, _, default in trajectory_columns()
    if default is not msgspec.NODEFAULT and default is not new_id
}
"""Columns that may be missing (episodes written before the field existed): name -> default or factory."""
Columns = msgspec.defstruct(
    "Columns",
    [
        (name, list[typ]) if name not in COLUMN_DEFAULTS else (name, list[typ] | None, None)
        for name, typ, _ in trajectory_columns()
    ]
    + [("length", list[Count])]
    + [(f"has_{name}", list[bool] | None, None) for name, _, optional in PER_TOKEN if optional],
    bases=(Body,),
    module=__name__,
    kw_only=True,
)
Columns.__doc__ = (
    "One list per Trajectory field that is not per-token, ``n`` entries each (generated from "
    ":class:`asyncrl.types.Trajectory`), ``length`` (tokens per trajectory) and ``has_<field>`` "
    "for each optional per-token array (the arrays are frames, see :mod:`asyncrl.wire.codec`)."
)


class EpisodeBody(Body):
    KIND = "episode"
    episode: EpisodeHead
    n: Count
    trajectories: Columns


# --- weights and events -----------------------------------------------------------------------


class Subscribe(Body):
    KIND = "subscribe"
    actor_id: Name
    have: Version
    applied_at: float | None = None


class TensorSpec(msgspec.Struct, forbid_unknown_fields=True):
    """Where one tensor lies in a flat byte buffer (an ``ipc`` segment, a collective broadcast, a
    learner-group step): ``nbytes`` bytes from ``offset`` (:mod:`asyncrl.wire.tensors`)."""

    name: Id
    dtype: Annotated[str, msgspec.Meta(max_length=32)]
    shape: list[Count]
    offset: Count
    nbytes: Count


_Handle = Annotated[bytes, msgspec.Meta(max_length=256)]


class CudaHandle(msgspec.Struct, forbid_unknown_fields=True):
    """GPU memory the learner shares with actors on its host (ipc sync, learner on CUDA): the eight
    values of torch's ``UntypedStorage._share_cuda_`` (a CUDA IPC memory handle, the allocation's
    size and offset, torch's cross-process reference counter, and an IPC event), which an actor
    passes to ``UntypedStorage._new_shared_cuda`` to map it (:mod:`asyncrl.weights.ipc`)."""

    device: Count
    handle: _Handle
    size: Count
    offset: Count
    ref_counter: _Handle
    ref_counter_offset: Count
    event: _Handle
    event_sync: bool


class Weights(Body):
    """Tensor frames named by state-dict key (zmq sync), ``path`` to a safetensors file
    (filesystem), or ``segment`` + ``layout``: a shared-memory segment on this host (ipc), whose
    tensors lie in the GPU memory of ``cuda`` when that is set (the segment then holds only the
    version header)."""

    KIND = "weights"
    version: Count
    path: Name | None = None
    segment: Name | None = None
    layout: list[TensorSpec] | None = None
    cuda: CudaHandle | None = None
    group: Name | None = None  # nccl/gloo: the learner's weight-sync store, host:port
    group_key: Name | None = None  # nccl/gloo: the secret every request to that store must carry
    digest: Name | None = None  # SHA-256 of the published tensors (asyncrl.weights.digest)


class Event(Body):
    KIND = "event"
    event: JsonMap


# --- the learner group: rank 0 -> the other ranks (asyncrl.learner.training.ranks, over a gloo broadcast) ---


class GroupStart(Body):
    """Build the model and the trainer (the wrap is itself a collective)."""

    KIND = "group.start"


class GroupLoad(Body):
    """Receive a checkpoint's model and optimizer state from rank 0 (each rank its shards); with
    ``critic``, then the critic's (``train.advantage.estimator: gae``)."""

    KIND = "group.load"
    critic: bool = False


class GroupStep(Body):
    """Train on this batch: its tensors lie in the message's byte bucket at ``layout``."""

    KIND = "group.step"
    keep_rows: bool
    version: Count
    sample_types: list[Name]
    group_ids: list[Name]
    layout: list[TensorSpec] = []


class GroupState(Body):
    """Join the gathering of the full parameters (FSDP2: for publishing and evaluation)."""

    KIND = "group.state"


class GroupCheckpoint(Body):
    """Join the gathering of the full model and optimizer states."""

    KIND = "group.checkpoint"


class GroupStop(Body):
    """Exit 0."""

    KIND = "group.stop"


GROUP_KINDS = ("group.start", "group.load", "group.step", "group.state", "group.checkpoint", "group.stop")

KINDS: dict[str, type[Body]] = {
    cls.KIND: cls
    for cls in (
        Hello,
        Welcome,
        Credit,
        Ack,
        Status,
        Alive,
        Stop,
        EpisodeBody,
        Subscribe,
        Weights,
        Event,
        GroupStart,
        GroupLoad,
        GroupStep,
        GroupState,
        GroupCheckpoint,
        GroupStop,
    )
}
ARRAY_KINDS = frozenset({"episode", "weights"})  # the only kinds that may carry array frames
