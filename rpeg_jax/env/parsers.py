"""Tool-call parsers: an assistant turn's text -> the tool calls it makes, in the chat template's own
format, without evaluating anything (json.loads only).

    parser = get_parser("hermes")                   # or resolve_parser(cfg.env, template_text)
    turn = parser.parse('Let me compute. <tool_call>\\n{"name": "calculator", '
                        '"arguments": {"expression": "2+2"}}\\n</tool_call>')
    turn.calls       # (ToolCall(name='calculator', arguments={'expression': '2+2'}, ...),)
    turn.errors      # () -- a malformed block is a CallError here, never an exception
    parser.call_end  # "</tool_call>": where a policy turn ends with a call pending (env.stop_at_call)

Built in: `hermes`, the format of Qwen2.5, Qwen3 and Hermes 2 Pro chat templates (a JSON object
{"name": ..., "arguments": {...}} between <tool_call> and </tool_call>; arguments given as a JSON
string holding an object are accepted, as vLLM's hermes parser does). `env.tool_parser=auto` picks
the first parser whose `detect(template source)` is true. A parser of your own: subclass ToolParser
and name it `env.tool_parser=my_module:MyParser`.

Called by: env/tools_env.py (parsing turns), env/session.py (the turn's stop strings).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from rpeg_jax.config.base import ConfigError
from rpeg_jax.config.registry import Registry

# CallError kinds of a parser (tools add unknown_tool, bad_arguments, timeout, exception, exit, ...)
MALFORMED_JSON = "malformed_json"  # the block is not JSON
BAD_CALL = "bad_call"  # JSON, but not {"name": str, "arguments": object}
UNCLOSED = "unclosed"  # an opening tag with no close: the turn ended inside a call


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    raw: str  # the block's text between the tags


@dataclass(frozen=True)
class CallError:
    kind: str  # MALFORMED_JSON | BAD_CALL | UNCLOSED (a parser's); a tool's kinds in env/tools/base.py
    message: str  # what the policy is told
    raw: str = ""
    name: str | None = None  # the tool named, when known


@dataclass(frozen=True)
class ParsedTurn:
    """A turn's text outside the call blocks, its calls and its broken blocks, each in turn order
    (`items` interleaves them as written)."""

    content: str
    items: tuple[ToolCall | CallError, ...] = ()
    calls: tuple[ToolCall, ...] = field(init=False)
    errors: tuple[CallError, ...] = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "calls", tuple(i for i in self.items if isinstance(i, ToolCall)))
        object.__setattr__(self, "errors", tuple(i for i in self.items if isinstance(i, CallError)))


class ToolParser:
    """How one chat-template family writes tool calls. Subclasses set `name`, `call_start`, `call_end`
    and implement `parse`; `detect` says whether a template's source uses this format."""

    name: str = ""
    call_start: str = ""
    call_end: str = ""

    @classmethod
    def detect(cls, template_source: str) -> bool:
        return bool(cls.call_start) and cls.call_start in template_source

    def parse(self, text: str) -> ParsedTurn:
        raise NotImplementedError


class HermesParser(ToolParser):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number per turn, text around them."""

    name = "hermes"
    call_start = "<tool_call>"
    call_end = "</tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        items: list[ToolCall | CallError] = []
        content: list[str] = []
        pos = 0
        while True:
            start = text.find(self.call_start, pos)
            if start < 0:
                content.append(text[pos:])
                break
            content.append(text[pos:start])
            body_at = start + len(self.call_start)
            end = text.find(self.call_end, body_at)
            if end < 0:
                raw = text[body_at:]
                items.append(CallError(UNCLOSED, f"the tool call is not closed with {self.call_end}", raw.strip()))
                break
            items.append(self.parse_call(text[body_at:end]))
            pos = end + len(self.call_end)
        return ParsedTurn("".join(content).strip(), tuple(items))

    @staticmethod
    def parse_call(raw: str) -> ToolCall | CallError:
        body = raw.strip()
        try:
            obj = json.loads(body)
        except (json.JSONDecodeError, RecursionError) as e:
            why = f"{e.msg} at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
            return CallError(MALFORMED_JSON, f"the tool call is not valid JSON: {why}", body)
        if not isinstance(obj, dict):
            return CallError(BAD_CALL, f"the tool call must be a JSON object, not {type(obj).__name__}", body)
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            return CallError(BAD_CALL, 'the tool call has no "name" string', body)
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                return CallError(BAD_CALL, f'"arguments" is a string that is not JSON: {e.msg}', body, name)
        if not isinstance(args, dict):
            return CallError(BAD_CALL, f'"arguments" must be a JSON object, not {type(args).__name__}', body, name)
        return ToolCall(name, args, body)


PARSERS = Registry("tool parser", key="env.tool_parser", base=ToolParser)  # config/registry.py
PARSERS.register("hermes", HermesParser)


def get_parser(name: str, template_source: str | None = None) -> ToolParser:
    """The parser env.tool_parser names: a built-in, module:Class, or auto (detected from the template)."""
    if name == "auto":
        for cls in PARSERS.values():
            if template_source is not None and cls.detect(template_source):
                return cls()
        raise ConfigError(
            "env.tool_parser",
            name,
            "no built-in parser recognises the chat template's tool-call format "
            f"(known: {', '.join(PARSERS)}); set env.tool_parser",
        )
    return PARSERS.get(name)()
