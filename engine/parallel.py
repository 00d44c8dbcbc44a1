"""The tensor-parallel group: the N processes that run one model together (docs/design.md, "Parallelism").

Contract:

- Ranks `0 .. N-1`, one process each, all on this host. Rank 0 is the engine (scheduler,
  sampling, the only rank a caller talks to); ranks 1 .. N-1 are its followers
  (`engine/tp_worker.py`). On CUDA rank `r` uses device `cuda:<base + r>`; on CPU every rank uses
  the CPU.
- `all_reduce(tensor)`: in-place sum over the ranks, on the tensor's device (gloo on CPU, NCCL on
  CUDA). Every rank calls the same collectives in the same order with the same shapes and dtypes;
  the model's row-parallel layers and the runner's setup do.
- `gather(tensor)` (every rank's, to rank 0) and `scatter(out, parts)` (rank 0's `parts[r]` into
  rank r's `out`): on the data group, like `all_reduce`; the runner moves KV heads with them
  (rank 0 is a tensor-parallel worker's KV transfer endpoint).
- `broadcast_object(obj)`: rank 0 passes a picklable object; every rank gets it back (the others
  pass nothing). It always goes through a gloo group on the CPU (small control messages: a step's
  token ids, positions and block tables), whose timeout is long (`CONTROL_TIMEOUT`), so a follower
  waits for the next step as long as the engine idles.
- Setup: rank 0 calls `host_store()`, which listens on 127.0.0.1 on a port the OS picks (never a
  fixed one), and hands its `address` to the followers; then every rank calls
  `TensorParallelGroup(rank, world_size, device, address, store=...)`, which returns once all
  ranks are connected. Rank 0 may pass `peers_alive` (called while it waits) to fail at once when
  a follower died before joining.
- No global torch.distributed state: the groups are standalone c10d backends over a prefix of one
  store, so an engine with TP coexists with user code that calls `torch.distributed`, and two
  engines in one process each have their own group. `close()` releases them.
- A rank that dies makes the others' next collective raise at once on gloo ("Connection closed by
  peer"); the model runner then treats the group as broken (`engine/model_runner.py`). NCCL does
  not notice a dead peer that fast: the others' collective waits until `DATA_TIMEOUT`, when NCCL's
  watchdog ends the process (not yet checked on GPUs).
- TP=1 never builds a group: the model and the runner take `tp=None` and run the single-process
  code, with no collective and no extra process.

Messages are pickled: the store and the gloo sockets listen on 127.0.0.1 only, and only rank 0
sends objects.
"""
from __future__ import annotations

import datetime
import pickle
import time
from typing import Callable

import torch
import torch.distributed as dist

HOST = "127.0.0.1"
# How long a follower may wait for rank 0's next message (an idle server sends none).
CONTROL_TIMEOUT = datetime.timedelta(days=365)
# A collective of the model (or of the runner's setup, while the slowest rank loads its weights);
# on gloo a dead peer fails it at once anyway (its sockets close), this bounds a hung one.
DATA_TIMEOUT = datetime.timedelta(minutes=30)
STARTUP_TIMEOUT_S = 300.0
# broadcast_object sends messages up to this size in one broadcast (a decode step's), bigger ones
# in a second.
_INLINE_BYTES = 16 * 1024
_LENGTH_BYTES = 8


def host_store(world_size: int) -> tuple[dist.TCPStore, str]:
    """Rank 0: the rendezvous store on 127.0.0.1 and a free port the OS picks; returns the store
    and its address (`host:port`) for the followers."""
    store = dist.TCPStore(HOST, 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
    return store, f"{HOST}:{store.port}"


class TensorParallelGroup:
    """One rank's view of the group (see the module docstring for the contract)."""

    def __init__(self, rank: int, world_size: int, device: torch.device | str, address: str,
                 store: dist.Store | None = None, peers_alive: Callable[[], None] | None = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.address = address
        if store is None:
            host, _, port = address.rpartition(":")
            store = dist.TCPStore(host, int(port), world_size, is_master=False,
                                  timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
        self._store = store
        store.set(f"joined/{rank}", "1")
        if rank == 0:
            self._wait_for_peers(peers_alive)
        # Control messages: gloo on the CPU, whatever the device.
        self._control = _gloo(dist.PrefixStore("control/", store), rank, world_size, CONTROL_TIMEOUT)
        if self.device.type == "cuda":
            self._data = _nccl(dist.PrefixStore("data/", store), rank, world_size, self.device, DATA_TIMEOUT)
        else:
            self._data = _gloo(dist.PrefixStore("data/", store), rank, world_size, DATA_TIMEOUT)
        self._header = torch.zeros(_LENGTH_BYTES + _INLINE_BYTES, dtype=torch.uint8)

    def _wait_for_peers(self, peers_alive: Callable[[], None] | None) -> None:
        """Until every rank wrote its `joined/<rank>` key; `peers_alive()` raises if one died."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        keys = [f"joined/{r}" for r in range(1, self.world_size)]
        while not self._store.check(keys):
            if peers_alive is not None:
                peers_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor parallel: not every rank of {self.world_size} joined within "
                                   f"{STARTUP_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        """In place over every rank (sum by default); returns `tensor`."""
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self._data.allreduce([tensor], options).wait()
        return tensor

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Rank 0 gets every rank's `tensor` (same shape and dtype on each), in rank order; the
        others get None."""
        tensor = tensor.contiguous()
        outputs = [[torch.empty_like(tensor) for _ in range(self.world_size)]] if self.rank == 0 else []
        options = dist.GatherOptions()
        options.rootRank = 0
        self._data.gather(outputs, [tensor], options).wait()
        return outputs[0] if self.rank == 0 else None

    def scatter(self, out: torch.Tensor, parts: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Every rank's `out` = rank 0's `parts[rank]` (rank 0 passes one tensor per rank, each
        of `out`'s shape and dtype)."""
        options = dist.ScatterOptions()
        options.rootRank = 0
        inputs = [[part.contiguous() for part in parts]] if self.rank == 0 else []
        self._data.scatter([out], inputs, options).wait()
        return out

    def broadcast_object(self, obj=None):
        """Rank 0's `obj` on every rank (others pass nothing)."""
        header = self._header
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                                       dtype=torch.uint8)
            header[:_LENGTH_BYTES].copy_(torch.tensor([payload.numel()], dtype=torch.int64).view(torch.uint8))
            inline = min(payload.numel(), _INLINE_BYTES)
            header[_LENGTH_BYTES:_LENGTH_BYTES + inline].copy_(payload[:inline])
        self._broadcast(header)
        length = int(header[:_LENGTH_BYTES].view(torch.int64).item())
        rest = None
        if length > _INLINE_BYTES:
            rest = payload[_INLINE_BYTES:] if self.rank == 0 else torch.empty(length - _INLINE_BYTES, dtype=torch.uint8)
            self._broadcast(rest)
        if self.rank == 0:
            return obj
        data = header[_LENGTH_BYTES:_LENGTH_BYTES + min(length, _INLINE_BYTES)].numpy().tobytes()
        if rest is not None:
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        self._control.broadcast([tensor], options).wait()

    def close(self) -> None:
        """Release the backends and the store connection (idempotent)."""
        data, self._data = self._data, None
        if data is not None and self.device.type == "cuda":
            data.shutdown()  # NCCL's communicators; gloo's need no call
        self._control = None
        self._store = None


def _gloo(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta):
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def _nccl(store: dist.Store, rank: int, world_size: int, device: torch.device, timeout: datetime.timedelta):
    """NCCL over `device` (set as this process's current device first, as NCCL requires)."""
    if not dist.is_nccl_available():
        raise RuntimeError("tensor parallelism on CUDA needs torch with NCCL")
    torch.cuda.set_device(device)
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)
