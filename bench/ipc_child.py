"""The receiving end of ``sync.type: ipc`` in a process of its own, for ``bench_gpu.py ipc`` and the
CUDA IPC tests: an actor's weight path without the rest of the actor.

    python bench/ipc_child.py SEGMENT_DIR [--digest]

Reads ``weights`` messages from stdin (each: a little-endian uint32 frame count, then every frame as
a uint64 length and its bytes, the frames :func:`asyncrl.wire.codec.encode` made), receives each
with :class:`asyncrl.weights.ipc.IpcReceiver`, checks its values as an actor does and copies it into
tensors of its own (the actor's model weights, on the device the version arrived on), then writes
one JSON line: ``version``, ``device``, ``apply_s`` (decode to copied, synchronised), the GPU's
``allocated`` bytes in this process and ``free`` bytes on the device, and with ``--digest`` the
SHA-256 of every tensor's bytes; or ``error``, for a version refused. Ends at end of input.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from asyncrl.weights.base import check_weight_values  # noqa: E402
from asyncrl.weights.ipc import IpcReceiver  # noqa: E402
from asyncrl.wire.codec import decode  # noqa: E402


def write_frames(stream, frames: list) -> None:
    """One message to ``stream`` in the framing :func:`read_frames` reads."""
    stream.write(struct.pack("<I", len(frames)))
    for frame in frames:
        data = bytes(frame)
        stream.write(struct.pack("<Q", len(data)))
        stream.write(data)
    stream.flush()


def read_frames(stream) -> list[bytes] | None:
    head = stream.read(4)
    if len(head) < 4:
        return None
    frames = []
    for _ in range(struct.unpack("<I", head)[0]):
        (size,) = struct.unpack("<Q", stream.read(8))
        frames.append(stream.read(size))
    return frames


def read_answer(child) -> dict:
    """The next JSON line of the child process ``child`` (a Popen with pipes); RuntimeError naming
    its exit code if it ended instead (a crash in native code prints no traceback)."""
    line = child.stdout.readline()
    if not line:
        raise RuntimeError(f"the receiving process ended (exit code {child.wait(timeout=60)}) without answering")
    return json.loads(line)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def main() -> None:
    receiver = IpcReceiver(SimpleNamespace(dir=sys.argv[1]))
    targets: dict[str, torch.Tensor] | None = None
    while (frames := read_frames(sys.stdin.buffer)) is not None:
        t0 = time.perf_counter()
        try:
            version, tensors = receiver.tensors(decode(frames, kinds=("weights",)))
            check_weight_values(tensors)
            if targets is None:
                targets = {k: torch.empty_like(t) for k, t in tensors.items()}
            for k, t in tensors.items():
                targets[k].copy_(t)
            device = next(iter(targets.values())).device
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            out = {"version": version, "device": str(device), "apply_s": time.perf_counter() - t0}
            if device.type == "cuda":
                out["allocated"], out["free"] = torch.cuda.memory_allocated(device), torch.cuda.mem_get_info(device)[0]
            if "--digest" in sys.argv:
                out["sha"] = {k: digest(t) for k, t in targets.items()}
        except Exception as e:  # noqa: BLE001 - reported to the parent, which decides
            out = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)
    receiver.close()


if __name__ == "__main__":
    main()
