"""Hosts in Linux network namespaces, for tests that need real network stacks on one machine:
each host a namespace of its own with loopback up and one address on a bridge in the root
namespace (through a veth pair), so the hosts reach each other and pytest (in the root
namespace, on the bridge too) reaches every host.

    with hosts("a", "b", "stranger") as net:      # 10.77.N.1, .2, .3; the root namespace .254
        net["a"].popen([sys.executable, "-m", ...])   # a process on host a (`ip netns exec`)
        net["b"].link_down(); net["b"].link_up()      # cut host b off the bridge, and back

What a namespace isolates here: interfaces, addresses, routes, ports (every host has all its
ports free, loopback included), abstract Unix sockets. What it does not: processes (one PID
namespace: a host's processes are visible, and killable, from every other one), files, the
hostname. So a `ray stop` run anywhere stops every Ray of the machine: stop what a test started by
its pids instead. Every process started through `Host.popen` / `Host.run` carries the run's marker
(`MARKER_ENV` = `Network.marker`) and inherits it down its tree; `Network.close()` (also on any
failure) kills every process inside each namespace (`ip netns pids`) or carrying the marker, then
deletes the namespaces, veths and bridge. `leftovers(suffix)` says what of a run is still there.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN: `ip netns add` mounts) and iproute2:
`netns_unavailable_reason()` says why not, for a skip. Delay and loss need the kernel's sch_netem
qdisc (`tc qdisc ... netem`), missing on some CI kernels: `netem_unavailable_reason()`.
"""
from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

MARKER_ENV = "PDSERVE_TEST_NETNS"  # = the run's suffix, in every process a host starts
PREFIX = "pdn"  # every namespace, bridge and veth of these tests starts with it
ROOT_HOST = 254  # the root namespace's address on the bridge: 10.77.N.254
SUBNET_BASE = "10.77"  # one /24 per run: 10.77.N.0/24, N chosen free


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here (the message says why)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {(result.stderr or result.stdout).strip()}")
    return result


@functools.lru_cache(maxsize=None)
def netns_unavailable_reason() -> str | None:
    """None when this process can build hosts (a probe namespace with a veth pair is made and
    removed), else why not, for `pytest.skip`."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux only (this is {sys.platform})"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN); this runs as uid %d" % os.geteuid()
    suffix = secrets.token_hex(3)
    name, veth = f"{PREFIX}-probe-{suffix}", f"{PREFIX}p{suffix}"
    try:
        _ip("netns", "add", name)
        _ip("link", "add", veth, "type", "veth", "peer", "name", veth + "x")
        _ip("link", "set", veth + "x", "netns", name)
        _ip("-n", name, "link", "set", "lo", "up")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot build a network namespace with a veth pair here: {exc}"
    finally:
        _ip("link", "del", veth, check=False)
        _ip("netns", "del", name, check=False)
    return None


@functools.lru_cache(maxsize=None)
def netem_unavailable_reason() -> str | None:
    """None when `tc qdisc ... netem` (delay, loss) works here, else why not (no `tc`, or a kernel
    without sch_netem: "Specified qdisc kind is unknown"). Probed on the loopback of a namespace
    made for it, so nothing of the machine's is touched."""
    reason = netns_unavailable_reason()
    if reason is not None:
        return reason
    if shutil.which("tc") is None:
        return "no `tc` command (iproute2)"
    name = f"{PREFIX}-netem-{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", name)
        _ip("-n", name, "link", "set", "lo", "up")
        result = subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root",
                                 "netem", "delay", "1ms", "loss", "1%"], capture_output=True, text=True, timeout=30)
        if result.returncode != 0:
            return f"tc netem does not work here (kernel without sch_netem?): {(result.stderr or result.stdout).strip()}"
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot probe netem: {exc}"
    finally:
        _ip("netns", "del", name, check=False)
    return None


def host_env(marker: str, **extra: str) -> dict[str, str]:
    """The environment of a process on a host: this one's (PATH, PYTHONPATH, ...), the repository
    first on PYTHONPATH, one OpenMP thread, no huge-page advice, no Ray usage stats, no inherited
    RAY_ADDRESS, the run's marker, and `extra`."""
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
           "PDSERVE_HUGE_PAGES": "0", "RAY_USAGE_STATS_ENABLED": "0", MARKER_ENV: marker}
    env["PYTHONPATH"] = os.pathsep.join([repo, *filter(None, [os.environ.get("PYTHONPATH")])])
    env.pop("RAY_ADDRESS", None)
    env.update(extra)
    return env


class Host:
    """One namespace: `name` (the namespace), `address` (its IP on the bridge), `veth` (the root
    side of its link: down cuts the host off)."""

    def __init__(self, network: "Network", label: str, name: str, address: str, veth: str) -> None:
        self.network, self.label, self.name, self.address, self.veth = network, label, name, address, veth

    def __repr__(self) -> str:
        return f"Host({self.label!r}, {self.name}, {self.address})"

    def command(self, args: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *map(str, args)]

    def env(self, **extra: str) -> dict[str, str]:
        return host_env(self.network.marker, **extra)

    def popen(self, args: Sequence[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """`args` running on this host (`ip netns exec` execs it: the Popen's pid is the command's),
        in the repository root, with `env()` unless `env`; other keywords go to Popen."""
        kwargs.setdefault("cwd", Path(__file__).resolve().parents[1])
        return subprocess.Popen(self.command(args), env=self.env() if env is None else env, **kwargs)

    def run(self, args: Sequence[str], timeout: float = 120, env: dict[str, str] | None = None,
            check: bool = False, **kwargs) -> subprocess.CompletedProcess:
        """`args` run to the end on this host, output captured as text."""
        kwargs.setdefault("cwd", Path(__file__).resolve().parents[1])
        result = subprocess.run(self.command(args), env=self.env() if env is None else env, capture_output=True,
                                text=True, timeout=timeout, **kwargs)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(map(str, args))} on {self.label} failed ({result.returncode}):\n"
                                 f"{result.stdout}\n{result.stderr}")
        return result

    def python(self, code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """`python -c code *args` on this host (this interpreter, the repository importable)."""
        return self.run([sys.executable, "-c", code, *args], timeout=timeout)

    def pids(self) -> list[int]:
        """The processes inside this namespace."""
        result = _ip("netns", "pids", self.name, check=False)
        return [int(pid) for pid in result.stdout.split()] if result.returncode == 0 else []

    def link_down(self) -> None:
        """Cut the host off: the root side of its veth goes down (its packets are dropped, as
        on a cut cable; its sockets see no error, only silence)."""
        _ip("link", "set", self.veth, "down")

    def link_up(self) -> None:
        _ip("link", "set", self.veth, "up")

    @contextlib.contextmanager
    def link_cut(self, seconds: float) -> Iterator[None]:
        """The link down, then after the block (at least `seconds` after the cut) up again, even
        if the block raised."""
        self.link_down()
        cut_at = time.monotonic()
        try:
            yield
            time.sleep(max(0.0, seconds - (time.monotonic() - cut_at)))
        finally:
            self.link_up()


class Network:
    """The hosts of one run: `net[label]`, `hosts` (in order), `suffix` (in every name), `marker`
    (= suffix, `MARKER_ENV` of every process started on a host), `root_address`, `bridge`,
    `subnet`. `close()` is idempotent and removes everything, killing what still runs."""

    def __init__(self, labels: Sequence[str], subnet: ipaddress.IPv4Network | None = None) -> None:
        if len(set(labels)) != len(labels) or not labels or len(labels) > 200:
            raise ValueError(f"need distinct host labels, got {labels!r}")
        self.suffix = secrets.token_hex(3)
        self.marker = self.suffix
        self.subnet = subnet or _free_subnet()
        self.bridge = f"{PREFIX}br{self.suffix}"  # <= 15 characters, as interface names must be
        self.root_address = str(self.subnet[ROOT_HOST])
        self.hosts: list[Host] = []
        self._namespaces: list[str] = []
        self._links: list[str] = []
        self._closed = False
        try:
            self._build(labels)
        except BaseException:
            self.close()
            raise

    def _build(self, labels: Sequence[str]) -> None:
        prefix = self.subnet.prefixlen
        self._links.append(self.bridge)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.root_address}/{prefix}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for index, label in enumerate(labels, start=1):
            name = f"{PREFIX}-{label}-{self.suffix}"
            veth = f"{PREFIX}{index}{self.suffix}"  # root side, on the bridge
            peer = f"{PREFIX}{index}{self.suffix}x"  # moved into the namespace, renamed eth0
            address = str(self.subnet[index])
            self._namespaces.append(name)
            _ip("netns", "add", name)
            self._links.append(veth)
            _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", name)
            _ip("-n", name, "link", "set", peer, "name", "eth0")
            _ip("-n", name, "addr", "add", f"{address}/{prefix}", "dev", "eth0")
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            self.hosts.append(Host(self, label, name, address, veth))

    def __getitem__(self, label: str) -> Host:
        for host in self.hosts:
            if host.label == label:
                return host
        raise KeyError(label)

    def processes(self) -> list[int]:
        """Live processes inside any of the namespaces or carrying the marker."""
        pids = {pid for host in self.hosts for pid in host.pids()} | set(marked_processes(self.marker))
        return sorted(pid for pid in pids if pid != os.getpid() and _running(pid))

    def kill_all(self, timeout: float = 30.0, grace_s: float = 0.0) -> list[int]:
        """Kill every process of `processes()` (SIGTERM then, after `grace_s`, SIGKILL), until none
        is left; the pids that were killed. Raises if some outlive `timeout` seconds."""
        killed: set[int] = set()
        if grace_s > 0 and (pids := self.processes()):
            _signal(pids, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while self.processes() and time.monotonic() < deadline:
                time.sleep(0.2)
        deadline = time.monotonic() + timeout
        while pids := self.processes():
            killed.update(pids)
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes of network {self.suffix} outlived SIGKILL: {pids}")
            _signal(pids, signal.SIGKILL)
            time.sleep(0.2)
        return sorted(killed)

    def close(self) -> None:
        """Kill what runs on the hosts, delete the namespaces, veths and bridge (each step tried
        even if one before it failed; the first error raised at the end)."""
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        try:
            self.kill_all()
        except BaseException as exc:  # go on deleting: a stuck process does not keep the namespace
            errors.append(exc)
        for name in self._namespaces:
            result = _ip("netns", "del", name, check=False)
            if result.returncode != 0 and "No such file" not in result.stderr:
                errors.append(RuntimeError(f"ip netns del {name}: {result.stderr.strip()}"))
        for link in reversed(self._links):  # a veth whose peer's namespace went is gone already
            if Path(f"/sys/class/net/{link}").exists():
                result = _ip("link", "del", link, check=False)
                if result.returncode != 0 and Path(f"/sys/class/net/{link}").exists():
                    errors.append(RuntimeError(f"ip link del {link}: {result.stderr.strip()}"))
        if errors:
            raise errors[0]

    def leftovers(self) -> list[str]:
        return leftovers(self.suffix)

    def __enter__(self) -> "Network":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _signal(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def marked_processes(marker: str) -> list[int]:
    """Processes whose environment has `MARKER_ENV`=marker (zombies included)."""
    needle = f"{MARKER_ENV}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                    found.append(int(entry))
            except OSError:
                continue
    return found


def _running(pid: int) -> bool:
    """Exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _free_subnet() -> ipaddress.IPv4Network:
    """10.77.N.0/24 with N such that no address or route of the root namespace is in it."""
    used = _ip("-4", "addr", "show").stdout + _ip("-4", "route", "show", "table", "all").stdout
    candidates = list(range(1, 255))
    secrets.SystemRandom().shuffle(candidates)
    for n in candidates:
        if f"{SUBNET_BASE}.{n}." not in used:
            return ipaddress.IPv4Network(f"{SUBNET_BASE}.{n}.0/24")
    raise NetnsUnavailable(f"every {SUBNET_BASE}.N.0/24 is in use")


def leftovers(suffix: str) -> list[str]:
    """What of the run `suffix` is still on the machine: namespaces, interfaces, processes with
    its marker."""
    found = [f"namespace {line.split()[0]}" for line in _ip("netns", "list", check=False).stdout.splitlines()
             if line.split() and line.split()[0].endswith(suffix) and line.split()[0].startswith(PREFIX)]
    found += [f"interface {name}" for name in os.listdir("/sys/class/net")
              if name.startswith(PREFIX) and suffix in name]
    found += [f"process {pid}" for pid in marked_processes(suffix) if pid != os.getpid() and _running(pid)]
    return found


@contextlib.contextmanager
def hosts(*labels: str) -> Iterator[Network]:
    """A `Network` of one host per label (addresses .1, .2, ... in label order), removed after
    the block whatever happens in it. Raises `NetnsUnavailable` (with `netns_unavailable_reason`)
    where namespaces cannot be made."""
    reason = netns_unavailable_reason()
    if reason is not None:
        raise NetnsUnavailable(reason)
    network = Network(labels)
    try:
        yield network
    finally:
        network.close()
