"""Harnesses shared by the test suite and the benchmarks (as ``torch.testing`` is): nothing in asyncrl
imports them.

- ``netns``: a cluster of hosts made of Linux network namespaces (root), to cross real interfaces.
- ``peer_attacks``: hostile peers (forged, oversized, replayed and malformed messages) against a learner.
"""
