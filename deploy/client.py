"""`ControllerClient`: async calls to the controller actor (used by the serve driver, the admin
HTTP routes and the `pdserve` commands). The controller answers a caller's mistake with
{"error": message}; here that becomes a ValueError with the same message. An actor that cannot
answer (Ray is restarting it, or it is gone) is `ControllerUnavailable`."""
from __future__ import annotations

import functools
from typing import Any, Awaitable, Callable

from ray.exceptions import RayActorError


class ControllerUnavailable(Exception):
    """The controller actor did not answer: Ray is restarting it (seconds), or it died."""


def _answered(call: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(call)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await call(*args, **kwargs)
        except RayActorError as exc:
            raise ControllerUnavailable(f"the controller is not answering (restarting?): {type(exc).__name__}") \
                from exc
    return wrapper


class ControllerClient:
    def __init__(self, actor: Any) -> None:
        self.actor = actor

    @_answered
    async def scale(self, prefill: int | None = None, decode: int | None = None, colocated: int | None = None,
                    drain: list[str] | None = None) -> dict[str, Any]:
        """{"targets": {"prefill", "decode", "both"}} plus "warning" when the cluster is too small."""
        return _unwrap(await self.actor.scale.remote(prefill, decode, colocated, list(drain or [])))

    @_answered
    async def wait_settled(self, timeout_s: float) -> dict[str, Any]:
        return await self.actor.wait_settled.remote(timeout_s)

    @_answered
    async def status(self) -> dict[str, Any]:
        return await self.actor.status.remote()

    async def router_sync(self, router_id: str, workers: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        return await self.actor.router_sync.remote(router_id, workers)

    async def planner_status(self) -> dict[str, Any] | None:
        return await self.actor.planner_status.remote()

    async def start(self) -> dict[str, Any]:
        return _unwrap(await self.actor.start.remote())

    async def shutdown(self) -> None:
        await self.actor.shutdown.remote()


def _unwrap(result: dict[str, Any]) -> dict[str, Any]:
    if "error" in result:
        raise ValueError(result["error"])
    return result
