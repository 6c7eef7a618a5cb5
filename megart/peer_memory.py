"""Memory the ranks of a tensor-parallel group share: named exchange buffers, each rank's own plus views of
its peers' (written over NVLink), and the event counters peers count up. One interface, two engines:

* HostPeers (CPU, every rank in one process): a peer's buffer is the peer's own tensor, so the joint
  emulator (megart.emulate.ranks) moves data exactly as the GPUs would.
* SymmetricPeers (GPUs, one process per rank, torch.distributed): one allocation of torch's symmetric
  memory (torch.distributed._symmetric_memory: empty + rendezvous) holds every buffer; a peer's buffer is
  get_buffer(peer) of it. NVLink multicast is never used (docs/TP.md).

Usage, in the same order on every rank: declare(name, numel, dtype) for each buffer, allocate(), then
local(name) / remote(rank, name); event_buffer(n) once the schedule is known."""
from __future__ import annotations

import os

import torch

from .errors import DeviceError, GraphError

# NVLink multicast stays off on shared machines (it can take the host's GPUs out of service).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _align(n: int) -> int:
    return -(-n // 256) * 256


class _Layout:
    def __init__(self, rank: int, world: int):
        if not (isinstance(world, int) and world >= 2 and 0 <= rank < world):
            raise GraphError(f"a tensor-parallel group needs world >= 2 and 0 <= rank < world, got rank {rank} "
                             f"of {world}")
        self.rank, self.world = rank, world
        self.regions: dict = {}           # name -> (byte offset, numel, dtype)
        self.nbytes = 0
        self.allocated = False

    def declare(self, name: str, numel: int, dtype: torch.dtype) -> None:
        if self.allocated:
            raise GraphError(f"peer buffer {name!r} declared after allocate()")
        if name in self.regions:
            raise GraphError(f"peer buffer {name!r} is declared twice")
        self.regions[name] = (self.nbytes, int(numel), dtype)
        self.nbytes = _align(self.nbytes + int(numel) * torch.empty(0, dtype=dtype).element_size())

    def _region(self, name: str):
        if not self.allocated:
            raise GraphError("allocate() the peer buffers before asking for one")
        if name not in self.regions:
            raise GraphError(f"no peer buffer named {name!r}; declared: {sorted(self.regions)[:8]}")
        return self.regions[name]

    def _check_rank(self, q: int) -> None:
        if not (0 <= q < self.world) or q == self.rank:
            raise GraphError(f"rank {q} is not a peer of rank {self.rank} (world {self.world})")


class HostPeers:
    """All ranks of a group in one process (CPU emulation): rank(r) gives rank r's view. A buffer is made
    on first use, by its owner or by a peer that builds first (same name, size and dtype, or an error)."""

    def __init__(self, world: int):
        self.world = world
        self._ranks = {}
        self._bufs = {}              # (rank, name) -> tensor

    def rank(self, r: int) -> "HostRankPeers":
        if r not in self._ranks:
            self._ranks[r] = HostRankPeers(self, r)
        return self._ranks[r]

    def buffer(self, r: int, name: str, numel: int, dtype) -> torch.Tensor:
        t = self._bufs.get((r, name))
        if t is None:
            t = self._bufs[(r, name)] = torch.zeros(numel, dtype=dtype)
        elif t.numel() != numel or t.dtype != dtype:
            raise GraphError(f"peer buffer {name!r} of rank {r} is {t.numel()} x {t.dtype} there, {numel} x {dtype} "
                             "here: ranks must declare the same buffers")
        return t


class HostRankPeers(_Layout):
    def __init__(self, group: HostPeers, rank: int):
        super().__init__(rank, group.world)
        self.group = group

    def allocate(self) -> None:
        self.allocated = True

    def local(self, name: str) -> torch.Tensor:
        _, numel, dt = self._region(name)
        return self.group.buffer(self.rank, name, numel, dt)

    def remote(self, q: int, name: str) -> torch.Tensor:
        self._check_rank(q)
        _, numel, dt = self._region(name)
        return self.group.buffer(q, name, numel, dt)

    def event_buffer(self, n: int, device) -> tuple:
        raise DeviceError("host peers have no device event counters: CPU ranks run in megart.emulate.ranks")

    def barrier(self) -> None:
        pass


class SymmetricPeers(_Layout):
    """One rank of a group of GPU processes (torch.distributed initialised, NCCL backend)."""

    def __init__(self, group=None, device=None):
        import torch.distributed as dist
        for k, v in NO_MULTICAST.items():
            if os.environ.get(k) != v:
                raise DeviceError(f"{k} must be {v} before the process group starts (NVLink multicast stays off); "
                                  "scripts/tp_run.sh sets it")
        if not dist.is_initialized():
            raise DeviceError("SymmetricPeers needs torch.distributed initialised (torchrun, NCCL backend)")
        self.dist, self.group = dist, group or dist.group.WORLD
        super().__init__(dist.get_rank(self.group), dist.get_world_size(self.group))
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self._handles = []           # keep every symmetric allocation and its handle alive

    def _symmetric(self, nbytes: int):
        import warnings
        import torch.distributed._symmetric_memory as symm_mem
        if hasattr(symm_mem, "enable_symm_mem_for_group"):      # needed by older torch, a no-op in newer
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                symm_mem.enable_symm_mem_for_group(self.group.group_name)
        buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
        buf.zero_()
        hdl = symm_mem.rendezvous(buf, self.group.group_name)
        self._handles.append((buf, hdl))
        return buf, hdl

    def allocate(self) -> None:
        self._buf, self._hdl = self._symmetric(max(self.nbytes, 256))
        torch.cuda.synchronize(self.device)
        self.dist.barrier(self.group)
        self.allocated = True

    def _view(self, raw: torch.Tensor, name: str) -> torch.Tensor:
        off, numel, dt = self._region(name)
        size = torch.empty(0, dtype=dt).element_size()
        return raw[off:off + numel * size].view(dt)

    def local(self, name: str) -> torch.Tensor:
        return self._view(self._buf, name)

    def remote(self, q: int, name: str) -> torch.Tensor:
        self._check_rank(q)
        raw = self._hdl.get_buffer(q, (self._buf.numel(),), torch.uint8, 0)
        return self._view(raw, name)

    def event_buffer(self, n: int, device) -> tuple:
        """(this rank's int32 counters, [address of rank q's counters as mapped here]): sized to the
        largest rank's event count, zeroed on every rank before any kernel runs."""
        t = torch.tensor([n], dtype=torch.int64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.group)
        buf, hdl = self._symmetric(4 * max(int(t.item()), 1))
        torch.cuda.synchronize(self.device)
        self.dist.barrier(self.group)
        return buf.view(torch.int32), [int(p) for p in hdl.buffer_ptrs]

    def barrier(self) -> None:
        torch.cuda.synchronize(self.device)
        self.dist.barrier(self.group)


def init_process_group() -> tuple:
    """Start torch.distributed for a torchrun-launched rank (NCCL backend, this rank's GPU = LOCAL_RANK), with
    NVLink multicast off; returns (rank, world, device). Idempotent."""
    import torch.distributed as dist
    for k, v in NO_MULTICAST.items():
        if os.environ.setdefault(k, v) != v:
            raise DeviceError(f"{k}={os.environ[k]!r}: NVLink multicast must stay off ({k}={v})")
    if "LOCAL_RANK" not in os.environ:
        raise DeviceError("not launched by torchrun: run scripts/tp_run.sh (torchrun --nproc-per-node N)")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=device)
    return dist.get_rank(), dist.get_world_size(), device
