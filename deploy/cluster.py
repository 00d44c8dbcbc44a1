"""Ray sessions: start a small local instance or join a cluster; find a running controller.

`pdserve serve` writes a state file (default `serve.json` in pdserve's cache root,
`$PDSERVE_CACHE_DIR` or `~/.cache/pdserve`; or `$PDSERVE_STATE_FILE`) with the Ray address,
namespace, controller name and router URL, so `pdserve scale` / `pdserve status` find the
controller without flags.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from deploy.config import DEFAULT_NAMESPACE
from engine.paths import state_file
from router.config import LOOPBACK_HOSTS

logger = logging.getLogger(__name__)

STATE_FILE_ENV = "PDSERVE_STATE_FILE"
# On Linux Ray advertises the host's routable IP even for a one-machine instance; with this
# set to 0 it uses 127.0.0.1 (what it does on macOS/Windows), so nothing binds beyond loopback.
RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# A new local instance uses token authentication (token in ~/.ray/auth_token); a client that
# joins it by explicit address must say so.
RAY_AUTH_ENV = "RAY_AUTH_MODE"


@dataclass
class RaySettings:
    """`address=None` starts a local instance (small: no dashboard, bounded object store, usage
    stats off, 127.0.0.1 when `loopback`); otherwise join that cluster ("auto" finds a local
    `ray start` head)."""
    address: str | None = None
    namespace: str = DEFAULT_NAMESPACE
    num_cpus: int | None = None
    num_gpus: int | None = None
    object_store_memory_mb: int = 150
    include_dashboard: bool = False
    loopback: bool = True
    temp_dir: str | None = None

    def __post_init__(self) -> None:
        if self.address is not None and not self.address:
            raise ValueError("ray address must be non-empty when set (e.g. 'auto' or HOST:6379)")
        if self.object_store_memory_mb < 75:
            raise ValueError(f"object store memory must be at least 75 MB (Ray's minimum), "
                             f"got {self.object_store_memory_mb}")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ValueError(f"num_cpus must be >= 1, got {self.num_cpus}")
        if self.temp_dir is not None and len(self.temp_dir) > 40:
            raise ValueError(f"ray temp dir {self.temp_dir!r} is too long: Ray's socket paths under it must "
                             "fit in 107 bytes; use a short path such as /tmp/pdserve-ray")


def quiet_ray_environment(loopback: bool, token_auth: bool = False) -> None:
    """Environment for Ray in this process and the ones it starts (raylet, workers, actors).
    Call before `import ray`: Ray reads some of it once, at import."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if token_auth:
        os.environ[RAY_AUTH_ENV] = "token"
    if loopback:
        os.environ[RAY_LOOPBACK_ENV] = "0"
        constants = sys.modules.get("ray._private.ray_constants")
        if constants is not None:  # ray already imported: its constant was read from the environment then
            constants.ENABLE_RAY_CLUSTER = False


def start_or_join(settings: RaySettings) -> dict[str, Any]:
    """`ray.init` as the settings say; returns {"address", "started", "node_ip", "resources" (the
    cluster's totals), "nodes" (each alive node's resources), "token_auth"}."""
    started = settings.address is None
    address = None if started else resolve_address(settings.address)
    quiet_ray_environment(loopback=settings.loopback if started else is_loopback_address(address))
    import ray
    if started:
        # "local": a new instance of its own, even where $RAY_ADDRESS is set or `ray start --head`
        # runs (without it ray.init joins that one, and refuses num_cpus there)
        context = ray.init(address="local", num_cpus=settings.num_cpus or os.cpu_count() or 1, num_gpus=settings.num_gpus,
                           include_dashboard=settings.include_dashboard,
                           object_store_memory=settings.object_store_memory_mb * 2**20,
                           namespace=settings.namespace, _temp_dir=settings.temp_dir,
                           logging_level=logging.WARNING)
    else:
        try:
            context = ray.init(address=address, namespace=settings.namespace, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError) as exc:
            raise ValueError(f"cannot join the Ray cluster at --ray-address {settings.address}"
                             f"{f' ({address})' if address != settings.address else ''}: {exc}; start one "
                             "(`ray start --head`), give its address, or leave --ray-address out to start "
                             "a Ray instance of pdserve's own") from exc
    return {"address": context.address_info["gcs_address"], "started": started,
            "node_ip": context.address_info["node_ip_address"], "resources": ray.cluster_resources(),
            "nodes": node_resources(), "token_auth": os.environ.get(RAY_AUTH_ENV, "").lower() == "token"}


def node_resources() -> list[dict[str, float]]:
    """The total Ray resources of each alive node of the cluster this process joined (a worker,
    with all its tensor-parallel ranks, must fit on one)."""
    import ray
    return [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]


def connect(address: str, namespace: str, token_auth: bool = False) -> None:
    """Join a running cluster as a short-lived client (pdserve scale/status)."""
    address = resolve_address(address)
    quiet_ray_environment(loopback=is_loopback_address(address), token_auth=token_auth)
    import ray
    ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level=logging.ERROR)


def resolve_address(address: str) -> str:
    """`auto` as Ray resolves it: $RAY_ADDRESS, else the address the latest `ray start --head` on
    this machine recorded (in Ray's temp dir). Resolved here so that a head on 127.0.0.1 is joined
    in loopback mode: Ray itself would swap 127.0.0.1 for this host's routable IP, where nothing
    listens. `auto` stays `auto` when neither is there; any other address is returned as is."""
    if address != "auto":
        return address
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    from ray._private.utils import read_ray_address  # Ray's record of its latest head (no public API)
    return read_ray_address() or address


def is_loopback_address(address: str) -> bool:
    """A cluster reached at 127.0.0.1 / localhost runs in loopback mode: join it the same way
    (Ray would otherwise replace 127.0.0.1 with this host's routable IP, where nothing listens)."""
    host = address.rpartition(":")[0] if ":" in address else address
    return host.strip("[]") in LOOPBACK_HOSTS


def find_controller(name: str, namespace: str) -> Any:
    import ray
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        raise ValueError(f"no pdserve controller named {name!r} in Ray namespace {namespace!r}: is "
                         "`pdserve serve` running against this cluster?") from None


# ---- the state file -----------------------------------------------------------------------------

@dataclass
class ServeState:
    pid: int
    ray_address: str
    namespace: str
    controller: str
    url: str
    started_ray: bool
    token_auth: bool = False
    ready: bool = False  # written as the controller is created (status and scale work while workers load), then ready
    # when the pid's process started (Linux: /proc/PID/stat, clock ticks since boot): a pid reused by
    # another process after serve died does not make the file look live; None where unknown
    pid_started: int | None = None


def default_state_file() -> Path:
    """$PDSERVE_STATE_FILE, else serve.json in pdserve's cache root ($PDSERVE_CACHE_DIR, default
    ~/.cache/pdserve; engine/paths.py)."""
    override = os.environ.get(STATE_FILE_ENV)
    return Path(override) if override else state_file()


def write_state(path: Path, state: ServeState) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps(asdict(state), indent=2) + "\n")
    temporary.replace(path)


def read_state(path: Path) -> ServeState:
    """The state of a running `pdserve serve`; ValueError when none runs (missing or stale file)."""
    try:
        data = json.loads(path.read_text())
        state = ServeState(**data)
    except FileNotFoundError:
        raise ValueError(f"no running `pdserve serve` found ({path} does not exist); start one, or pass "
                         "--ray-address to reach a cluster directly") from None
    except (json.JSONDecodeError, TypeError) as exc:
        raise ValueError(f"{path} is not a pdserve state file ({exc}); remove it") from None
    if not pid_alive(state.pid) or (state.pid_started is not None and
                                    process_started(state.pid) not in (None, state.pid_started)):
        raise ValueError(f"the `pdserve serve` that wrote {path} (pid {state.pid}) is no longer running; "
                         "remove the file or start a new one")
    return state


def check_state_file_free(path: Path) -> None:
    """Refuse to start a second `pdserve serve` that would overwrite a live one's state file."""
    try:
        state = read_state(path)
    except ValueError:
        return
    if state.pid != os.getpid():
        raise ValueError(f"another `pdserve serve` (pid {state.pid}, {state.url}) owns {path}; stop it, or "
                         f"give this one its own --state-file")


def remove_state(path: Path) -> None:
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def process_started(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (Linux); None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the fields after the command name, which is in parentheses and may contain spaces; starttime is field 22
    return int(stat.rsplit(")", 1)[1].split()[19])


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
