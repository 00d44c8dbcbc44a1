"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

Every failure the router answers goes through `APIError`; the exception handlers installed by
`install_error_handlers` turn FastAPI's own errors (bad route, bad method, validation) into the
same shape. A client's mistake is a 4xx, never a 500; 429/503 carry `Retry-After`.
"""
from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def context_length_exceeded(message: str, param: str = "messages") -> APIError:
    return APIError(400, message, "invalid_request_error", param, "context_length_exceeded")


def model_not_found(model: str, served: str) -> APIError:
    return APIError(404, f"The model {model!r} does not exist; this server serves {served!r}.",
                    "invalid_request_error", "model", "model_not_found")


def not_found(message: str, param: str | None, code: str) -> APIError:
    """A 404 for something the request names that this router does not have (e.g. a stored response)."""
    return APIError(404, message, "invalid_request_error", param, code)


def unauthorized() -> APIError:
    return APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                    "invalid_request_error", None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})


def payload_too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server accepts ({limit} bytes).",
                    "invalid_request_error", None, "request_too_large")


def overloaded(message: str, retry_after_s: int) -> APIError:
    return APIError(429, message, "rate_limit_error", None, "rate_limit_exceeded",
                    {"Retry-After": str(retry_after_s)})


def unavailable(message: str, retry_after_s: int) -> APIError:
    return APIError(503, message, "service_unavailable", None, "service_unavailable",
                    {"Retry-After": str(retry_after_s)})


def upstream_failed(message: str) -> APIError:
    return APIError(502, message, "upstream_error", None, "worker_error")


def internal_error(message: str = "The server had an internal error while processing the request.") -> APIError:
    return APIError(500, message, "internal_error", None, "internal_error")


_STATUS_TYPES = {404: ("not_found_error", "not_found"), 405: ("invalid_request_error", "method_not_allowed")}


def _validation_error(exc: RequestValidationError) -> APIError:
    first = exc.errors()[0] if exc.errors() else {}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    message = first.get("msg", "invalid request")
    return invalid_request(f"{param}: {message}" if param else message, param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_, code = _STATUS_TYPES.get(exc.status_code, ("invalid_request_error", None))
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return APIError(exc.status_code, message, type_, None, code, dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in the router")
        return internal_error().response()
