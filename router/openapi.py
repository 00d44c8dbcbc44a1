"""The router's API document: `GET /openapi.json` (OpenAPI 3.1) and Swagger UI at `GET /docs`.

The handlers read their bodies themselves (router/app.py `_read_json_body`: the size cap, the
OpenAI-style 400s of `protocol.parse_request`), so FastAPI never sees the request models. Each
POST route names its model with `json_body(Model)` (the route's `openapi_extra`: a `$ref` to
`#/components/schemas/<Model>`), and `install(app)` adds the named models' JSON schemas (pydantic's,
validation mode) to the document's components when the document is first built, after every
route is mounted (the `/admin` routes of `pdserve serve` too). Errors are `errors(...)`:
`protocol.ErrorResponse` per status. FastAPI's default 422 (its own validation body) is taken
out: the router answers a request that fails validation with a 400 in OpenAI's shape
(router/errors.py). With an API key, the protected routes' Bearer dependency is a security scheme
(`bearerAuth`), so the document says which routes need it; the document and /docs are open.
"""
from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from router.protocol import ErrorResponse

REF_PREFIX = "#/components/schemas/"
DESCRIPTION = """\
pdserve's OpenAI-compatible API: completions, chat completions and responses (streamed as Server-Sent
Events with `stream: true`), vLLM's `/tokenize` and `/detokenize`, and the operations routes.

Every error is `{"error": {"message", "type", "param", "code"}}` (`ErrorResponse`). Request
bodies are JSON objects of at most the router's `--max-request-body-bytes` (413 beyond);
unknown fields are ignored. When the router has an API key, the `/v1` routes, `/tokenize`,
`/detokenize`, `/status` and `/admin` need `Authorization: Bearer <key>` (`bearerAuth`);
`/health`, `/metrics` and this document do not.
"""

ERROR_WHEN: dict[int, str] = {
    400: "an invalid request: a body that is not a JSON object, a missing field, a wrong type or an out-of-range "
         "value (`param` names the field), an unsupported option, an empty prompt, a prompt longer than the context",
    401: "the API key is missing or wrong (send `Authorization: Bearer <key>`)",
    404: "`model` is not the served model, or the stored response named (`previous_response_id`, the path's "
         "id) is not kept by this router process",
    413: "the body is larger than the router's --max-request-body-bytes",
    429: "the router is at its in-flight limit, or a worker is (retry after Retry-After)",
    502: "a worker failed the request",
    503: "no healthy worker to serve it (retry after Retry-After)",
}
RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}

# Models named by `json_body`, by their schema name.
_body_models: dict[str, type[BaseModel]] = {}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra`: its JSON request body is a `model` (the handler still reads and
    validates the body itself)."""
    known = _body_models.setdefault(model.__name__, model)
    if known is not model:
        raise ValueError(f"two request models named {model.__name__}: {known} and {model}")
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": REF_PREFIX + model.__name__}}}}}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route's `responses` for the error statuses it answers."""
    return {status: {"model": ErrorResponse, "description": ERROR_WHEN[status],
                     **({"headers": RETRY_AFTER} if status in (429, 503) else {})} for status in statuses}


def install(app: FastAPI) -> None:
    """Build `app`'s document (once, at the first `/openapi.json`) with the request models."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_document(app)
        return app.openapi_schema
    app.openapi = openapi  # type: ignore[method-assign]


def build_document(app: FastAPI) -> dict[str, Any]:
    document = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    referenced = sorted({name for path in document.get("paths", {}).values() for operation in path.values()
                         for name in _body_refs(operation)})
    unknown = [name for name in referenced if name not in _body_models]
    if unknown:
        raise ValueError(f"request bodies name unknown models: {unknown} (declare them with json_body)")
    models = [(_body_models[name], "validation") for name in referenced]
    refs, definitions = models_json_schema(models, ref_template=REF_PREFIX + "{model}")
    for (model, _mode), ref in refs.items():
        if ref.get("$ref") != REF_PREFIX + model.__name__:
            raise ValueError(f"pydantic named the schema of {model} {ref}, not {model.__name__}")
    for name, schema in definitions.get("$defs", {}).items():
        if schemas.get(name, schema) != schema:
            raise ValueError(f"two different schemas named {name} in the API document")
        schemas[name] = schema
    _drop_default_422(document)
    return document


def _body_refs(operation: dict[str, Any]) -> list[str]:
    """The component names of an operation's request body schemas."""
    content = operation.get("requestBody", {}).get("content", {})
    refs = [media.get("schema", {}).get("$ref", "") for media in content.values()]
    return [ref[len(REF_PREFIX):] for ref in refs if ref.startswith(REF_PREFIX)]


def _drop_default_422(document: dict[str, Any]) -> None:
    """FastAPI documents a 422 with its own body on routes with parameters; the router answers
    those failures with a 400 in OpenAI's shape instead (errors.py)."""
    default = {"$ref": REF_PREFIX + "HTTPValidationError"}
    for path in document.get("paths", {}).values():
        for operation in path.values():
            responses = operation.get("responses", {})
            if responses.get("422", {}).get("content", {}).get("application/json", {}).get("schema") == default:
                del responses["422"]
    schemas = document.get("components", {}).get("schemas", {})
    if default["$ref"] not in json.dumps(document.get("paths", {})):
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
