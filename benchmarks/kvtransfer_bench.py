"""KV transfer bandwidth per transport, beside the raw ceiling measured in the same run.

    python benchmarks/kvtransfer_bench.py [--sizes 1,16,64,256] [--transports tcp,shm,ucx,nccl]
                                          [--repeats 5] [--device cpu|cuda] [--max-message-mib N]
                                          [--kv-dtypes float32,bfloat16,int8,fp8_e4m3]
                                          [--json out.json] [--smoke]

Variants beside the transports: shm-cma and shm-mapped (shm's single-copy paths) and ucx-tcp (ucx
without its same-host endpoint: UCX's TCP path); see `variant`.

Two processes: this one hosts the receiver, a spawned one the sender. Each transfer moves every
layer of randomly scattered blocks of a SmolLM2-135M-shaped cache (30 layers, block size 16,
3 KV heads, head dim 64, float32 on CPU) into randomly scattered destination blocks; its time
runs from `send()` to the sender seeing every layer acknowledged. Ceilings: a plain TCP socket
copy of the same bytes between the same two processes (for tcp, ucx, nccl) and a single
memcpy of the same bytes (for shm), each measured right before the transfer it is paired with,
so both see the same machine load; "% of ceiling" is the median over those pairs. Every
transport's last transfer is checked byte for byte.

`--kv-dtypes` repeats the run per KV cache dtype (float32, bfloat16, and the 8-bit formats of
engine/kv_quant.py, whose blocks carry their scales): `--sizes` stay MiB of the float32 cache, so
every dtype's row at a size moves the same tokens, and the rows compare bytes and time per transfer.

`--device cuda` puts both caches on the GPU (both processes on `cuda:0`; nccl, which needs its
ranks on different GPUs, is skipped with one), and the ceiling becomes a device-to-device copy of
the same bytes from the sender process into a buffer of this one, shared through CUDA IPC: the
most that any transport between two processes on that GPU could do.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.multiprocessing  # noqa: E402,F401  (registers CUDA IPC pickling for the pipe)

from engine.huge_pages import advise_huge_pages  # noqa: E402
from engine.kv_quant import QUANTIZED_KV_DTYPES, KVQuantFormat  # noqa: E402
from kvtransfer import (TransferConfig, allocate_shared, available_transports,  # noqa: E402
                        create_receiver, create_sender)

MIB = 1 << 20
FLOAT_KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
KV_DTYPES = (*FLOAT_KV_DTYPES, *QUANTIZED_KV_DTYPES)
CEILING_FOR = {"tcp": "socket", "ucx": "socket", "ucx-tcp": "socket", "nccl": "socket",
               "shm": "memcpy", "shm-cma": "memcpy", "shm-mapped": "memcpy"}


def ceiling_for(transport: str, device: str) -> str:
    return "cuda-ipc copy" if device == "cuda" else CEILING_FOR[transport]


def variant(name: str, timeout_s: float, max_message_mib: float = 0) -> tuple[str, TransferConfig]:
    """A transport and its config. shm variants: "shm" is the ring (cross-memory reads off, no
    shared caches), "shm-cma" reads the sender's memory with process_vm_readv, "shm-mapped"
    maps the sender's caches, which lie in shared memory (a memfd), as a prefill worker's do.
    ucx variants: "ucx" lets UCX use its shared-memory transports between the two processes
    (`ucx_same_host_fast_path`), "ucx-tcp" keeps every byte on UCX's TCP path, which is what two
    hosts without RDMA get. `max_message_mib` > 0 overrides `TransferConfig.max_message_bytes`."""
    transport, _, extra = name.partition("-")
    overrides = {"max_message_bytes": int(max_message_mib * MIB)} if max_message_mib else {}
    return transport, TransferConfig(timeout_s=timeout_s,
                                     shm_cross_memory_attach=(extra == "cma"),
                                     ucx_same_host_fast_path=(extra != "tcp"), **overrides)


@dataclass(frozen=True)
class BenchLayout:
    num_layers: int = 30
    block_size: int = 16
    num_kv_heads: int = 3
    head_dim: int = 64
    num_blocks: int = 64
    kv_dtype: str = "float32"  # one of KV_DTYPES

    @property
    def packed(self) -> KVQuantFormat | None:
        """The 8-bit block format, or None for a float cache."""
        if self.kv_dtype in FLOAT_KV_DTYPES:
            return None
        return KVQuantFormat(self.kv_dtype, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def chunk_nbytes(self) -> int:
        if self.packed is not None:
            return self.packed.block_bytes
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * FLOAT_KV_DTYPES[self.kv_dtype].itemsize

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block id across all layers: what one transferred block costs."""
        return self.num_layers * self.chunk_nbytes

    def blocks_for(self, size_mib: float) -> int:
        """Blocks of `size_mib` MiB of a float32 cache: the same tokens whatever the dtype."""
        float32_block = self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * 4
        return max(1, round(size_mib * MIB / float32_block))


def _allocate(shape, dtype=torch.float32) -> torch.Tensor:
    """Uninitialized CPU memory in transparent huge pages where Linux offers them, as the engine
    allocates its KV cache (`engine.kv_cache`); `PDSERVE_BENCH_SMALL_PAGES=1` measures 4 KiB pages."""
    tensor = torch.empty(shape, dtype=dtype)
    if os.environ.get("PDSERVE_BENCH_SMALL_PAGES") != "1":
        advise_huge_pages(tensor)
    return tensor


def cache_shape_and_dtype(layout: BenchLayout) -> tuple[tuple[int, ...], torch.dtype]:
    if layout.packed is not None:  # [num_blocks, block_bytes] bytes per layer
        return (layout.num_layers, layout.num_blocks, layout.packed.block_bytes), torch.uint8
    return ((layout.num_layers, layout.num_blocks, 2, layout.block_size, layout.num_kv_heads, layout.head_dim),
            FLOAT_KV_DTYPES[layout.kv_dtype])


def make_caches(layout: BenchLayout, seed: int | None, device: str = "cpu") -> list[torch.Tensor]:
    """The per-layer caches; seeded content is generated on the CPU, so it is the same on any
    device (8-bit caches: random bytes, values and scales alike; the transfer moves them as they are)."""
    shape, dtype = cache_shape_and_dtype(layout)
    if device != "cpu":
        if seed is None:
            return list(torch.zeros(shape, dtype=dtype, device=device).unbind(0))
        return [layer.to(device) for layer in make_caches(layout, seed)]
    data = _allocate(shape, dtype)
    if seed is None:
        return list(data.zero_().unbind(0))
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return list(data.random_(0, 256, generator=generator).unbind(0))
    return list(data.normal_(generator=generator).unbind(0))


def make_shared_caches(layout: BenchLayout, seed: int):
    """`make_caches(layout, seed)`'s content in shared memory: (caches, SharedMemory, keep-alive)."""
    plain = make_caches(layout, seed)
    nbytes = sum(cache.numel() * cache.element_size() for cache in plain)
    raw, shared, mapping = allocate_shared(nbytes)
    whole = raw.view(plain[0].dtype).view(layout.num_layers, *plain[0].shape)
    for layer, cache in enumerate(plain):
        whole[layer].copy_(cache)
    return list(whole.unbind(0)), shared, (raw, mapping)


def _sender_main(connection, layout: BenchLayout, threads: int, device: str) -> None:
    """The sender process: answers commands from the receiver process."""
    torch.set_num_threads(threads)
    caches = make_caches(layout, seed=1, device=device)
    senders = {}
    while True:
        command, args = connection.recv()
        if command == "exit":
            break
        if command == "raw_socket":
            port, nbytes = args
            connection.send(_raw_socket_send(port, nbytes))
        elif command == "cuda_copy":
            destination = args  # the receiver's buffer, opened here through CUDA IPC
            source = torch.empty_like(destination).random_(0, 255)
            destination.copy_(source)  # warm: IPC mapping, first touch
            torch.cuda.synchronize()
            start = time.perf_counter()
            destination.copy_(source)
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            del destination, source
            connection.send(elapsed)
        elif command == "transfer":
            transport, address, request_id, src_ids, dst_ids, timeout_s, max_message_mib = args
            if transport not in senders:
                name, config = variant(transport, timeout_s, max_message_mib)
                if transport == "shm-mapped":  # caches in a memfd, as a prefill worker has them
                    shared_caches, shared, keep_alive = make_shared_caches(layout, seed=1)
                    senders[transport] = create_sender(name, shared_caches, config, shared_memory=shared,
                                                       packed=layout.packed)
                    senders[transport].keep_alive = keep_alive
                else:
                    senders[transport] = create_sender(name, caches, config, packed=layout.packed)
            sender = senders[transport]
            start = time.perf_counter()
            handle = sender.send(request_id, address, src_ids, dst_ids)
            status = handle.wait(600)
            elapsed = time.perf_counter() - start
            handle.cancel()
            connection.send((status.state.value, status.error, elapsed))
    for sender in senders.values():
        sender.close()


def _raw_socket_send(port: int, nbytes: int) -> float:
    payload = memoryview(bytearray(os.urandom(1024)) * (nbytes // 1024 + 1))[:nbytes]
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.perf_counter()
        sock.sendall(payload)
        if sock.recv(1) != b"k":
            raise RuntimeError("raw socket ceiling: no ack")
        return time.perf_counter() - start


def _raw_socket_receive(listener: socket.socket, nbytes: int, buffer: memoryview) -> None:
    conn, _ = listener.accept()
    with conn:
        received = 0
        while received < nbytes:
            count = conn.recv_into(buffer[received:nbytes])
            if count == 0:
                raise RuntimeError("raw socket ceiling: sender closed early")
            received += count
        conn.sendall(b"k")


class SocketCeiling:
    """A plain TCP socket copy of `nbytes` from the sender process to this one."""

    def __init__(self, connection) -> None:
        self.connection = connection
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(1)
        self.port = self.listener.getsockname()[1]
        self.buffer = memoryview(bytearray(0))

    def measure(self, nbytes: int) -> float:
        if len(self.buffer) < nbytes:
            self.buffer = memoryview(bytearray(nbytes))
        self.connection.send(("raw_socket", (self.port, nbytes)))
        _raw_socket_receive(self.listener, nbytes, self.buffer)
        return self.connection.recv()

    def close(self) -> None:
        self.listener.close()


def measure_memcpy(nbytes: int) -> float:
    src = _allocate((nbytes,), torch.uint8).random_(0, 255)
    dst = _allocate((nbytes,), torch.uint8)
    dst.copy_(src)  # first touch of the pages
    start = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - start


def measure_cuda_copy(connection, nbytes: int) -> float:
    """A copy of `nbytes` by the sender process, device to device, into this process's memory."""
    destination = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    connection.send(("cuda_copy", destination))
    elapsed = connection.recv()
    torch.cuda.synchronize()
    return elapsed


def measure_transport(connection, ceiling: SocketCeiling, transport: str, layout: BenchLayout,
                      sizes: list[float], repeats: int, timeout_s: float,
                      device: str = "cpu", max_message_mib: float = 0) -> tuple[dict, bool]:
    """Per size: (transfer seconds, ceiling seconds) pairs, each ceiling measured right before
    its transfer so both see the same machine load."""
    caches = make_caches(layout, seed=None, device=device)
    name, config = variant(transport, timeout_s, max_message_mib)
    receiver = create_receiver(name, caches, config, packed=layout.packed)
    rng = random.Random(0)
    per_size, verified = {}, True
    try:
        for size in sizes:
            blocks = layout.blocks_for(size)
            nbytes = blocks * layout.block_nbytes
            pairs = []
            for run in range(repeats + 1):  # run 0 warms up the connection and the pages
                if device == "cuda":
                    ceiling_s = measure_cuda_copy(connection, nbytes)
                elif CEILING_FOR[transport] == "socket":
                    ceiling_s = ceiling.measure(nbytes)
                else:
                    ceiling_s = measure_memcpy(nbytes)
                src_ids = rng.sample(range(layout.num_blocks), blocks)
                dst_ids = rng.sample(range(layout.num_blocks), blocks)
                request_id = f"{transport}-{size}-{run}"
                receiver.expect(request_id, dst_ids)
                connection.send(("transfer", (transport, receiver.address, request_id, src_ids,
                                              dst_ids, timeout_s, max_message_mib)))
                state, error, elapsed = connection.recv()
                received = receiver.wait(request_id, 600)
                if state != "success" or not received.ok:
                    raise RuntimeError(f"{transport} {size} MiB transfer failed: "
                                       f"{error or received.error}")
                if run == repeats:
                    if device == "cuda":
                        torch.cuda.synchronize()
                    verified &= _verify(caches, layout, src_ids, dst_ids)
                receiver.cancel(request_id)
                if run:
                    pairs.append((elapsed, ceiling_s))
            per_size[size] = pairs
    finally:
        receiver.close()
    return per_size, verified


def _verify(caches, layout: BenchLayout, src_ids, dst_ids) -> bool:
    expected = make_caches(layout, seed=1)
    index_src, index_dst = torch.tensor(src_ids), torch.tensor(dst_ids)
    return all(torch.equal(caches[layer][index_dst.to(caches[layer].device)].cpu(),
                           expected[layer][index_src])
               for layer in range(layout.num_layers))


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def measure_dtype(args, layout: BenchLayout, transports: list[str], sizes: list[float]) -> list[dict]:
    """Every transport at every size for one cache layout, against a sender process of its own."""
    context = multiprocessing.get_context("spawn")
    parent_end, child_end = context.Pipe()
    child = context.Process(target=_sender_main,
                            args=(child_end, layout, args.threads, args.device), daemon=True)
    child.start()
    ceiling = SocketCeiling(parent_end)
    results = []
    try:
        for transport in transports:
            per_size, verified = measure_transport(parent_end, ceiling, transport, layout, sizes,
                                                   args.repeats, args.timeout, args.device,
                                                   args.max_message_mib)
            for size, pairs in per_size.items():
                nbytes = layout.blocks_for(size) * layout.block_nbytes
                rates = [gbps(nbytes, elapsed) for elapsed, _ in pairs]
                ceilings = [gbps(nbytes, ceiling_s) for _, ceiling_s in pairs]
                results.append({
                    "transport": transport, "kv_dtype": layout.kv_dtype, "size_mib": size, "bytes": nbytes,
                    "blocks": layout.blocks_for(size), "tokens": layout.blocks_for(size) * layout.block_size,
                    "ms_median": 1e3 * statistics.median(elapsed for elapsed, _ in pairs),
                    "gbps_median": statistics.median(rates), "gbps_best": max(rates),
                    "ceiling": ceiling_for(transport, args.device),
                    "ceiling_gbps_median": statistics.median(ceilings),
                    "fraction_of_ceiling": statistics.median(
                        rate / top for rate, top in zip(rates, ceilings)),
                    "gbps_samples": rates, "ceiling_gbps_samples": ceilings,
                    "verified_byte_exact": verified})
    finally:
        ceiling.close()
        parent_end.send(("exit", None))
        child.join(60)
        if child.is_alive():
            child.kill()
    return results


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    sizes = [float(size) for size in args.sizes.split(",")]
    available = available_transports()
    if "shm" in available:
        available[available.index("shm") + 1:available.index("shm") + 1] = ["shm-cma", "shm-mapped"]
    if "ucx" in available:
        available.insert(available.index("ucx") + 1, "ucx-tcp")
    transports = available if args.transports == "all" else args.transports.split(",")
    skipped = {name: "not available" for name in transports if name not in available}
    if args.device == "cuda":
        # mapped and cma read CPU memory of the sender; nccl needs its ranks on different GPUs
        unusable = {"shm-cma": "CPU caches only", "shm-mapped": "CPU caches only",
                    "ucx-tcp": "CPU caches only (device payloads never take the same-host path)"}
        if torch.cuda.device_count() < 2:
            unusable["nccl"] = "needs two GPUs (one rank per GPU)"
        skipped.update({name: reason for name, reason in unusable.items() if name in transports})
    transports = [name for name in transports if name in available and name not in skipped]
    base = BenchLayout()
    num_blocks = max(2 * base.blocks_for(max(sizes)), 16)
    load_before = os.getloadavg()
    results = []
    for kv_dtype in args.kv_dtypes.split(","):
        layout = BenchLayout(num_blocks=num_blocks, kv_dtype=kv_dtype)
        results += measure_dtype(args, layout, transports, sizes)
    return {
        "layout": asdict(BenchLayout(num_blocks=num_blocks)), "kv_dtypes": args.kv_dtypes.split(","),
        "device": args.device, "sizes_mib": sizes,
        "repeats": args.repeats, "threads": args.threads, "transports": transports,
        "max_message_mib": args.max_message_mib or TransferConfig().max_message_bytes / MIB,
        "skipped": skipped,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(),
                 "python": platform.python_version(), "torch": torch.__version__,
                 "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
                 "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "results": results,
    }


def format_table(report: dict) -> str:
    lines = ["| transport | KV dtype | tokens | size | ms (median) | GB/s (median) | GB/s (best) | ceiling "
             "| ceiling GB/s (median) | % of ceiling (median of pairs) | byte-exact |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for row in report["results"]:
        lines.append(
            f"| {row['transport']} | {row['kv_dtype']} | {row['tokens']} | {row['bytes'] / MIB:.1f} MiB "
            f"| {row['ms_median']:.1f} | {row['gbps_median']:.2f} | {row['gbps_best']:.2f} | {row['ceiling']} "
            f"| {row['ceiling_gbps_median']:.2f} | {100 * row['fraction_of_ceiling']:.0f}% "
            f"| {'yes' if row['verified_byte_exact'] else 'NO'} |")
    for name, reason in report["skipped"].items():
        lines.append(f"| {name} | skipped: {reason} | | | | | | | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1,16,64,256", help="MiB per transfer, comma-separated")
    parser.add_argument("--transports", default="all", help="comma-separated, or all available")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per size (+1 warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--timeout", type=float, default=30.0, help="transfer timeout_s")
    parser.add_argument("--max-message-mib", type=float, default=0,
                        help="TransferConfig.max_message_bytes in MiB (default: the config's)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where both processes keep their caches")
    parser.add_argument("--kv-dtypes", default="float32",
                        help=f"comma-separated KV cache dtypes, each a run of its own: {', '.join(KV_DTYPES)}")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--smoke", action="store_true",
                        help="CI-sized: sizes 1,4 MiB, 1 timed run, every available transport")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    unknown = [name for name in args.kv_dtypes.split(",") if name not in KV_DTYPES]
    if unknown:
        parser.error(f"--kv-dtypes: unknown {', '.join(unknown)}; choose from {', '.join(KV_DTYPES)}")
    if args.smoke:
        args.sizes, args.repeats = "1,4", 1
    report = run(args)
    print(format_table(report))
    print(f"load average (1, 5, 15 min) before {report['host']['load_average_before']}, "
          f"after {report['host']['load_average_after']} on {report['host']['cpus']} CPUs")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    return 0 if all(row["verified_byte_exact"] for row in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
