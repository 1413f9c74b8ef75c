"""Fixtures of the endpoint tests (test_endpoint_api.py, test_client.py)."""

from __future__ import annotations

import threading

import pytest

from asyncrl.config import SamplingConfig
from asyncrl.endpoint.core import Endpoint


@pytest.fixture
def serving(random_engine, tok):
    """An endpoint whose calls the engine answers on a thread of its own (as a rollout thread does)."""
    made = []

    def make(parser=None, max_new_tokens=6):
        ep = Endpoint(
            tok,
            "policy",
            SamplingConfig(max_new_tokens=max_new_tokens, temperature=3.0),
            random_engine.eos_ids,
            parser,
            request_timeout_s=60,
        )
        stop = threading.Event()

        def loop():
            while not stop.is_set():
                calls = ep.wait_batch(1, timeout=0.05)
                if calls:
                    ep.serve(random_engine, calls, seed=None)

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        made.append((ep, stop, t))
        return ep

    yield make
    for ep, stop, t in made:
        stop.set()
        t.join(10)
        ep.close()
