"""Data-parallel training under ``torchrun``, on ``torch.distributed`` alone.

    World        this process's place among the ranks (rank, world size, local rank) and the few
                 collectives the loop needs: a mean of device values, an OR of device flags, an
                 agreement on host flags, a broadcast of a path. With one process every method is
                 the identity and nothing is initialised, so a single-process run is unchanged.
    init_world   read torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) and
                 join the default process group: NCCL for CUDA, gloo for CPU, after check_store.
    check_store  refuse a rendezvous store this user did not start (TCPStore has no login: whoever
                 runs it steers the ranks, and what they exchange is unpickled).

What makes N ranks train like one process with the same config (docs/pretrain.md, "DDP"):
``train.batch_size`` is the global micro-batch and each rank takes its equal slice of every batch
(model/data.py); DistributedDataParallel averages gradients, which with per-rank mean losses over
equal slices is the gradient of the global mean; the losses every decision reads (divergence, the
spike detector, vetoes) are all-reduced the same way, and stops and preemption are agreed on
before any rank acts on them, so every rank takes every branch at the same step.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from model.typed_config import UserError

TIMEOUT = datetime.timedelta(minutes=10)
"""How long a collective waits for a missing rank before it raises (instead of hanging for good)."""


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs, writes checkpoints and holds the run lock."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @classmethod
    def current(cls) -> World:
        """The world of the initialised default process group, or a single process."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        return cls(
            dist.get_rank(),
            dist.get_world_size(),
            int(os.environ.get("LOCAL_RANK", 0)),
            int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        )

    def device(self, device: torch.device) -> torch.device:
        """CUDA ranks on one node take one GPU each (LOCAL_RANK); CPU ranks share the CPU."""
        if device.type == "cuda" and self.distributed:
            return torch.device("cuda", self.local_rank)
        return device

    def mean_(self, tensor: torch.Tensor) -> torch.Tensor:
        """In place: the mean over ranks (on the device, no host sync with NCCL)."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            tensor /= self.size
        return tensor

    def any(self, flag: torch.Tensor) -> torch.Tensor:
        """Bool flags (elementwise) that hold on every rank where they hold on one."""
        if not self.distributed:
            return flag
        as_int = flag.to(torch.int32)
        dist.all_reduce(as_int, op=dist.ReduceOp.MAX)
        return as_int.bool()

    def agree(self, *flags: bool) -> tuple[bool, ...]:
        """Host flags ORed over ranks, through a CPU (gloo) group: no device sync under NCCL."""
        if not self.distributed:
            return flags
        values = torch.tensor(flags, dtype=torch.int32)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=_host_group())
        return tuple(bool(v) for v in values.tolist())

    def first_of(self, value: Any) -> Any:
        """The first non-None ``value`` in rank order (a stop's reason; rare, so pickled)."""
        if not self.distributed:
            return value
        values: list[Any] = [None] * self.size
        dist.all_gather_object(values, value, group=_host_group())
        return next((v for v in values if v is not None), None)

    def from_main(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (which checkpoint to resume)."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=_host_group())
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=_host_group())


SINGLE = World()
"""One process, no process group: every collective is the identity."""

_HOST_GROUP: list[Any] = []  # the gloo group for host values, made once per process group


def _host_group() -> Any:
    """The default group when it is gloo; otherwise (NCCL) a gloo group over the same ranks."""
    if dist.get_backend() == "gloo":
        return None
    if not _HOST_GROUP:
        _HOST_GROUP.append(dist.new_group(backend="gloo", timeout=TIMEOUT))
    return _HOST_GROUP[0]


def init_world(device_name: str) -> World:
    """Join torchrun's process group when launched by it (WORLD_SIZE > 1); a single process
    otherwise. ``device_name`` is ``train.device`` as resolved (``cpu`` or ``cuda``)."""
    if int(os.environ.get("WORLD_SIZE", 1)) <= 1:
        return World()
    check_store(os.environ)
    cuda = device_name.startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend="nccl" if cuda else "gloo", timeout=TIMEOUT)
    return World.current()


TRUSTED_STORE_ENV = "SPIKELAB_TRUSTED_STORE"
"""``MASTER_ADDR:MASTER_PORT`` of a store on another machine that the user vouches for (the head
node of their own multi-node run): nothing on this machine can tell who runs a remote store."""

FIX = (
    "on one node launch with `torchrun --standalone --nnodes 1 --nproc-per-node N -m model.train ...` "
    "(torchrun then hosts its own store on a port the kernel picks); across nodes follow docs/pretrain.md, "
    '"Data-parallel pretraining (torchrun DDP)"'
)


def check_store(environ: Mapping[str, str]) -> None:
    """Refuse (UserError) to join the store at MASTER_ADDR:MASTER_PORT unless this user runs it.

    torch's TCPStore has no login and no TLS, and the ranks trust it completely: it tells each rank
    where its peers are, and the object collectives unpickle what arrives. Another local user who
    listens on the port first gets every rank as a client (torchrun's c10d rendezvous even falls back
    to being a client when its own bind fails). So on this machine the socket listening on the port
    (``/proc/net/tcp``, ``tcp6``) must be this uid's; a store elsewhere cannot be checked and is
    joined only when :data:`TRUSTED_STORE_ENV` names it. A rank that hosts the store itself (rank 0
    without torchrun's agent store) fails to bind rather than connect, so it needs only no other
    listener; the other ranks wait, as the store's client would, for the store to appear."""
    host, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    if not host or not port:
        return  # init_process_group names what is missing
    hosts_itself = environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and environ.get("RANK") == "0"
    local = is_this_machine(host)
    owners = local_listeners(int(port)) if local else set()
    deadline = time.monotonic() + TIMEOUT.total_seconds()
    while local and not owners and not hosts_itself and time.monotonic() < deadline:
        time.sleep(0.1)
        owners = local_listeners(int(port))
    refusal = store_refusal(
        f"{host}:{port}",
        local=local,
        owners=owners,
        uid=os.getuid(),
        trusted=environ.get(TRUSTED_STORE_ENV),
        hosts_itself=hosts_itself,
    )
    if refusal:
        raise UserError(refusal)


def store_refusal(
    store: str, *, local: bool, owners: set[int], uid: int, trusted: str | None, hosts_itself: bool
) -> str | None:
    """Why this process must not join ``store`` (``host:port``), or None: ``local``, whether it is on
    this machine; ``owners``, the uids listening on its port here; ``trusted``, the user's
    :data:`TRUSTED_STORE_ENV`; ``hosts_itself``, whether this process is to start it."""
    refuse = f"refusing to join the rendezvous store {store}"
    if not local:
        if trusted == store:
            return None
        return (
            f"{refuse}: it is on another machine, where nothing here can tell who runs it; if it is the head "
            f"node of your own multi-node run, set {TRUSTED_STORE_ENV}={store}; {FIX}"
        )
    if others := owners - {uid}:
        uids = ", ".join(map(str, sorted(others)))
        return f"{refuse}: the socket listening there belongs to uid {uids}, not to you (uid {uid}); {FIX}"
    if not owners and not hosts_itself:
        return f"{refuse}: nothing of yours listens there (waited {TIMEOUT.total_seconds():.0f} s); {FIX}"
    return None


def local_listeners(port: int, tables: tuple[str, ...] = ("/proc/net/tcp", "/proc/net/tcp6")) -> set[int]:
    """The uids of the sockets listening on TCP ``port`` on this machine (any address)."""
    uids: set[int] = set()
    for table in tables:
        try:
            with open(table) as f:
                uids |= listening_uids(f.read(), port)
        except FileNotFoundError:  # no IPv6
            continue
    return uids


def listening_uids(table: str, port: int) -> set[int]:
    """The uids in a ``/proc/net/tcp`` or ``tcp6`` table whose sockets listen (state 0A) on ``port``."""
    uids = set()
    for row in table.splitlines()[1:]:
        fields = row.split()  # sl local_address rem_address st queues timer retransmits uid ...
        if len(fields) > 7 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
            uids.add(int(fields[7]))
    return uids


def is_this_machine(host: str) -> bool:
    """Whether every address ``host`` resolves to is this machine's (one it can bind to)."""
    try:
        addresses = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False  # unresolvable: not checkable here
    return all(_can_bind(family, address) for family, _, _, _, address in addresses)


def _can_bind(family: int, address: tuple[Any, ...]) -> bool:
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((address[0], 0, *address[2:]))
        return True
    except OSError:
        return False


def leave_world() -> None:
    if dist.is_available() and dist.is_initialized():
        _HOST_GROUP.clear()
        dist.destroy_process_group()


def wrap(model: torch.nn.Module, world: World) -> torch.nn.Module:
    """``model`` in DistributedDataParallel when there is more than one rank (the GPT has no
    buffers, so DDP exchanges gradients only)."""
    if not world.distributed:
        return model
    device_ids = [world.local_rank] if next(model.parameters()).is_cuda else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
