"""The controller's durable record: what it needs of one (`StateStore`) and the one it keeps in
production (`GcsStateStore`: one JSON document in Ray's GCS key-value store), so that a restarted
controller finds its targets and membership (deploy/controller.py, `recover()`).

The key is the controller's name, in the KV namespace `pdserve:<Ray namespace>`; it lives as long
as the Ray cluster. `pdserve serve` clears it before it creates a controller and after it stops
one, so a record never outlives its cluster's `pdserve serve`.
"""
from __future__ import annotations

import json
from typing import Any, Protocol


class StateStore(Protocol):
    """Where the controller keeps what it must not lose with its process."""

    def load(self) -> dict[str, Any] | None: ...

    def save(self, state: dict[str, Any]) -> None: ...

    def clear(self) -> None: ...


class GcsStateStore:
    def __init__(self, controller_name: str, namespace: str) -> None:
        self.key = controller_name
        self.namespace = f"pdserve:{namespace}"

    def load(self) -> dict[str, Any] | None:
        from ray.experimental.internal_kv import _internal_kv_get
        raw = _internal_kv_get(self.key, namespace=self.namespace)
        return json.loads(raw) if raw else None

    def save(self, state: dict[str, Any]) -> None:
        from ray.experimental.internal_kv import _internal_kv_put
        _internal_kv_put(self.key, json.dumps(state), overwrite=True, namespace=self.namespace)

    def clear(self) -> None:
        from ray.experimental.internal_kv import _internal_kv_del
        _internal_kv_del(self.key, namespace=self.namespace)
