"""The OpenAI-compatible endpoint an actor serves to agent code, over its own engine.

- ``core``: :class:`~asyncrl.endpoint.core.Endpoint`, the chat and completions bookkeeping: each
  request's prompt tokens, the policy's reply tokens and versions, tool-call parsing, sessions.
- ``server``: the HTTP side, an ASGI application on uvicorn (loopback TCP and a private Unix socket).
- ``responses``: OpenAI's Responses API over the chat bookkeeping.
- ``client``: the HTTP transport of the ``openai`` clients lent to agent rollouts.

``env.type=agent`` (:mod:`asyncrl.envs.agent`) runs agent code against it.
"""
