"""Answer extraction (`services/reward/extract.py`): the forms models write, and a fuzz of
thousands of random strings that must never raise and must keep the stated invariants."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.reward import extract

FUZZ = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Text that looks like model output: words, digits, LaTeX-ish and markup characters.
model_text = st.text(
    alphabet=st.sampled_from(list("abcxyz ABC0123456789 .,;:$#\\{}[]()^*/+-=%\n\t<>é∞")),
    max_size=300,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Janet sells 16 - 3 - 4 = 9 eggs, 9 * 2 = 18.\n#### 18", "18"),
        ("The total is $1,080.\n#### 1,080", "1,080"),
        ("#### $18.00.", "18.00"),
        ("so the answer is \\boxed{\\frac{3}{4}} .", "\\frac{3}{4}"),
        ("first \\boxed{1} then \\boxed{2}", "2"),
        ("nested \\boxed{\\sqrt{\\frac{1}{2}}}", "\\sqrt{\\frac{1}{2}}"),
        ("The answer is 42.", "42"),
        ("Final answer: -7", "-7"),
        ("She has 5 apples and buys 3 more, 8 in total", "8"),
        ("#### 5\n#### 6 apples", "6 apples"),  # the last marker wins
        ("nothing numeric here", None),
        ("", None),
    ],
)
def test_final_answer_forms_models_write(text: str, expected: str | None) -> None:
    assert extract.final_answer(text) == expected


def test_unclosed_last_box_falls_back_to_previous_closed_box() -> None:
    # Truncated inside the final box: the earlier, complete box is the answer given.
    assert extract.last_boxed("\\boxed{12} and then \\boxed{13") == "12"
    assert extract.last_boxed("\\boxed 7 done") == "7"
    assert extract.last_boxed("\\fbox{9}") == "9"


def test_many_unclosed_boxes_stay_cheap() -> None:
    # 100k unclosed boxes: bounded fallbacks keep this linear (a quadratic scan would take
    # minutes); the result is None because no box closes.
    assert extract.last_boxed("\\boxed{" * 100_000) is None


@pytest.mark.parametrize(
    ("s", "value"),
    [
        ("1,234.50", Fraction(246900, 200)),  # 1234.5
        ("-3", Fraction(-3)),
        ("3/4", Fraction(3, 4)),
        (".5", Fraction(1, 2)),
        ("$18.", Fraction(18)),
        ("50%", Fraction(50)),
        ("−2", Fraction(-2)),  # unicode minus
        ("2.5e3", Fraction(2500)),  # 2.5 x 10^3
        ("1E6", Fraction(10**6)),
        ("-4.5e-2", Fraction(-45, 1000)),  # -4.5 / 100
        ("1e100", Fraction(10**100)),  # the largest exponent written out
        ("1e101", None),  # beyond MAX_EXPONENT: refused, no huge integers
        ("1e9999999", None),
        ("1/0", None),
        ("abc", None),
    ],
)
def test_to_fraction(s: str, value: Fraction | None) -> None:
    assert extract.to_fraction(s) == value


def test_gsm8k_gold_reads_the_worked_solution_field() -> None:
    assert extract.gsm8k_gold("16 - 3 - 4 = <<16-3-4=9>>9\n9 * 2 = $<<9*2=18>>18\n#### 18") == "18"
    assert extract.gsm8k_gold(" 42 ") == "42"


def test_bracketed_answer_takes_the_last_one() -> None:
    assert extract.bracketed_answer("I count [3] cubes, no wait [4]") == "4"
    assert extract.bracketed_answer("no brackets") is None


@FUZZ
@given(text=model_text)
def test_fuzz_extractors_never_raise(text: str) -> None:
    for fn in (
        extract.last_boxed,
        extract.hash_answer,
        extract.phrase_answer,
        extract.bracketed_answer,
        extract.last_number,
        extract.final_answer,
    ):
        out = fn(text)
        assert out is None or isinstance(out, str)
    value = extract.to_fraction(text)
    assert value is None or isinstance(value, Fraction)


@FUZZ
@given(prefix=model_text.filter(lambda t: "####" not in t), n=st.integers(-(10**9), 10**9))
def test_fuzz_hash_marker_wins_over_any_prefix(prefix: str, n: int) -> None:
    text = f"{prefix}\n#### {n}"
    assert extract.final_answer(text) == str(n)
    assert extract.to_fraction(extract.final_answer(text) or "") == n


@FUZZ
@given(
    prefix=model_text,
    inner=st.text(alphabet=st.sampled_from(list("0123456789x+-^ \\frac")), max_size=40),
    suffix=st.text(alphabet=st.sampled_from(list("abc .,!\n")), max_size=40),
)
def test_fuzz_last_boxed_returns_the_balanced_content(prefix: str, inner: str, suffix: str) -> None:
    # Balanced content: wrap `inner` (no braces of its own) in one more brace pair.
    content = "{" + inner + "}"
    assert extract.last_boxed(f"{prefix}\\boxed{{{content}}}{suffix}") == content


@FUZZ
@given(n=st.integers(0, 10**12), frac=st.integers(0, 99))
def test_fuzz_thousands_commas_and_decimals_round_trip(n: int, frac: int) -> None:
    written = f"{n:,}.{frac:02d}"
    # e.g. 1234567 and 5 -> "1,234,567.05" -> 123456705/100
    assert extract.to_fraction(written) == Fraction(n * 100 + frac, 100)
    assert extract.last_number(f"costs ${written} total") == written


# --- scientific notation ------------------------------------------------------------------
# Reference: Python's float() reads scientific notation by the language's floating-point
# literal grammar (`1e6` is 1.0 x 10**6); a number written out by `plain_number` must denote
# the same value to it, and the extractors must take the whole token, never its mantissa.


@pytest.mark.parametrize(
    ("s", "written"),
    [
        ("1e6", "1000000"),  # 1 x 10^6
        ("2.5e3", "2500"),  # 2.5 x 1000
        ("2.5E-3", "0.0025"),  # 2.5 / 1000
        ("-1.25e+2", "-125"),  # -1.25 x 100
        (".5e1", "5"),  # 0.5 x 10
        ("−3e2", "-300"),  # unicode minus
        (" 7e0 ", "7"),
        ("1e101", "1e101"),  # beyond MAX_EXPONENT: as written
        ("1,000", "1,000"),  # not scientific: unchanged
        ("e5", "e5"),
        ("x1e5", "x1e5"),
    ],
)
def test_plain_number_writes_scientific_notation_out(s: str, written: str) -> None:
    assert extract.plain_number(s) == written
    if written != s and "e" not in written:
        assert float(written) == float(s.replace("−", "-"))


@pytest.mark.parametrize(
    ("text", "first", "last"),
    [
        ("#### 1e6", "1e6", "1e6"),
        ("so 2.5e3 dollars, not 2.5", "2.5e3", "2.5"),
        ("it is 4.5E-2.", "4.5E-2", "4.5E-2"),
        ("take 3e and 2", "3", "2"),  # no exponent digits: `e` is a word
        ("1e6kg", "1e6", "1e6"),  # a unit glued on: still all of 1e6
        ("x1e6", None, None),  # inside a word: no number at all
    ],
)
def test_first_and_last_number_take_the_whole_scientific_token(
    text: str, first: str | None, last: str | None
) -> None:
    assert extract.first_number(text) == first
    assert extract.last_number(text) == last


def test_expand_exponents_leaves_latex_and_words_alone_and_stays_bounded() -> None:
    text = "x = 2.5e3, y = 1e6. e^{2}, 3e^{x}, 0x3e5, a1e5, 1e999"
    assert extract.expand_exponents(text) == (
        "x = 2500, y = 1000000. e^{2}, 3e^{x}, 0x3e5, a1e5, 1e999"
    )
    # The worst growth: `1e99` (4 characters) becomes 100 digits; `1e100` is 101 from 5.
    worst = "1e99 " * 1000
    assert len(extract.expand_exponents(worst)) == 101 * 1000


@FUZZ
@given(
    mantissa=st.decimals(min_value=-(10**6), max_value=10**6, places=3, allow_nan=False),
    exponent=st.integers(-extract.MAX_EXPONENT, extract.MAX_EXPONENT),
    upper=st.booleans(),
)
def test_fuzz_scientific_notation_keeps_its_value(
    mantissa: object, exponent: int, upper: bool
) -> None:
    written = f"{mantissa}{'E' if upper else 'e'}{exponent}"
    expected = Fraction(str(mantissa)) * Fraction(10) ** exponent
    assert extract.to_fraction(written) == expected
    assert Fraction(extract.plain_number(written)) == expected
    assert float(extract.plain_number(written)) == float(written)
    assert extract.last_number(f"the total is {written} units") == written
