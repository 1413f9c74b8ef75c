"""Weight transports by ``sync.type`` (``asyncrl.weights.base`` has the interface)."""

from pathlib import Path

from ..registry import Registry
from .base import WeightPublisher, WeightReceiver, WeightsError
from .collective import CollectivePublisher, CollectiveReceiver
from .filesystem import FilesystemPublisher, FilesystemReceiver
from .ipc import IpcPublisher, IpcReceiver
from .zmq import ZmqPublisher, ZmqReceiver

TRANSPORTS: Registry[tuple[type, type]] = Registry(
    "weight transport",
    {
        "zmq": (ZmqPublisher, ZmqReceiver),
        "filesystem": (FilesystemPublisher, FilesystemReceiver),
        "ipc": (IpcPublisher, IpcReceiver),
        "nccl": (CollectivePublisher, CollectiveReceiver),
    },
)


def make_publisher(sync_cfg, run_dir: Path, wire_cfg=None) -> WeightPublisher:
    """The learner's side of ``sync.type`` (``wire_cfg``: its CURVE keys, for a transport that
    serves a socket of its own)."""
    return TRANSPORTS[sync_cfg.type][0](sync_cfg, run_dir, wire_cfg)


def make_receiver(sync_cfg, wire_cfg=None, actor_id: str | None = None) -> WeightReceiver:
    """The actor's side of ``sync.type`` (``wire_cfg`` and ``actor_id``: its CURVE keys)."""
    return TRANSPORTS[sync_cfg.type][1](sync_cfg, wire_cfg, actor_id)


__all__ = ["TRANSPORTS", "WeightPublisher", "WeightReceiver", "WeightsError", "make_publisher", "make_receiver"]
