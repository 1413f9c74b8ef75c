"""ZeroMQ weight sync (``sync.type: zmq``): one frame per tensor in the ``weights`` message
(raw little-endian bytes, bfloat16 as its bit pattern; ``asyncrl.wire.codec``)."""

from __future__ import annotations

from ..wire.codec import Message, decode_weights, encode_weights
from .base import Publisher, Receiver, WeightsError


class ZmqPublisher(Publisher):
    def __init__(self, sync_cfg=None, run_dir=None, wire_cfg=None):
        pass

    def frames(self, state: dict, version: int, digest: str | None = None) -> list:
        """The ``weights`` message: zero-copy frames over ``state`` (a snapshot: it must not
        change until sent)."""
        return encode_weights(state, version, digest)


class ZmqReceiver(Receiver):
    def __init__(self, sync_cfg=None, wire_cfg=None, actor_id=None):
        pass

    def tensors(self, msg: Message) -> tuple[int, dict]:
        if msg.body.path:
            raise WeightsError(
                f"the learner sent a weights file ({msg.body.path}) but this actor expects "
                f"sync.type=zmq; use the same sync.type on both sides"
            )
        return decode_weights(msg)
