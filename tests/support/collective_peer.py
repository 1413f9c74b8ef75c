"""An actor's side of ``sync.type=nccl`` (gloo) in a process of its own, for tests/unit/weights/test_sync_collective.py:
``python -m tests.support.collective_peer HOST:PORT KEY LAST_VERSION`` takes versions until it holds LAST_VERSION,
checks each against :func:`expected` bit for bit and prints ``got <version>`` (or ``bad <version>``)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch

from asyncrl.weights.collective import CollectiveReceiver
from asyncrl.wire.codec import decode, encode
from asyncrl.wire.messages import Weights


def expected(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {"w": torch.randn(33, 7, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16)}


def main(address: str, key: str, last: int) -> int:
    receiver = CollectiveReceiver(SimpleNamespace(timeout_s=60.0))
    version, want = -1, 0
    while version < last:
        version, tensors = receiver.tensors(
            decode(encode("weights", Weights(version=want, group=address, group_key=key)))
        )
        ok = all(torch.equal(tensors[k], t) for k, t in expected(version).items())
        print(f"{'got' if ok else 'bad'} {version}", flush=True)
        want = version + 1
    receiver.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
