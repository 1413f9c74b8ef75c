"""The learner's training step over several processes (issue 15): DDP or FSDP2 on a process group.

Promised here (``asyncrl.learner.training.ranks`` runs the learner's ranks on top of it):

- :func:`init_from_env` joins the group that ``torchrun`` / ``accelerate launch`` describe in the
  environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): gloo on CPU, nccl on CUDA,
  with a timeout on every collective so that a dead rank ends the others with an error, not a hang.
- :func:`wrap` puts a model under DistributedDataParallel (gradients averaged over ranks) or FSDP2
  (``fully_shard`` on every decoder layer and on the root, over a 1-D device mesh).
- :func:`shard_rows` gives each rank its contiguous share of a batch's rows.
- :func:`step_totals`: DDP and FSDP2 *average* gradients over the ``W`` ranks, so each rank's loss
  (each micro-batch's), normalised over its own rows, is multiplied by a factor
  (:func:`asyncrl.learner.training.micro_batches.loss_scales`) that makes the average equal the
  one-process gradient of the whole batch, for every ``loss_agg_mode`` of
  :func:`asyncrl.objectives.aggregation.agg_loss` (token-mean: ``W * n_local / N_global`` tokens;
  seq-mean modes: the same with non-empty rows; seq-mean-token-sum-norm: ``W``, its divisor being
  a constant); the global ``N`` and the number of micro-batches every rank runs come from here.
  :func:`gradient_sync` holds the gradients' reduction back until the last micro-batch.
- :func:`full_state_dict`: the full, unsharded parameters on every rank, on the CPU (for
  publishing weights and for checkpoints); :func:`reduce_stats` and :func:`gather_rows` combine
  per-rank metrics and per-row tensors. Metrics cross ranks as msgpack bytes, never pickle.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import msgpack
import torch
import torch.distributed as dist

from ...wire.codec import WireError, decode, encode
from ...wire.messages import GROUP_KINDS, Body
from ...wire.tensors import check_layout, pack, plan_layout, unpack

if TYPE_CHECKING:
    from .batch import TrainBatch
    from .micro_batches import MicroPlan, Totals

MODES = ("none", "ddp", "fsdp2")
_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_world(env: dict | None = None) -> int:
    """WORLD_SIZE as set by ``torchrun`` / ``accelerate launch`` / ``asyncrl run --learner-procs``;
    1 when no launcher set it."""
    env = os.environ if env is None else env
    try:
        return max(int(env.get("WORLD_SIZE", "1")), 1)
    except ValueError:
        raise ValueError(f"WORLD_SIZE={env['WORLD_SIZE']!r} is not a whole number of processes") from None


def resolve_mode(configured: str, world: int, env: dict | None = None) -> str:
    """The mode a learner of ``world`` processes runs: 'none' for one process (whatever the config
    says); otherwise ``train.distributed`` when set, else what the accelerate config chose
    (``accelerate launch`` with ``distributed_type: FSDP`` sets ACCELERATE_USE_FSDP=true: 'fsdp2';
    anything else: 'ddp')."""
    env = os.environ if env is None else env
    if configured not in MODES:
        raise ValueError(f"train.distributed={configured!r}; expected one of {', '.join(MODES)}")
    if world <= 1:
        return "none"
    if configured != "none":
        return configured
    return "fsdp2" if env.get("ACCELERATE_USE_FSDP", "").lower() == "true" else "ddp"


def active() -> bool:
    """True when a process group with more than one rank is up."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def init_from_env(timeout_s: float = 60.0, curve_dir: str | None = None) -> tuple[int, int]:
    """Join the process group named by the launcher's environment; returns ``(rank, world_size)``.

    gloo on CPU, nccl (and ``cuda:LOCAL_RANK``) when CUDA is available. Every collective is bounded
    by ``timeout_s``: a rank that died makes the others raise instead of waiting for ever. gloo
    connects the ranks over the interface that reaches MASTER_ADDR (``GLOO_SOCKET_IFNAME``, unless
    set: ``lo`` for a group on one host, where gloo would otherwise take the interface the host name
    resolves to). ``curve_dir``: with a non-loopback MASTER_ADDR, the CURVE keys of the group's store
    (rank 0: the learner's server keys; the other ranks: a bundle made for them), see
    :func:`_group_store`."""
    missing = [name for name in _ENV if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"distributed.init_from_env: {', '.join(missing)} not set; start under torchrun "
            "or accelerate launch (they set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)"
        )
    if timeout_s <= 0:
        raise ValueError(f"distributed.init_from_env: timeout_s={timeout_s}; expected a positive number of seconds")
    if not dist.is_initialized():
        backend = "gloo"
        if torch.cuda.is_available():
            backend = "nccl"
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if backend == "gloo" and not os.environ.get("GLOO_SOCKET_IFNAME"):
            iface = route_interface(os.environ["MASTER_ADDR"])
            if iface:
                os.environ["GLOO_SOCKET_IFNAME"] = iface
        timeout = datetime.timedelta(seconds=timeout_s)
        store = _group_store(timeout_s, curve_dir)
        if store is None:  # torchrun / accelerate: their own rendezvous store (MASTER_ADDR:MASTER_PORT)
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(
                backend,
                store=store,
                rank=int(os.environ["RANK"]),
                world_size=int(os.environ["WORLD_SIZE"]),
                timeout=timeout,
            )
    return dist.get_rank(), dist.get_world_size()


_STORE: list = []  # this process's rendezvous store objects, alive as long as the group


def _group_store(timeout_s: float, curve_dir: str | None = None):
    """With ``ASYNCRL_STORE_SECRET`` set (``asyncrl run --learner-procs`` sets it; ranks started by
    hand on several hosts are given the same one), the group meets at an authenticated, bounded
    :class:`asyncrl.weights.rendezvous.StoreServer` that rank 0 binds on MASTER_ADDR:MASTER_PORT alone
    (a plain ``TCPStore`` listens on every interface and takes anyone's keys); without it, None: the
    launcher's own store. A non-loopback MASTER_ADDR (ranks on several hosts) also needs CURVE:
    rank 0 serves with the server keys in ``curve_dir`` (its ``wire.curve_dir``) and admits the keys
    in their ``authorized/``; every other rank connects with the bundle in its own ``curve_dir``."""
    secret = os.environ.get("ASYNCRL_STORE_SECRET")
    if not secret:
        return None
    from ...weights.rendezvous import StoreClient, StoreServer
    from ...wire.sockets import is_loopback

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    rank = int(os.environ["RANK"])
    if is_loopback(host):
        curve_dir = None
    elif not curve_dir:
        raise RuntimeError(
            f"MASTER_ADDR={host} is not a loopback address: the learner group's store there is a CURVE "
            f"server, and rank {rank} has no keys; set wire.curve_dir (rank 0: the learner's server keys; "
            f"each other rank: a bundle made for it by `asyncrl keys`)"
        )
    if rank == 0:
        server = StoreServer(host, port, secret=secret, curve_dir=curve_dir)
        _STORE.append(server)
        store = server.local(timeout_s)
    else:
        store = StoreClient(host, port, secret, timeout_s=timeout_s, curve_dir=curve_dir)
    _STORE.append(store)
    return store


def route_interface(address: str) -> str | None:
    """The name of this host's network interface that holds the local address a connection to
    ``address`` would leave from (``lo`` for a loopback one), or None where that cannot be told
    (no route, or no IPv4 interface holds the address)."""
    import fcntl
    import socket
    import struct

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(address), 9))  # (UDP: nothing is sent)
            local = probe.getsockname()[0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:  # SIOCGIFADDR: the interface's IPv4 address
                    raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                except OSError:
                    continue
                if socket.inet_ntoa(raw[20:24]) == local:
                    return name
    except OSError:
        return None
    return None


def leave_group() -> None:
    """Destroy this process's process groups on an orderly way out (each rank, after the last
    collective). Left to the interpreter's exit, gloo's worker threads can be torn down after the
    interpreter and the process aborts ("terminate called without an active exception", exit -6;
    pytorch/pytorch#190489): a follower that had trained and stopped cleanly once exited that way."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    while _STORE:
        store = _STORE.pop()
        if hasattr(store, "close"):
            store.close()


def _device() -> torch.device:
    """The device collectives run on: the current CUDA device under nccl, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: modules of the classes a Hugging Face model names in
    ``_no_split_modules`` (its decoder layers), outermost first."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def wrap(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """``model`` under ``mode``: 'none' (unchanged), 'ddp' (a DistributedDataParallel wrapper) or
    'fsdp2' (sharded in place by ``fully_shard``: each decoder layer, then the root, which keeps
    tied embeddings together). Needs :func:`init_from_env` first for 'ddp' and 'fsdp2'."""
    if mode not in MODES:
        raise ValueError(f"distributed.wrap: mode {mode!r} unknown; expected one of {', '.join(MODES)}")
    if mode == "none":
        return model
    if not dist.is_initialized():
        raise RuntimeError(f"distributed.wrap: mode {mode!r} needs a process group; call init_from_env first")
    if mode == "ddp":
        dev = _device()
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev] if dev.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(_device().type, (dist.get_world_size(),))
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under a DDP wrapper (FSDP2 shards in place, so there it is ``model`` itself)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def shard_rows(n_rows: int, rank: int, world: int) -> slice:
    """Rank ``rank``'s contiguous rows of ``n_rows``: sizes differ by at most one, the first
    ``n_rows % world`` ranks taking one more. Every rank must get a row (a rank with none would
    have nothing to run forward and backward on), so ``n_rows >= world``."""
    if not 0 <= rank < world:
        raise ValueError(f"distributed.shard_rows: rank {rank} outside a world of {world}")
    if n_rows < world:
        raise ValueError(
            f"distributed.shard_rows: {n_rows} rows cannot be split over {world} ranks; "
            f"expected at least one row per rank (a larger batch or fewer mini_batches)"
        )
    base, extra = divmod(n_rows, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def step_totals(mask: torch.Tensor, parts: int) -> tuple["Totals", int]:
    """The mini-batch's normalisers over every rank's rows (``mask[b, T]``: this rank's), and the
    most micro-batches (``parts``: this rank's) any rank runs, which every rank must run (a rank
    with fewer runs empty ones: under FSDP2 each forward is a collective). One process: its own.
    Two all-reduces of a few numbers."""
    from .micro_batches import Totals

    local = Totals.of(mask)
    if not active():
        return local, parts
    dev = _device()
    sums = torch.tensor([local.tokens, local.seqs], dtype=torch.float64, device=dev)
    dist.all_reduce(sums)
    most = torch.tensor([parts], dtype=torch.long, device=dev)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return Totals(float(sums[0]), float(sums[1]), dist.get_world_size()), int(most)


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, sync: bool):
    """Within: backward passes accumulate gradients without reducing them over ranks unless
    ``sync`` (the last micro-batch's): DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync``.
    One process, or ``sync``: nothing changes."""
    if sync or not active():
        yield
    elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


@dataclass
class Part:
    """One micro-batch of a mini-batch, as :func:`accumulate` hands it out."""

    batch: "TrainBatch"  # its rows
    index: list[int]  # their places in the mini-batch
    real: bool  # False: an empty part that a rank with fewer micro-batches runs; its loss must count 0
    totals: "Totals"  # the mini-batch's normalisers over every rank (micro_batches.loss_scales)


def accumulate(model: torch.nn.Module, mb: "TrainBatch", plan: "MicroPlan") -> Iterator[Part]:
    """The one micro-batch loop of the policy and the critic: each part of ``plan`` handed out inside
    :func:`gradient_sync`, so that the caller's forward and backward accumulate gradients and the
    last part's reduces them over the ranks. Every rank runs as many parts as the rank with the most
    (:func:`step_totals`); the extra ones are ``real=False`` (the caller multiplies their loss by 0)."""
    totals, n_parts = step_totals(mb.response_mask, len(plan.micro_batches))
    for i in range(n_parts):
        real = i < len(plan.micro_batches)
        index = plan.micro_batches[i] if real else [0]
        with gradient_sync(model, sync=i == n_parts - 1):
            yield Part(mb.take(index), index, real, totals)


def all_true(flag: bool) -> bool:
    """True only when ``flag`` holds on every rank (so that every rank takes the same branch)."""
    if not active():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item() > 0)


def _all_gather_bytes(payload: bytes) -> list[bytes]:
    """Every rank's ``payload``, in rank order."""
    dev, w = _device(), dist.get_world_size()
    size = torch.tensor([len(payload)], dtype=torch.long, device=dev)
    sizes = [torch.zeros_like(size) for _ in range(w)]
    dist.all_gather(sizes, size)
    longest = max(int(s) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8, device=dev)
    buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(dev)
    bufs = [torch.empty_like(buf) for _ in range(w)]
    dist.all_gather(bufs, buf)
    return [b[: int(s)].cpu().numpy().tobytes() for b, s in zip(bufs, sizes)]


def reduce_stats(stats: dict[str, float], weight: float, mean_keys: frozenset[str] = frozenset()) -> dict[str, float]:
    """Combine each rank's metrics into the whole batch's (the same dict on every rank), by
    :func:`micro_batches.combine_stats` with each rank's ``weight`` (its loss tokens) and the plain
    mean for ``mean_keys`` (figures already on the global scale, e.g. a scaled loss). Without a
    process group, ``stats`` unchanged."""
    if not active():
        return stats
    from .micro_batches import combine_stats

    parts = [msgpack.unpackb(b) for b in _all_gather_bytes(msgpack.packb({"w": float(weight), "s": stats}))]
    return combine_stats([(p["s"], p["w"]) for p in parts], sum_keys=frozenset(), mean_keys=mean_keys)


def gather_rows(local: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's rows ``[b_r, ...]`` in rank order (the rows :func:`shard_rows`
    gave them), on the CPU. Trailing shapes must agree. Without a process group, ``local``."""
    if not active():
        return local.cpu()
    dev, w = _device(), dist.get_world_size()
    n = torch.tensor([local.shape[0]], dtype=torch.long, device=dev)
    counts = [torch.zeros_like(n) for _ in range(w)]
    dist.all_gather(counts, n)
    most = max(int(c) for c in counts)
    padded = torch.zeros((most, *local.shape[1:]), dtype=local.dtype, device=dev)
    padded[: local.shape[0]] = local.detach().to(dev)
    parts = [torch.empty_like(padded) for _ in range(w)]
    dist.all_gather(parts, padded)
    return torch.cat([p[: int(c)] for p, c in zip(parts, counts)]).cpu()


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full parameters and buffers as CPU tensors, named as in the unwrapped model (no DDP
    ``module.`` prefix): what weight publishing and checkpoints need. Under a process group this is
    a collective (every rank calls it) and, with ``cpu_offload``, only rank 0 receives the tensors:
    the other ranks get an empty dict, so no rank but the one that publishes holds a full copy."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    inner = unwrap(model)
    if not dist.is_initialized():
        return {k: v.detach().cpu() for k, v in inner.state_dict().items()}
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: v.detach().cpu() for k, v in get_model_state_dict(inner, options=opts).items()}


def full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """A parameter's full gradient on the CPU (gathered from shards under FSDP2: a collective)."""
    g = param.grad
    if g is None:
        return None
    return (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().cpu()


# -- rank 0 -> the other ranks: what to do next -------------------------------------------------


class Control:
    """Rank 0 tells the other ranks what to do next (:meth:`send`), they wait for it (:meth:`recv`).

    A gloo group of its own (the training group may be nccl), with a long timeout: a follower may
    wait for minutes while rank 0 waits for actors or evaluates. A rank 0 that dies closes its
    connections, which ends a follower's wait with an error at once."""

    def __init__(self, idle_timeout_s: float = 7 * 24 * 3600.0):
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=idle_timeout_s))

    def send(self, body: Body, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Announce ``body`` (a ``group.*`` message) and, for a step, its tensors: the body through the
        wire codec, then the tensors packed into one byte bucket at ``body.layout``."""
        bucket = torch.empty(0, dtype=torch.uint8)
        if tensors:
            tensors = {k: v.detach().cpu() for k, v in tensors.items()}
            body.layout, size = plan_layout(tensors)
            bucket = torch.empty(size, dtype=torch.uint8)
            pack(bucket, body.layout, tensors)
        head = encode(body.KIND, body)[0]
        sizes = torch.tensor([len(head), bucket.numel()], dtype=torch.long)
        dist.broadcast(sizes, src=0, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(head), dtype=torch.uint8), src=0, group=self.group)
        if bucket.numel():
            dist.broadcast(bucket, src=0, group=self.group)

    def recv(self) -> tuple[Body, dict[str, torch.Tensor]]:
        """The next announcement and its tensors (views of a fresh bucket). A message that is not a
        ``group.*`` body, or whose layout does not fit its bucket, raises WireError."""
        sizes = torch.zeros(2, dtype=torch.long)
        dist.broadcast(sizes, src=0, group=self.group)
        head_n, bucket_n = (int(n) for n in sizes.tolist())
        head = torch.empty(head_n, dtype=torch.uint8)
        dist.broadcast(head, src=0, group=self.group)
        bucket = torch.empty(bucket_n, dtype=torch.uint8)
        if bucket_n:
            dist.broadcast(bucket, src=0, group=self.group)
        body = decode([head.numpy().tobytes()], kinds=GROUP_KINDS).body
        layout = getattr(body, "layout", [])
        problem = check_layout(layout, bucket_n)
        if problem:
            raise WireError(f"message {body.KIND!r}: {problem}", reason="arrays")
        return body, unpack(bucket, layout)


# -- checkpoints: one format whatever the number of processes -------------------------------------


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's full state keyed by parameter name (not index), on the CPU: the same format
    from 1 process, DDP or FSDP2 (gathered from shards: a collective; only rank 0 receives it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def by_name(optim_state: dict, names: list[str]) -> dict:
    """An optimizer state dict keyed by parameter name. ``optim_state`` is either that already or
    ``torch.optim.Optimizer.state_dict()``'s (keyed by the index of each parameter in
    ``model.parameters()``, whose names are ``names`` in order: a checkpoint from before issue 15)."""
    groups = optim_state.get("param_groups", [])
    if all(isinstance(p, str) for g in groups for p in g.get("params", [])):
        return optim_state

    def name(i):
        if not 0 <= int(i) < len(names):
            raise ValueError(f"optimizer state refers to parameter {i}; the model has {len(names)}")
        return names[int(i)]

    return {
        "state": {name(i): v for i, v in optim_state.get("state", {}).items()},
        "param_groups": [{**g, "params": [name(i) for i in g["params"]]} for g in groups],
    }


def load_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optim_state: dict) -> None:
    """Load full (unsharded, by-name) model and optimizer states into ``model``/``optimizer``, in any
    mode. Under a process group this is a collective: rank 0 passes the states, the other ranks
    empty dicts, and each rank receives its part (its shards under FSDP2)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    group = dist.is_initialized() and dist.get_world_size() > 1
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=group, strict=False)
    set_model_state_dict(model, model_state, options=opts)
    set_optimizer_state_dict(model, optimizer, optim_state, options=opts)
