"""`ControllerClient`: async calls to the controller actor (used by the serve driver, the admin
HTTP routes and the `pdserve` commands). The controller answers a caller's mistake with
{"error": message}; here that becomes a ValueError with the same message."""
from __future__ import annotations

from typing import Any


class ControllerClient:
    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def scale(self, prefill: int | None = None, decode: int | None = None, colocated: int | None = None,
                    drain: list[str] | None = None) -> dict[str, Any]:
        """{"targets": {"prefill", "decode", "both"}} plus "warning" when the cluster is too small."""
        return _unwrap(await self.actor.scale.remote(prefill, decode, colocated, list(drain or [])))

    async def wait_settled(self, timeout_s: float) -> dict[str, Any]:
        return await self.actor.wait_settled.remote(timeout_s)

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
