"""Tool calling (OpenAI `tools` / `tool_choice`) on top of structured output.

The model is told about the tools in a system message and calls one by writing
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes format that Qwen and many
open models use). The router makes that reliable with a grammar (engine/structured_output.py):
- `tool_choice` a named function: the output is that function's `arguments` object, constrained
  to its `parameters` schema;
- `"required"`: the output is one `{"name", "arguments"}` object, one schema alternative per tool;
- `"auto"` (the default with tools): either a tool call in the tags above or plain text whose
  first non-blank character is not `<`, so that character tells which it is (streaming relies
  on that);
- `"none"`: no instructions, free text.

Each tool's call grammar is compiled from its own schema (so its `$defs` resolve) and the tools
are joined with xgrammar's union; the result travels to the workers as EBNF text.

Earlier turns come back as OpenAI messages: an assistant message's `tool_calls` are rendered in
the same tagged form and a `tool` message becomes a user turn in `<tool_response>` tags, which
every chat template accepts (many allow only user/assistant turns). Only one call per turn is
produced (`parallel_tool_calls` is accepted, not used).
"""
from __future__ import annotations

import functools
import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.structured_output import MAX_SPEC_CHARS, StructuredOutput
from router.errors import invalid_request

OPEN, CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
_BLANK = "[ \\t\\r\\n]*"  # EBNF: optional leading whitespace


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionSpec


def tagged(call: dict[str, Any]) -> str:
    """A call as the model writes it (and as earlier calls are shown to it)."""
    return OPEN + json.dumps(call, ensure_ascii=False) + CLOSE


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses its tools: the constraint, the instructions and how to read the output."""
    mode: Literal["auto", "required", "named"]
    tools: tuple[ToolSpec, ...]
    forced_name: str | None = None

    @functools.cached_property
    def constraint(self) -> StructuredOutput:
        """The grammar the output must follow (built once, on first use: off the event loop).
        Raises ValueError when a tool's schema cannot be compiled."""
        if self.mode == "named":
            return StructuredOutput.json_schema(_parameters(self._tool(self.forced_name)))
        import xgrammar

        calls = [xgrammar.Grammar.from_json_schema(json.dumps(_call_schema(t)), any_whitespace=False)
                 for t in self.tools]
        call = calls[0] if len(calls) == 1 else xgrammar.Grammar.union(*calls)
        if self.mode == "required":
            return StructuredOutput.grammar(str(call))
        ebnf = xgrammar.Grammar.from_ebnf
        # Blanks are allowed around the JSON inside the tags too (Qwen's own form has newlines there).
        tagged_call = xgrammar.Grammar.concat(ebnf(f'root ::= {_BLANK} "{OPEN}" {_BLANK}'), call,
                                              ebnf(f'root ::= {_BLANK} "{CLOSE}"'))
        plain = ebnf(f"root ::= {_BLANK} [^< \\t\\r\\n] [^\\x00]*")
        return StructuredOutput.grammar(str(xgrammar.Grammar.union(tagged_call, plain)))

    def _tool(self, name: str | None) -> ToolSpec:
        return next(t for t in self.tools if t.function.name == name)

    def instructions(self) -> str:
        lines = ["You can call these tools (JSON Schema of each one's arguments):"]
        for tool in self.tools:
            entry = {"name": tool.function.name, "description": tool.function.description or "",
                     "parameters": _parameters(tool)}
            lines.append(json.dumps(entry, ensure_ascii=False))
        if self.mode == "named":
            lines.append(f"Call the tool {self.forced_name} now: answer with its arguments as one JSON object.")
        elif self.mode == "required":
            lines.append('Call one tool now: answer with {"name": <tool name>, "arguments": <JSON object>}.')
        else:
            lines.append("To call a tool, answer with " + tagged({"name": "<tool name>", "arguments": {}})
                         + " (the arguments as a JSON object) and nothing else; otherwise answer in plain text.")
        return "\n".join(lines)

    def is_call(self, text: str) -> bool | None:
        """Whether the output (so far) is a tool call; None while it cannot be told yet."""
        if self.mode != "auto":
            return True
        stripped = text.lstrip()
        return stripped.startswith("<") if stripped else None

    def parse(self, text: str) -> dict[str, Any] | None:
        """The OpenAI `tool_calls` entry for a complete output, or None if it is not a whole call
        to one of the tools (cut short, or plain text in auto mode). The grammar allows nothing
        after the call but the end-of-sequence token, whose text may follow it (with
        `include_stop_str_in_output` and `skip_special_tokens: false`): it is not part of the call."""
        body = text.strip()
        if self.mode == "auto":
            end = body.rfind(CLOSE)
            if not body.startswith(OPEN) or end < 0:
                return None
            body = body[len(OPEN):end].strip()
        try:
            value, _ = json.JSONDecoder().raw_decode(body)
        except (json.JSONDecodeError, RecursionError):
            return None
        if self.mode == "named":
            name, arguments = self.forced_name, value
        elif isinstance(value, dict) and "name" in value and "arguments" in value:
            name, arguments = value["name"], value["arguments"]
        else:
            return None
        if not any(t.function.name == name for t in self.tools) or not isinstance(arguments, dict):
            return None
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _parameters(tool: ToolSpec) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


_DEFINITIONS = ("$defs", "definitions")


def _call_schema(tool: ToolSpec) -> dict[str, Any]:
    """`{"name": <this tool>, "arguments": <its parameters>}`, with the parameters' `$defs` /
    `definitions` moved to this schema's root, where their `#/$defs/...` references point; any
    other reference into the parameters (`#`, `#/properties/...`: a recursive schema) is rewritten
    to point under `#/properties/arguments`, where they now are."""
    parameters = _rebased(dict(_parameters(tool)))
    hoisted = {key: parameters.pop(key) for key in _DEFINITIONS if key in parameters}
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False, **hoisted}


def _rebased(schema: Any) -> Any:
    """`schema` with its root-relative `$ref`s moved under `#/properties/arguments` (the
    definitions' stay: they are hoisted to the root)."""
    if isinstance(schema, list):
        return [_rebased(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebased = {key: _rebased(value) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        head = ref[2:].split("/", 1)[0]
        if head not in _DEFINITIONS:
            rebased["$ref"] = "#/properties/arguments" + ref[1:]
    return rebased


def plan(tools: list[Any] | None, tool_choice: Any) -> ToolPlan | None:
    """Validate `tools` and `tool_choice` (400 naming the field) and decide what to do; None when
    the request uses no tools. Cheap: the grammar is built later (`ToolPlan.constraint`)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise invalid_request("tool_choice needs tools", "tool_choice")
        return None
    specs = []
    for index, tool in enumerate(tools):
        try:
            specs.append(ToolSpec.model_validate(tool))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in (f"tools[{index}]", *first["loc"]))
            raise invalid_request(f"invalid tool: {where}: {first['msg']}; each tool is {{'type': 'function', "
                                  "'function': {'name': ..., 'parameters': {...}}}", "tools") from None
    specs = tuple(specs)
    names = [t.function.name for t in specs]
    if len(set(names)) != len(names):
        raise invalid_request("tool names must be unique", "tools")
    size = sum(len(json.dumps(_parameters(t))) for t in specs)
    if size > MAX_SPEC_CHARS:
        raise invalid_request(f"the tools' parameters schemas have {size} characters, more than the "
                              f"{MAX_SPEC_CHARS} this server accepts", "tools")
    if tool_choice in (None, "auto"):
        mode, forced = "auto", None
    elif tool_choice == "none":
        return None
    elif tool_choice == "required":
        mode, forced = "required", None
    elif (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
          and isinstance(tool_choice.get("function"), dict)):
        forced = tool_choice["function"].get("name")
        if forced not in names:
            raise invalid_request(f"tool_choice names {forced!r}, which is not one of the tools ({', '.join(names)})",
                                  "tool_choice")
        mode = "named"
    else:
        raise invalid_request("tool_choice must be 'none', 'auto', 'required' or "
                              "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    return ToolPlan(mode, specs, forced)


def constraint_of(tool_plan: ToolPlan) -> StructuredOutput:
    """The plan's grammar; a schema that does not compile is the client's error (400)."""
    try:
        return tool_plan.constraint
    except (ValueError, RuntimeError) as exc:
        message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise invalid_request(f"a tool's parameters schema is not usable: {message}", "tools") from None


def render_messages(messages: list[dict[str, Any]], tool_plan: ToolPlan | None) -> list[dict[str, Any]]:
    """The conversation for the chat template: earlier tool calls as tagged text, tool results
    as user turns in `<tool_response>` tags, and (with tools) the instructions in the system
    message. Raises ValueError (a 400 on `messages`) for a malformed tool call."""
    rendered = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            rendered.append(message)  # the tokenizer reports it
            continue
        role, calls = message.get("role"), message.get("tool_calls")
        if role == "assistant" and calls:
            text = _text(message.get("content"), index)
            if not isinstance(calls, list):
                raise ValueError(f"chat message {index}: tool_calls must be a list")
            text += "".join(tagged(_call_of(call, index)) for call in calls)
            message = {"role": "assistant", "content": text}
        elif role == "tool":
            message = {"role": "user",
                       "content": RESPONSE_OPEN + _text(message.get("content"), index) + RESPONSE_CLOSE}
        elif role == "developer":  # OpenAI's newer name for the system message; templates know "system"
            message = {**message, "role": "system"}
        rendered.append(message)
    if tool_plan is None:
        return rendered
    instructions = tool_plan.instructions()
    if rendered and isinstance(rendered[0], dict) and rendered[0].get("role") == "system":
        first = rendered[0]
        content = _text(first.get("content"), 0)
        return [{**first, "content": f"{content}\n\n{instructions}" if content else instructions}] + rendered[1:]
    return [{"role": "system", "content": instructions}] + rendered


def _text(content: Any, index: int) -> str:
    """A message's content as text: a string, text parts, or nothing."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    raise ValueError(f"chat message {index}: 'content' must be a string or a list of text parts")


def _call_of(call: Any, index: int) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
        raise ValueError(f"chat message {index}: each tool call needs a 'function' with a 'name'")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            pass  # shown as the string it is
    return {"name": function["name"], "arguments": arguments}
