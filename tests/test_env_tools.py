"""Built-in tools and the tool interface (rpeg_jax/env/tools/): the calculator's arithmetic, its refusals and
bounds (no eval anywhere), argument checking against a tool's schema, building tools from env.tools."""

import ast
import inspect
import math

import pytest

from rpeg_jax.config import load_config
from rpeg_jax.config.base import ConfigError
from rpeg_jax.config.env import BUILTIN_TOOLS, EnvConfig
from rpeg_jax.env import tools as tools_pkg
from rpeg_jax.env.tools import TOOLS, Tool, ToolResult, check_arguments, make_tools
from rpeg_jax.env.tools.base import FAILED
from rpeg_jax.env.tools.calculator import MAX_BITS, CalcError, Calculator, calculate


@pytest.mark.parametrize(
    "expr,value",
    [
        ("1 + 2 * 3", 7),
        ("(3 + 4) * 2 ** 10 / 7", 1024.0),
        ("7 // 2", 3),
        ("-7 % 3", 2),
        ("-(2 ** 3)", -8),
        ("+-+1", -1),
        ("2 ** -1", 0.5),
        ("1.5e3 / 3", 500.0),
        ("0.1 + 0.2", 0.1 + 0.2),
        ("2 ** 10 ** 2", 2**100),
        ("12345678901234567890 * 98765432109876543210", 12345678901234567890 * 98765432109876543210),
        ("1_000 + 0x10", 1016),
        ("((((1))))", 1),
    ],
)
def test_calculator_values(expr, value):
    got = calculate(expr)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize(
    "expr,fragment",
    [
        ("__import__('os').system('true')", "Call is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("(1).real", "Attribute is not allowed"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("1j * 2", "only numbers"),
        ("1 < 2", "Compare is not allowed"),
        ("1 << 100", "LShift is not allowed"),
        ("~1", "Invert is not allowed"),
        ("[1, 2]", "List is not allowed"),
        ("lambda: 1", "Lambda is not allowed"),
        ("1 if 1 else 2", "IfExp is not allowed"),
        ("1 +", "not an arithmetic expression"),
        ("1; 2", "not an arithmetic expression"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("1e308 * 10", "not a finite number"),
        ("10 ** 400 / 3 ** 0.5", "OverflowError"),
    ],
)
def test_calculator_refusals(expr, fragment):
    with pytest.raises(CalcError, match=fragment.replace("(", r"\(")):
        calculate(expr)


def test_calculator_bounds_keep_every_call_cheap():
    assert calculate("2 ** 4095").bit_length() == 4096
    for expr in ("2 ** 4096", "9 ** 9 ** 9", "10 ** 10 ** 10", "(2 ** 4000) * (2 ** 4000)", "2.0 ** 10 ** 7"):
        with pytest.raises(CalcError):
            calculate(expr)
    with pytest.raises(CalcError, match="longer than"):
        calculate("1+" * 300 + "1")
    with pytest.raises(CalcError, match="too many nested parentheses"):
        calculate("(" * 240 + "1" + ")" * 240)
    assert calculate("(" * 150 + "1" + ")" * 150) == 1 and calculate("-" * 490 + "1") == 1  # deep, but no crash
    assert MAX_BITS == 4096


def test_calculator_source_never_evaluates():
    """The module parses with ast and walks nodes: no eval, exec or compile call anywhere in it."""
    from rpeg_jax.env.tools import calculator

    tree = ast.parse(inspect.getsource(calculator))
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert not called & {"eval", "exec", "compile", "__import__"}


def test_the_calculator_tool_returns_text_and_error_results():
    calc = Calculator()
    assert calc.run({"expression": "6 * 7"}) == ToolResult("42")
    assert calc.run({"expression": "1 / 4"}) == ToolResult("0.25")
    res = calc.run({"expression": "1 / 0"})
    assert res.error == FAILED and res.content == "Error: division by zero"
    fn = calc.schema()["function"]
    assert fn["name"] == "calculator" and fn["parameters"]["required"] == ["expression"]


def test_check_arguments():
    schema = Calculator.parameters
    assert check_arguments(schema, {"expression": "1"}) is None
    assert "missing required" in check_arguments(schema, {})
    assert "unknown argument(s): extra" in check_arguments(schema, {"expression": "1", "extra": 2})
    assert "must be of type string" in check_arguments(schema, {"expression": 12})
    typed = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "x": {"type": ["number", "null"]}, "mode": {"enum": ["a", "b"]}},
    }
    assert check_arguments(typed, {"n": 3, "x": None, "mode": "a"}) is None
    assert "type integer" in check_arguments(typed, {"n": True})  # a bool is not an integer
    assert "type integer" in check_arguments(typed, {"n": 1.5})
    assert check_arguments(typed, {"x": 2}) is None
    assert "one of" in check_arguments(typed, {"mode": "c"})


class Echo(Tool):
    name = "echo"
    description = "Repeat the text."
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}

    def run(self, arguments):
        return ToolResult(arguments["text"])


class Nameless(Tool):
    pass


def test_make_tools_builds_built_ins_and_tools_of_ones_own():
    assert set(TOOLS) == set(BUILTIN_TOOLS)  # config/env.py repeats the names; kept in step here
    tools = make_tools(EnvConfig(name="tools", tools=("calculator", "test_env_tools:Echo")))
    assert list(tools) == ["calculator", "echo"] and tools["echo"].run({"text": "hi"}).content == "hi"
    assert isinstance(tools["calculator"].settings, EnvConfig)
    with pytest.raises(ConfigError, match=r"env.tools\[0\].*no name"):
        make_tools(EnvConfig(name="tools", tools=("test_env_tools:Nameless",)))
    with pytest.raises(ConfigError, match="not a subclass"):
        make_tools(EnvConfig(name="tools", tools=("test_env_tools:check_arguments",)))
    assert tools_pkg.__all__


def test_env_config_validation():
    cfg = load_config(None, ["env.name=tools", "env.tools=[calculator, python]", "env.max_turns=3"])
    assert cfg.env.tools == ("calculator", "python") and cfg.env.max_turns == 3
    for override, key in [
        ("env.name=tool", "env.name"),
        ("env.tools=[calc]", r"env.tools\[0\]"),
        ("env.tools=[calculator, calculator]", "env.tools"),
        ("env.max_turns=0", "env.max_turns"),
        ("env.tool_timeout_s=0", "env.tool_timeout_s"),
        ("env.tool_parser=json", "env.tool_parser"),
        ("env.python_memory_mb=0", "env.python_memory_mb"),
    ]:
        with pytest.raises(ConfigError, match=key):
            load_config(None, [override])
    with pytest.raises(ConfigError, match="at least one tool"):
        load_config(None, ["env.name=tools"])
    with pytest.raises(ConfigError, match="chat template"):
        load_config(None, ["env.name=tools", "env.tools=[calculator]", "data.chat_template=none"])
    assert load_config(None, ["env.name=my_module.sub:MyEnv"]).env.name == "my_module.sub:MyEnv"
    assert math.isfinite(EnvConfig().tool_timeout_s)
