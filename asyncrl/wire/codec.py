"""Wire format: msgpack header + raw little-endian array frames (DESIGN.md section 2).

Every message is a multipart ZeroMQ message::

    frame 0      msgpack map  {"schema": SCHEMA_VERSION, "kind": str, "body": {...},
                               "arrays": [{"name": str, "dtype": str, "shape": [int, ...]}, ...]}
    frame 1..k   the raw bytes of arrays[0..k-1], C order, little-endian, no padding

Nothing is ever pickled. The header ``body`` holds msgpack-native values only (None, bool, int,
float, str, bytes, list, map); numpy scalars are converted with ``.item()``; tuples come back as
lists. Allowed dtypes are ``DTYPES``. ``bfloat16`` (torch only) travels as its raw 16-bit pattern;
:func:`decode` returns such an array as a ``uint16`` numpy array holding the bf16 bits and lists its
name in ``Message.bf16``; ``Message.tensor(name)`` (and :func:`decode_weights`) turn it into a
``torch.bfloat16`` tensor without copying.

Decoded arrays are views over the received frames (zero-copy) unless a frame is not aligned for
its dtype (ZeroMQ may hand out frames at odd offsets inside its receive buffer); those are copied.
Views over ``zmq.Frame`` buffers are writable; views over ``bytes`` are read-only.

Message kinds used by asyncrl: ``episode`` (:func:`encode_episode`), ``weights``
(:func:`encode_weights`), and small control messages built with :func:`encode_msg`: ``hello``,
``ack`` (``episode_ids``), ``credit`` (``n``, ``min_version``), ``stop``, ``status``, ``event``.

Episode layout (``kind="episode"``): ``body["episode"]`` holds the Episode's scalar fields and
``task``; ``body["trajectories"]`` is columnar, one list of length ``n`` per Trajectory field plus
``length``, ``has_recorded_logprobs`` and ``has_exp_mask``. Per-token arrays of all trajectories
are concatenated into one frame per kind: ``token_ids`` int32, ``loss_mask`` uint8,
``behavior_logprobs`` float32 (each of total length ``sum(length)``), and, only if some trajectory
has them, ``recorded_logprobs`` float32 / ``exp_mask`` uint8 holding the flagged trajectories only.

Weights layout (``kind="weights"``): ``body = {"version": int}``, one frame per tensor, frame
names are the state-dict keys, in order.
"""

from __future__ import annotations

import sys
import warnings
from itertools import accumulate
from dataclasses import dataclass, field
from typing import Any, Iterable

import msgpack
import numpy as np

from asyncrl.types import Episode, Task, Trajectory

SCHEMA_VERSION = 1

# wire name -> little-endian numpy dtype ("bfloat16" is carried as its uint16 bit pattern)
DTYPES: dict[str, np.dtype] = {
    "int8": np.dtype("i1"), "uint8": np.dtype("u1"), "int16": np.dtype("<i2"),
    "int32": np.dtype("<i4"), "int64": np.dtype("<i8"), "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"), "float64": np.dtype("<f8"), "bool": np.dtype("?"),
    "bfloat16": np.dtype("<u2"),
}
_NP_TO_WIRE = {np.dtype(v).newbyteorder("="): k for k, v in DTYPES.items() if k != "bfloat16"}
_HEADER_KEYS = ("schema", "kind", "body", "arrays")


class WireError(ValueError):
    """A message that does not follow the wire format; the text says what was wrong and expected."""


class SchemaVersionError(WireError):
    """The peer speaks another schema version (``remote``) than this process (``local``)."""

    def __init__(self, remote: Any, local: int = SCHEMA_VERSION):
        super().__init__(f"message schema version {remote}, this process speaks {local}; "
                         f"upgrade the older side")
        self.remote, self.local = remote, local


@dataclass
class Message:
    """A decoded message. ``arrays`` are numpy views over the received frames where possible;
    names in ``bf16`` are bfloat16 arrays held as uint16 bit patterns (see ``tensor``)."""

    kind: str
    body: dict[str, Any]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    bf16: frozenset[str] = frozenset()

    def tensor(self, name: str):
        """``arrays[name]`` as a torch tensor sharing its memory (bfloat16 where it was sent so).
        Read-only arrays (frames given as ``bytes``) give tensors that must not be written."""
        return _to_torch(self.arrays[name], name in self.bf16)


# ---------------------------------------------------------------------------------------------
# generic encode / decode


def encode(kind: str, body: dict[str, Any] | None = None,
           arrays: dict[str, Any] | None = None) -> list:
    """Frames for one message: ``[header_bytes, buf_1, ..., buf_k]``.

    ``arrays`` values are numpy arrays or CPU/GPU torch tensors (GPU ones are copied to CPU).
    Contiguous little-endian arrays are sent zero-copy as memoryviews: do not modify them until
    the send has completed. Raises WireError for an unsupported dtype or unpackable body value.
    """
    specs, bufs = [], []
    for name, value in (arrays or {}).items():
        arr, wire_dtype = _as_wire_array(name, value)
        specs.append({"name": str(name), "dtype": wire_dtype, "shape": list(arr.shape)})
        bufs.append(memoryview(arr.reshape(-1).view(np.uint8)))
    header = {"schema": SCHEMA_VERSION, "kind": kind, "body": body or {}, "arrays": specs}
    return [_pack(header), *bufs]


def encode_msg(kind: str, **body: Any) -> list:
    """Frames for a control message without arrays: ``encode_msg("ack", episode_ids=[...])``."""
    return encode(kind, body)


def decode(frames: Iterable[Any]) -> Message:
    """Parse frames (``bytes``, ``zmq.Frame`` or ``memoryview``) into a :class:`Message`.

    Checks, in order: header is msgpack, is a map, has ``schema`` equal to SCHEMA_VERSION
    (else SchemaVersionError), has ``kind``/``body``/``arrays`` of the right types, every array
    spec has a known dtype and a valid shape, the frame count matches the specs, and every frame's
    byte length equals dtype size x prod(shape). Any failure raises WireError saying which.
    """
    bufs = [_buffer(f) for f in frames]
    if not bufs:
        raise WireError("empty message: expected at least the msgpack header frame")
    header = _unpack_header(bufs[0])
    specs = header["arrays"]
    if len(bufs) - 1 != len(specs):
        names = [s.get("name") for s in specs if isinstance(s, dict)]
        raise WireError(f"message '{header['kind']}' has {len(bufs) - 1} array frames but its "
                        f"header lists {len(specs)} arrays {names}")
    arrays, bf16 = {}, set()
    for i, (spec, buf) in enumerate(zip(specs, bufs[1:])):
        name, dtype, shape = _check_spec(i, spec, header["kind"])
        if name in arrays:
            raise WireError(f"message '{header['kind']}' lists array '{name}' twice")
        arrays[name] = _array_from_buffer(name, buf, dtype, shape)
        if spec["dtype"] == "bfloat16":
            bf16.add(name)
    return Message(header["kind"], header["body"], arrays, frozenset(bf16))


def _pack(header: dict) -> bytes:
    try:
        return msgpack.packb(header, use_bin_type=True, default=_msgpack_default)
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError(f"cannot encode message '{header.get('kind')}' body: {e}; "
                        f"expected msgpack-native values (str, int, float, bool, None, "
                        f"bytes, list, dict)") from e


def _msgpack_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    raise TypeError(f"value of type {type(obj).__name__} is not msgpack-serialisable")


def _buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    try:
        mv = buf if isinstance(buf, memoryview) else memoryview(frame)
    except TypeError as e:
        raise WireError(f"frame of type {type(frame).__name__} is not a byte buffer; expected "
                        f"bytes, memoryview or zmq.Frame") from e
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _unpack_header(buf: memoryview) -> dict:
    try:
        header = msgpack.unpackb(buf, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types for garbage input
        raise WireError(f"frame 0 is not a msgpack header ({type(e).__name__}: {e}); expected a "
                        f"msgpack map with keys {list(_HEADER_KEYS)}") from e
    if not isinstance(header, dict):
        raise WireError(f"message header is a {type(header).__name__}, expected a msgpack map "
                        f"with keys {list(_HEADER_KEYS)}")
    missing = [k for k in _HEADER_KEYS if k not in header]
    if "schema" in header and header["schema"] != SCHEMA_VERSION:
        raise SchemaVersionError(header["schema"])
    if missing:
        raise WireError(f"message header is missing keys {missing}; expected {list(_HEADER_KEYS)}")
    for key, typ in (("kind", str), ("body", dict), ("arrays", list)):
        if not isinstance(header[key], typ):
            raise WireError(f"message header '{key}' is a {type(header[key]).__name__}, "
                            f"expected {typ.__name__}")
    return header


def _check_spec(i: int, spec: Any, kind: str) -> tuple[str, np.dtype, tuple[int, ...]]:
    where = f"message '{kind}' array spec {i}"
    if not isinstance(spec, dict) or not all(k in spec for k in ("name", "dtype", "shape")):
        raise WireError(f"{where} is {spec!r}; expected a map with name, dtype, shape")
    name, dtype, shape = spec["name"], spec["dtype"], spec["shape"]
    if not isinstance(name, str):
        raise WireError(f"{where}: name {name!r} is not a string")
    if dtype not in DTYPES:
        raise WireError(f"{where} ('{name}'): unknown dtype {dtype!r}; expected one of "
                        f"{sorted(DTYPES)}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise WireError(f"{where} ('{name}'): shape {shape!r} is not a list of non-negative ints")
    return name, DTYPES[dtype], tuple(shape)


def _array_from_buffer(name: str, buf: memoryview, dtype: np.dtype,
                       shape: tuple[int, ...]) -> np.ndarray:
    expected = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    if buf.nbytes != expected:
        raise WireError(f"array '{name}' frame has {buf.nbytes} bytes, expected {expected} "
                        f"({dtype.name} x shape {list(shape)})")
    arr = np.frombuffer(buf, dtype=dtype).reshape(shape)
    return arr if arr.flags.aligned else arr.copy()


def _as_wire_array(name: str, value: Any) -> tuple[np.ndarray, str]:
    """A C-contiguous little-endian numpy array (a view where possible) and its wire dtype."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        t = value.detach()
        t = (t if t.device.type == "cpu" else t.cpu()).contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(DTYPES["bfloat16"]), "bfloat16"
        value = t.numpy()
    arr = np.asarray(value)
    wire = _NP_TO_WIRE.get(arr.dtype.newbyteorder("="))
    if wire is None:
        raise WireError(f"array '{name}' has dtype {arr.dtype}, expected one of {sorted(DTYPES)}")
    return arr.astype(DTYPES[wire], order="C", copy=False), wire


def _to_torch(arr: np.ndarray, is_bf16: bool):
    import torch

    with warnings.catch_warnings():  # read-only arrays (from bytes) are copied by callers first
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        t = torch.from_numpy(arr.view(np.int16) if is_bf16 else arr)
    return t.view(torch.bfloat16) if is_bf16 else t


# ---------------------------------------------------------------------------------------------
# episodes

_TRAJ_TYPES: dict[str, tuple[type, ...]] = {
    "id": (str,), "policy_version": (int,), "reward": (float, int), "scores": (dict,),
    "sample_type": (str,), "group_id": (str,), "task_id": (str,), "is_replay": (bool,),
    "advantage": (float, int, type(None)), "text": (str,), "metadata": (dict,),
    "length": (int,), "has_recorded_logprobs": (bool,), "has_exp_mask": (bool,),
}
_EP_TYPES: dict[str, tuple[type, ...]] = {
    "id": (str,), "actor_id": (str,), "task": (dict, type(None)), "decision": (dict,),
    "metrics": (dict,), "created_at": (float, int),
}
_TOKEN_ARRAYS = {"token_ids": "int32", "loss_mask": "uint8", "behavior_logprobs": "float32"}
_OPTIONAL_ARRAYS = {"recorded_logprobs": ("float32", "has_recorded_logprobs"),
                    "exp_mask": ("uint8", "has_exp_mask")}


def encode_episode(ep: Episode) -> list:
    """Frames for an Episode: 3 to 5 array frames however many trajectories (see module doc)."""
    trajs = ep.trajectories
    cols: dict[str, list] = {
        "id": [t.id for t in trajs], "policy_version": [int(t.policy_version) for t in trajs],
        "reward": [float(t.reward) for t in trajs], "scores": [dict(t.scores) for t in trajs],
        "sample_type": [t.sample_type for t in trajs], "group_id": [t.group_id for t in trajs],
        "task_id": [t.task_id for t in trajs], "is_replay": [bool(t.is_replay) for t in trajs],
        "advantage": [None if t.advantage is None else float(t.advantage) for t in trajs],
        "text": [t.text for t in trajs], "metadata": [t.metadata for t in trajs],
        "length": [len(t.token_ids) for t in trajs],
        "has_recorded_logprobs": [t.recorded_logprobs is not None for t in trajs],
        "has_exp_mask": [t.exp_mask is not None for t in trajs],
    }
    arrays = {name: _concat([getattr(t, name) for t in trajs], dt)
              for name, dt in _TOKEN_ARRAYS.items()}
    for name, (dt, flag) in _OPTIONAL_ARRAYS.items():
        if any(cols[flag]):
            present = [getattr(t, name) for t in trajs]
            arrays[name] = _concat([a for a in present if a is not None], dt)
    episode = {"id": ep.id, "actor_id": ep.actor_id, "decision": ep.decision,
               "task": ep.task.to_dict() if ep.task is not None else None,
               "metrics": ep.metrics, "created_at": float(ep.created_at)}
    return encode("episode", {"episode": episode, "n": len(trajs), "trajectories": cols}, arrays)


def decode_episode(msg: Message, copy: bool = False) -> Episode:
    """The Episode in an ``episode`` message; raises WireError naming the first bad field.

    Trajectory arrays are views into the message's frames (one shared buffer per array kind)
    unless ``copy=True``, which gives each trajectory its own arrays (use it when trajectories
    outlive their siblings for long, e.g. in a replay buffer, or when the frames were read-only).
    """
    if msg.kind != "episode":
        raise WireError(f"expected an 'episode' message, got '{msg.kind}'")
    ep_body = _field(msg.body, "episode", (dict,), "body")
    n = _field(msg.body, "n", (int,), "body")
    cols = _field(msg.body, "trajectories", (dict,), "body")
    ep_f = {k: _field(ep_body, k, types, "episode") for k, types in _EP_TYPES.items()}
    tr_f = {k: _column(cols, k, types, n) for k, types in _TRAJ_TYPES.items()}
    if any(x < 0 for x in tr_f["length"]):
        raise WireError(f"trajectories.length has a negative entry: {tr_f['length']}")
    per_traj = {name: _split(msg, name, dt, tr_f["length"], [True] * n, copy)
                for name, dt in _TOKEN_ARRAYS.items()}
    for name, (dt, flag) in _OPTIONAL_ARRAYS.items():
        per_traj[name] = _split(msg, name, dt, tr_f["length"], tr_f[flag], copy)
    trajs = _trajectories(tr_f, per_traj)
    return Episode(trajectories=trajs, actor_id=ep_f["actor_id"], task=_task(ep_f["task"]),
                   decision=ep_f["decision"], metrics=ep_f["metrics"],
                   created_at=float(ep_f["created_at"]), id=ep_f["id"])


def _concat(arrs: list[np.ndarray], dtype: str) -> np.ndarray:
    dt = DTYPES[dtype]
    return np.concatenate(arrs, dtype=dt) if arrs else np.zeros(0, dt)


def _field(d: dict, key: str, types: tuple[type, ...], where: str) -> Any:
    if key not in d:
        raise WireError(f"episode message: field '{where}.{key}' is missing")
    _check_type(d[key], types, f"{where}.{key}")
    return d[key]


def _check_type(v: Any, types: tuple[type, ...], where: str) -> None:
    if not isinstance(v, types) or (v.__class__ is bool and bool not in types):
        raise WireError(f"episode message: field '{where}' is a {type(v).__name__}, "
                        f"expected {' or '.join(t.__name__ for t in types)}")


def _column(cols: dict, key: str, types: tuple[type, ...], n: int) -> list:
    col = _field(cols, key, (list,), "trajectories")
    if len(col) != n:
        raise WireError(f"episode message: field 'trajectories.{key}' has {len(col)} entries, "
                        f"expected {n} (one per trajectory)")
    if not set(map(type, col)) <= set(types):  # fast path: msgpack yields exact types
        for i, v in enumerate(col):
            _check_type(v, types, f"trajectories[{i}].{key}")
    return col


def _split(msg: Message, name: str, dtype: str, lengths: list[int], present: list[bool],
           copy: bool) -> list[np.ndarray | None]:
    """Per-trajectory slices of array ``name`` (None where not ``present``)."""
    lens = [n for n, p in zip(lengths, present) if p]
    if not lens and name not in msg.arrays:
        return [None] * len(lengths)
    arr = msg.arrays.get(name)
    if arr is None:
        raise WireError(f"episode message: array '{name}' is missing")
    if DTYPES[dtype] != arr.dtype or name in msg.bf16 or arr.ndim != 1:
        raise WireError(f"episode message: array '{name}' is {arr.dtype}{list(arr.shape)}, "
                        f"expected 1-D {dtype}")
    if arr.size != sum(lens):
        raise WireError(f"episode message: array '{name}' has {arr.size} elements but the "
                        f"trajectory lengths sum to {sum(lens)}")
    offsets = list(accumulate(lens, initial=0))
    parts = [arr[a:b] for a, b in zip(offsets, offsets[1:])]
    if copy:
        parts = [x.copy() for x in parts]
    if len(parts) == len(present):
        return parts
    it = iter(parts)
    return [next(it) if p else None for p in present]


_TRAJ_SCALARS = ("id", "policy_version", "reward", "scores", "sample_type", "group_id", "task_id",
                 "is_replay", "advantage", "text", "metadata")
_TRAJ_ARRAYS = ("token_ids", "loss_mask", "behavior_logprobs", "recorded_logprobs", "exp_mask")


def _trajectories(f: dict[str, list], arrays: dict[str, list]) -> list[Trajectory]:
    """Build Trajectory objects from validated columns and per-trajectory array slices."""
    f = dict(f, reward=[float(r) for r in f["reward"]],
             advantage=[None if a is None else float(a) for a in f["advantage"]])
    names = _TRAJ_SCALARS + _TRAJ_ARRAYS
    rows = zip(*(f[k] for k in _TRAJ_SCALARS), *(arrays[k] for k in _TRAJ_ARRAYS))
    return [Trajectory(**dict(zip(names, row))) for row in rows]


def _task(d: dict | None) -> Task | None:
    if d is None:
        return None
    try:
        task = Task.from_dict(d)
    except (KeyError, TypeError, ValueError) as e:
        raise WireError(f"episode message: field 'episode.task' is invalid ({e!r}); expected a "
                        f"map with id, prompt, answer, metadata") from e
    if not all(isinstance(m, dict) for m in task.prompt):
        raise WireError("episode message: field 'episode.task.prompt' must be a list of maps")
    return task


# ---------------------------------------------------------------------------------------------
# weights


def encode_weights(named_tensors: dict[str, Any], version: int) -> list:
    """Frames for a ``weights`` message: one frame per tensor, zero-copy for contiguous CPU
    tensors (do not step the optimizer before the send completes), bfloat16 supported."""
    return encode("weights", {"version": int(version)}, named_tensors)


def decode_weights(msg: Message, copy: bool = False) -> tuple[int, dict[str, Any]]:
    """``(version, {name: torch.Tensor})`` from a ``weights`` message.

    Tensors share the received frames when those are writable and aligned (``zmq.Frame`` from
    ``recv_multipart(copy=False)``), and are writable copies otherwise or with ``copy=True``.
    Either way they are safe to pass to ``module.load_state_dict``.
    """
    if msg.kind != "weights":
        raise WireError(f"expected a 'weights' message, got '{msg.kind}'")
    version = msg.body.get("version")
    if type(version) is not int:
        raise WireError(f"weights message: field 'version' is {version!r}, expected an int")
    out = {}
    for name, arr in msg.arrays.items():
        if copy or not arr.flags.writeable:
            arr = arr.copy()
        out[name] = _to_torch(arr, name in msg.bf16)
    return version, out
