"""The security boundary: where model-written code and model-chosen tool calls run.

- ``python``: model-written Python (Absolute Zero ``code_o``) under an isolation level
  (``sandbox.isolation``: bwrap, a subprocess, or ``remote``).
- ``bwrap``: the operating-system boundary (bubblewrap namespaces, seccomp, no network).
- ``remote``: a client for a SandboxFusion-style remote sandbox.
- ``tools``: a verifiers toolset's tool calls, chosen by the model, in a bubblewrap worker.
- ``arith``: integer arithmetic from model text without ``eval`` (self-play's proposals).
"""
