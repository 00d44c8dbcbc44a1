"""Tool calling (OpenAI `tools` / `tool_choice`) on top of structured output.

The model is told about the tools in a system message and calls one by writing
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes format that Qwen and many
open models use). The router makes that reliable with a grammar (engine/structured_output.py):
- `tool_choice` a named function: the output is that function's `arguments` object, constrained
  to its `parameters` schema;
- `"required"`: the output is one `{"name", "arguments"}` object, one schema alternative per tool;
- `"auto"` (the default with tools): either a tool call in the tags above or plain text that does
  not start with `<`, so the first character tells which it is (streaming relies on that);
- `"none"`: no instructions, free text.

Earlier turns come back as OpenAI messages: an assistant message's `tool_calls` are rendered in
the same tagged form and `tool` messages keep their role, so any chat template can show them.
Only one call per turn is produced (`parallel_tool_calls` is accepted, not used).
"""
from __future__ import annotations

import functools
import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.structured_output import StructuredOutput
from router.errors import invalid_request

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionSpec


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses its tools: the constraint, the instructions and how to read the output."""
    mode: Literal["auto", "required", "named"]
    tools: tuple[ToolSpec, ...]
    forced_name: str | None = None

    @functools.cached_property
    def constraint(self) -> StructuredOutput:
        """The grammar the output must follow (built once)."""
        if self.mode == "named":
            return StructuredOutput.json_schema(_parameters(self._tool(self.forced_name)))
        call = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                            "arguments": _parameters(t)},
                           "required": ["name", "arguments"], "additionalProperties": False}
                          for t in self.tools]}
        if self.mode == "required":
            return StructuredOutput.json_schema(call)
        return StructuredOutput.grammar(_auto_grammar(StructuredOutput.json_schema(call).grammar_object()))

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
            lines.append(f'To call a tool, answer with {OPEN}{{"name": <tool name>, "arguments": <JSON object>}}'
                         f"{CLOSE} and nothing else; otherwise answer in plain text.")
        return "\n".join(lines)

    def is_call(self, text: str) -> bool | None:
        """Whether the output (so far) is a tool call; None while it cannot be told yet."""
        if self.mode != "auto":
            return True
        stripped = text.lstrip()
        return stripped.startswith("<") if stripped else None

    def parse(self, text: str) -> dict[str, Any] | None:
        """The OpenAI `tool_calls` entry for a complete output, or None if it is not a whole call
        (cut by max_tokens, or plain text in auto mode)."""
        body = text.strip()
        if self.mode == "auto":
            if not (body.startswith(OPEN) and body.endswith(CLOSE)):
                return None
            body = body[len(OPEN):-len(CLOSE)]
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        if self.mode == "named":
            name, arguments = self.forced_name, value
        elif isinstance(value, dict) and "name" in value and "arguments" in value:
            name, arguments = value["name"], value["arguments"]
        else:
            return None
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _parameters(tool: ToolSpec) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _auto_grammar(call: Any) -> str:
    """EBNF text: `<tool_call>` + a call (xgrammar `Grammar` of its JSON) + `</tool_call>`, or text
    whose first character is not `<`. Built with xgrammar's grammar combinators, which keep the
    rule names apart, and sent on as EBNF (the wire carries constraints as text)."""
    import xgrammar

    tag = xgrammar.Grammar.from_ebnf
    tagged = xgrammar.Grammar.concat(tag(f'root ::= "{OPEN}"'), call, tag(f'root ::= "{CLOSE}"'))
    return str(xgrammar.Grammar.union(tagged, tag("root ::= [^<] [^\\x00]*")))


def plan(tools: list[Any] | None, tool_choice: Any) -> ToolPlan | None:
    """Validate `tools` and `tool_choice` (400 naming the field) and decide what to do; None when
    the request uses no tools."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise invalid_request("tool_choice needs tools", "tool_choice")
        return None
    try:
        specs = tuple(ToolSpec.model_validate(tool) for tool in tools)
    except Exception as exc:  # pydantic's ValidationError
        raise invalid_request(f"invalid tools: {str(exc).splitlines()[0]}; each tool is {{'type': 'function', "
                              "'function': {'name': ..., 'parameters': {...}}}", "tools") from None
    names = [t.function.name for t in specs]
    if len(set(names)) != len(names):
        raise invalid_request("tool names must be unique", "tools")
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
    result = ToolPlan(mode, specs, forced)
    try:
        result.constraint  # noqa: B018 - a parameters schema that does not compile is the client's error
    except ValueError as exc:
        raise invalid_request(f"a tool's parameters schema is not usable: {exc}", "tools") from None
    return result


def render_messages(messages: list[dict[str, Any]], tool_plan: ToolPlan | None) -> list[dict[str, Any]]:
    """The conversation for the chat template: earlier tool calls as tagged text, tool results
    as `tool` messages, and (with tools) the instructions in the system message."""
    rendered = []
    for message in messages:
        if not isinstance(message, dict):
            rendered.append(message)  # the tokenizer reports it
            continue
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and calls:
            text = message.get("content") or ""
            for call in calls if isinstance(calls, list) else []:
                function = call.get("function", {}) if isinstance(call, dict) else {}
                try:
                    arguments = json.loads(function.get("arguments") or "{}")
                except (TypeError, json.JSONDecodeError):
                    arguments = function.get("arguments")
                text += OPEN + json.dumps({"name": function.get("name"), "arguments": arguments},
                                          ensure_ascii=False) + CLOSE
            message = {"role": "assistant", "content": text}
        rendered.append(message)
    if tool_plan is None:
        return rendered
    instructions = tool_plan.instructions()
    if rendered and isinstance(rendered[0], dict) and rendered[0].get("role") == "system":
        first = rendered[0]
        content = first.get("content")
        content = content if isinstance(content, str) else ""
        return [{**first, "content": f"{content}\n\n{instructions}" if content else instructions}] + rendered[1:]
    return [{"role": "system", "content": instructions}] + rendered
