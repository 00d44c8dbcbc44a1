"""The router's API document: `/openapi.json` is a valid OpenAPI document that describes every
route (request bodies by their protocol models, errors in OpenAI's shape, the Bearer scheme
when there is an API key), `/docs` serves Swagger UI, and a schemathesis run over every
operation, against fake workers, gets no 5xx."""
import os

import httpx
import pytest
from openapi_spec_validator import validate

from tests.router.conftest import MODEL

OPERATIONS = [
    ("post", "/v1/completions"), ("post", "/v1/chat/completions"), ("post", "/tokenize"), ("post", "/detokenize"),
    ("post", "/v1/responses"), ("get", "/v1/responses/{response_id}"), ("delete", "/v1/responses/{response_id}"),
    ("get", "/v1/models"), ("get", "/v1/models/{model}"), ("get", "/health"), ("get", "/status"), ("get", "/metrics"),
]
BODIES = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest",
          "/v1/responses": "ResponsesRequest",
          "/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest"}
REF = "#/components/schemas/"


def document_of(url: str) -> dict:
    response = httpx.get(url + "/openapi.json")
    assert response.status_code == 200, response.text
    return response.json()


def refs_in(node) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [ref for value in node.values() for ref in refs_in(value)]
    if isinstance(node, list):
        return [r for v in node for r in refs_in(v)]
    return []


def test_document_is_valid_and_describes_every_route(router):
    document = document_of(router.url)
    validate(document)  # OpenAPI 3.1
    assert document["openapi"].startswith("3.")
    schemas = document["components"]["schemas"]
    for ref in refs_in(document):  # every $ref resolves to a component
        assert ref.startswith(REF) and ref[len(REF):] in schemas, ref
    operations = sorted((method, path) for path, item in document["paths"].items() for method in item)
    assert operations == sorted(OPERATIONS)  # all of them, and nothing else
    for path, model in BODIES.items():
        body = document["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"] == {"$ref": REF + model}
    for method, path in OPERATIONS:
        operation = document["paths"][path][method]
        assert operation.get("description") or operation.get("summary"), (method, path)
        assert "422" not in operation["responses"]  # a failed validation is a 400 (errors.py)
        for status, response in operation["responses"].items():
            if status != "200":
                assert response["content"]["application/json"]["schema"] == {"$ref": REF + "ErrorResponse"}
        assert "security" not in operation  # no API key configured
    assert {"400", "404", "413", "429", "502", "503"} <= set(document["paths"]["/v1/chat/completions"]["post"]["responses"])
    assert set(document["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]) == {
        "application/json", "text/event-stream"}
    assert document["paths"]["/v1/completions"]["post"]["responses"]["429"]["headers"]["Retry-After"]
    assert schemas["ErrorResponse"]["properties"]["error"] == {"$ref": REF + "ErrorDetail"}
    assert set(schemas["ErrorDetail"]["required"]) == {"message", "type", "param", "code"}
    assert "text/plain" in document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]

    chat = schemas["ChatCompletionRequest"]
    assert {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop", "seed",
            "tools", "tool_choice", "stream", "stream_options", "logprobs", "top_logprobs", "response_format",
            "structured_outputs", "logit_bias"} <= set(chat["properties"])
    assert set(chat["required"]) == {"model", "messages"}
    roles = [role for variant in chat["properties"]["messages"]["items"]["anyOf"]
             for role in variant["properties"]["role"]["enum"]]
    assert set(roles) == {"system", "developer", "user", "assistant", "tool"}
    assert chat["properties"]["temperature"]["maximum"] == 2
    completion = schemas["CompletionRequest"]
    assert {"prompt", "max_tokens", "echo", "best_of", "logprobs", "suffix"} <= set(completion["properties"])
    assert set(completion["required"]) == {"model", "prompt"}
    assert set(schemas["DetokenizeRequest"]["required"]) == {"model", "tokens"}
    assert {"prompt", "messages", "add_special_tokens"} <= set(schemas["TokenizeRequest"]["properties"])


def test_docs_serve_swagger_ui(router):
    response = httpx.get(router.url + "/docs")
    assert response.status_code == 200
    assert "swagger-ui" in response.text and "/openapi.json" in response.text


def test_api_key_guards_the_api_not_its_description(make_router, decode):
    router = make_router(colocated=[decode.address], api_key="s3cret")
    document = document_of(router.url)  # no key needed
    assert httpx.get(router.url + "/docs").status_code == 200
    validate(document)
    assert document["components"]["securitySchemes"] == {"bearerAuth": {
        "type": "http", "scheme": "bearer", "description": "the router's API key (--api-key, $PDSERVE_API_KEY)"}}
    for method, path in OPERATIONS:
        operation = document["paths"][path][method]
        protected = path not in ("/health", "/metrics")
        assert (operation.get("security") == [{"bearerAuth": []}]) is protected, (method, path)
        assert ("401" in operation["responses"]) is protected, (method, path)
    assert httpx.get(router.url + "/v1/models").status_code == 401  # the routes themselves still need it


def test_admin_routes_are_described(make_router, decode):
    from deploy.admin import admin_routes
    router = make_router(colocated=[decode.address])
    router.app.include_router(admin_routes(controller=None, api_key=None))
    router.app.openapi_schema = None  # (the app was built before the admin routes were mounted)
    document = document_of(router.url)
    validate(document)
    scale = document["paths"]["/admin/scale"]["post"]
    body = scale["requestBody"]["content"]["application/json"]["schema"]
    assert {"prefill", "decode", "colocated", "drain", "wait", "timeout_s"} <= set(body["properties"])
    assert scale["responses"]["400"]["content"]["application/json"]["schema"] == {"$ref": REF + "ErrorResponse"}
    assert "get" in document["paths"]["/admin/status"]


# ---- schemathesis: no 5xx for anything a client sends -------------------------------------------

EXAMPLES = int(os.environ.get("PDSERVE_OPENAPI_EXAMPLES", 25))  # per operation and generation mode


@pytest.mark.parametrize("method, path, mode", [(method, path, "positive") for method, path in OPERATIONS] + [
    ("post", path, "negative") for path in BODIES])  # (a GET here has no input a client could get wrong)
def test_schemathesis_finds_no_server_error(router, method, path, mode):
    """Requests generated from the document (half of them naming the served model, so that they get
    past the 404 and into tokenizing, admission and the fake workers) are never answered 5xx,
    and every 4xx carries an OpenAI error body; valid ones (positive) get the documented
    statuses, content types and bodies; bodies broken against their schemas (negative) are never
    a 5xx either. Derandomized: CI runs the same
    examples each time; PDSERVE_OPENAPI_EXAMPLES=300 for a longer hunt."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings, strategies as st
    from schemathesis.checks import (content_type_conformance, not_a_server_error, response_schema_conformance,
                                     status_code_conformance)

    schema = schemathesis.openapi.from_dict(document_of(router.url))
    operation = schema[path][method.upper()]
    checks = [not_a_server_error]
    if mode == "positive":
        checks += [status_code_conformance, content_type_conformance, response_schema_conformance]
    # (negative: no 5xx only. The router is lenient where the document is strict in places, as
    # OpenAI's API is: a chat message's `name` or a tool call's `id` of another type is ignored.)

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode)), served=st.booleans())
    def run(case, served):
        if served and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL
        if served and case.path_parameters and "model" in case.path_parameters:
            case.path_parameters["model"] = MODEL
        response = case.call(base_url=router.url, timeout=30)
        if os.environ.get("PDSERVE_OPENAPI_TRACE"):
            print("TRACE", mode, path, response.status_code, response.text[:200].replace("\n", " "))
        case.validate_response(response, checks=checks)
        if 400 <= response.status_code < 500:  # every client error, valid request or broken, is OpenAI's shape
            error = response.json()["error"]
            assert isinstance(error["message"], str) and error["message"] and error["type"], response.text

    run()
