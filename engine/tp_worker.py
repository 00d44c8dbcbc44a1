"""Tensor-parallel follower processes: started by rank 0's model runner, one per rank 1 .. N-1.

Rank 0 (`start_tensor_parallel`, called by `ModelRunner` when `tensor_parallel_size > 1`) opens
the group's store (`engine.parallel.host_store`), starts `python -m engine.tp_worker <rank>
<world size> <store address> <threads>` for every other rank with the engine config pickled on
its stdin, and joins the group with them. Each follower loads the same model (its shard), builds
the same KV cache and runs `ModelRunner.follower_loop()` until rank 0 says shutdown.

No orphans: a follower exits when rank 0 closes the engine (shutdown message, then terminate /
kill after a grace period), when rank 0's process dies (rank 0 keeps the follower's stdin open
after the config; its end of file wakes a thread blocked reading it), or when a collective fails
because a rank died. At interpreter exit rank 0 stops
the followers it still has. Followers ignore SIGINT (a Ctrl-C reaches the whole process group:
rank 0 decides), write nothing on stdout (a worker's ready line is there) and log to stderr.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import torch

from engine.process import configure_logging

log = logging.getLogger(__name__)

_STOP_GRACE_S = 10.0


class Followers:
    """Rank 0's handle on its follower processes."""

    def __init__(self, processes: list[subprocess.Popen]) -> None:
        self.processes = processes
        atexit.register(self._at_exit)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def exited(self) -> str | None:
        """The first follower that exited (rank, pid, exit code), or None while they all run.
        Any thread may ask (a worker's Health does, through `ModelRunner.broken`)."""
        for rank, process in enumerate(self.processes, start=1):
            code = process.poll()
            if code is not None:
                return f"tensor-parallel follower rank {rank} (pid {process.pid}) exited with code {code}"
        return None

    def check_alive(self) -> None:
        """While the group starts: RuntimeError naming the first follower that exited."""
        exited = self.exited()
        if exited is not None:
            raise RuntimeError(f"{exited} while starting; its error is on stderr")

    def _at_exit(self) -> None:
        """The interpreter exits with the engine never closed: no shutdown message will come."""
        self.stop(grace_s=0.0)

    def stop(self, grace_s: float = _STOP_GRACE_S) -> None:
        """Wait up to `grace_s` for the followers to exit (after the shutdown message), then
        terminate, then kill; reaps them all. Idempotent."""
        atexit.unregister(self._at_exit)
        deadline = time.monotonic() + grace_s
        for process in self.processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.terminate()
            _close_quietly(process.stdin)
        for process in self.processes:
            try:
                process.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def start_tensor_parallel(config, model_dir: str):
    """Rank 0: start the followers for `config.tensor_parallel_size` ranks and join the group.
    Returns (group, followers, threads per rank); the caller checked the model splits."""
    from engine.parallel import TensorParallelGroup, host_store

    world_size = config.tensor_parallel_size
    device = torch.device(config.device)
    devices = [device] * world_size
    if device.type == "cuda":
        base = device.index or 0
        if torch.cuda.device_count() < base + world_size:
            raise ValueError(f"tensor_parallel_size {world_size} needs CUDA devices {base}..{base + world_size - 1}; "
                             f"torch sees {torch.cuda.device_count()}")
        devices = [torch.device("cuda", base + r) for r in range(world_size)]
    threads = max(1, torch.get_num_threads() // world_size)
    store, address = host_store(world_size)
    processes = []
    try:
        for rank in range(1, world_size):
            follower_config = dataclasses.replace(config, model=model_dir, device=str(devices[rank]))
            env = dict(os.environ, OMP_NUM_THREADS=str(threads),
                       PYTHONPATH=os.pathsep.join(filter(None, [_project_root(), os.environ.get("PYTHONPATH")])))
            process = subprocess.Popen(
                [sys.executable, "-m", "engine.tp_worker", str(rank), str(world_size), address, str(threads)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env)
            processes.append(process)
            process.stdin.write(pickle.dumps(follower_config))
            process.stdin.flush()  # and kept open: its end of file tells the follower rank 0 is gone
        followers = Followers(processes)
    except BaseException:
        for process in processes:
            process.kill()
            process.wait()
        raise
    try:
        group = TensorParallelGroup(0, world_size, devices[0], address, store=store,
                                    peers_alive=followers.check_alive)
    except BaseException:
        followers.stop(grace_s=0.0)
        raise
    return group, followers, threads


def _project_root() -> str:
    """The folder holding the `engine` package, so `python -m engine.tp_worker` finds it."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _close_quietly(stream) -> None:
    try:
        stream.close()
    except OSError:  # the follower is gone and the pipe broken: nothing to tell it
        pass


def _exit_at_end_of_stdin() -> None:
    """Rank 0 holds this process's stdin open until it stops it or dies: either way the read
    below returns, and nothing will ever be asked of this rank again."""
    def wait() -> None:
        sys.stdin.buffer.read()
        os._exit(1)

    threading.Thread(target=wait, name="tp-rank0-gone", daemon=True).start()


def main(argv: list[str]) -> int:
    rank, world_size, address, threads = int(argv[0]), int(argv[1]), argv[2], int(argv[3])
    parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(logging.WARNING, prefix=f"tp rank {rank}")
    torch.set_num_threads(threads)
    config = pickle.load(sys.stdin.buffer)  # EOFError if rank 0 died before sending it
    _exit_at_end_of_stdin()
    from engine.model.loader import resolve_model
    from engine.model_runner import ModelRunner
    from engine.parallel import TensorParallelGroup

    group = TensorParallelGroup(rank, world_size, config.device, address)
    try:
        runner = ModelRunner(config, resolve_model(config.model), tp=group)
        runner.follower_loop()
    except Exception:
        if os.getppid() != parent:  # rank 0 died first and closed its sockets: no traceback
            return 1
        raise
    finally:
        group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
