"""The `calculator` tool: arithmetic on numeric literals, parsed with Python's ast and evaluated by
walking a whitelist of nodes (never eval).

Allowed: int and float literals, + - * / // % ** (binary), + - (unary), parentheses. Anything else
(names, calls, attributes, strings, comparisons, bools, complex numbers) is refused. Bounds keep a
call cheap whatever the input: the expression is at most MAX_CHARS characters, every integer
(operand, intermediate or result) at most MAX_BITS bits (an exponentiation is refused before it is
computed when its result would be larger), and a float result must be finite. Errors (division by
zero, a bound, a syntax error) are results with error="failed", which the policy reads.
"""

from __future__ import annotations

import ast
import math
import operator

from rpeg_jax.env.tools.base import FAILED, Tool, ToolResult

MAX_CHARS = 500
MAX_BITS = 4096  # ~1233 decimal digits

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ValueError):
    pass


def _number(value):
    if type(value) not in (int, float):  # e.g. (-8) ** 0.5 is complex
        raise CalcError("the result is not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise CalcError(f"a number is larger than {MAX_BITS} bits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError("the result is not a finite number")
    return value


def _power(base, exp):
    if isinstance(base, int) and isinstance(exp, int) and exp > 0 and abs(base) > 1:
        if (abs(base).bit_length() - 1) * exp > MAX_BITS:  # a lower bound of the result's bits
            raise CalcError(f"the power is larger than {MAX_BITS} bits")
    if isinstance(exp, float) or isinstance(base, float):
        if abs(exp) > 1e6:
            raise CalcError("the exponent is too large")
    return base**exp


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if type(node.value) in (int, float):  # not bool, complex, str, bytes, None
            return _number(node.value)
        raise CalcError(f"only numbers are allowed, not {node.value!r}")
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _number(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _number(_power(left, right))
        return _number(_BINARY[type(node.op)](left, right))
    what = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
    raise CalcError(f"{what} is not allowed (numbers, + - * / // % ** and parentheses only)")


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression; CalcError says why there is none."""
    if len(expression) > MAX_CHARS:
        raise CalcError(f"the expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise CalcError(f"not an arithmetic expression: {getattr(e, 'msg', None) or e}") from None
    try:
        return _eval(tree)
    except ZeroDivisionError:
        raise CalcError("division by zero") from None
    except (OverflowError, RecursionError, ValueError) as e:
        if isinstance(e, CalcError):
            raise
        raise CalcError(f"{type(e).__name__}: {e}") from None


class Calculator(Tool):
    name = "calculator"
    description = "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses."
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 2 ** 10 / 7"}},
        "required": ["expression"],
        "additionalProperties": False,
    }

    def run(self, arguments: dict) -> ToolResult:
        try:
            value = calculate(arguments["expression"])
        except CalcError as e:
            return ToolResult(f"Error: {e}", FAILED)
        return ToolResult(repr(value) if isinstance(value, float) else str(value))
