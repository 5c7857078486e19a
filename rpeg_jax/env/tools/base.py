"""What a tool is: a name, a JSON-schema of its arguments (what the chat template shows the model),
and `run(arguments) -> ToolResult`.

    class Weather(Tool):                             # in my_tools.py; env.tools=[my_tools:Weather]
        name = "weather"
        description = "Today's weather in a city."
        parameters = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

        def run(self, arguments: dict) -> ToolResult:
            return ToolResult(f"sunny in {arguments['city']}")

A tool is built once per run as `cls(settings)` (settings: the run's EnvConfig) and called from
several threads at once. Arguments are checked against `parameters` (check_arguments) before `run`,
so a call with bad arguments never reaches it. `run` must return within env.tool_timeout_s; a tool
that can block or run untrusted code should do its work in a child process (env/sandbox.py) and
kill it on time, as the python tool does. Whatever `run` raises becomes an error result the policy
sees (kind "exception"); nothing a tool does stops the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Error kinds of a call (a parser's in env/parsers.py: malformed_json, bad_call, unclosed)
UNKNOWN_TOOL = "unknown_tool"
BAD_ARGUMENTS = "bad_arguments"
TIMEOUT = "timeout"
EXCEPTION = "exception"  # the tool raised
FAILED = "failed"  # the tool ran and reports failure (an arithmetic error, a non-zero exit, a limit hit)


@dataclass(frozen=True)
class ToolResult:
    content: str  # what the policy reads (the tool message's content)
    error: str | None = None  # an error kind (above) when the call failed; counted in env/tool_errors
    metadata: dict[str, Any] = field(default_factory=dict)  # for logs and tests, never shown to the policy


class Tool:
    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}

    def __init__(self, settings: Any = None):
        self.settings = settings

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema chat templates render (tools=[...])."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def run(self, arguments: dict[str, Any]) -> ToolResult:
        raise NotImplementedError


_TYPES = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


def _type_ok(value: Any, want: str | list) -> bool:
    wants = want if isinstance(want, list) else [want]
    for w in wants:
        types = _TYPES.get(w)
        if types is None:
            return True  # a type this checker does not know: not checked
        if isinstance(value, bool) and w in ("integer", "number"):
            continue
        if isinstance(value, types):
            return True
    return False


def check_arguments(schema: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    """Why `arguments` do not fit an object schema's required keys, property types and enums, and
    additionalProperties=false; None when they fit (a small subset of JSON Schema, enough for the
    flat argument objects tools take)."""
    props = schema.get("properties") or {}
    missing = [k for k in schema.get("required") or () if k not in arguments]
    if missing:
        return f"missing required argument(s): {', '.join(missing)}"
    if schema.get("additionalProperties") is False:
        extra = sorted(set(arguments) - set(props))
        if extra:
            return f"unknown argument(s): {', '.join(extra)}; expected: {', '.join(props) or 'none'}"
    for k, v in arguments.items():
        spec = props.get(k)
        if not isinstance(spec, dict):
            continue
        if "type" in spec and not _type_ok(v, spec["type"]):
            return f"argument {k!r} must be of type {spec['type']}, not {type(v).__name__}"
        if "enum" in spec and v not in spec["enum"]:
            return f"argument {k!r} must be one of {spec['enum']}"
    return None
