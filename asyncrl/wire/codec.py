"""Wire format: a msgpack header + raw little-endian array frames (docs/design/events.md, "Wire messages").

Every message is a multipart ZeroMQ message::

    frame 0      msgpack map  {"schema": SCHEMA_VERSION, "kind": str, "body": {...},
                               "arrays": [{"name": str, "dtype": str, "shape": [int, ...]}, ...]}
    frame 1..k   the raw bytes of arrays[0..k-1], C order, little-endian, no padding

Nothing is ever pickled. ``body`` is the typed body of ``kind`` (:mod:`asyncrl.wire.messages`):
:func:`encode` and :func:`decode` are the one path every message takes, and :func:`decode` refuses
(WireError naming kind, field and expected type) a wrong schema version, an unknown kind, unknown,
missing or wrongly typed fields, a header over the channel's size limit, arrays on a kind that
carries none, and frames whose byte length is not dtype size x shape (computed without overflow).

Allowed dtypes are ``DTYPES``. ``bfloat16`` (torch only) travels as its raw 16-bit pattern;
:func:`decode` returns such an array as a ``uint16`` numpy array holding the bf16 bits and lists its
name in ``Message.bf16``; ``Message.tensor(name)`` (and :func:`decode_weights`) turn it into a
``torch.bfloat16`` tensor without copying. Decoded arrays are views over the received frames
(zero-copy) unless a frame is not aligned for its dtype; those are copied. Views over
``zmq.Frame`` buffers are writable; views over ``bytes`` are read-only.

Episode layout (``kind="episode"``, :class:`~asyncrl.wire.messages.EpisodeBody`): ``episode`` holds
the Episode's own fields; ``trajectories`` is columnar, one list of length ``n`` per Trajectory field
plus ``length``, ``has_recorded_logprobs`` and ``has_exp_mask``. Per-token arrays of all trajectories
are concatenated into one frame per kind: ``token_ids`` int32, ``loss_mask`` uint8,
``behavior_logprobs`` float32 (each of total length ``sum(length)``), and, only if some trajectory
has them, ``recorded_logprobs`` float32 / ``exp_mask`` uint8 holding the flagged trajectories only.
The layout is unchanged since schema 1, so episodes written by schema 1 (write-ahead logs,
checkpoints) still decode.

Weights layout (``kind="weights"``): body ``{"version": int, "path": null}``, one frame per tensor,
frame names are the state-dict keys, in order; or no frames and ``path`` naming a safetensors file.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Annotated, Any, Container, Iterable

import msgspec
import numpy as np

from asyncrl.types import PER_TOKEN, WIDE, Episode, Trajectory
from asyncrl.wire.messages import (
    ARRAY_KINDS,
    COLUMN_DEFAULTS,
    JSON_MAX_DEPTH,
    KINDS,
    Body,
    Columns,
    EpisodeBody,
    EpisodeHead,
    Weights,
)
from asyncrl.wire.tensors import DTYPES, as_numpy, to_torch

SCHEMA_VERSION = 2
EPISODE_SCHEMAS = (1, 2)  # schemas whose episodes this process reads (the layout is unchanged)

_HEADER_KEYS = ["schema", "kind", "body", "arrays"]


class WireError(ValueError):
    """A message that does not follow the wire format; the text says what was wrong and expected.
    ``reason`` is a short key for counting rejections (``malformed``, ``schema``, ``too_large``,
    ``wrong_kind``, ``field``, ``arrays``)."""

    def __init__(self, text: str, reason: str = "malformed"):
        super().__init__(text)
        self.reason = reason


class SchemaVersionError(WireError):
    """The peer speaks another schema version (``remote``) than this process (``local``)."""

    def __init__(self, remote: Any, local: int = SCHEMA_VERSION):
        super().__init__(
            f"message schema version {remote}, this process speaks {local}; upgrade the older side", reason="schema"
        )
        self.remote, self.local = remote, local


@dataclass
class Message:
    """A decoded message: its typed ``body`` (a :class:`~asyncrl.wire.messages.Body`), and
    ``arrays``, numpy views over the received frames where possible; names in ``bf16`` are
    bfloat16 arrays held as uint16 bit patterns (see ``tensor``)."""

    kind: str
    body: Body
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    bf16: frozenset[str] = frozenset()

    def tensor(self, name: str):
        """``arrays[name]`` as a torch tensor sharing its memory (bfloat16 where it was sent so).
        Read-only arrays (frames given as ``bytes``) give tensors that must not be written."""
        return to_torch(self.arrays[name], name in self.bf16)


class _ArraySpec(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(max_length=1024)]
    dtype: str
    shape: list[Annotated[int, msgspec.Meta(ge=0)]]


class _Header(msgspec.Struct, forbid_unknown_fields=True):
    schema: int
    kind: str
    body: msgspec.Raw
    arrays: list[_ArraySpec] = []


# ---------------------------------------------------------------------------------------------
# generic encode / decode


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"value of type {type(obj).__name__} is not msgpack-serialisable")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_HEADER_DECODER = msgspec.msgpack.Decoder(_Header)


def encode(kind: str, body: Body | dict[str, Any] | None = None, arrays: dict[str, Any] | None = None) -> list:
    """Frames for one message: ``[header_bytes, buf_1, ..., buf_k]``.

    ``body`` is the kind's Body struct, or a dict of its fields (type-checked here, so a bad
    message fails at the sender). ``arrays`` values are numpy arrays or CPU/GPU torch tensors (GPU
    ones are copied to CPU); contiguous little-endian ones are sent zero-copy as memoryviews: do not
    modify them until the send has completed. Raises WireError for an unknown kind, a field of the
    wrong type, an unsupported dtype or an unpackable value.
    """
    body = _as_body(kind, body)
    specs, bufs = [], []
    for name, value in (arrays or {}).items():
        try:
            arr, wire_dtype = as_numpy(name, value)
        except ValueError as e:
            raise WireError(str(e)) from e
        specs.append(_ArraySpec(str(name), wire_dtype, list(arr.shape)))
        bufs.append(memoryview(arr.reshape(-1).view(np.uint8)))
    header = {"schema": SCHEMA_VERSION, "kind": kind, "body": body, "arrays": specs}
    try:
        return [_ENCODER.encode(header), *bufs]
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError(
            f"cannot encode message '{kind}': {e}; expected msgpack-native values "
            f"(str, int, float, bool, None, list, dict)"
        ) from e


def encode_msg(kind: str, **fields: Any) -> list:
    """Frames for a message without arrays: ``encode_msg("ack", ids=[...])``."""
    return encode(kind, fields)


def _as_body(kind: str, body: Body | dict[str, Any] | None) -> Body:
    cls = KINDS.get(kind)
    if cls is None:
        raise WireError(f"unknown message kind {kind!r}; expected one of {sorted(KINDS)}")
    if isinstance(body, cls):
        return body
    if isinstance(body, Body):
        raise WireError(f"message '{kind}' needs a {cls.__name__} body, got {type(body).__name__}")
    try:
        return msgspec.convert(body or {}, cls)
    except msgspec.ValidationError as e:
        raise WireError(f"cannot encode {_explain(f'message {kind!r}', e)}", reason="field") from e


def decode(frames: Iterable[Any], max_header_bytes: int | None = None, kinds: Container[str] | None = None) -> Message:
    """Parse frames (``bytes``, ``zmq.Frame`` or ``memoryview``) into a :class:`Message`.

    Checks, in order: the header frame is at most ``max_header_bytes`` (None: no limit), is a
    msgpack map with exactly schema/kind/body/arrays, ``schema`` is SCHEMA_VERSION (episodes:
    one of EPISODE_SCHEMAS; else SchemaVersionError), ``kind`` is known (and in ``kinds`` when
    given, before its body is decoded), the body has the kind's fields with their types, only
    episodes and weights carry arrays, every array spec has a known dtype, the frame count
    matches the specs and every frame's byte length is dtype size x prod(shape).
    Any failure raises WireError saying which.
    """
    bufs = [_buffer(f) for f in frames]
    if not bufs:
        raise WireError("empty message: expected at least the msgpack header frame")
    if max_header_bytes is not None and bufs[0].nbytes > max_header_bytes:
        raise WireError(
            f"message header is {bufs[0].nbytes} bytes; this channel takes at most "
            f"{max_header_bytes} (wire.max_header_kb, wire.max_control_kb)",
            reason="too_large",
        )
    header = _decode_header(bufs[0])
    if kinds is not None and header.kind not in kinds:
        raise WireError(f"a {header.kind!r} message on a channel that takes {sorted(kinds)}", reason="wrong_kind")
    body = _decode_body(header)
    arrays, bf16 = _decode_arrays(header, bufs[1:])
    return Message(header.kind, body, arrays, bf16)


def _decode_header(buf: memoryview) -> _Header:
    try:
        header = _HEADER_DECODER.decode(buf)
    except msgspec.ValidationError as e:  # (a subclass of DecodeError)
        _raise_if_other_schema(buf)
        raise WireError(f"{_explain('message header', e)}; expected a map with keys {_HEADER_KEYS}") from e
    except msgspec.DecodeError as e:
        raise WireError(
            f"frame 0 is not a msgpack header ({e}); expected a msgpack map with keys {_HEADER_KEYS}"
        ) from e
    except RecursionError as e:
        raise WireError(f"message header: {_TOO_DEEP}") from e
    if header.schema != SCHEMA_VERSION and not (header.kind == "episode" and header.schema in EPISODE_SCHEMAS):
        raise SchemaVersionError(header.schema)
    if header.kind not in KINDS:
        raise WireError(f"unknown message kind {header.kind!r}; expected one of {sorted(KINDS)}", reason="wrong_kind")
    return header


def _raise_if_other_schema(buf: memoryview) -> None:
    """A header that does not parse may still name another schema version: say that instead."""
    try:
        raw = msgspec.msgpack.decode(buf)
    except (msgspec.DecodeError, RecursionError):
        return
    if isinstance(raw, dict) and "schema" in raw and raw["schema"] != SCHEMA_VERSION:
        raise SchemaVersionError(raw["schema"])


@functools.lru_cache(maxsize=None)
def _body_decoder(kind: str) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(KINDS[kind])


def _decode_body(header: _Header) -> Body:
    try:
        return _body_decoder(header.kind).decode(header.body)
    except msgspec.ValidationError as e:
        raise WireError(_explain(f"message '{header.kind}'", e), reason="field") from e
    except RecursionError as e:
        raise WireError(f"message '{header.kind}': {_TOO_DEEP}", reason="field") from e


_AT = re.compile(r"^(.*?)(?: - at `(.*)`)?$", re.S)
_TOO_DEEP = f"nested too deeply (free-form values nest at most {JSON_MAX_DEPTH} levels)"
_SCALARS_ONLY = "expected bool | int | float | str | null, got "


def _explain(where: str, err: Exception) -> str:
    """``WHERE field 'PATH': expected TYPE, got TYPE`` from a msgspec ValidationError (``[...]``
    in a path stands for a map key or list index msgspec does not name)."""
    text, at = _AT.match(str(err)).groups()
    text = re.sub(r"field `([^`]*)`", r"field '\1'", text).replace("`", "")
    text = text[:1].lower() + text[1:]
    if text.startswith(_SCALARS_ONLY) and text[len(_SCALARS_ONLY) :] in ("array", "object"):
        text += f" ({_TOO_DEEP})"
    path = (at or "").replace("`", "").removeprefix("$").removeprefix(".")
    return f"{where}{f' field {path!r}' if path else ''}: {text}"


def _decode_arrays(header: _Header, bufs: list[memoryview]) -> tuple[dict, frozenset]:
    kind, specs = header.kind, header.arrays
    if (specs or bufs) and kind not in ARRAY_KINDS:
        raise WireError(
            f"message '{kind}' carries {len(bufs)} array frames; only {sorted(ARRAY_KINDS)} messages carry arrays",
            reason="arrays",
        )
    if len(bufs) != len(specs):
        raise WireError(
            f"message '{kind}' has {len(bufs)} array frames but its header lists "
            f"{len(specs)} arrays {[s.name for s in specs]}",
            reason="arrays",
        )
    arrays, bf16 = {}, set()
    for i, (spec, buf) in enumerate(zip(specs, bufs)):
        if spec.dtype not in DTYPES:
            raise WireError(
                f"message '{kind}' array spec {i} ('{spec.name}'): unknown dtype "
                f"{spec.dtype!r}; expected one of {sorted(DTYPES)}",
                reason="arrays",
            )
        if spec.name in arrays:
            raise WireError(f"message '{kind}' lists array '{spec.name}' twice", reason="arrays")
        arrays[spec.name] = _array_from_buffer(spec.name, buf, DTYPES[spec.dtype], spec.shape)
        if spec.dtype == "bfloat16":
            bf16.add(spec.name)
    return arrays, frozenset(bf16)


def _buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    try:
        mv = buf if isinstance(buf, memoryview) else memoryview(frame)
    except TypeError as e:
        raise WireError(
            f"frame of type {type(frame).__name__} is not a byte buffer; expected bytes, memoryview or zmq.Frame"
        ) from e
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _array_from_buffer(name: str, buf: memoryview, dtype: np.dtype, shape: list[int]) -> np.ndarray:
    expected = dtype.itemsize * math.prod(shape)  # Python ints: no wrap-around for huge shapes
    if buf.nbytes != expected:
        raise WireError(
            f"array '{name}' frame has {buf.nbytes} bytes, expected {expected} ({dtype.name} x shape {list(shape)})",
            reason="arrays",
        )
    arr = np.frombuffer(buf, dtype=dtype).reshape(shape)
    return arr if arr.flags.aligned else arr.copy()


# ---------------------------------------------------------------------------------------------
# episodes

_COLUMNS = Columns.__struct_fields__
_SCALARS = [name for name in Trajectory.__struct_fields__ if name in _COLUMNS]  # Trajectory fields sent as columns
_HEAD = EpisodeHead.__struct_fields__


def encode_episode(ep: Episode) -> list:
    """Frames for an Episode: 3 to 5 array frames however many trajectories (see module doc)."""
    trajs = ep.trajectories
    columns = {name: [getattr(t, name) for t in trajs] for name in _SCALARS}
    columns["length"] = [len(t.token_ids) for t in trajs]
    arrays = {}
    for name, dtype, optional in PER_TOKEN:
        present = [a for a in (getattr(t, name) for t in trajs) if a is not None]
        if optional:
            columns[f"has_{name}"] = [getattr(t, name) is not None for t in trajs]
        if present or not optional:
            arrays[name] = _concat(present, dtype)
    head = EpisodeHead(**{name: getattr(ep, name) for name in _HEAD})
    return encode("episode", EpisodeBody(episode=head, n=len(trajs), trajectories=Columns(**columns)), arrays)


class _EpisodeIds(msgspec.Struct):
    id: str
    actor_id: str


class _EpisodeRef(msgspec.Struct):
    episode: _EpisodeIds


class _EpisodeHeaderRef(msgspec.Struct):
    kind: str
    body: _EpisodeRef


_EPISODE_REF_DECODER = msgspec.msgpack.Decoder(_EpisodeHeaderRef)


def episode_identity(header_frame: Any) -> tuple[str, str] | None:
    """``(actor_id, episode_id)`` of an episode message that failed to decode, when its header
    still names them (so that its actor can be told), else None. Other fields are skipped
    without being built, so this is cheap even for a hostile header."""
    try:
        ref = _EPISODE_REF_DECODER.decode(_buffer(header_frame))
    except (msgspec.DecodeError, WireError, RecursionError):
        return None
    ids = ref.body.episode
    if ref.kind != "episode" or not 0 < len(ids.id) <= 1024 or len(ids.actor_id) > 1024:
        return None
    return ids.actor_id, ids.id


def decode_episode(msg: Message, copy: bool = False) -> Episode:
    """The Episode in an ``episode`` message; raises WireError naming the first bad field.

    Field types were checked by :func:`decode`; this checks that every column has ``n`` entries
    and that the arrays hold exactly the trajectories' tokens. Trajectory arrays are views into the
    message's frames (one shared buffer per array kind) unless ``copy=True``, which gives each
    trajectory its own arrays (use it when trajectories outlive their siblings for long, e.g. in a
    replay buffer, or when the frames were read-only).
    """
    if msg.kind != "episode":
        raise WireError(f"expected an 'episode' message, got '{msg.kind}'", reason="wrong_kind")
    body: EpisodeBody = msg.body
    n, cols = body.n, body.trajectories
    for name, default in COLUMN_DEFAULTS.items():  # (written before the field existed)
        if getattr(cols, name) is None:
            setattr(cols, name, [default() for _ in range(n)] if callable(default) else [default] * n)
    for name in _COLUMNS:
        if getattr(cols, name) is not None and len(getattr(cols, name)) != n:  # (has_<array>: may be missing)
            raise WireError(
                f"message 'episode' field 'trajectories.{name}' has "
                f"{len(getattr(cols, name))} entries, expected {n} (one per trajectory)",
                reason="field",
            )
    columns = {name: getattr(cols, name) for name in _SCALARS}
    for name, dtype, optional in PER_TOKEN:
        present = (
            (getattr(cols, f"has_{name}") or [False] * n)  # missing: written before the field existed
            if optional
            else [True] * n
        )
        columns[name] = _split(msg, name, dtype, cols.length, present, copy)
    trajectories = [Trajectory(*row) for row in zip(*(columns[name] for name in Trajectory.__struct_fields__))]
    head = body.episode
    return Episode(trajectories, **{name: getattr(head, name) for name in _HEAD})


def _concat(arrs: list[np.ndarray], dtype: str) -> np.ndarray:
    dt = DTYPES[dtype]
    if len({a.shape[1:] for a in arrs}) > 1:
        raise ValueError(f"the trajectories' per-token rows differ in width: {sorted({a.shape[1:] for a in arrs})}")
    return np.concatenate(arrs, dtype=dt) if arrs else np.zeros(0, dt)


def _split(
    msg: Message, name: str, dtype: str, lengths: list[int], present: list[bool], copy: bool
) -> list[np.ndarray | None]:
    """Per-trajectory slices of array ``name`` (None where not ``present``)."""
    lens = [n for n, p in zip(lengths, present) if p]
    if not lens and name not in msg.arrays:
        return [None] * len(lengths)
    arr = msg.arrays.get(name)
    if arr is None:
        raise WireError(f"message 'episode': array '{name}' is missing", reason="arrays")
    ndim = 2 if name in WIDE else 1
    if DTYPES[dtype] != arr.dtype or name in msg.bf16 or arr.ndim != ndim:
        raise WireError(
            f"message 'episode': array '{name}' is {arr.dtype}{list(arr.shape)}, expected {ndim}-D {dtype}",
            reason="arrays",
        )
    if arr.shape[0] != sum(lens):
        raise WireError(
            f"message 'episode': array '{name}' has {arr.shape[0]} {'rows' if ndim == 2 else 'elements'} but the "
            f"trajectory lengths sum to {sum(lens)}",
            reason="arrays",
        )
    offsets = list(accumulate(lens, initial=0))
    parts = [arr[a:b] for a, b in zip(offsets, offsets[1:])]
    if copy:
        parts = [x.copy() for x in parts]
    if len(parts) == len(present):
        return parts
    it = iter(parts)
    return [next(it) if p else None for p in present]


# ---------------------------------------------------------------------------------------------
# weights


def encode_weights(named_tensors: dict[str, Any], version: int, digest: str | None = None) -> list:
    """Frames for a ``weights`` message: one frame per tensor, zero-copy for contiguous CPU
    tensors (do not modify them before the send completes), bfloat16 supported."""
    return encode("weights", Weights(version=int(version), digest=digest), named_tensors)


def decode_weights(msg: Message, copy: bool = False) -> tuple[int, dict[str, Any]]:
    """``(version, {name: torch.Tensor})`` from a ``weights`` message with tensor frames.

    Tensors share the received frames when those are writable and aligned (``zmq.Frame`` from
    ``recv_multipart(copy=False)``), and are writable copies otherwise or with ``copy=True``.
    Either way they are safe to pass to ``module.load_state_dict``.
    """
    if msg.kind != "weights":
        raise WireError(f"expected a 'weights' message, got '{msg.kind}'", reason="wrong_kind")
    out = {}
    for name, arr in msg.arrays.items():
        if copy or not arr.flags.writeable:
            arr = arr.copy()
        out[name] = to_torch(arr, name in msg.bf16)
    return msg.body.version, out
