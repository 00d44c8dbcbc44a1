"""router/tools.py without a model: tool plans, their grammars, output parsing, message rendering."""
import json

import pytest
import xgrammar

from router import tools
from router.errors import APIError

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def accepts(plan, text):
    return xgrammar.testing._is_grammar_accept_string(plan.constraint.grammar_object(), text)


def test_no_tools_or_none_means_no_plan():
    assert tools.plan(None, None) is None and tools.plan([], "auto") is None
    assert tools.plan([WEATHER], "none") is None
    with pytest.raises(APIError, match="needs tools"):
        tools.plan(None, "required")


def test_auto_grammar_takes_a_tagged_call_or_text_that_does_not_start_with_a_bracket():
    plan = tools.plan([WEATHER, ADD], None)
    assert plan.mode == "auto"
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    assert accepts(plan, call) and accepts(plan, "It is sunny.")
    assert not accepts(plan, '<tool_call>{"name": "add", "arguments": {"a": "x", "b": 2}}</tool_call>')
    assert not accepts(plan, '<tool_call>{"name": "other", "arguments": {}}</tool_call>')
    assert not accepts(plan, "<b>bold</b>")
    # blanks first: still a call (checked against the schema), never plain text starting with `<`
    assert accepts(plan, "\n " + call) and not accepts(plan, ' <tool_call>{"name": "evil", "arguments": {}}</tool_call>')
    assert accepts(plan, "  It is sunny.")
    newlines = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert accepts(plan, newlines) and plan.parse(newlines)["function"]["name"] == "add"
    assert plan.is_call("") is None and plan.is_call("  ") is None
    assert plan.is_call("It") is False and plan.is_call("<tool") is True
    parsed = plan.parse(call)
    assert parsed["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'} and parsed["type"] == "function"
    assert plan.parse("It is sunny.") is None and plan.parse('<tool_call>{"name": "add"') is None
    assert plan.parse('<tool_call>{"name": "evil", "arguments": {}}</tool_call>') is None  # not one of the tools


def test_required_and_named_plans():
    required = tools.plan([WEATHER, ADD], "required")
    assert accepts(required, '{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert not accepts(required, "Oslo")
    assert required.parse('{"name": "get_weather", "arguments": {"city": "Oslo"}}')["function"]["name"] == "get_weather"
    named = tools.plan([WEATHER, ADD], {"type": "function", "function": {"name": "add"}})
    assert accepts(named, '{"a": 3, "b": 4}') and not accepts(named, '{"city": "Oslo"}')
    assert json.loads(named.parse('{"a": 3, "b": 4}')["function"]["arguments"]) == {"a": 3, "b": 4}
    assert "Call the tool add now" in named.instructions()


def test_earlier_calls_are_rendered_as_tagged_text_and_instructions_join_the_system_message():
    plan = tools.plan([WEATHER], "auto")
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Rain"}]
    rendered = tools.render_messages(messages, plan)
    assert rendered[0]["role"] == "system" and rendered[0]["content"].startswith("Be brief.\n\n")
    assert '"name": "get_weather"' in rendered[0]["content"]
    assert rendered[2] == {"role": "assistant",
                           "content": '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'}
    assert rendered[3] == {"role": "user", "content": "<tool_response>Rain</tool_response>"}
    assert tools.render_messages(messages[1:2], plan)[0]["role"] == "system"  # added when there is none
    assert tools.render_messages(messages[1:2], None) == messages[1:2]


def test_a_developer_message_is_the_system_message_and_takes_the_tool_instructions():
    # OpenAI's newer clients send the system prompt as role "developer"; chat templates know "system".
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tools.render_messages(messages, None) == [{"role": "system", "content": "Be brief."}, messages[1]]
    rendered = tools.render_messages(messages, tools.plan([WEATHER], "auto"))
    assert len(rendered) == 2 and rendered[0]["role"] == "system"
    assert rendered[0]["content"].startswith("Be brief.\n\n") and "get_weather" in rendered[0]["content"]


def test_tools_with_defs_compile_in_every_mode():
    """Pydantic-generated parameters keep their models in `$defs`; each call schema carries them
    at its own root, so references resolve with several tools too."""
    ship = {"type": "function", "function": {"name": "ship", "parameters": {
        "$defs": {"Addr": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Addr"}}, "required": ["to"]}}}
    for choice in (None, "required", {"type": "function", "function": {"name": "ship"}}):
        plan = tools.plan([ship, WEATHER], choice)
        body = '{"to": {"city": "Porto"}}'
        text = {"auto": f'<tool_call>{{"name": "ship", "arguments": {body}}}</tool_call>',
                "required": f'{{"name": "ship", "arguments": {body}}}', "named": body}[plan.mode]
        assert accepts(plan, text)
        assert json.loads(plan.parse(text)["function"]["arguments"]) == {"to": {"city": "Porto"}}


def test_a_recursive_tool_schema_means_the_same_in_every_mode():
    """`$ref: "#"` (and `#/properties/...`) point at the parameters' root; in a call schema the
    parameters sit under `arguments`, so the references follow them there."""
    tree = {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "additionalProperties": False,
        "properties": {"value": {"type": "integer"}, "child": {"$ref": "#"}, "twin": {"$ref": "#/properties/value"}}}}}
    body = '{"value": 1, "child": {"value": 2, "twin": 3}}'
    wrong = '{"value": 1, "child": {"name": "tree", "arguments": {"value": 2}}}'  # the wrapper's shape
    for choice in (None, "required", {"type": "function", "function": {"name": "tree"}}):
        plan = tools.plan([tree, WEATHER], choice)
        wrap = {"auto": '<tool_call>{{"name": "tree", "arguments": {}}}</tool_call>',
                "required": '{{"name": "tree", "arguments": {}}}', "named": "{}"}[plan.mode]
        assert accepts(plan, wrap.format(body)), plan.mode
        assert not accepts(plan, wrap.format(wrong)), plan.mode


def test_a_call_followed_by_the_end_tokens_text_is_still_a_call():
    """With include_stop_str_in_output and skip_special_tokens false the output ends with the EOS
    token's text, after the call the grammar completed: the call is parsed without it."""
    end = "<|im_end|>"
    named = tools.plan([WEATHER, ADD], {"type": "function", "function": {"name": "add"}})
    assert json.loads(named.parse('{"a": 3, "b": 4}' + end)["function"]["arguments"]) == {"a": 3, "b": 4}
    required = tools.plan([WEATHER, ADD], "required")
    assert required.parse('{"name": "add", "arguments": {"a": 1, "b": 2}}' + end)["function"]["name"] == "add"
    auto = tools.plan([WEATHER, ADD], None)
    assert auto.parse('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>' + end) is not None
    assert auto.parse('<tool_call>{"name": "add", "arguments": {"a": 1') is None  # cut short: text
    assert named.parse('{"a": 3, "b"') is None


@pytest.mark.parametrize("message, error", [
    ({"role": "assistant", "tool_calls": "x"}, "must be a list"),
    ({"role": "assistant", "tool_calls": [{"function": "x"}]}, "needs a 'function' with a 'name'"),
    ({"role": "assistant", "tool_calls": [None]}, "needs a 'function' with a 'name'"),
    ({"role": "assistant", "content": 5, "tool_calls": [{"function": {"name": "f"}}]}, "must be a string"),
])
def test_malformed_tool_calls_in_messages_are_value_errors(message, error):
    with pytest.raises(ValueError, match=error):
        tools.render_messages([{"role": "user", "content": "hi"}, message], None)


def test_odd_but_valid_history_renders():
    deep = "[" * 5000
    rendered = tools.render_messages([
        {"role": "assistant", "content": [{"type": "text", "text": "Let me check."}],
         "tool_calls": [{"function": {"name": "f", "arguments": deep}}]}], None)
    assert rendered[0]["content"].startswith("Let me check.<tool_call>")  # the unparsable arguments kept as text


def test_stop_strings_do_not_apply_to_a_forced_call():
    from router.protocol import ChatCompletionRequest, parse_request
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "stop": ["}"]}
    forced = parse_request(ChatCompletionRequest, {**body, "tool_choice": "required"})
    assert forced.sampling_params(16, None).stop == []
    auto = parse_request(ChatCompletionRequest, body)
    assert auto.sampling_params(16, None).stop == ["}"]
    assert auto.sampling_params(16, None).structured_output.kind == "grammar"
