"""Built-in reward functions (`services/reward/builtins.py`), called in-process.

The GSM8K cases are completions in the forms models actually write (worked solutions,
dollar amounts, thousands separators, boxed answers, trailing units); the arithmetic
and format rewards are fuzzed with thousands of random strings (no sympy involved)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.reward import builtins as b

GSM8K_GOLD = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n48+24 = <<48+24=72>>72\n#### 72"


def call(fn, completion: str, answer: str, prompt: str = "", **kwargs) -> float:  # type: ignore[no-untyped-def]
    return fn(prompt, completion, [1, 2], [3, 4], answer, **kwargs)


@pytest.mark.parametrize(
    "completion",
    [
        "In May she sold 48 / 2 = 24 clips. Altogether 48 + 24 = 72 clips.\n#### 72",
        "She sold 24 clips in May, so 48 + 24 = 72 in total.\nThe answer is 72.",
        "Total clips: $\\boxed{72}$",
        "48 + 24 = 72\n#### 72 clips",
        "#### 72.0",
        "Answer: 72",
        "She sold 72",  # only the last number
    ],
)
def test_gsm8k_correct_forms(completion: str) -> None:
    assert call(b.gsm8k_reward, completion, GSM8K_GOLD) == 1.0


@pytest.mark.parametrize(
    "completion",
    [
        "48 + 24 = 71\n#### 71",
        "She sold 72 clips... wait, 48/2 = 24, so #### 96",  # marker wins over earlier 72
        "The answer is \\boxed{7.2}",
        "I don't know.",
        "",
    ],
)
def test_gsm8k_incorrect_forms(completion: str) -> None:
    assert call(b.gsm8k_reward, completion, GSM8K_GOLD) == 0.0


def test_gsm8k_dollars_commas_and_fractions() -> None:
    assert call(b.gsm8k_reward, "It costs $1,080.00 in all.\n#### $1,080", "#### 1080") == 1.0
    assert call(b.gsm8k_reward, "#### \\frac{3}{4}", "0.75") == 1.0
    assert call(b.gsm8k_reward, "#### 3/4", "#### 0.75") == 1.0
    assert call(b.gsm8k_reward, "#### 1,081", "#### 1080") == 0.0


def test_math_reward_uses_the_last_box_and_math_equivalence() -> None:
    assert call(b.math_reward, "so $x = \\boxed{\\frac{1}{2}}$", "0.5") == 1.0
    assert call(b.math_reward, "\\boxed{2\\sqrt{3}}", "\\sqrt{12}") == 1.0
    assert call(b.math_reward, "\\boxed{3}", "\\boxed{4}") == 0.0
    # No box: math-verify finds the last expression of the tail.
    assert call(b.math_reward, "Therefore the result is $\\frac{10}{4}$", "\\frac{5}{2}") == 1.0


def test_exact_match() -> None:
    assert call(b.exact_match_reward, "  Paris\n", "Paris") == 1.0
    assert call(b.exact_match_reward, "paris", "Paris") == 0.0
    assert call(b.exact_match_reward, "paris", "Paris", ignore_case=True) == 1.0


def test_geometry3k_style() -> None:
    assert (
        call(b.geometry3k_reward, "<think>...</think> The length is [2\\sqrt{3}]", "\\sqrt{12}")
        == 1.0
    )
    assert call(b.geometry3k_reward, "Angle measure: [40/3]", "\\frac{40}{3}") == 1.0
    assert call(b.geometry3k_reward, "so \\boxed{13}", "12") == 0.0


def test_clevr_count_style() -> None:
    assert call(b.clevr_count_reward, "I see 2 spheres and 3 cubes, total [5]", "5") == 1.0
    assert call(b.clevr_count_reward, "total [5]", "6") == 0.0
    assert call(b.clevr_count_reward, "There are 7 objects.", "7") == 1.0  # last number
    assert call(b.clevr_count_reward, "no count", "7") == 0.0


@pytest.mark.parametrize(
    ("prompt", "completion", "expected"),
    [
        ("End with '#### <answer>'.", "12+3=15\n#### 15", 1.0),
        ("End with '#### <answer>'.", "12+3=15, answer 15", 0.0),
        ("Put the answer in \\boxed{}.", "so \\boxed{15}", 1.0),
        ("Put the answer in \\boxed{}.", "so \\boxed{}", 0.0),
        (
            "Use <think></think> then <answer></answer>.",
            "<think>12+3</think>\n<answer>15</answer>",
            1.0,
        ),
        ("Use <think></think> then <answer></answer>.", "<answer>15</answer>", 0.0),
        ("12+3=", "#### 15", 1.0),  # prompt does not say: any final-answer marker
        ("12+3=", "15", 0.0),
    ],
)
def test_format_reward_reads_the_asked_form_from_the_prompt(
    prompt: str, completion: str, expected: float
) -> None:
    assert call(b.format_reward, completion, "15", prompt=prompt) == expected


def test_format_reward_style_from_kwargs_and_bad_style() -> None:
    assert call(b.format_reward, "\\boxed{1}", "1", prompt="####", format_style="boxed") == 1.0
    with pytest.raises(ValueError, match="format_style must be one of"):
        call(b.format_reward, "x", "1", format_style="yaml")


def test_arithmetic_demo_reward() -> None:
    # The demo's rows: prompt "12+34=", answer "#### 46".
    assert call(b.arithmetic_reward, "#### 46", "#### 46", prompt="12+34=") == 1.0
    assert call(b.arithmetic_reward, "46", "#### 46", prompt="12+34=") == 1.0
    assert call(b.arithmetic_reward, "#### 45", "#### 46", prompt="12+34=") == 0.0
    assert call(b.arithmetic_reward, "####", "#### 46", prompt="12+34=") == 0.0


FUZZ = settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
anything = st.text(max_size=200)


@FUZZ
@given(completion=anything, answer=anything, prompt=anything)
def test_fuzz_sympy_free_rewards_are_zero_or_one(completion: str, answer: str, prompt: str) -> None:
    for fn in (b.arithmetic_reward, b.clevr_count_reward, b.exact_match_reward, b.format_reward):
        assert call(fn, completion, answer, prompt=prompt) in (0.0, 1.0)


@settings(max_examples=200, deadline=None)
@given(
    noise=st.text(alphabet=st.sampled_from(list("abc xyz,.!\n")), max_size=80),
    n=st.integers(-(10**6), 10**6),
)
def test_fuzz_gsm8k_marker_answers(noise: str, n: int) -> None:
    # Numbers only (no `^`/braces): math-verify cannot hang on these, so it runs in-process.
    assert call(b.gsm8k_reward, f"{noise}\n#### {n}", f"#### {n}") == 1.0
    assert call(b.gsm8k_reward, f"{noise}\n#### {n + 1}", f"#### {n}") == 0.0
