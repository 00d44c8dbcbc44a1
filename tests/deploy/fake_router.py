"""A stand-in router process for the supervisor's tests: it keeps the router process contract
(deploy/router_process.py: spec from the environment, one ready line, SIGTERM ends it) and
answers every connection on the inherited socket with its pid. FAKE_ROUTER_EXIT=N exits with N
before it is ready; FAKE_ROUTER_HANG=1 never becomes ready (and ignores SIGTERM)."""
import os
import signal
import socket
import sys

from deploy.router_process import SPEC_ENV, RouterSpec

spec = RouterSpec.from_json(os.environ[SPEC_ENV])
if "FAKE_ROUTER_EXIT" in os.environ:
    sys.exit(int(os.environ["FAKE_ROUTER_EXIT"]))
if "FAKE_ROUTER_HANG" in os.environ:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        signal.pause()
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
listener = socket.socket(fileno=spec.listen_fd)
listener.setblocking(True)
with os.fdopen(spec.ready_fd, "w") as ready:
    ready.write(f"fake-{spec.index}-pid{os.getpid()}\n")
while True:
    connection, _ = listener.accept()
    connection.sendall(str(os.getpid()).encode())
    connection.close()
