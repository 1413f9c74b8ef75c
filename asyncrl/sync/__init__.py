"""Weight transports by ``sync.type`` (``asyncrl.sync.base`` has the interface)."""

from .base import WeightPublisher, WeightReceiver, WeightsError, make_publisher, make_receiver
from .filesystem import FilesystemPublisher, FilesystemReceiver
from .zmq import ZmqPublisher, ZmqReceiver

TRANSPORTS = {"zmq": (ZmqPublisher, ZmqReceiver), "filesystem": (FilesystemPublisher, FilesystemReceiver)}

__all__ = ["TRANSPORTS", "WeightPublisher", "WeightReceiver", "WeightsError", "make_publisher", "make_receiver"]
