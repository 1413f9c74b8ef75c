"""Runnable examples of asyncrl's environment paths (see examples/README.md): a verifiers taskset, an
OpenEnv server with the agent that plays it, and configs for them and for reasoning-gym."""
