"""Tool-call parsing (rpeg_jax/env/parsers.py): the hermes format of Qwen2.5 / Qwen3 / Hermes templates,
valid calls, malformed JSON, nested JSON, several calls in one turn, text around calls, a call split at
the end of a turn; parser choice (auto from the template, by name, module:Class)."""

import json
import os

import pytest

from rpeg_jax.config.base import ConfigError
from rpeg_jax.env.parsers import (
    BAD_CALL,
    MALFORMED_JSON,
    UNCLOSED,
    CallError,
    HermesParser,
    ToolCall,
    ToolParser,
    get_parser,
)

P = HermesParser()
QWEN_TEMPLATE = os.path.join(os.path.dirname(__file__), "fixtures", "chat", "qwen2_5", "chat_template.jinja")


def block(obj) -> str:
    body = obj if isinstance(obj, str) else json.dumps(obj)
    return f"<tool_call>\n{body}\n</tool_call>"


def test_a_valid_call():
    turn = P.parse(block({"name": "calculator", "arguments": {"expression": "2+2"}}))
    assert turn.errors == ()
    assert turn.calls == (ToolCall("calculator", {"expression": "2+2"}, turn.calls[0].raw),)
    assert json.loads(turn.calls[0].raw)["name"] == "calculator"
    assert turn.content == ""


def test_text_around_calls_is_the_content_and_calls_keep_their_order():
    text = (
        "First I add.\n"
        + block({"name": "calculator", "arguments": {"expression": "1+1"}})
        + "\nThen I run code.\n"
        + block({"name": "python", "arguments": {"code": "print(3)"}})
        + "\nDone."
    )
    turn = P.parse(text)
    assert [c.name for c in turn.calls] == ["calculator", "python"]
    assert [c.arguments for c in turn.calls] == [{"expression": "1+1"}, {"code": "print(3)"}]
    assert turn.content == "First I add.\n\nThen I run code.\n\nDone."


def test_several_calls_in_one_turn_with_errors_interleaved_in_order():
    text = (
        block({"name": "a", "arguments": {}})
        + block("{not json")
        + block({"name": "b", "arguments": {"x": 1}})
        + block([1, 2])
    )
    turn = P.parse(text)
    kinds = [i.name if isinstance(i, ToolCall) else i.kind for i in turn.items]
    assert kinds == ["a", MALFORMED_JSON, "b", BAD_CALL]
    assert len(turn.calls) == 2 and len(turn.errors) == 2


def test_nested_json_arguments():
    args = {"code": "d = {'a': {'b': [1, {'c': 2}]}}\nprint(d)", "options": {"deep": {"list": [{"k": None}]}}}
    turn = P.parse(block({"name": "python", "arguments": args}))
    assert turn.errors == () and turn.calls[0].arguments == args


def test_braces_and_tags_inside_strings_do_not_confuse_the_scan():
    args = {"code": 'print("{\\"x\\": 1}")  # <tool_call> in a comment'}
    turn = P.parse("before " + block({"name": "python", "arguments": args}) + " after")
    assert turn.errors == () and turn.calls[0].arguments == args
    assert turn.content == "before  after"


@pytest.mark.parametrize(
    "body,kind,fragment",
    [
        ('{"name": "calculator", "arguments": {"expression": "1+1"}', MALFORMED_JSON, "not valid JSON"),
        ("calculator(1+1)", MALFORMED_JSON, "not valid JSON"),
        ("", MALFORMED_JSON, "not valid JSON"),
        ('"calculator"', BAD_CALL, "must be a JSON object"),
        ('{"arguments": {}}', BAD_CALL, 'no "name"'),
        ('{"name": 3, "arguments": {}}', BAD_CALL, 'no "name"'),
        ('{"name": "calculator", "arguments": [1]}', BAD_CALL, "must be a JSON object"),
        ('{"name": "calculator", "arguments": "not json"}', BAD_CALL, "string that is not JSON"),
    ],
)
def test_malformed_calls_are_errors_not_exceptions(body, kind, fragment):
    turn = P.parse("x " + block(body))
    assert turn.calls == ()
    (err,) = turn.errors
    assert isinstance(err, CallError) and err.kind == kind and fragment in err.message


def test_arguments_as_a_json_string_and_missing_arguments_are_accepted():
    turn = P.parse(block('{"name": "calculator", "arguments": "{\\"expression\\": \\"3*3\\"}"}'))
    assert turn.calls[0].arguments == {"expression": "3*3"}
    assert P.parse(block('{"name": "clock"}')).calls[0].arguments == {}


def test_a_call_split_at_the_end_of_the_turn():
    """The turn ran out (or the model stopped) inside a call: an `unclosed` error, the text before it kept."""
    turn = P.parse('Computing.\n<tool_call>\n{"name": "calculator", "argum')
    assert turn.calls == ()
    (err,) = turn.errors
    assert err.kind == UNCLOSED and "</tool_call>" in err.message and err.raw.startswith('{"name"')
    assert turn.content == "Computing."
    # a complete call, then a second one cut off
    turn = P.parse(block({"name": "a", "arguments": {}}) + "<tool_call>{")
    assert [type(i).__name__ for i in turn.items] == ["ToolCall", "CallError"] and turn.errors[0].kind == UNCLOSED


def test_no_call_and_a_stray_close_are_plain_text():
    assert P.parse("The answer is 4.").items == ()
    turn = P.parse("a </tool_call> b")
    assert turn.items == () and turn.content == "a </tool_call> b"


def test_deeply_nested_json_is_an_error_not_a_crash():
    turn = P.parse(block("[" * 100000 + "]" * 100000))
    assert turn.calls == () and turn.errors[0].kind in (MALFORMED_JSON, BAD_CALL)


def test_get_parser_auto_detects_hermes_from_the_qwen_template():
    with open(QWEN_TEMPLATE, encoding="utf-8") as f:
        source = f.read()
    assert isinstance(get_parser("auto", source), HermesParser)
    assert isinstance(get_parser("hermes"), HermesParser)
    with pytest.raises(ConfigError, match="env.tool_parser"):
        get_parser("auto", "{{ messages }}")  # a template without tool calls
    with pytest.raises(ConfigError, match="env.tool_parser"):
        get_parser("auto", None)


class BracketParser(ToolParser):
    """A format of the test's own: [[name|{json}]]."""

    name, call_start, call_end = "brackets", "[[", "]]"

    def parse(self, text):
        from rpeg_jax.env.parsers import ParsedTurn

        items = []
        for part in text.split("[[")[1:]:
            name, _, body = part.split("]]")[0].partition("|")
            items.append(ToolCall(name, json.loads(body), body))
        return ParsedTurn(text.split("[[")[0].strip(), tuple(items))


def test_a_parser_of_ones_own_by_module_and_class():
    p = get_parser("test_env_parsers:BracketParser")
    assert p.call_end == "]]" and p.parse('hi [[calc|{"x": 1}]]').calls[0].arguments == {"x": 1}
    with pytest.raises(ConfigError, match="not a subclass"):
        get_parser("test_env_parsers:block")
    with pytest.raises(ConfigError, match="cannot load"):
        get_parser("no_such_module_xyz:Parser")
