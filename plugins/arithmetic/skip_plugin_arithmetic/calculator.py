"""The built-in ``calculator`` tool: exact integer and decimal arithmetic, without ``eval``.

The expression is parsed with ``ast`` and only numbers, ``+ - * / // % **``, unary signs
and parentheses are interpreted; anything else (names, calls, attributes) is an error the
model reads back as the tool response. Sizes are bounded so a model cannot make the
environment compute ``9**9**9``.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction
from typing import Any

from skip_plugin_trainer.rollout.tools import Tool, ToolResponse

SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (12 + 7) * 3"}},
            "required": ["expression"],
        },
    },
}

MAX_LENGTH = 200
MAX_DIGITS = 60
MAX_EXPONENT = 64

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


class CalculatorError(ValueError):
    pass


def evaluate(expression: str) -> str:
    """The exact value of ``expression``: an integer, else a decimal rounded to 10 places."""
    if len(expression) > MAX_LENGTH:
        raise CalculatorError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from None
    value = _value(tree.body)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10f}".rstrip("0")


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and (right.denominator != 1 or abs(right) > MAX_EXPONENT):
            raise CalculatorError(f"exponent must be an integer of at most {MAX_EXPONENT}")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError("division by zero")
        result = Fraction(_BINARY[type(node.op)](left, right))
        if max(len(str(abs(result.numerator))), len(str(result.denominator))) > MAX_DIGITS:
            raise CalculatorError(f"result has more than {MAX_DIGITS} digits")
        return result
    raise CalculatorError(f"unsupported syntax: {ast.unparse(node)!r}")


class Calculator(Tool):
    schema = SCHEMA

    async def execute(self, request_id: str, arguments: dict[str, Any], **_: Any) -> ToolResponse:
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            raise CalculatorError('arguments must be {"expression": "<arithmetic>"}')
        return ToolResponse(evaluate(expression))
