"""The `calculator` tool: exact arithmetic on a parsed expression, never `eval`.

The expression is parsed with `ast` and only numbers, parentheses and the operators
`+ - * / // % **` are walked; names, calls, attributes and everything else are refused.
Integers stay integers (Python's are exact at any size) and `/` divides as a `Fraction`,
so `123 * 45` is `5535` and `1 / 3 * 3` is `1`, not `0.9999999999999999`. Sizes are
bounded (expression length, exponent, digits of the result) so a call cannot spend the
sandbox's whole deadline building one huge number.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from fractions import Fraction

from services.reward.tools.schemas import one_argument_tool

MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 256
MAX_RESULT_DIGITS = 1000

SCHEMA = one_argument_tool(
    "calculator",
    "Evaluate an arithmetic expression exactly, e.g. 123 * 45.",
    "expression",
    "Numbers with + - * / // % ** and parentheses.",
)
"""The OpenAI `tools` entry an agent offers the model for this tool."""

Number = Fraction

_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: lambda a, b: Fraction(a // b),
    ast.Mod: operator.mod,
}


class CalculatorError(ValueError):
    """The expression is not arithmetic this tool evaluates (the message says why)."""


def _check_size(value: Number) -> Number:
    if max(len(str(abs(value.numerator))), len(str(value.denominator))) > MAX_RESULT_DIGITS:
        raise CalculatorError(f"result has more than {MAX_RESULT_DIGITS} digits")
    return value


def _power(base: Number, exp: Number) -> Number:
    if exp.denominator != 1:
        raise CalculatorError("only whole-number exponents are supported")
    if abs(exp) > MAX_EXPONENT:
        raise CalculatorError(f"exponent above {MAX_EXPONENT}")
    if base == 0 and exp < 0:
        raise CalculatorError("division by zero")
    return Fraction(base) ** int(exp)


def _walk(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _walk(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.Constant) and type(node.value) is float:
        return Fraction(str(node.value))  # the literal as written, not its binary rounding
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        value = _walk(node.operand)
        return value if isinstance(node.op, ast.UAdd) else -value
    if isinstance(node, ast.BinOp):
        left, right = _walk(node.left), _walk(node.right)
        if isinstance(node.op, ast.Pow):
            return _check_size(_power(left, right))
        fn = _BINARY.get(type(node.op))
        if fn is None:
            raise CalculatorError(f"operator {type(node.op).__name__} is not supported")
        if right == 0 and isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod):
            raise CalculatorError("division by zero")
        return _check_size(fn(left, right))
    raise CalculatorError(f"{type(node).__name__} is not arithmetic")


def format_number(value: Number) -> str:
    """An integer as digits; otherwise the exact fraction's decimal to 12 places, trimmed."""
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    scaled = round(abs(value) * 10**12)
    whole, frac = divmod(scaled, 10**12)
    return f"{sign}{whole}.{frac:012d}".rstrip("0").rstrip(".")


def evaluate(expression: str) -> str:
    """The value of `expression` as text (`CalculatorError` for anything else)."""
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("^", "**")
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an arithmetic expression: {exc.msg}") from None
    return format_number(_walk(tree))


def calculator(expression: str) -> str:
    """The tool as the sandbox calls it: `{"expression": "..."}` in, the value as text out."""
    return evaluate(str(expression))
