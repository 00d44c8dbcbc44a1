"""Admin HTTP routes, mounted on the router's app by `pdserve serve` (Bearer `api_key` when set):

    POST /admin/scale   {"prefill": N, "decode": M, "colocated": K, "drain": [ADDRESS, ...],
                         "wait": false, "timeout_s": 600}
                        -> {"targets": {...}} (with "wait": the controller status once settled),
                           plus "warning" when the cluster lacks the resources for the new targets
    GET  /admin/status  -> the controller status (targets, workers, recent events)

Omitted pool sizes keep their value. Errors use the router's OpenAI-style error body; while the
controller restarts, 503 with Retry-After.
"""
from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from deploy.client import ControllerClient, ControllerUnavailable
from engine.config import Role
from router.app import bearer_auth
from router.errors import invalid_request, unavailable
from router.openapi import errors

CONTROLLER_RETRY_AFTER_S = 5  # a restarted controller answers again in seconds (deploy/README.md)
POOL_FIELDS: tuple[str, ...] = tuple(role.pool for role in Role)  # the pool sizes a scale request may set

# The scale body in the router's /openapi.json (router/openapi.py); `parse_scale_body` checks it.
SCALE_BODY_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "description": "at least one pool size",
    "properties": {
        **{name: {"type": ["integer", "null"], "minimum": 0, "description": f"the {name} pool's size"}
           for name in POOL_FIELDS},
        "drain": {"type": "array", "items": {"type": "string"}, "description": "worker addresses (host:port) to drain"},
        "wait": {"type": "boolean", "description": "answer once the cluster has settled"},
        "timeout_s": {"type": "number", "exclusiveMinimum": 0, "description": "how long to wait (default 600)"}}}


def admin_routes(controller: ControllerClient, api_key: str | None) -> APIRouter:
    admin = APIRouter(prefix="/admin", dependencies=[Depends(bearer_auth(api_key))])
    auth = (401,) if api_key is not None else ()

    @admin.post("/scale", openapi_extra={"requestBody": {"required": True, "content": {
                    "application/json": {"schema": SCALE_BODY_SCHEMA}}}},
                responses={200: {"description": "the new targets (with wait: the controller's status once settled)",
                                 "content": {"application/json": {"schema": {"type": "object"}}}},
                           **errors(400, *auth, 503)})
    async def scale(request: Request) -> JSONResponse:
        """Set the pools' sizes and drain workers."""
        body = await _json_object(request)
        sizes = parse_scale_body(body)
        timeout_s = _timeout(body)
        try:
            result = await controller.scale(**sizes)
            if body.get("wait", False):
                status = await controller.wait_settled(timeout_s)
                return JSONResponse({**status, **({"warning": result["warning"]} if "warning" in result else {})})
        except ValueError as exc:
            raise invalid_request(str(exc)) from None
        except ControllerUnavailable as exc:
            raise unavailable(str(exc), CONTROLLER_RETRY_AFTER_S) from None
        return JSONResponse(result)

    @admin.get("/status", responses={200: {"description": "the controller's status: targets, workers, recent events",
                                          "content": {"application/json": {"schema": {"type": "object"}}}},
                                     **errors(*auth, 503)})
    async def status() -> JSONResponse:
        """The controller's status."""
        try:
            return JSONResponse(await controller.status())
        except ControllerUnavailable as exc:
            raise unavailable(str(exc), CONTROLLER_RETRY_AFTER_S) from None

    return admin


def parse_scale_body(body: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(body) - set(POOL_FIELDS) - {"drain", "wait", "timeout_s"})
    if unknown:
        raise invalid_request(f"unknown field(s) {', '.join(unknown)}; send {', '.join(POOL_FIELDS)}, drain, "
                              "wait, timeout_s", unknown[0])
    sizes: dict[str, Any] = {}
    for name in POOL_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise invalid_request(f"{name} must be an integer >= 0, got {value!r}", name)
        sizes[name] = value
    drain = body.get("drain", [])
    if not isinstance(drain, list) or not all(isinstance(a, str) for a in drain):
        raise invalid_request("drain must be a list of worker addresses (host:port)", "drain")
    if not sizes:
        raise invalid_request(f"nothing to scale: send at least one of {', '.join(POOL_FIELDS)}")
    if not isinstance(body.get("wait", False), bool):
        raise invalid_request("wait must be true or false", "wait")
    sizes["drain"] = drain
    return sizes


def _timeout(body: dict[str, Any]) -> float:
    value = body.get("timeout_s", 600.0)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise invalid_request(f"timeout_s must be a number > 0, got {value!r}", "timeout_s")
    return float(value)


async def _json_object(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid_request("send a JSON object such as {\"decode\": 2}", code="invalid_json")
    return body
