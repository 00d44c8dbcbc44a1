"""OpenAI's Responses API (`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`) over the chat path.

A Responses request is said again as a chat completion request (`ResponsesRequest.chat_body`:
instructions as the first system message, input items as chat messages, flat function tools
as chat tools, `text.format` as `response_format`, `max_output_tokens` as
`max_completion_tokens`) and served by the chat path of router/app.py: the same validation,
chat template, tool plan (router/tools.py), admission and dispatch through the prefill and
decode workers. Its chat output (router/streaming.py: `collect`'s body, or the chunks of
`interleaved_chunks`) is then said as a `response` object (`_Output`: a `message` item with
`output_text`, or a `function_call` item) or as the Responses API's stream events, each with
its `sequence_number`. Errors of the chat path name the Responses fields (`in_responses_terms`).

`ResponseStore` keeps finished responses (`store`, true by default) for `previous_response_id`
and `GET` / `DELETE`: in this router process's memory only (several router processes do not
share it, and a restart forgets it), at most `RouterConfig.max_stored_responses`, the least
recently used forgotten first. A stored response holds its own input and output items and a
reference to the response it continued, so a chain is shared, not copied, turn by turn.

What is refused (a 400 naming the field): `background: true`, `reasoning`, a non-empty `include`,
`top_logprobs`, `prompt` templates, `conversation` objects, `truncation: "auto"`, tools other
than functions (web_search, file_search, ...), input parts other than text, input items other
than messages, function calls and their outputs.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import json
import re
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, AsyncIterator, Iterator, Literal, Sequence

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, Strict, ValidationError, WithJsonSchema

from router import protocol, tools
from router.dispatch import ClientGone
from router.errors import APIError, invalid_request, not_found
from router.protocol import MAX_TEMPERATURE, Bool, Int32, Int64, Number
from router.streaming import ChoiceStream, ResponseContext, collect, interleaved_chunks, usage

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
ITEM_TYPES = ("message", "function_call", "function_call_output")
TEXT_PARTS = ("input_text", "output_text")
# OpenAI's limits on metadata: 16 pairs, keys of at most 64 characters, values of at most 512.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512

# Shapes described in /openapi.json where the model takes any JSON (checked by `input_items`,
# `chat_tools`, `chat_tool_choice` and `response_format` below).
_TEXT_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": {
    "type": "object", "required": ["type", "text"],
    "properties": {"type": {"enum": list(TEXT_PARTS)}, "text": {"type": "string"}}}}]}
INPUT_ITEM_SCHEMA: dict[str, Any] = {"anyOf": [
    {"type": "object", "required": ["role", "content"], "description": "a message",
     "properties": {"type": {"const": "message"}, "role": {"enum": list(MESSAGE_ROLES)}, "content": _TEXT_CONTENT}},
    {"type": "object", "required": ["type", "call_id", "name", "arguments"],
     "description": "a function call of an earlier turn",
     "properties": {"type": {"const": "function_call"}, "call_id": {"type": "string", "minLength": 1},
                    "name": {"type": "string", "minLength": 1},
                    "arguments": {"type": "string", "description": "the arguments' JSON text"}}},
    {"type": "object", "required": ["type", "call_id", "output"], "description": "the result of a function call",
     "properties": {"type": {"const": "function_call_output"}, "call_id": {"type": "string", "minLength": 1},
                    "output": _TEXT_CONTENT}}]}
FUNCTION_TOOL_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["type", "name"],
    "properties": {"type": {"const": "function"},
                   "name": tools.FunctionSpec.model_json_schema()["properties"]["name"],  # (chat's rule)
                   "description": {"type": "string"},
                   "parameters": {"type": "object", "description": "the arguments' JSON Schema"},
                   "strict": {"type": ["boolean", "null"]}}}

# A JSON null means the default, true (OpenAI's "boolean or null")
StoreFlag = Annotated[bool, BeforeValidator(lambda value: True if value is None else value), Strict(),
                      WithJsonSchema({"type": ["boolean", "null"]})]

# pdserve/vLLM's fields that a chat request takes and a Responses request passes on as they are.
CHAT_EXTRAS = ("seed", "top_k", "min_p", "repetition_penalty", "cache_salt", "shared_cache_salt", "priority")

# Fields of the Responses API this server does not serve, with what to do instead.
_REFUSED: dict[str, str] = {
    "background": "background responses are not supported: a response is made while its request waits or "
                  "streams; leave background out (or false)",
    "reasoning": "reasoning options are not supported: this server's models do not reason; leave reasoning out",
    "include": "include is not supported: there is nothing extra to include (no reasoning, logprobs or tool "
               "sources); leave it out",
    "top_logprobs": "top_logprobs is not supported on /v1/responses; use /v1/chat/completions with logprobs",
    "prompt": "prompt templates are not supported: send input and instructions",
    "conversation": "conversations are not supported: chain responses with previous_response_id",
}


class ResponsesRequest(BaseModel):
    """`POST /v1/responses`: OpenAI's Responses API, served as a chat completion."""
    model_config = ConfigDict(extra="ignore")

    model: str = Field(description="the served model's name (`GET /v1/models`); any other is a 404")
    input: str | list[dict[str, Any]] = Field(
        description="a user message's text, or a list of items: messages (role user, system, developer or "
                    "assistant; text content), and an earlier turn's function_call and function_call_output items",
        json_schema_extra={"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": INPUT_ITEM_SCHEMA}]})
    instructions: str | None = Field(None, description="a system message put first (not carried over by "
                                                       "previous_response_id)")
    previous_response_id: str | None = Field(None, description="a stored response of this router process: its "
                                                               "input and output items come before input")
    store: StoreFlag = Field(True, description="keep the response (in this router process, bounded) for GET and "
                                               "previous_response_id")
    stream: Bool | None = Field(False, description="stream Server-Sent Events (`event: <type>`, `data: <JSON>`)")
    max_output_tokens: Int32 | None = Field(None, description="tokens to generate (default: the rest of the "
                                                              "context)", json_schema_extra={"minimum": 1})
    temperature: Number | None = Field(None, description="0 is greedy (default 1)",
                                       json_schema_extra={"minimum": 0, "maximum": MAX_TEMPERATURE})
    top_p: Number | None = Field(None, json_schema_extra={"minimum": 0, "maximum": 1})
    tools: list[Any] | None = Field(None, description="function tools ({type: function, name, description, "
                                                      "parameters, strict}); built-in tools are refused",
                                    json_schema_extra={"items": FUNCTION_TOOL_SCHEMA})
    tool_choice: Any = Field(None, description="none, auto (the default with tools), required, or {type: "
                                               "function, name}", json_schema_extra={"anyOf": [
        {"enum": ["none", "auto", "required"]},
        {"type": "object", "required": ["type", "name"],
         "properties": {"type": {"const": "function"}, "name": {"type": "string"}}},
        {"type": "null"}]})
    parallel_tool_calls: Bool | None = Field(None, description="accepted; one call per response is produced")
    text: dict[str, Any] | None = Field(None, description="text.format: text, json_object or json_schema "
                                                          "({type, name, schema, strict})", json_schema_extra={
        "properties": {"format": {"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]}, "name": {"type": "string"},
            "schema": {"type": "object"}, "strict": {"type": ["boolean", "null"]}}}}})
    metadata: dict[str, str] | None = Field(None, description="up to 16 string pairs, kept with the response",
                                            json_schema_extra={"maxProperties": MAX_METADATA_PAIRS})
    user: str | None = None
    truncation: str | None = Field(None, description='only "disabled" (the default): a conversation longer than '
                                                     'the context is a 400',
                                   json_schema_extra={"enum": ["disabled", None]})
    # pdserve/vLLM's, as in a chat completion (CHAT_EXTRAS)
    seed: Int64 | None = Field(None, description="sampling seed")
    top_k: Int32 | None = Field(None, description="vLLM's: sample among the k most likely tokens")
    min_p: Number | None = Field(None, description="vLLM's", json_schema_extra={"minimum": 0, "maximum": 1})
    repetition_penalty: Number | None = Field(None, description="vLLM's",
                                              json_schema_extra={"exclusiveMinimum": 0, "maximum": 10})
    cache_salt: str | None = Field(None, description="vLLM's: prompts share cached KV only with the same salt",
                                   json_schema_extra={"minLength": 1})
    shared_cache_salt: str | None = Field(None, description="pdserve's, with cache_salt: the instructions and "
                                                            "leading system messages are cached under this salt, "
                                                            "shared with the tenants that give the same one",
                                          json_schema_extra={"minLength": 1})
    priority: Int32 | None = Field(None, description="vLLM's: lower runs first; above 0, a batch request")
    # OpenAI fields this server does not serve (_REFUSED): named here so that they are refused, not ignored.
    background: Any = Field(None, description="not supported: true is a 400")
    reasoning: Any = Field(None, description="not supported: a 400")
    include: Any = Field(None, description="not supported: a non-empty list is a 400")
    top_logprobs: Any = Field(None, description="not supported: a 400 (above 0)")
    prompt: Any = Field(None, description="not supported (prompt templates): a 400")
    conversation: Any = Field(None, description="not supported (use previous_response_id): a 400")
    _items: list[dict[str, Any]] = PrivateAttr(default_factory=list)

    def check_supported(self) -> None:
        """A 400 for what this server does not serve; the input items checked (`items`)."""
        for name, why in _REFUSED.items():
            if _asks_for(getattr(self, name)):
                raise invalid_request(why, name)
        if self.truncation not in (None, "disabled"):
            raise invalid_request('truncation must be "disabled": a conversation longer than the context is a 400 '
                                  "here, never cut", "truncation")
        _check_metadata(self.metadata)
        self._items = input_items(self.input)
        chat_tools(self.tools)
        chat_tool_choice(self.tool_choice)
        response_format(self.text)

    @property
    def items(self) -> list[dict[str, Any]]:
        """The input as items (a string is one user message), checked by `check_supported`."""
        return self._items

    def chat_body(self, earlier: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """This request as a chat completion request's body, after the `earlier` items (the
        conversation that previous_response_id names)."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        body: dict[str, Any] = {
            "model": self.model, "messages": system + chat_messages([*earlier, *self.items]),
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "tools": chat_tools(self.tools), "tool_choice": chat_tool_choice(self.tool_choice),
            "parallel_tool_calls": self.parallel_tool_calls, "response_format": response_format(self.text),
            "user": self.user, **{name: getattr(self, name) for name in CHAT_EXTRAS}}
        return {key: value for key, value in body.items() if value is not None}


def _asks_for(value: Any) -> bool:
    """Whether a refused field asks for something: set, and not to its "off" value (false, 0,
    an empty list or an object of nulls)."""
    if isinstance(value, dict):
        return any(v is not None for v in value.values())
    return value not in (None, False, 0, [])


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise invalid_request(f"metadata takes at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}", "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise invalid_request(f"metadata keys are at most {MAX_METADATA_KEY} characters and values at most "
                                  f"{MAX_METADATA_VALUE}; {key[:80]!r} is longer", "metadata")


# ---- Responses fields -> chat fields -------------------------------------------------------------

def input_items(given: str | list[Any]) -> list[dict[str, Any]]:
    """The input as checked items: a string is one user message; a 400 (param `input`) names a
    malformed or unsupported item."""
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": given}]
    if not given:
        raise _bad_input("input must be a string or a non-empty list of items")
    return [_input_item(item, f"input[{index}]") for index, item in enumerate(given)]


def _input_item(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise _bad_input(f"{where} must be an object: a message, function_call or function_call_output item")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise _bad_input(f"{where}: a message's role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r} "
                             "(a tool result is a function_call_output item)")
        return {"type": "message", "role": role, "content": _text_content(item.get("content"), f"{where}.content")}
    if kind == "function_call":
        return {"type": "function_call", "call_id": _string(item, "call_id", where),
                "name": _string(item, "name", where), "arguments": _string(item, "arguments", where, empty=True)}
    if kind == "function_call_output":
        return {"type": "function_call_output", "call_id": _string(item, "call_id", where),
                "output": _text_content(item.get("output"), f"{where}.output")}
    raise _bad_input(f"{where}: items of type {kind!r} are not supported; this server takes "
                     f"{', '.join(ITEM_TYPES)} items")


def _text_content(content: Any, where: str) -> str | list[dict[str, str]]:
    """A string, or text parts (input_text, output_text) as given."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad_input(f"{where} must be a string or a list of input_text / output_text parts")
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in TEXT_PARTS:
            raise _bad_input(f"{where}[{index}]: only text parts ({', '.join(TEXT_PARTS)}) are supported, got {kind!r}")
        if not isinstance(part.get("text"), str):
            raise _bad_input(f"{where}[{index}]: a {kind} part needs a string 'text'")
    return [{"type": part["type"], "text": part["text"]} for part in content]


def _string(item: dict[str, Any], key: str, where: str, empty: bool = False) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not (value or empty):
        raise _bad_input(f"{where}: a {item.get('type')} item needs a {'' if empty else 'non-empty '}string {key!r}")
    return value


def _bad_input(message: str) -> APIError:
    return invalid_request(message, "input")


def chat_messages(items: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Checked items (input items, or a stored response's input and output items) as chat
    messages; consecutive function calls are one assistant message's tool_calls."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if item["type"] == "message":
            messages.append({"role": item["role"], "content": _chat_content(item["content"])})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else {}
            if last.get("role") == "assistant" and last.get("tool_calls") and last.get("content") is None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _chat_content(item["output"])})
    return messages


def _chat_content(content: str | list[dict[str, Any]]) -> str | list[dict[str, str]]:
    return content if isinstance(content, str) else [{"type": "text", "text": part["text"]} for part in content]


class _FunctionTool(tools.FunctionSpec):
    """A function tool in the Responses API's flat shape."""
    type: Literal["function"]
    strict: bool | None = None


def chat_tools(given: list[Any] | None) -> list[dict[str, Any]] | None:
    """Flat function tools as chat tools; a 400 for a built-in tool or a malformed one."""
    if given is None:
        return None
    converted = []
    for index, tool in enumerate(given):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise invalid_request(f"tools[{index}]: only function tools are supported ({{'type': 'function', 'name': "
                                  f"..., 'parameters': {{...}}}}), got type {kind!r}; built-in tools (web_search, "
                                  "file_search, ...) are not", "tools")
        try:
            spec = _FunctionTool.model_validate(tool)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in (f"tools[{index}]", *first["loc"]))
            raise invalid_request(f"invalid tool: {where}: {first['msg']}; each tool is {{'type': 'function', "
                                  "'name': ..., 'parameters': {...}}", "tools") from None
        function = {"name": spec.name, "description": spec.description, "parameters": spec.parameters}
        converted.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return converted


def chat_tool_choice(given: Any) -> Any:
    """`tool_choice` in chat's shape: the modes as they are, `{type: function, name}` nested."""
    if given is None or given in ("none", "auto", "required"):
        return given
    if isinstance(given, dict) and given.get("type") == "function" and isinstance(given.get("name"), str):
        return {"type": "function", "function": {"name": given["name"]}}
    raise invalid_request("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}; "
                          "built-in tools and allowed_tools are not supported", "tool_choice")


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (None for free text)."""
    spec = (text or {}).get("format")
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {key: spec[key] for key in ("name", "schema", "strict") if spec.get(key) is not None}
        return {"type": "json_schema", "json_schema": schema}
    raise invalid_request(f"text.format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                          "text.format")


# The chat fields a Responses request was said in, by the Responses field they came from.
_CHAT_FIELDS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}
_CHAT_FIELD_NAMES = re.compile(r"\b(" + "|".join(_CHAT_FIELDS) + r")\b")


@contextlib.contextmanager
def in_responses_terms() -> Iterator[None]:
    """Around the chat path: its errors (the chat request's checks, the chat template, the context
    length) name the Responses fields the client sent."""
    try:
        yield
    except APIError as exc:
        message = _CHAT_FIELD_NAMES.sub(lambda match: _CHAT_FIELDS[match.group(1)], exc.message)
        raise APIError(exc.status, message, exc.type, _CHAT_FIELDS.get(exc.param or "", exc.param), exc.code,
                       exc.headers) from None


# ---- the store ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class StoredResponse:
    """A finished response: its body (what GET returns) and its conversation: the response it
    continued (`previous`), then its own input and output items."""
    body: dict[str, Any]
    items: tuple[dict[str, Any], ...]
    previous: "StoredResponse | None"

    def conversation(self) -> list[dict[str, Any]]:
        """Every item through this response, the first turn's first."""
        chain, node = [], self
        while node is not None:
            chain.append(node.items)
            node = node.previous
        return [item for items in reversed(chain) for item in items]


class ResponseStore:
    """This router process's stored responses, by id: at most `capacity`, the least recently
    used (created, read or continued) forgotten first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def begin(self, request: ResponsesRequest) -> "Turn":
        """A response to `request`; a 404 when its previous_response_id is not stored."""
        previous = None
        if request.previous_response_id is not None:
            previous = self._find(request.previous_response_id)
            if previous is None:
                raise not_found(f"Previous response with id {request.previous_response_id!r} not found (responses "
                                f"are kept in the router process that made them, the last {self.capacity}).",
                                "previous_response_id", "previous_response_not_found")
        return Turn(self, request, previous)

    def get(self, response_id: str) -> dict[str, Any]:
        """A stored response's body; a 404 when it is not stored."""
        stored = self._find(response_id)
        if stored is None:
            raise self._unknown(response_id)
        return stored.body

    def delete(self, response_id: str) -> dict[str, Any]:
        if self._entries.pop(response_id, None) is None:
            raise self._unknown(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def put(self, stored: StoredResponse) -> None:
        self._entries[stored.body["id"]] = stored
        self._entries.move_to_end(stored.body["id"])
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def _find(self, response_id: str) -> StoredResponse | None:
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)
        return stored

    def _unknown(self, response_id: str) -> APIError:
        return not_found(f"Response with id {response_id!r} not found (responses are kept in the router process "
                         f"that made them, the last {self.capacity}, when made with store: true).",
                         "response_id", "response_not_found")


# ---- output -------------------------------------------------------------------------------------

def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Output:
    """A response's output items, built from the chat path's text and tool call, and the stream
    events (without their sequence numbers) that build them on a client."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None  # the message item being written, at `_index`
        self._index = 0

    def text(self, delta: str) -> list[dict[str, Any]]:
        if not delta:
            return []
        events = self._open_message() if self._message is None else []
        self._message["content"][0]["text"] += delta
        return events + [self._text_event("response.output_text.delta", delta=delta, logprobs=[])]

    def call(self, tool_call: dict[str, Any]) -> list[dict[str, Any]]:
        """A whole call (router/tools.py's chat `tool_calls` entry) as a function_call item."""
        function = tool_call["function"]
        item = {"id": _new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": tool_call["id"],
                "name": function["name"], "arguments": ""}
        index, where = len(self.items), {"item_id": item["id"], "output_index": len(self.items)}
        self.items.append(item)
        events = [{"type": "response.output_item.added", "output_index": index, "item": dict(item)},
                  {"type": "response.function_call_arguments.delta", **where, "delta": function["arguments"]},
                  {"type": "response.function_call_arguments.done", **where, "name": item["name"],
                   "arguments": function["arguments"]}]
        item.update(arguments=function["arguments"], status="completed")
        return events + [{"type": "response.output_item.done", "output_index": index, "item": dict(item)}]

    def finish(self, complete: bool) -> list[dict[str, Any]]:
        """Close the output: the message being written (an empty one when there is nothing else)."""
        events = self._open_message() if self._message is None and not self.items else []
        if self._message is None:
            return events
        message, index = self._message, self._index
        message["status"] = "completed" if complete else "incomplete"
        part = message["content"][0]
        self._message = None
        return events + [
            {"type": "response.output_text.done", "item_id": message["id"], "output_index": index, "content_index": 0,
             "text": part["text"], "logprobs": []},
            {"type": "response.content_part.done", "item_id": message["id"], "output_index": index,
             "content_index": 0, "part": dict(part)},
            {"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(message)}]

    def _open_message(self) -> list[dict[str, Any]]:
        message = {"id": _new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                   "content": []}
        index = len(self.items)
        self.items.append(message)
        added = {"type": "response.output_item.added", "output_index": index, "item": copy.deepcopy(message)}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        message["content"].append(part)
        self._message, self._index = message, index
        return [added, {"type": "response.content_part.added", "item_id": message["id"], "output_index": index,
                        "content_index": 0, "part": dict(part)}]

    def _text_event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "item_id": self._message["id"], "output_index": self._index, "content_index": 0,
                **fields}


def _usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """Chat's usage in the Responses API's names."""
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


class _Sequence:
    """Numbers a stream's events and writes them as SSE (`event: <type>`, `data: <JSON>`)."""

    def __init__(self) -> None:
        self.next = 0

    def sse(self, event: dict[str, Any]) -> str:
        numbered = {"type": event["type"], "sequence_number": self.next,
                    **{k: v for k, v in event.items() if k != "type"}}
        self.next += 1
        payload = json.dumps(numbered, ensure_ascii=False, separators=(",", ":"))
        return f"event: {event['type']}\ndata: {payload}\n\n"


_FAILURE_CODES = {400: "invalid_prompt", 429: "rate_limit_exceeded"}  # others: server_error


class Turn:
    """One response being made: the request in chat terms, its output said as a `response` (whole
    or as stream events), stored when it finishes (`store`)."""

    def __init__(self, store: ResponseStore, request: ResponsesRequest, previous: StoredResponse | None) -> None:
        self.id = _new_id("resp")  # also the request id the workers see
        self.created_at = protocol.now()
        self.request = request
        self._store = store
        self._previous = previous

    def chat_request(self) -> protocol.ChatCompletionRequest:
        """The chat completion request this response is served as (400s in chat's field names:
        run it `in_responses_terms`)."""
        earlier = self._previous.conversation() if self._previous is not None else []
        return protocol.parse_request(protocol.ChatCompletionRequest, self.request.chat_body(earlier))

    async def body(self, ctx: ResponseContext, streams: Sequence[ChoiceStream]) -> dict[str, Any]:
        """The whole response (the chat path's body, said again); APIError / ClientGone propagate."""
        chat = await collect(ctx, streams)
        [choice] = chat["choices"]
        output = _Output()
        output.text(choice["message"]["content"] or "")
        for call in choice["message"].get("tool_calls") or []:
            output.call(call)
        return self._finish(output, choice["finish_reason"], chat["usage"])[1]

    async def events(self, ctx: ResponseContext, streams: Sequence[ChoiceStream]) -> AsyncIterator[str]:
        """The SSE body: response.created, response.in_progress, the output's events, then
        response.completed, response.incomplete (max_output_tokens) or response.failed (a failure
        after the stream began)."""
        sequence, output = _Sequence(), _Output()
        try:
            for kind in ("response.created", "response.in_progress"):
                yield sequence.sse({"type": kind, "response": self._response("in_progress", [])})
            finish_reason = None
            try:
                async for chunk in interleaved_chunks(ctx, streams):
                    [choice] = chunk["choices"]
                    events = output.text(choice["delta"].get("content") or "")
                    for call in choice["delta"].get("tool_calls") or []:
                        events += output.call(call)
                    finish_reason = choice["finish_reason"] or finish_reason
                    for event in events:
                        yield sequence.sse(event)
            except APIError as exc:
                error = {"code": _FAILURE_CODES.get(exc.status, "server_error"), "message": exc.message}
                failed = self._response("failed", output.items, error=error)
                yield sequence.sse({"type": "response.failed", "response": failed})
                return
            events, final = self._finish(output, finish_reason, usage(streams))
            for event in events:
                yield sequence.sse(event)
            yield sequence.sse({"type": f"response.{final['status']}", "response": final})
        except ClientGone:
            return
        finally:
            for stream in streams:
                stream.close()

    def _finish(self, output: _Output, finish_reason: str | None,
                chat_usage: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The output closed (its last events) and the final response, stored if asked."""
        complete = finish_reason != "length"
        events = output.finish(complete)
        final = self._response("completed" if complete else "incomplete", output.items, usage=_usage(chat_usage),
                               incomplete=None if complete else {"reason": "max_output_tokens"})
        if self.request.store:
            self._store.put(StoredResponse(final, (*self.request.items, *output.items), self._previous))
        return events, final

    def _response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                  incomplete: dict[str, Any] | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The `response` object (`ResponseObject`)."""
        request = self.request
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "error": error,
            "incomplete_details": incomplete, "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens, "model": request.model, "output": copy.deepcopy(output),
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": request.store, "temperature": 1.0 if request.temperature is None else request.temperature,
            "text": {"format": (request.text or {}).get("format") or {"type": "text"}},
            "tool_choice": "auto" if request.tool_choice is None else request.tool_choice,
            "tools": request.tools or [], "top_p": 1.0 if request.top_p is None else request.top_p,
            "truncation": "disabled", "usage": usage, "user": request.user, "metadata": request.metadata or {},
            "background": False}


# ---- the API document (router/openapi.py): these describe the bodies above, never instantiated ----

class ResponseOutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class ResponseOutputMessage(BaseModel):
    id: str
    type: Literal["message"]
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[ResponseOutputText]


class ResponseFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"]
    status: Literal["in_progress", "completed"]
    call_id: str = Field(description="what the function_call_output item of the next turn names")
    name: str
    arguments: str = Field(description="the arguments' JSON text")


class ResponseInputTokensDetails(BaseModel):
    cached_tokens: int = Field(description="input tokens served from a prefix cache")


class ResponseOutputTokensDetails(BaseModel):
    reasoning_tokens: int = Field(description="always 0")


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: ResponseInputTokensDetails
    output_tokens: int
    output_tokens_details: ResponseOutputTokensDetails
    total_tokens: int


class ResponseIncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseFailure(BaseModel):
    code: str = Field(description="server_error, invalid_prompt or rate_limit_exceeded")
    message: str


class ResponseObject(BaseModel):
    """A `response` (`POST /v1/responses`, `GET /v1/responses/{id}`)."""
    id: str = Field(description="resp_...")
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseFailure | None
    incomplete_details: ResponseIncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[ResponseOutputMessage | ResponseFunctionCall]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any]
    store: bool
    temperature: float | None
    text: dict[str, Any]
    tool_choice: Any
    tools: list[Any]
    top_p: float | None
    truncation: Literal["disabled"]
    usage: ResponseUsage | None
    user: str | None
    metadata: dict[str, str]
    background: bool


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response.deleted"]
    deleted: bool
