"""Rollout routing replay (R3) for mixture-of-experts models (``model.routing_replay``; issue 68).

A mixture-of-experts layer sends each token to the ``top_k`` experts its router scores highest. The
engine that samples and the learner that trains compute those scores with different kernels, batch
shapes and caches, so a token whose scores nearly tie can go to other experts in the learner than
it went to when it was sampled: the trained policy is then not the sampling one, and the
importance ratio carries that difference (Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by
Aligning Training and Inference Routers"). R3 records each token's experts at generation and makes
the learner's forward use them; the gate weights still come from the learner's own router logits
(softmax over the recorded experts, renormalised as the model does), so the router keeps its gradient.

- :class:`RoutingRecorder` (the engine): a forward hook on every router keeps the expert indices of
  each call, ``[tokens of the call, top_k]`` per layer, in the order of the call's hidden states.
- :func:`replay_routing` (the learner): a context in which every router's indices are replaced by
  the recorded ones wherever they exist (``>= 0``); ``routes`` is ``[slots, layers x top_k]``
  (layer-major) in the order of the forward's flattened hidden states (padded or packed).

A router here is a transformers ``*TopKRouter`` module (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE and
the others of transformers 5): ``forward(hidden) -> (router_logits, scores, indices)``, with
``top_k``, ``num_experts`` and, where the model renormalises, ``norm_topk_prob``.
A trajectory carries its routes as ``Trajectory.routing``, ``int16 [tokens, layers x top_k]``, -1
where none was recorded (the last generated token, which no forward read; environment tokens after
the last turn).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's expert routers, in layer order (empty for a dense model)."""
    return [
        m
        for m in model.modules()
        if type(m).__name__.endswith("Router") and hasattr(m, "top_k") and hasattr(m, "num_experts")
    ]


def _entries(found: list[torch.nn.Module]) -> int:
    return sum(int(r.top_k) for r in found)


def routing_width(model: torch.nn.Module) -> int:
    """Entries per token of ``Trajectory.routing``: the routed layers times their ``top_k`` (0: dense)."""
    return _entries(routers(model))


class RoutingRecorder:
    """Keeps the expert indices every router chose in each forward while :meth:`recording`."""

    def __init__(self, model: torch.nn.Module):
        self.routers = routers(model)
        self._current: dict[int, torch.Tensor] = {}  # router -> the last forward's indices, int16 [tokens, top_k]

    @contextlib.contextmanager
    def recording(self):
        """Record the routers' choices of the forwards run inside (:meth:`take` after each)."""

        def hook(i):
            def fn(module, args, output):
                self._current[i] = output[2].detach().to(torch.int16)

            return fn

        handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(self.routers)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def take(self) -> torch.Tensor:
        """The last forward's routes, ``int16 [tokens, layers x top_k]`` (layer-major), and clear them."""
        got = [self._current.pop(i) for i in range(len(self.routers))]
        return torch.cat(got, dim=1)


class RouteBuffer:
    """One generation batch's routes, ``int16 [B, P + T, width]`` (-1 where no forward read a
    position): :meth:`put` places the last forward's at its columns."""

    def __init__(self, recorder: RoutingRecorder, rows: int, columns: int, device):
        self.recorder = recorder
        self.routes = torch.full((rows, columns, _entries(recorder.routers)), -1, dtype=torch.int16, device=device)

    def put(self, start: int, length: int, rows: torch.Tensor | None = None) -> None:
        """The last forward read ``length`` positions of each of its rows from column ``start``;
        ``rows``: which of its rows each batch row is (a shared prompt's prefill)."""
        got = self.recorder.take().view(-1, length, self.routes.shape[-1])
        self.routes[:, start : start + length] = got if rows is None else got[rows]


def _replayed(module, output, routes: torch.Tensor):
    logits, scores, indices = output
    want = routes.to(indices.device, torch.long)
    if want.shape != indices.shape:
        raise ValueError(
            f"routing replay: the recorded routes are {tuple(want.shape)} for a router call over "
            f"{tuple(indices.shape)} (tokens, top_k): the forward's layout does not match the recorded one"
        )
    keep = (want >= 0).all(-1, keepdim=True)
    chosen = torch.where(keep, want, indices)
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    top = probs.gather(-1, chosen)
    if getattr(module, "norm_topk_prob", True):
        top = top / top.sum(-1, keepdim=True)
    return logits, top.to(scores.dtype), chosen.to(indices.dtype)


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, routes: torch.Tensor | None):
    """Forwards inside use ``routes`` (``[slots, layers x top_k]``, layer-major, in the order of the
    forward's flattened hidden states; -1: the router's own choice) as every router's expert indices;
    ``None``: nothing replayed."""
    found = routers(model) if routes is not None else []
    width = _entries(found)
    if routes is not None and routes.shape[1] != width:
        raise ValueError(
            f"routing replay: the routes have {routes.shape[1]} entries per token, the model's routers "
            f"{width} (routed layers x top_k)"
        )
    offsets = [0]
    for r in found:
        offsets.append(offsets[-1] + int(r.top_k))

    def hook(i):
        def fn(module, args, output):
            return _replayed(module, output, routes[:, offsets[i] : offsets[i + 1]])

        return fn

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(found)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def routing_limits(model: torch.nn.Module, enabled: bool) -> tuple[int, int]:
    """``(width, num_experts)`` that the learner accepts in ``Trajectory.routing`` (``(0, 0)``: off)."""
    found = routers(model) if enabled else []
    return (_entries(found), max(int(r.num_experts) for r in found)) if found else (0, 0)
