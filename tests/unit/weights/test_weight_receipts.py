"""A receipt for every weight version (issue 66): the actor refuses a version whose bytes are not
the ones the learner published (damaged on the way) and one its engine did not really take (an
update that silently does nothing), says so in one line, and generates with neither; the versions it
took are stamped on its episodes and reported in its heartbeat."""

from __future__ import annotations

import torch

from asyncrl.actor.actor import Actor
from asyncrl.config import load_config
from asyncrl.types import Episode
from asyncrl.weights.digest import weights_digest
from asyncrl.wire.codec import encode_weights
from tests.conftest import SMALL_RUN as COMMON
from tests.support.factories import trajectory


def _actor(tiny_overrides) -> Actor:
    cfg = load_config(None, [*tiny_overrides, *COMMON])
    return Actor(cfg, "ipc:///nonexistent/asyncrl-test-control", "actor-0")  # (nothing is ever sent)


def _weights(a: Actor, scale: float) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() * scale for n, t in a.engine.state_dict_for_sync().items()}


def test_the_digest_covers_names_dtypes_shapes_and_every_byte():
    w = {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, 3, dtype=torch.bfloat16)}
    d = weights_digest(w)
    assert d == weights_digest({k: v.clone() for k, v in reversed(w.items())})  # (name order, not insertion)
    changed = {"a": w["a"].clone(), "b": w["b"]}
    changed["a"][5] = torch.nextafter(changed["a"][5], torch.tensor(100.0))  # one ulp of one value
    assert weights_digest(changed) != d
    assert weights_digest({"a": w["a"].reshape(2, 3), "b": w["b"]}) != d
    assert weights_digest({"a": w["a"].double(), "b": w["b"]}) != d
    assert weights_digest({"c": w["a"], "b": w["b"]}) != d


def test_a_version_damaged_on_the_way_or_not_taken_by_the_engine_is_refused(tiny_overrides, capsys):
    a = _actor(tiny_overrides)
    try:
        a.net.session = "s1"  # (as after a welcome)
        a.ask_weights = lambda: None  # (no learner to tell)
        good = _weights(a, 1.0)
        a.net.newest_weights = lambda timeout_ms=0: encode_weights(good, 1, weights_digest(good))
        assert a.apply_weights() is True and a.weights_digest == weights_digest(good)
        assert a._weights_session == "s1"  # generating with them
        # damaged on the way: the bytes are not those the learner published for version 2
        sent = _weights(a, 1.5)
        damaged = {n: t.clone() for n, t in sent.items()}
        name = sorted(damaged)[0]
        damaged[name].view(-1)[0] += 1.0
        before = {n: t.detach().clone() for n, t in a.engine.model.state_dict().items()}
        a.net.newest_weights = lambda timeout_ms=0: encode_weights(damaged, 2, weights_digest(sent))
        assert a.apply_weights() is False
        err = capsys.readouterr().err
        assert "weights version 2 arrived with digest" in err and "not loaded" in err, err
        after = a.engine.model.state_dict()
        assert all(torch.equal(before[n], after[n]) for n in before) and a.engine.version == 1
        # an engine whose update silently does nothing (it only sets the version): caught, not generated with
        a.engine.update_weights = lambda tensors, version: setattr(a.engine, "version", int(version))
        newer = _weights(a, 2.0)
        a.net.newest_weights = lambda timeout_ms=0: encode_weights(newer, 3, weights_digest(newer))
        assert a.apply_weights() is False
        err = capsys.readouterr().err
        assert "weights version 3" in err and "did not load" in err and "differ from what arrived" in err, err
        assert a.weights_digest == "" and a._weights_session is None  # it refuses to generate with them
        # the episodes of the version it did take carry that version's digest
        ep = Episode(trajectories=[trajectory(6, version=1)])
        a._stamp([ep], ["0.0.1"])
        assert ep.weights_digests == {"1": weights_digest(good)} and ep.ticket == "0.0.1"
    finally:
        a.close()
