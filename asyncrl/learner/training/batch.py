"""Trajectories -> one padded training batch, and the learner's log-prob forward (padded, or packed
without padding: :mod:`.packing`).

Alignment: ``input_ids[B, T]`` holds the right-padded token sequences; every per-token tensor is
``[B, T-1]`` over TARGET positions: position ``j`` refers to token ``j + 1``, the one the logits at
``j`` predict. So ``response_mask[b, j] = loss_mask[j + 1]`` and ``behavior_logprobs[b, j]`` is the
engine's log-prob of token ``j + 1``. Token 0 is never a target (it is always prompt).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ...engine.routing import replay_routing
from ...objectives.logprobs import entropy_from_logits, logprobs_from_logits
from ...types import Trajectory, training_rows
from .attention import FLEX_BLOCK, packed_attention
from .chunked_head import chunk_tokens, output_layer, target_head, usable
from .packing import mask_for, pack_rows, varlen_attention

__all__ = [
    "Forward",
    "TrainBatch",
    "collate",
    "compute_logprobs",
    "forward_rows",
    "put_rows",
    "replayed_share",
    "shared_width",
    "value_rows",
]


@dataclass
class TrainBatch:
    """A padded batch of ``B`` trajectories (see the module docstring for the alignment)."""

    input_ids: Tensor  # long [B, T], right-padded with pad_id
    attention_mask: Tensor  # long [B, T], 1 on real tokens
    response_mask: Tensor  # float [B, T-1], loss_mask of the target token
    behavior_logprobs: Tensor  # float [B, T-1], engine log-probs of the target token (0 off-mask)
    old_logprobs: Tensor  # float [B, T-1], proximal policy; a copy of behaviour until recomputed
    advantages: Tensor  # float [B, T-1], trajectory advantage on response tokens, 0 elsewhere
    exp_mask: Tensor  # float [B, T-1], 1 on replayed (off-policy) target tokens
    recorded_logprobs: Tensor  # float [B, T-1], replay's recorded log-probs (0 when absent)
    recorded_mask: Tensor  # float [B, T-1], 1 where a recorded log-prob exists (NaN/absent: 0)
    rewards: Tensor  # float [B]
    row_advantages: Tensor  # float [B], each trajectory's advantage (what ``advantages`` spreads on its tokens)
    policy_versions: Tensor  # long [B], each row's oldest generated token's version
    token_versions: Tensor  # long [B, T-1], the policy version of each target token (its row's where none recorded)
    old_values: Tensor  # float [B, T-1], the critic's values before the step (estimator gae; else 0)
    returns: Tensor  # float [B, T-1], the critic's return targets (estimator gae; else 0)
    sample_types: list[str]
    group_ids: list[str]
    routing: Tensor | None = None  # int16 [B, T, layers x top_k]: recorded experts (routing replay), -1: none

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Response (trained) tokens in the batch."""
        return int(self.response_mask.sum().item())

    def truncate_stale(self, version: int, max_staleness: int) -> int:
        """``buffer.stale_tokens: truncate``: no loss on generated tokens more than ``max_staleness``
        versions older than ``version`` (response mask and advantages 0 there, in place; replayed
        tokens are left alone). Returns how many tokens it masked."""
        stale = ((version - self.token_versions) > max_staleness) & (self.response_mask > 0) & (self.exp_mask == 0)
        n = int(stale.sum())
        if n:
            self.response_mask = self.response_mask.masked_fill(stale, 0.0)
            self.advantages = self.advantages.masked_fill(stale, 0.0)
        return n

    def _map(self, tensor_fn, list_fn) -> "TrainBatch":
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = tensor_fn(v) if isinstance(v, Tensor) else None if v is None else list_fn(v)
        return TrainBatch(**out)

    def to(self, device: str | torch.device) -> "TrainBatch":
        """A copy with every tensor on ``device``."""
        return self._map(lambda t: t.to(device), list)

    def select(self, rows: slice) -> "TrainBatch":
        """Rows ``rows`` of every field (tensors share storage with this batch)."""
        return self._map(lambda t: t[rows], lambda xs: list(xs[rows]))

    def take(self, index: list[int]) -> "TrainBatch":
        """Rows ``index`` (copies), cut to the width of the longest of them (``T'`` tokens, ``T' - 1``
        target positions): what a micro-batch runs. :func:`put_rows` puts its per-token results back."""
        if not index:
            raise ValueError("TrainBatch.take needs at least one row")
        ix = torch.tensor(index, dtype=torch.long, device=self.input_ids.device)
        width = max(int(self.attention_mask.index_select(0, ix).sum(1).max()), 1)
        full = self.input_ids.shape[1]

        def cut(t: Tensor) -> Tensor:
            t = t.index_select(0, ix)
            if t.dim() >= 2:
                return t[:, :width] if t.shape[1] == full else t[:, : width - 1]
            return t

        return self._map(cut, lambda xs: [xs[i] for i in index])

    def split(self, k: int) -> list["TrainBatch"]:
        """``k`` mini-batches along B, sizes differing by at most one, order kept."""
        b = self.batch_size
        if not 1 <= k <= b:
            raise ValueError(f"cannot split a batch of {b} trajectories into {k} mini-batches")
        base, extra = divmod(b, k)
        out, start = [], 0
        for i in range(k):
            stop = start + base + (1 if i < extra else 0)
            out.append(self.select(slice(start, stop)))
            start = stop
        return out


def put_rows(full: Tensor, index: list[int], part: Tensor) -> None:
    """Write a micro-batch's per-token ``part[b, w]`` (rows ``index`` of :meth:`TrainBatch.take`)
    into ``full[B, T-1]``, in place; positions past ``w`` are left as they are."""
    ix = torch.tensor(index, dtype=torch.long, device=full.device)
    full[ix, : part.shape[1]] = part.to(full.device, full.dtype)


def _shifted(arr: np.ndarray | None, n: int, width: int, dtype: torch.dtype) -> Tensor:
    """Row ``[width]``: ``arr[1:n]`` (the target positions), zero-padded; zeros when ``arr`` is None."""
    row = torch.zeros(width, dtype=dtype)
    if arr is not None and n > 1:
        row[: n - 1] = torch.tensor(np.asarray(arr[1:n]), dtype=dtype)  # (a copy: restored rows are read-only views)
    return row


def collate(
    trajectories: list[Trajectory], advantages: Tensor, pad_id: int, device: str | torch.device = "cpu"
) -> TrainBatch:
    """Pad ``N`` trajectories into a :class:`TrainBatch` with ``advantages[N]`` on response tokens.

    ``exp_mask`` comes from ``Trajectory.exp_mask``; a replay trajectory (``is_replay``) without one
    is off-policy on all its generated tokens, so its ``loss_mask`` is used. NaN in
    ``recorded_logprobs`` means "not recorded" (seed 6.4): ``recorded_mask`` is 0 there, the value 0.
    """
    if not trajectories:
        raise ValueError("collate needs at least one trajectory")
    adv = torch.as_tensor(advantages, dtype=torch.float32).detach().reshape(-1).cpu()
    if adv.shape[0] != len(trajectories):
        raise ValueError(f"got {adv.shape[0]} advantages for {len(trajectories)} trajectories")
    cols = training_rows(trajectories)
    lengths = [len(ids) for ids in cols["token_ids"]]
    T = max(lengths)
    W = max(T - 1, 0)
    B = len(trajectories)
    input_ids = torch.full((B, T), int(pad_id), dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    rows: dict[str, list[Tensor]] = {k: [] for k in ("resp", "behav", "exp", "rec", "recm", "ver")}
    for i, n in enumerate(lengths):
        input_ids[i, :n] = torch.tensor(cols["token_ids"][i], dtype=torch.long)
        attention_mask[i, :n] = 1
        rows["resp"].append(_shifted(cols["loss_mask"][i], n, W, torch.float32))
        rows["behav"].append(_shifted(cols["behavior_logprobs"][i], n, W, torch.float32))
        rows["exp"].append(_shifted(cols["off_policy"][i], n, W, torch.float32))
        rows["ver"].append(_shifted(cols["versions"][i], n, W, torch.long))
        recorded = cols["recorded_logprobs"][i]
        rec = _shifted(recorded, n, W, torch.float32)
        rows["recm"].append(torch.isfinite(rec).float() if recorded is not None else torch.zeros(W))
        rows["rec"].append(torch.nan_to_num(rec, nan=0.0, posinf=0.0, neginf=0.0))
    response_mask = torch.stack(rows["resp"])
    behavior = torch.stack(rows["behav"])
    batch = TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        behavior_logprobs=behavior,
        old_logprobs=behavior.clone(),
        advantages=adv[:, None] * response_mask,
        exp_mask=torch.stack(rows["exp"]),
        recorded_logprobs=torch.stack(rows["rec"]),
        recorded_mask=torch.stack(rows["recm"]),
        rewards=torch.tensor([float(t.reward) for t in trajectories], dtype=torch.float32),
        row_advantages=adv.clone(),
        policy_versions=torch.tensor([int(t.policy_version) for t in trajectories], dtype=torch.long),
        token_versions=torch.stack(rows["ver"]),
        old_values=torch.zeros_like(response_mask),
        returns=torch.zeros_like(response_mask),
        sample_types=[t.sample_type for t in trajectories],
        group_ids=[t.group_id for t in trajectories],
        routing=_routing(trajectories, T),
    )
    return batch if torch.device(device).type == "cpu" else batch.to(device)


def _routing(trajectories: list[Trajectory], T: int) -> Tensor | None:
    """``int16 [B, T, width]`` of the rows' recorded experts (-1: none, the router's own choice); None
    when no row has any."""
    widths = {t.routing.shape[1] for t in trajectories if t.routing is not None}
    if not widths:
        return None
    if len(widths) > 1:
        raise ValueError(f"routing replay: rows recorded with {sorted(widths)} entries per token; expected one width")
    out = torch.full((len(trajectories), T, widths.pop()), -1, dtype=torch.int16)
    for i, t in enumerate(trajectories):
        if t.routing is not None:
            out[i, : len(t.routing)] = torch.from_numpy(np.asarray(t.routing))
    return out


def replayed_share(batch: TrainBatch) -> float:
    """Routing replay: the share of trained targets whose input token (the position that predicts
    them) has recorded experts in every routed layer."""
    on = batch.response_mask > 0
    routed = (batch.routing[:, :-1] >= 0).all(-1)
    return float((routed & on).sum()) / max(int(on.sum()), 1)


def _routes(batch: TrainBatch, packed=None) -> Tensor | None:
    """The recorded routes in the order of the forward's flattened hidden states: ``[B * T, width]``
    for the padded layout, ``[slots, width]`` for ``packed`` (a shared prompt's slot takes any of its
    rows' routes: one prefill recorded them all). None: no routing replay."""
    if batch.routing is None:
        return None
    if packed is None:
        return batch.routing.reshape(-1, batch.routing.shape[-1])
    R, W = packed.input_ids.shape
    out = batch.routing.new_full((R * W, batch.routing.shape[-1]), -1)
    index = packed.token_index
    real = index >= 0
    out[index[real]] = batch.routing[:, : index.shape[1]][real]
    return out


@dataclass
class Forward:
    """One forward over a batch's rows: ``logprobs[B, T-1]`` (and ``entropy``) in the padded layout
    (0 on positions past a row's end), and how many slots it ran: ``slots`` in all, ``real_tokens``
    of them holding a token (a shared prompt counted once per bin), ``shared_rows`` rows that read a
    prompt another row's forward computed."""

    logprobs: Tensor
    entropy: Tensor | None
    slots: int
    real_tokens: int
    shared_rows: int = 0

    @property
    def padding_share(self) -> float:
        return 1.0 - self.real_tokens / max(self.slots, 1)


def forward_rows(
    model: torch.nn.Module,
    batch: TrainBatch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    packing: bool | str = False,
    shared_prefix: bool = False,
    width: int | None = None,
    logits_chunk_mb: float = 0,
) -> Forward:
    """Forward a Hugging Face causal LM over ``batch``: the log-probs of the targets
    (``logits[:, :-1] / temperature`` against ``input_ids[:, 1:]``), and with ``with_entropy`` the
    entropies. Grad flows if enabled by the caller (``torch.no_grad()`` for the proximal/reference
    passes); ``entropy_grad=False`` computes the entropy without a graph (for logging).

    ``packing``: the rows packed (:mod:`.packing`), so that the forward and backward touch real tokens
    only: True or ``mask``, bins of ``width`` slots under a block mask; ``flex`` or ``varlen``, one flat
    bin under those attention functions (:mod:`.attention`). With ``shared_prefix`` the completions of
    one prompt read one copy of it (the tokens before each row's first trained token; not ``varlen``).
    The same values as the padded forward up to float rounding. False or ``padded``: every row padded
    to the longest (the reference).

    ``logits_chunk_mb`` > 0: the output layer computes only the trained targets' log-probs and entropies
    (``response_mask``; 0 at every other position), a chunk of this many MiB of logits at a time
    (:mod:`.chunked_head`), never the whole micro-batch's ``[tokens, vocabulary]`` logits; the same values
    there. 0 (or a model it does not suit): full logits at every position.
    """
    chunk = _chunk_for(model, batch, logits_chunk_mb, temperature)
    if _path(packing) != "padded":
        return _packed_forward(
            model, batch, temperature, with_entropy, entropy_grad, shared_prefix, width, chunk, _path(packing)
        )
    if chunk:
        valid = (batch.attention_mask[:, 1:] > 0) & (batch.response_mask > 0)  # target j (token j + 1) is trained
        T = batch.input_ids.shape[1]
        slots = (
            torch.arange(batch.input_ids.shape[0], device=valid.device)[:, None] * T
            + torch.arange(T - 1, device=valid.device)[None, :]
        )[valid]
        with (
            target_head(model, slots, batch.input_ids[:, 1:][valid], temperature, with_entropy, entropy_grad, chunk),
            replay_routing(model, _routes(batch)),
        ):
            out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        lp, ent = _place(out.logits, valid, with_entropy)
        return Forward(lp, ent, batch.input_ids.numel(), int(batch.attention_mask.sum()))
    with replay_routing(model, _routes(batch)):
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    logp, ent = _targets(out.logits[:, :-1], batch.input_ids[:, 1:], temperature, with_entropy, entropy_grad)
    return Forward(logp, ent, batch.input_ids.numel(), int(batch.attention_mask.sum()))


def _place(values: Tensor, valid: Tensor, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """The chunked head's ``[1, N, 2]`` back in the ``[B, T-1]`` layout (0 where ``valid`` is False)."""
    flat = values.reshape(-1, 2)
    lp = flat[:, 0].new_zeros(valid.shape).masked_scatter(valid, flat[:, 0])
    ent = flat[:, 1].new_zeros(valid.shape).masked_scatter(valid, flat[:, 1]) if with_entropy else None
    return lp, ent


def _chunk_for(model, batch: TrainBatch, budget_mb: float, temperature: float) -> int:
    """Target positions per chunk of the chunked output layer, or 0 for full logits (off, or a model
    whose forward does not give the plain path's values: checked once, on one row's first tokens)."""
    head = output_layer(model) if budget_mb > 0 else None
    if head is None:
        return 0
    chunk = chunk_tokens(head, budget_mb)
    n = min(int(batch.attention_mask[0].sum()), 16)
    ids = batch.input_ids[:1, :n]
    labels, slots = ids[:, 1:], torch.arange(n - 1, device=ids.device)

    def plain():
        return logprobs_from_logits(model(input_ids=ids, use_cache=False).logits[:, :-1] / temperature, labels)

    def chunked():
        with target_head(model, slots, labels, temperature, chunk=chunk):
            return model(input_ids=ids, use_cache=False).logits.reshape(-1, 2)[:, 0][None]

    return chunk if n > 1 and usable(model, plain, chunked) else 0


def shared_width(batch: TrainBatch, budget: int) -> int:
    """The bin width for packing with shared prompts: up to four times the longest row (within the
    token budget ``budget``), so that a prompt's completions share more bins."""
    longest = int(batch.attention_mask.sum(1).max())
    return max(longest, min(4 * longest, budget))


def value_rows(
    critic: torch.nn.Module,
    batch: TrainBatch,
    packing: bool | str = False,
    shared_prefix: bool = False,
    width: int | None = None,
) -> Tensor:
    """``[B, T-1]``: a critic's value of the state before each target token, i.e. its scalar head at
    the position whose logits would predict the token (``asyncrl.models.critic``: a causal LM whose
    output layer is the head). ``packing``, ``shared_prefix``, ``width``: the rows packed into bins as
    :func:`forward_rows` does; the same values as the padded forward up to float rounding. 0 past a row's end."""
    if _path(packing) == "padded":
        out = critic(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        return out.logits[:, :-1, 0].float() * batch.attention_mask[:, 1:]
    packed, out = _run_packed(critic, batch, shared_prefix, width, path=_path(packing))
    R, W = packed.shape
    flat = out.logits.reshape(R * W).float()
    valid = packed.token_index[:, 1:] >= 0
    return flat.new_zeros(valid.shape).masked_scatter(valid, flat[packed.token_index[:, :-1][valid]])


def compute_logprobs(
    model: torch.nn.Module,
    batch: TrainBatch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    packing: bool | str = False,
    shared_prefix: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``(logprobs[B, T-1], entropy[B, T-1] or None)`` of :func:`forward_rows`. Positions past a
    row's end hold finite junk (padded) or 0 (packed); mask them."""
    out = forward_rows(model, batch, temperature, with_entropy, entropy_grad, packing, shared_prefix)
    return out.logprobs, out.entropy


def _targets(
    logits: Tensor, labels: Tensor, temperature: float, with_entropy: bool, entropy_grad: bool
) -> tuple[Tensor, Tensor | None]:
    if temperature != 1.0:
        logits = logits / temperature
    logprobs = logprobs_from_logits(logits, labels)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits)
    return logprobs, entropy


def first_trained(batch: TrainBatch) -> Tensor:
    """``[B]`` the token index of each row's first trained token (its prompt is the tokens before);
    0 for a row with none (it shares nothing)."""
    trained = batch.response_mask > 0
    return torch.where(trained.any(1), trained.float().argmax(1) + 1, torch.zeros_like(trained[:, 0], dtype=torch.long))


def _path(packing: bool | str) -> str:
    """``packing`` as an attention path (:mod:`.attention`): False is ``padded``, True ``mask``."""
    return {False: "padded", True: "mask"}.get(packing, packing) if isinstance(packing, bool) else packing


def _run_packed(model, batch: TrainBatch, shared_prefix: bool, width: int | None, head=None, path: str = "mask"):
    """``(packed rows, the model's output on them)``: the rows packed for attention ``path``
    (:mod:`.packing`, :mod:`.attention`): ``mask``, bins of ``width`` slots and a block mask (with
    ``shared_prefix`` a prompt once per bin, unless the model's own attention is a flash varlen kernel);
    ``flex``, one flat bin, a prompt once in it; ``varlen``, one flat bin of whole rows.
    ``head(packed)``: a context for the forward (the chunked output layer)."""
    starts = first_trained(batch) if shared_prefix else None
    lengths = batch.attention_mask.sum(1)
    if path in ("flex", "varlen"):
        packed = pack_rows(
            batch.input_ids,
            lengths,
            starts=starts if path == "flex" else None,
            varlen=path == "varlen",
            flat=True,
            multiple=FLEX_BLOCK if path == "flex" else 1,
        )
        with (
            packed_attention(model, path, packed),
            head(packed) if head is not None else contextlib.nullcontext(),
            replay_routing(model, _routes(batch, packed)),
        ):
            out = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
        return packed, out
    varlen = varlen_attention(model)
    packed = pack_rows(batch.input_ids, lengths, width=width, starts=None if varlen else starts, varlen=varlen)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    with head(packed) if head is not None else contextlib.nullcontext(), replay_routing(model, _routes(batch, packed)):
        out = model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            attention_mask=mask_for(model, packed.attention, dtype),
            use_cache=False,
        )
    return packed, out


def _packed_forward(
    model,
    batch: TrainBatch,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
    shared_prefix: bool,
    width: int | None,
    chunk: int = 0,
    path: str = "mask",
) -> Forward:
    """:func:`forward_rows` on the packed layout: the model runs ``[R, W]`` slots; each row's
    target ``j`` takes the logits of the slot holding its token ``j`` (only real targets go through
    the vocabulary's softmax) and lands back at ``[b, j]``."""
    labels = batch.input_ids[:, 1:]
    if chunk:
        trained = batch.response_mask > 0

        def head(packed):
            valid = (packed.token_index[:, 1:] >= 0) & trained
            return target_head(
                model, packed.token_index[:, :-1][valid], labels[valid], temperature, with_entropy, entropy_grad, chunk
            )

        packed, out = _run_packed(model, batch, shared_prefix, width, head, path)
        lp, ent = _place(out.logits, (packed.token_index[:, 1:] >= 0) & trained, with_entropy)
        R, W = packed.shape
        return Forward(lp, ent, R * W, packed.slots_used, packed.shared_rows)
    packed, out = _run_packed(model, batch, shared_prefix, width, path=path)
    R, W = packed.shape
    logits = out.logits.reshape(R * W, -1)
    index = packed.token_index
    valid = index[:, 1:] >= 0  # target j (token j + 1) exists
    lp, ent = _targets(
        logits[index[:, :-1][valid]], batch.input_ids[:, 1:][valid], temperature, with_entropy, entropy_grad
    )
    shape = valid.shape

    def place(values: Tensor | None) -> Tensor | None:
        return None if values is None else values.new_zeros(shape).masked_scatter(valid, values)

    return Forward(place(lp), place(ent), R * W, packed.slots_used, packed.shared_rows)
