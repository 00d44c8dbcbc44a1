"""The OpenAI HTTP API's shapes: request models (validated -> 400) and response/chunk builders.

Field names follow OpenAI's; a few vLLM-style extensions are accepted (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`, `skip_special_tokens`,
`include_stop_str_in_output`, `cache_salt`, `priority`, and `structured_outputs` for regex,
choice and grammar constraints next to OpenAI's `response_format`). Unknown fields are ignored,
as OpenAI clients send ones that a server may not know. Values outside what this server supports
(suffix, n or best_of above MAX_CHOICES) are refused with a 400 that says so. `n > 1`, `best_of`
and a completions batch of prompts are served by the router (router/choices.py); `echo` and
vLLM's `prompt_logprobs` by the worker that prefills the prompt (router/streaming.py renders them). Tools: router/tools.py. Sampling ranges are
the engine's (`engine.sampling_params.SamplingParams`), and so is the check of a constraint
(`engine.structured_output.StructuredOutput`: a schema, regex or grammar that does not parse is a
400 naming the problem).
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, Strict, ValidationError, WithJsonSchema,
                      field_validator)

from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutput
from router import tools as tool_calling
from router.errors import APIError, invalid_request

Int = Annotated[int, Strict()]
Int32 = Annotated[int, Strict(), Field(ge=-2**31, le=2**31 - 1)]  # bounds of the wire schema's fields
Int64 = Annotated[int, Strict(), Field(ge=-2**63, le=2**63 - 1)]
UInt32 = Annotated[int, Strict(), Field(ge=0, le=2**32 - 1)]
Number = Annotated[float, Strict(), Field(allow_inf_nan=False)]
Bool = Annotated[bool, Strict()]
# OpenAI's "boolean or null" fields: null means the default, false
OptionalBool = Annotated[bool, BeforeValidator(lambda value: False if value is None else value), Strict(),
                         WithJsonSchema({"type": ["boolean", "null"]})]
TokenIds = list[UInt32]

# OpenAI's range; the engine takes more, but above 2 a model's output is noise.
MAX_TEMPERATURE = 2.0
# Most choices one request may ask for (n, or best_of candidates): each is a sequence on a decode
# worker, admitted as a request of its own.
MAX_CHOICES = 16


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

# Shapes described in /openapi.json where the models take any JSON (the router checks them as it
# renders the messages and compiles the tools: router/tools.py, engine/tokenizer.py).
_TEXT_PARTS = {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                          "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}
_CONTENT = {"anyOf": [{"type": "string"}, _TEXT_PARTS]}
_TOOL_CALL = {"type": "object", "required": ["function"], "properties": {
    "id": {"type": "string"}, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "arguments": {"type": "string", "description": "the arguments' JSON text"}}}}}


def _message(role: list[str], required: list[str], **properties: Any) -> dict[str, Any]:
    return {"type": "object", "required": ["role", *required],
            "properties": {"role": {"enum": role}, "content": _CONTENT, "name": {"type": "string"}, **properties}}


CHAT_MESSAGE_SCHEMA: dict[str, Any] = {"anyOf": [
    _message(["system", "developer", "user"], ["content"]),
    _message(["assistant"], ["content"]),
    _message(["assistant"], ["tool_calls"], content={"anyOf": [*_CONTENT["anyOf"], {"type": "null"}]},
             tool_calls={"type": "array", "minItems": 1, "items": _TOOL_CALL}),
    _message(["tool"], ["content", "tool_call_id"],
             tool_call_id={"type": "string", "minLength": 1, "description": "the call this message answers"})]}
TOOL_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["type", "function"],
    "properties": {"type": {"const": "function"},
                   "function": {"type": "object", "required": ["name"],
                                "properties": {"name": {"type": "string"}, "description": {"type": "string"},
                                               "parameters": {"type": "object",
                                                              "description": "the arguments' JSON Schema"},
                                               "strict": {"type": ["boolean", "null"]}}}}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: OptionalBool = False


class _GenerationRequest(BaseModel):
    """Fields shared by both endpoints."""
    model_config = ConfigDict(extra="ignore")

    model: str = Field(description="the served model's name (`GET /v1/models`); any other is a 404")
    temperature: Number | None = Field(None, description="0 is greedy (default 1)",
                                       json_schema_extra={"minimum": 0, "maximum": MAX_TEMPERATURE})
    top_p: Number | None = Field(None, description="nucleus sampling (0 keeps the most likely token)",
                                 json_schema_extra={"minimum": 0, "maximum": 1})
    top_k: Int32 | None = Field(None, description="vLLM's: sample among the k most likely tokens (-1 or 0: all)")
    min_p: Number | None = Field(None, description="vLLM's: drop tokens below min_p times the top one's probability",
                                 json_schema_extra={"minimum": 0, "maximum": 1})
    presence_penalty: Number | None = Field(None, json_schema_extra={"minimum": -2, "maximum": 2})
    frequency_penalty: Number | None = Field(None, json_schema_extra={"minimum": -2, "maximum": 2})
    repetition_penalty: Number | None = Field(None, description="vLLM's (default 1)",
                                              json_schema_extra={"exclusiveMinimum": 0, "maximum": 10})
    seed: Int64 | None = Field(None, description="sampling seed (choice i of n uses seed + i)")
    stop: str | list[str] | None = Field(None, description="a stop string or up to 16, each at most 4096 characters")
    stop_token_ids: TokenIds | None = Field(None, description="vLLM's: token ids that end the output")
    ignore_eos: Bool = Field(False, description="vLLM's: keep generating past EOS")
    n: Int32 | None = Field(1, description="choices to return", json_schema_extra={"minimum": 1, "maximum": MAX_CHOICES})
    stream: Bool | None = Field(False, description="stream Server-Sent Events (text/event-stream), ending with "
                                                   "`data: [DONE]`")
    stream_options: StreamOptions | None = Field(None, description="only with stream: include_usage adds a last "
                                                                   "chunk with the usage")
    user: str | None = None
    logit_bias: dict[str, Number] | None = Field(  # token id (a decimal string, as OpenAI sends it) -> bias
        None, description="token id (a decimal string) -> bias in [-100, 100] added to its logit",
        json_schema_extra={"propertyNames": {"pattern": "^[0-9]+$"}})
    min_tokens: Int32 = Field(0, description="vLLM's: no EOS or stop token id before this many tokens")
    prompt_logprobs: Int32 | None = Field(None, description="vLLM's: each prompt token's logprob, plus the top k",
                                          json_schema_extra={"minimum": 0, "maximum": 20})
    speculative: Bool = Field(True, description="pdserve's: false keeps this request out of speculative decoding")
    skip_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    cache_salt: str | None = Field(None, description="vLLM's: prompts share cached KV only with the same salt",
                                   json_schema_extra={"minLength": 1})
    shared_cache_salt: str | None = Field(
        None, description="pdserve's, chat only, with cache_salt: the leading system (or developer) messages are "
                          "cached under this salt instead, so tenants giving the same one share that system "
                          "prompt's KV while the rest of each prompt stays under its own cache_salt",
        json_schema_extra={"minLength": 1})
    priority: Int32 = Field(0, description="vLLM's: lower runs first; above 0, a batch request (its share of the "
                                           "router's in-flight limit)")
    response_format: dict[str, Any] | None = Field(None, description="structured output", json_schema_extra={
        "properties": {"type": {"enum": ["text", "json_object", "json_schema"]},
                       "json_schema": {"type": "object", "properties": {"name": {"type": "string"},
                                                                        "schema": {"type": "object"}}}}})
    structured_outputs: dict[str, Any] | None = Field(  # vLLM's extension: json, regex, choice or grammar
        None, description="vLLM's structured output: exactly one of json (a schema), json_object, regex, choice "
                          "(a list of strings), grammar (EBNF)", json_schema_extra={
            "properties": {"json": {"type": ["object", "string", "boolean"]}, "json_object": {"type": "boolean"},
                           "regex": {"type": "string"}, "choice": {"type": "array", "items": {"type": "string"}},
                           "grammar": {"type": "string"}}})

    def check_supported(self) -> None:
        if self.temperature is not None and not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise invalid_request(f"temperature must be in [0, {MAX_TEMPERATURE:g}], as in OpenAI's API, got "
                                  f"{self.temperature:g}", "temperature")
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            raise invalid_request(f"n must be in [1, {MAX_CHOICES}], got {self.n}", "n")
        for key in self.logit_bias or {}:
            if not (key.isascii() and key.isdigit()):  # ("²".isdigit() holds, and int() refuses it)
                raise invalid_request(f"logit_bias keys must be token ids (decimal strings), got {key!r}", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise invalid_request("stream_options is only allowed when stream is true", "stream_options")
        if self.cache_salt is not None and not self.cache_salt:
            raise invalid_request("cache_salt must be a non-empty string when set", "cache_salt")
        if self.shared_cache_salt is not None and not (self.shared_cache_salt and self.cache_salt):
            raise invalid_request("shared_cache_salt must be a non-empty string, given with cache_salt (which keys "
                                  "the rest of the prompt)", "shared_cache_salt")

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def num_candidates(self) -> int:
        """Sequences to generate: n, or best_of (completions) to keep the n most likely of."""
        return self.num_choices

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's SamplingParams; its ValueError (out-of-range values) becomes a 400."""
        values: dict[str, Any] = {name: getattr(self, name) for name in (
            "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "seed") if getattr(self, name) is not None}
        if values.get("top_p") == 0:  # OpenAI's range is [0, 1]: the smallest nucleus is the top token
            values["top_p"], values["top_k"] = 1.0, 1
        stop = self._stop_strings()
        constraint = self.structured_output()
        try:
            return SamplingParams(max_tokens=max_tokens, stop=stop, stop_token_ids=list(self.stop_token_ids or []),
                                  ignore_eos=self.ignore_eos, logprobs=logprobs,
                                  skip_special_tokens=self.skip_special_tokens,
                                  include_stop_str_in_output=self.include_stop_str_in_output,
                                  structured_output=constraint, logit_bias=self.logit_bias_ids,
                                  min_tokens=self.min_tokens, prompt_logprobs=self.engine_prompt_logprobs,
                                  speculative=self.speculative, **values)
        except ValueError as exc:
            raise self.sampling_error(exc) from exc

    def sampling_error(self, exc: ValueError) -> APIError:
        """The 400 for SamplingParams' ValueError, naming the field the client sent."""
        message = str(exc)
        first_word = message.split(" ", 1)[0]
        param = first_word if first_word in type(self).model_fields or first_word == "max_tokens" else None
        if message.startswith("stop strings") or message.startswith("at most 16 stop"):
            param = "stop"
        sent = self._field_sent_as(param) if param is not None else None
        if sent is not None and sent != param:  # name the field the client sent
            message, param = sent + message[len(param):], sent
        return invalid_request(message, param)

    def _field_sent_as(self, engine_field: str) -> str:
        """The request field that set the engine's `engine_field` (their names differ in places)."""
        return engine_field


    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The engine's prompt_logprobs: what was asked for (and, with echo, the output's logprobs k)."""
        return self.prompt_logprobs

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        """`logit_bias` by integer token id (its keys were checked by `check_supported`)."""
        return {int(key): float(bias) for key, bias in (self.logit_bias or {}).items()}

    def _stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def has_constraint(self) -> bool:
        """Whether the output is constrained (cheap: nothing is parsed). Building the constraint
        (`sampling_params`) parses a grammar, which servers do off their event loop."""
        return self._asks_for_structure()

    def _asks_for_structure(self) -> bool:
        """Whether `response_format` or `structured_outputs` asks for a constraint (cheap: no parsing)."""
        kind = self.response_format.get("type", "text") if isinstance(self.response_format, dict) else "text"
        return kind != "text" or self.structured_outputs is not None

    def structured_output(self) -> StructuredOutput | None:
        """The constraint asked for by `response_format` (OpenAI) or `structured_outputs` (vLLM), or
        None for free text; a 400 naming the field when its shape or content is wrong."""
        from_format = _from_response_format(self.response_format)
        if self.structured_outputs is None:
            return from_format
        if from_format is not None:
            raise invalid_request("give either response_format or structured_outputs, not both", "structured_outputs")
        return _from_structured_outputs(self.structured_outputs)


def _from_response_format(response_format: dict[str, Any] | None) -> StructuredOutput | None:
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    try:
        if kind == "text":
            return None
        if kind == "json_object":
            return StructuredOutput.json_object()
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict):
                raise ValueError("response_format of type json_schema needs a 'json_schema' object "
                                 "({'name': ..., 'schema': {...}})")
            schema = spec.get("schema")
            # OpenAI makes the schema optional; without one, any JSON object will do.
            return StructuredOutput.json_object() if schema is None else StructuredOutput.json_schema(schema)
    except ValueError as exc:
        raise invalid_request(str(exc), "response_format") from None
    raise invalid_request(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                          "response_format")


_STRUCTURED_OUTPUT_KEYS = ("json", "json_object", "regex", "choice", "grammar")


def _from_structured_outputs(options: dict[str, Any]) -> StructuredOutput:
    given = [key for key in _STRUCTURED_OUTPUT_KEYS if options.get(key) not in (None, False)]
    if len(given) != 1:
        raise invalid_request(f"structured_outputs takes exactly one of {', '.join(_STRUCTURED_OUTPUT_KEYS)}, "
                              f"got {given or 'none'}", "structured_outputs")
    key, value = given[0], options[given[0]]
    try:
        if key == "json":
            if not isinstance(value, (dict, str, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object or its JSON text)")
            return StructuredOutput.json_schema(value)
        if key == "json_object":
            return StructuredOutput.json_object()
        if key == "choice":
            if not isinstance(value, list):
                raise ValueError("structured_outputs.choice must be a list of strings")
            return StructuredOutput.choice(value)
        if not isinstance(value, str):
            raise ValueError(f"structured_outputs.{key} must be a string")
        return StructuredOutput.regex(value) if key == "regex" else StructuredOutput.grammar(value)
    except ValueError as exc:
        raise invalid_request(str(exc), "structured_outputs") from None


class CompletionRequest(_GenerationRequest):
    """`POST /v1/completions`: a prompt (text or token ids) or a batch of them."""
    prompt: str | TokenIds | list[str] | list[TokenIds] = Field(
        description="text, token ids, or a batch: a list of either (choice i * n + j is prompt i's choice j)")
    max_tokens: Int32 | None = Field(16, description="tokens to generate; null: the rest of the context (0 only "
                                                     "with echo: the prompt's logprobs alone)")
    logprobs: Int32 | None = Field(None, description="the sampled token's logprob plus the top k",
                                   json_schema_extra={"minimum": 0, "maximum": 20})
    echo: OptionalBool = Field(False, description="return the prompt before the completion")
    best_of: Int32 | None = Field(None, description="candidates (n to 16) of which the n most likely are returned; "
                                                    "not with stream", json_schema_extra={"minimum": 1,
                                                                                          "maximum": MAX_CHOICES})
    suffix: str | None = Field(None, description="not supported: a non-empty suffix is a 400")

    @field_validator("prompt", mode="before")
    @classmethod
    def _token_ids_in_range(cls, prompt: Any) -> Any:
        # Without this, a bad id in a token-id prompt reads as the first union member's complaint
        # ("Input should be a valid string").
        lists = [prompt] if isinstance(prompt, list) else []
        if lists and all(isinstance(item, list) for item in prompt):
            lists = prompt
        for ids in lists:
            bad = next((t for t in ids if type(t) is int and not 0 <= t < 2**32), None)
            if bad is not None:
                raise ValueError(f"token ids must be integers in [0, 2**32), got {bad}")
        return prompt

    def check_supported(self) -> None:
        super().check_supported()
        if self.shared_cache_salt is not None:
            raise invalid_request("shared_cache_salt applies to chat requests (it keys their leading system "
                                  "messages); a completions prompt has none", "shared_cache_salt")
        if self.max_tokens == 0 and not self.echo:
            raise invalid_request("max_tokens must be at least 1 (0 only with echo: the prompt's logprobs, no "
                                  "completion)", "max_tokens")
        if self.best_of is not None:
            if not self.num_choices <= self.best_of <= MAX_CHOICES:
                raise invalid_request(f"best_of must be in [n, {MAX_CHOICES}] (n={self.num_choices}), got {self.best_of}",
                                      "best_of")
            if self.stream and self.best_of > self.num_choices:
                raise invalid_request("best_of > n cannot be streamed: the best choices are known only at the end",
                                      "best_of")
        if self.suffix:
            raise invalid_request("suffix is not supported by this server", "suffix")

    @property
    def num_candidates(self) -> int:
        return self.best_of or self.num_choices

    @property
    def engine_prompt_logprobs(self) -> int | None:
        if self.echo and self.logprobs is not None:
            return max(self.prompt_logprobs or 0, self.logprobs)
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, text or token ids: one, or a batch (OpenAI's list of strings or
        of token-id lists; choice `i * n + j` of the response is prompt i's choice j)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt or all(isinstance(item, int) for item in prompt):
            return [list(prompt)]
        return [item if isinstance(item, str) else list(item) for item in prompt]


class ChatCompletionRequest(_GenerationRequest):
    """`POST /v1/chat/completions`: messages rendered with the model's chat template."""
    messages: list[dict[str, Any]] = Field(min_length=1, json_schema_extra={"items": CHAT_MESSAGE_SCHEMA})
    max_tokens: Int32 | None = Field(None, description="tokens to generate (default: the rest of the context)")
    max_completion_tokens: Int32 | None = Field(None, description="OpenAI's newer name of max_tokens")
    logprobs: OptionalBool = Field(False, description="return the sampled tokens' logprobs")
    top_logprobs: Int32 | None = Field(None, description="with logprobs: the top k at each position",
                                       json_schema_extra={"minimum": 0, "maximum": 20})
    tools: list[Any] | None = Field(None, description="functions the model may call",
                                    json_schema_extra={"items": TOOL_SCHEMA})
    tool_choice: Any = Field(None, description="none, auto (the default with tools), required, or a named function",
                             json_schema_extra={"anyOf": [
                                 {"enum": ["none", "auto", "required"]},
                                 {"type": "object", "required": ["type", "function"],
                                  "properties": {"type": {"const": "function"},
                                                 "function": {"type": "object", "required": ["name"],
                                                              "properties": {"name": {"type": "string"}}}}},
                                 {"type": "null"}]})
    parallel_tool_calls: Bool | None = Field(None, description="accepted; one call per turn is produced")
    add_generation_prompt: Bool = True
    # OpenAI fields this server does not serve: named here so that they are refused, not ignored.
    functions: Any = Field(None, description="not supported (OpenAI's deprecated form of tools): a 400")
    function_call: Any = Field(None, description="not supported (OpenAI's deprecated form of tool_choice): a 400")
    modalities: Any = Field(None, description='only ["text"]')
    audio: Any = Field(None, description="not supported: a 400")
    web_search_options: Any = Field(None, description="not supported: a 400")
    _tool_plan: Any = PrivateAttr(default=None)

    def check_supported(self) -> None:
        super().check_supported()
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise invalid_request(f"{name} is OpenAI's deprecated form of tools; this server takes tools and "
                                      "tool_choice", name)
        if self.audio is not None or (self.modalities is not None and self.modalities != ["text"]):
            raise invalid_request("audio output is not supported: this server generates text (modalities: "
                                  "['text'])", "modalities" if self.audio is None else "audio")
        if self.web_search_options is not None:
            raise invalid_request("web search is not supported by this server", "web_search_options")
        _check_roles(self.messages)
        self._tool_plan = tool_calling.plan(self.tools, self.tool_choice)
        if self._tool_plan is not None and self._asks_for_structure():
            raise invalid_request("tools cannot be combined with response_format or structured_outputs", "tools")
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid_request("top_logprobs requires logprobs to be true", "top_logprobs")

    @property
    def tool_plan(self) -> "tool_calling.ToolPlan | None":
        """How this request uses its tools (set by `check_supported`); None without tools."""
        return self._tool_plan

    def structured_output(self) -> StructuredOutput | None:
        """With tools, their grammar (built here, which the app runs off the event loop)."""
        if self.tool_plan is not None:
            return tool_calling.constraint_of(self.tool_plan)
        return super().structured_output()

    def has_constraint(self) -> bool:
        return self.tool_plan is not None or super().has_constraint()

    def _stop_strings(self) -> list[str]:
        # A forced call is all JSON: a stop string could only cut it, so it does not apply.
        if self.tool_plan is not None and self.tool_plan.mode != "auto":
            return []
        return super()._stop_strings()

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _field_sent_as(self, engine_field: str) -> str:
        if engine_field == "logprobs":
            return "top_logprobs"
        if engine_field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return engine_field

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None




def _check_roles(messages: list[dict[str, Any]]) -> None:
    """Each message's role is OpenAI's, and a tool result names its call (the rest of a message's
    shape is checked where it is rendered: router/tools.py, engine/tokenizer.py)."""
    for index, message in enumerate(messages):
        role = message.get("role")
        if role == "function":
            raise invalid_request(f"chat message {index}: role 'function' is OpenAI's deprecated form of 'tool'; "
                                  "send a tool result as role 'tool' with the tool_call_id it answers", "messages")
        if role not in CHAT_ROLES:
            raise invalid_request(f"chat message {index}: role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                                  "messages")
        if role == "tool" and not (isinstance(message.get("tool_call_id"), str) and message["tool_call_id"]):
            raise invalid_request(f"chat message {index}: a tool message needs the tool_call_id of the call it "
                                  "answers", "messages")


class TokenizeRequest(BaseModel):
    """`POST /tokenize` (vLLM's shape): a `prompt`, or chat `messages` rendered by the chat template."""
    model_config = ConfigDict(extra="ignore")

    model: str
    prompt: str | None = Field(None, description="give exactly one of prompt and messages")
    messages: list[dict[str, Any]] | None = Field(None, json_schema_extra={"items": CHAT_MESSAGE_SCHEMA})
    add_generation_prompt: Bool = True  # messages only
    add_special_tokens: Bool | None = None  # default: true for a prompt (messages: the template adds them)

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise invalid_request("give exactly one of prompt and messages", "prompt")
        if self.messages is not None and self.add_special_tokens:
            raise invalid_request("add_special_tokens applies to a prompt; the chat template adds them to messages",
                                  "add_special_tokens")
        if self.messages is not None:
            if not self.messages:
                raise invalid_request("messages must not be empty", "messages")
            _check_roles(self.messages)  # as a chat completion would: the same ids, or the same 400


class DetokenizeRequest(BaseModel):
    """`POST /detokenize`: token ids back to text."""
    model_config = ConfigDict(extra="ignore")

    model: str
    tokens: TokenIds

    def check_supported(self) -> None:
        pass


def parse_request(model: type[_GenerationRequest | TokenizeRequest | DetokenizeRequest], data: Any) -> Any:
    """Validate a decoded JSON body against `model`; a 400 naming the first bad field otherwise."""
    if not isinstance(data, dict):
        raise invalid_request(f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        request = model.model_validate(data)
    except ValidationError as exc:
        raise _from_validation_error(exc) from None
    request.check_supported()
    return request


def _from_validation_error(exc: ValidationError) -> APIError:
    first = exc.errors()[0]
    location = first.get("loc", ())
    param = str(location[0]) if location else None
    path = ".".join(str(part) for part in location if not _is_type_tag(part))
    if first.get("type") == "missing":
        return invalid_request(f"missing required field {path!r}", param, "missing_required_parameter")
    return invalid_request(f"invalid value for {path!r}: {first.get('msg', 'invalid')}", param)


def check_text(data: Any, path: str = "") -> None:
    """A 400 for a string anywhere in a parsed JSON body that is not Unicode text: JSON can carry
    a lone UTF-16 surrogate (`"\\ud800"`), which no tokenizer or UTF-8 encoder takes."""
    if isinstance(data, str):
        try:
            data.encode("utf-8")
        except UnicodeEncodeError:
            field = path.split("[", 1)[0].split(".", 1)[0] or None
            raise invalid_request(f"{path or 'the body'} is not valid Unicode text: it has a lone UTF-16 "
                                  "surrogate (an escape \\ud800-\\udfff without its pair)", field) from None
    elif isinstance(data, dict):
        for key, value in data.items():
            check_text(key, path)
            check_text(value, f"{path}.{key}" if path else str(key))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            check_text(value, f"{path}[{index}]")


def _is_type_tag(part: Any) -> bool:
    """pydantic puts the union member it tried ('str', 'list[int]', ...) into error locations."""
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "dict"})


# ---- responses ----------------------------------------------------------------------------------
# The response bodies are built as dicts (below); these models describe them in /openapi.json
# (router/openapi.py) and are never instantiated.

class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, rate_limit_error, service_unavailable, upstream_error, "
                                  "not_found_error or internal_error")
    param: str | None = Field(description="the request field at fault, where one is")
    code: str | None = Field(description="e.g. invalid_value, missing_required_parameter, invalid_json, "
                                         "context_length_exceeded, model_not_found, invalid_api_key, "
                                         "request_too_large, rate_limit_exceeded, service_unavailable, worker_error")


class ErrorResponse(BaseModel):
    """Every error the router answers (OpenAI's shape)."""
    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = Field(description="the context length, in tokens")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens served from a prefix cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None = Field(description="stop, length, or (chat) tool_calls")
    prompt_logprobs: list[Any] | None = Field(None, description="with prompt_logprobs")


class Completion(BaseModel):
    """A whole `POST /v1/completions` response (with stream: Server-Sent Events of such objects)."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[dict[str, Any]] | None = Field(None, description="a tool call: {id, type, function: {name, "
                                                                      "arguments}}")


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: dict[str, Any] | None
    finish_reason: str | None = Field(description="stop, length or tool_calls")
    prompt_logprobs: list[Any] | None = Field(None, description="with prompt_logprobs")


class ChatCompletion(BaseModel):
    """A whole `POST /v1/chat/completions` response (with stream: Server-Sent Events of
    `chat.completion.chunk` objects)."""
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    status: Literal["ok"]
    degraded: str | None = Field(None, description="present while P/D is not engaged: prefill workers are in the "
                                                   "pool but the recent qualifying requests were all prefilled on "
                                                   "decode workers (why, and how they were filled)")


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def model_card(name: str, max_model_len: int | None, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "pdserve",
            "max_model_len": max_model_len}


Endpoint = Literal["completions", "chat"]


def completion_choice(endpoint: Endpoint, index: int, text: str, finish_reason: str | None, logprobs: Any,
                      tool_call: dict[str, Any] | None = None) -> dict[str, Any]:
    """One choice of a whole response; a chat reply that calls a tool has no content."""
    if endpoint == "completions":
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    message: dict[str, Any] = {"role": "assistant", "content": None if tool_call else text}
    if tool_call:
        message["tool_calls"] = [tool_call]
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_body(endpoint: Endpoint, request_id: str, model: str, created: int, choices: list[dict[str, Any]],
                    usage: dict[str, Any]) -> dict[str, Any]:
    """The whole (non-streaming) response, its choices built by `completion_choice`."""
    obj = "text_completion" if endpoint == "completions" else "chat.completion"
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices,
            "usage": usage}


def stream_chunk(endpoint: Endpoint, request_id: str, model: str, created: int, text: str | None,
                 finish_reason: str | None, logprobs: Any = None, first: bool = False,
                 tool_call: dict[str, Any] | None = None, index: int = 0) -> dict[str, Any]:
    """One SSE chunk with choice `index` (`text` None: the chunk only carries the finish reason)."""
    if endpoint == "completions":
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        if tool_call is not None:
            delta["tool_calls"] = [{"index": 0, **tool_call}]
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [choice]}


def usage_chunk(endpoint: Endpoint, request_id: str, model: str, created: int,
                usage: dict[str, Any]) -> dict[str, Any]:
    obj = "text_completion" if endpoint == "completions" else "chat.completion.chunk"
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [], "usage": usage}


def now() -> int:
    return int(time.time())
