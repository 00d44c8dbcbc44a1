"""Real pdserve processes for end-to-end tests: a child process whose output is read by a
thread, a worker's gRPC address from its READY line, and a router on a free port, healthy."""
import httpx

from tests.helpers import PythonProcess, free_port, stop_process, wait_until

STARTUP_TIMEOUT_S = 600


class Process(PythonProcess):
    """A child process whose stdout is read by a thread; `wait_for(prefix)` returns the first
    line starting with `prefix`."""

    def wait_for(self, prefix: str, timeout: float = STARTUP_TIMEOUT_S) -> str:
        line = self.next_line(lambda line: line.startswith(prefix), timeout)
        if line is None:
            raise AssertionError(f"{' '.join(self.args)} did not print {prefix!r}; output:\n{self.tail()}")
        return line.strip()

    def stop(self) -> None:
        stop_process(self.popen, 20)


def grpc_address(process: Process) -> str:
    """Waits for the worker's `READY grpc=HOST:PORT ...` line."""
    ready = process.wait_for("READY ")
    return dict(part.split("=", 1) for part in ready.split()[1:])["grpc"]


def start_worker(module: str, *args: str, env: dict[str, str] | None = None) -> Process:
    """`python -m prefill_worker|decode_worker` on the default model and a free port (`env`: its
    environment, default `child_env()`)."""
    return Process(["-m", module, "--model", "default", "--port", "0", *args], env)


def worker_stats(address: str, role: str):
    """A worker's own Stats (exact, not a router's last poll)."""
    import grpc

    import wire
    with grpc.insecure_channel(address) as channel:
        services = wire.services()
        stub = services.PrefillServiceStub(channel) if role == "prefill" else services.DecodeServiceStub(channel)
        return stub.Stats(wire.messages().StatsRequest(), timeout=30)


def start_router(*args: str, env: dict[str, str] | None = None) -> tuple[Process, str]:
    """`python -m router *args` on a free port; (the process, its URL) once /health answers 200."""
    port = free_port()
    router = Process(["-m", "router", *args, "--port", str(port), "--stats-interval", "0.5", "--log-level", "warning"],
                     env)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if router.popen.poll() is not None:
            raise AssertionError("the router exited:\n" + "".join(router.log[-40:]))
        try:
            return httpx.get(url + "/health").status_code == 200
        except httpx.TransportError:
            return False
    try:
        wait_until(healthy, timeout=STARTUP_TIMEOUT_S, what="the router to report healthy")
    except BaseException:
        router.stop()
        raise
    return router, url
