"""Weights are verified before they are loaded (issue 41.3 and 41.8): an actor maps only a
shared-memory segment (or reads only a weights file) of its own user's that no one else can read or
write, and refuses a version holding NaN, infinities or a dtype that is not a float weight's, full
weights and LoRA adapters alike, before the engine changes at all."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from asyncrl.actor.actor import Actor
from asyncrl.config import load_config
from asyncrl.weights import WeightsError
from asyncrl.weights.filesystem import FilesystemPublisher, FilesystemReceiver
from asyncrl.weights.ipc import IpcPublisher, IpcReceiver
from asyncrl.wire.codec import decode, encode_weights
from tests.conftest import SMALL_RUN as COMMON


def _cfg(tmp_path):
    return SimpleNamespace(type="ipc", dir=str(tmp_path), keep=1, every=1)


@pytest.mark.parametrize("kind", ["ipc", "filesystem"])
def test_weights_someone_else_could_have_written_are_refused(tmp_path, kind):
    cfg = _cfg(tmp_path / "w")
    pub = IpcPublisher(cfg) if kind == "ipc" else FilesystemPublisher(cfg, tmp_path)
    rec = IpcReceiver(cfg) if kind == "ipc" else FilesystemReceiver(cfg)
    try:
        msg = decode(pub.frames({"w": torch.ones(4)}, 1))
        path = pub.segment_paths[1] if kind == "ipc" else msg.body.path
        assert os.stat(path).st_mode & 0o777 == 0o600  # as the learner makes them
        assert rec.tensors(msg)[1]["w"].tolist() == [1.0] * 4
        rec.close()
        os.chmod(path, 0o644)  # readable (and so replaceable in a shared dir) by others: refused
        with pytest.raises(WeightsError, match="not this user's private weights file"):
            (IpcReceiver(cfg) if kind == "ipc" else rec).tensors(msg)
        os.chmod(path, 0o600)
        if os.geteuid() == 0:  # made by another user under the expected name
            os.chown(path, 65534, 65534)
            with pytest.raises(WeightsError, match="owner uid 65534"):
                (IpcReceiver(cfg) if kind == "ipc" else rec).tensors(msg)
            os.chown(path, 0, 0)
        real = str(path) + ".real"  # a link under the expected name
        os.rename(path, real)
        os.symlink(real, path)
        with pytest.raises(WeightsError, match="cannot be opened"):
            (IpcReceiver(cfg) if kind == "ipc" else rec).tensors(msg)
    finally:
        rec.close()
        pub.close()


@pytest.fixture(scope="module", params=["full", "lora"])
def actor(request, tiny_overrides):
    extra = ["model.lora.rank=4"] if request.param == "lora" else []
    cfg = load_config(None, [*tiny_overrides, *COMMON, *extra])
    a = Actor(cfg, "ipc:///nonexistent/asyncrl-test-control", "actor-0")  # (nothing is ever sent)
    yield a, request.param
    a.close()


def _expected(actor_obj, kind) -> dict[str, torch.Tensor]:
    engine = actor_obj.engine
    if kind == "lora":
        return {n: torch.full(shape, 0.01) for n, shape in engine.adapters.expected.items()}
    return {n: t.detach().clone() for n, t in engine.state_dict_for_sync().items()}


@pytest.mark.parametrize("poison", ["nan", "inf", "int64"])
def test_a_version_with_bad_values_changes_nothing(actor, poison, capsys):
    a, kind = actor
    before = {n: t.detach().clone() for n, t in a.engine.model.state_dict().items()}
    version = a.engine.version
    tensors = _expected(a, kind)
    name = sorted(tensors)[0]
    if poison == "int64":
        tensors[name] = torch.ones_like(tensors[name], dtype=torch.int64)
    else:
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] = float(poison)
    a.net.newest_weights = lambda timeout_ms=0: encode_weights(tensors, version + 7)
    assert a.apply_weights() is False
    assert a.engine.version == version
    after = a.engine.model.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before), "a weight changed"
    said = capsys.readouterr().out
    assert ("NaN or infinite" if poison != "int64" else "torch.int64") in said and name in said, said
    # the same version, clean, is taken (so what refused it was the values, not the path)
    a.net.newest_weights = lambda timeout_ms=0: encode_weights(_expected(a, kind), version + 7)
    assert a.apply_weights() is True and a.engine.version == version + 7
