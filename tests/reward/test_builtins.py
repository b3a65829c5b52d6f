"""Built-in reward functions (`services/reward/builtins.py`), called in-process.

The GSM8K cases are completions in the forms models actually write (worked solutions,
dollar amounts, thousands separators, boxed answers, trailing units); the arithmetic
and format rewards are fuzzed with thousands of random strings (no sympy involved). A
reference answer that is missing or unreadable is InvalidInput, never a silent 0.0."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.reward import builtins as b
from services.reward.errors import InvalidInput

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


@pytest.mark.parametrize(
    ("fn", "completion", "answer", "gold_latex", "expected"),
    [
        # 1e6 = 1 x 10^6 = 1000000: the false negative and false positives.
        (b.gsm8k_reward, "#### 1e6", "1000000", "1000000", 1.0),
        (b.gsm8k_reward, "#### 1e6", "1", "1", 0.0),
        (b.gsm8k_reward, "#### 2.5e3", "2.5", "2.5", 0.0),
        (b.gsm8k_reward, "#### 2.5e3", "2500", "2500", 1.0),  # 2.5 x 1000
        (b.gsm8k_reward, "She pays 1.5E-3 dollars.\n#### 1.5E-3", "0.0015", "0.0015", 1.0),
        (b.gsm8k_reward, "The answer is 3e2 apples.", "#### 300", "300", 1.0),
        (b.gsm8k_reward, "#### 1e6 dollars", "#### 1", "1", 0.0),
        (b.math_reward, "\\boxed{1e6}", "1000000", "1000000", 1.0),
        (b.math_reward, "\\boxed{2.5e3}", "2.5", "2.5", 0.0),
        (b.math_reward, "\\boxed{2.5e3}", "\\boxed{2500}", "2500", 1.0),
        (b.math_reward, "so the count is 1e6", "1000000", "1000000", 1.0),  # no box: the tail
        (b.math_reward, "so the count is 1e6", "1", "1", 0.0),
        # Scientific notation in the reference too: 10^6 against 10^6.
        (b.math_reward, "\\boxed{1e6}", "\\boxed{1e6}", "1 \\times 10^{6}", 1.0),
    ],
)
def test_scientific_notation_scores_its_value(  # type: ignore[no-untyped-def]
    fn, completion: str, answer: str, gold_latex: str, expected: float
) -> None:
    # Reference: math-verify itself, given the completion's number in the LaTeX it reads
    # (`m \times 10^{k}`) and the reference's value: the reward agrees with its verdict.
    import math_verify as mv

    m, k = re.findall(r"([\d.]+)[eE]([-+]?\d+)", completion)[0]
    verdict = mv.verify(
        mv.parse(f"${gold_latex}$", parsing_timeout=None),
        mv.parse(f"${m} \\times 10^{{{k}}}$", parsing_timeout=None),
        timeout_seconds=None,
    )
    assert float(verdict) == expected
    assert call(fn, completion, answer) == expected


def test_a_huge_exponent_is_read_whole_and_matches_nothing_plain() -> None:
    # 1e500 is beyond what is written out: still one number, never its mantissa 1.
    assert call(b.gsm8k_reward, "#### 1e500", "1") == 0.0
    assert call(b.arithmetic_reward, "#### 1e500", "1") == 0.0
    assert call(b.arithmetic_reward, "#### 2.5e3", "2500") == 1.0  # 2.5 x 1000, exactly
    assert call(b.arithmetic_reward, "#### 2.5e3", "2.5") == 0.0


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


@pytest.mark.parametrize(
    ("fn", "answer", "why"),
    [
        (b.gsm8k_reward, "", "answer is empty"),
        (b.gsm8k_reward, " \n", "answer is empty"),
        (b.gsm8k_reward, "#### ", "has no value math-verify can read (read '####')"),
        (b.gsm8k_reward, "{", "has no value math-verify can read"),
        (b.math_reward, "", "answer is empty"),
        (b.math_reward, "\\boxed{}", "has no value math-verify can read"),
        (b.math_reward, "}{", "has no value math-verify can read"),
        (b.geometry3k_reward, "", "answer is empty"),
        (b.geometry3k_reward, "{", "has no value math-verify can read"),
        (b.clevr_count_reward, "", "answer is empty"),
        (b.clevr_count_reward, "five", "'five' is not a number"),
        (b.arithmetic_reward, "", "answer is empty"),
        (b.arithmetic_reward, "#### seven", "has no number"),
        (b.exact_match_reward, "  ", "answer is empty"),
    ],
)
def test_a_missing_or_unreadable_reference_is_invalid_input(fn, answer: str, why: str) -> None:  # type: ignore[no-untyped-def]
    # Whatever the completion says, even nothing at all: the item, not the completion, is bad.
    for completion in ("#### 72\n\\boxed{72} [72]", "", "no answer here"):
        with pytest.raises(InvalidInput, match=re.escape(why)):
            call(fn, completion, answer)


@pytest.mark.parametrize(
    ("fn", "answer"),
    [
        (b.gsm8k_reward, GSM8K_GOLD),
        (b.math_reward, "\\frac{1}{2}"),
        (b.geometry3k_reward, "\\sqrt{12}"),
        (b.clevr_count_reward, "5"),
        (b.arithmetic_reward, "#### 46"),
        (b.exact_match_reward, "Paris"),
    ],
)
def test_a_completion_without_an_answer_scores_zero(fn, answer: str) -> None:  # type: ignore[no-untyped-def]
    # The reference is fine: a completion that gives no answer is wrong, not invalid.
    assert call(fn, "", answer) == 0.0
    assert call(fn, "I cannot solve this.", answer) == 0.0


def test_a_long_unreadable_reference_is_quoted_cut_short() -> None:
    with pytest.raises(InvalidInput) as err:
        call(b.clevr_count_reward, "[3]", "x" * 500)
    assert str(err.value) == f"answer {'x' * 77 + '...'!r} is not a number"


FUZZ = settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
anything = st.text(max_size=200)


@FUZZ
@given(completion=anything, answer=anything, prompt=anything)
def test_fuzz_sympy_free_rewards_are_zero_one_or_invalid_input(
    completion: str, answer: str, prompt: str
) -> None:
    assert call(b.format_reward, completion, answer, prompt=prompt) in (0.0, 1.0)  # no reference
    for fn in (b.arithmetic_reward, b.clevr_count_reward, b.exact_match_reward):
        try:
            assert call(fn, completion, answer, prompt=prompt) in (0.0, 1.0)
        except InvalidInput as exc:
            assert str(exc).startswith("answer ")


@FUZZ
@given(completion=anything, n=st.integers(-(10**9), 10**9))
def test_fuzz_a_numeric_reference_is_never_invalid(completion: str, n: int) -> None:
    for fn, answer in (
        (b.arithmetic_reward, f"#### {n}"),
        (b.clevr_count_reward, str(n)),
        (b.exact_match_reward, str(n)),
    ):
        assert call(fn, completion, answer) in (0.0, 1.0)


@settings(max_examples=200, deadline=None)
@given(
    noise=st.text(alphabet=st.sampled_from(list("abc xyz,.!\n")), max_size=80),
    n=st.integers(-(10**6), 10**6),
)
def test_fuzz_gsm8k_marker_answers(noise: str, n: int) -> None:
    # Numbers only (no `^`/braces): math-verify cannot hang on these, so it runs in-process.
    assert call(b.gsm8k_reward, f"{noise}\n#### {n}", f"#### {n}") == 1.0
    assert call(b.gsm8k_reward, f"{noise}\n#### {n + 1}", f"#### {n}") == 0.0
