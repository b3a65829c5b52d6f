"""The calculator tool (`services/reward/tools/calculator.py`): exact, and only arithmetic.

Expected values come from Python's own integer arithmetic (`a * b` on ints is exact at any
size) and `fractions.Fraction`, not from the evaluator under test."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from services.reward.tools.calculator import CalculatorError, evaluate, format_number


def test_three_digit_by_two_digit_products_are_exact() -> None:
    rng = random.Random(7)
    for _ in range(200):
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        assert evaluate(f"{a} * {b}") == str(a * b)
        assert evaluate(f"{a}×{b}") == str(a * b)


def test_division_is_exact_and_precedence_is_pythons() -> None:
    assert evaluate("1 / 3 * 3") == "1"  # float arithmetic gives 1.0 only by luck of rounding
    assert evaluate("7 / 4") == "1.75"
    assert evaluate("2 + 3 * 4 ** 2") == str(2 + 3 * 4**2)
    assert evaluate("-(5 - 8) // 2") == str(-(5 - 8) // 2)
    assert evaluate("2^10") == "1024"
    assert format_number(Fraction(1, 3)) == "0.333333333333"


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('true')",
        "open('/etc/passwd')",
        "(1).__class__",
        "x + 1",
        "[1, 2]",
        "1 / 0",
        "9 ** 9999",
        "",
        "1 +",
    ],
)
def test_anything_but_bounded_arithmetic_is_refused(expression: str) -> None:
    with pytest.raises(CalculatorError):
        evaluate(expression)
