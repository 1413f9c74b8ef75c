"""Filesystem weight sync (``sync.type: filesystem``): the learner writes
``weights-<version>.safetensors`` atomically and sends actors only its path; actors read the file.
For actors that share a filesystem with the learner. The directory is made private (mode 0700) and
each file mode 0600; an actor loads only a file of its own user's that no one else can read or write
(:func:`asyncrl.weights.ipc.check_owner`)."""

from __future__ import annotations

import os
from pathlib import Path

from safetensors.torch import load_file, save_file

from ..rundir.layout import WEIGHTS
from ..wire.codec import Message, encode
from ..wire.messages import Weights
from ..wire.sockets import private_dir
from .base import Publisher, Receiver, WeightsError
from .ipc import check_owner


class FilesystemPublisher(Publisher):
    def __init__(self, sync_cfg, run_dir: Path, wire_cfg=None):
        self.dir = Path(sync_cfg.dir or Path(run_dir) / WEIGHTS).resolve()
        self.keep = sync_cfg.keep

    def frames(self, state: dict, version: int, digest: str | None = None) -> list:
        """Save ``state`` as ``weights-<version>.safetensors`` (the newest ``sync.keep`` are kept)
        and return a ``weights`` message naming the file."""
        private_dir(self.dir)
        final = self.dir / f"weights-{version:08d}.safetensors"
        tmp = final.with_suffix(".tmp")
        save_file(state, str(tmp), metadata={"version": str(version)})
        os.chmod(tmp, 0o600)
        os.replace(tmp, final)
        for old in sorted(self.dir.glob("weights-*.safetensors"))[: -self.keep]:
            old.unlink(missing_ok=True)
        return encode("weights", Weights(version=int(version), path=str(final), digest=digest))


class FilesystemReceiver(Receiver):
    def __init__(self, sync_cfg=None, wire_cfg=None, actor_id=None):
        pass

    def tensors(self, msg: Message) -> tuple[int, dict]:
        path = msg.body.path
        if not path:
            raise WeightsError(
                "the learner sent tensor frames but this actor expects sync.type=filesystem; "
                "use the same sync.type on both sides"
            )
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise WeightsError(
                f"weights file {path} does not exist (filesystem sync needs a shared filesystem)"
            ) from None
        except OSError as e:
            raise WeightsError(f"weights file {path} cannot be opened: {e.strerror}") from None
        try:
            check_owner(fd, path)
        finally:
            os.close(fd)
        return msg.body.version, load_file(path)
