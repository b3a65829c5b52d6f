"""Built-in reward functions, each with the contract every reward function has:

    reward_fn(prompt, completions, prompt_ids, completion_ids, answer, **kwargs) -> float

`completions` is one completion (a `str`; the plural is the name AReaL users know), the
ids are the token ids of prompt and completion, `answer` is the dataset's reference and
`kwargs` are the other dataset fields. Every function returns 1.0 or 0.0 and never
decides what a timeout means: the service runs them in worker processes with deadlines
and reports failures as statuses.

A reference they cannot use is the item's fault, not the completion's: an empty
`answer`, or one with no value to compare with (no number for `clevr_count` and
`arithmetic`, nothing math-verify can read as math for `gsm8k`, `math`, `geometry3k`),
raises `InvalidInput`, which the worker reports as INVALID_INPUT. Scoring against it
would give a confident 0.0 that says nothing about the completion. It is checked before
the completion is read; a completion without an answer is a wrong answer (0.0).

Equivalence for math uses `math-verify` with its own timeouts switched off: they rely on
SIGALRM, and a parser that silently gives up would turn a hang into a wrong "0.0 OK".
The service's deadline, which kills the worker, is the one timeout; it reports TIMEOUT.
"""

from __future__ import annotations

import logging
import re
from functools import lru_cache
from typing import Any

from services.reward import extract
from services.reward.errors import InvalidInput

# math-verify warns on every call that its timeouts are off; that is deliberate here.
logging.getLogger("math_verify").setLevel(logging.ERROR)
logging.getLogger("latex2sympy2_extended").setLevel(logging.ERROR)

_GOLD_CACHE_SIZE = 4096


def _mv():  # type: ignore[no-untyped-def]
    """Import math-verify lazily: the service process that only routes never pays for sympy."""
    import math_verify

    return math_verify


def _as_latex(s: str) -> str:
    """Wrap a bare answer in `$...$` so math-verify's LaTeX extractor reads all of it
    (without delimiters, `2\\sqrt{3}` is read as `2`)."""
    if "$" in s or "\\boxed" in s or "\\(" in s or "\\[" in s:
        return s
    return f"${s}$"


def _parse(s: str) -> list[Any]:
    """math-verify's reading of `s`, numbers in scientific notation written out first (it
    reads `$1e6$` as `1*e*6` and a bare `2.5e3` as `2.5`: wrong either way)."""
    mv = _mv()
    return mv.parse(_as_latex(extract.expand_exponents(s)), parsing_timeout=None)


@lru_cache(maxsize=_GOLD_CACHE_SIZE)
def _parse_gold(s: str) -> tuple[Any, ...]:
    """Gold answers repeat n_samples times per prompt: parse each once per worker."""
    return tuple(_parse(s))


def unusable_answer(answer: str, why: str) -> InvalidInput:
    """The error for a reference `answer` that cannot be scored against, `why` saying why
    (the answer is quoted, cut to 80 characters); an empty one says so."""
    if not answer.strip():
        return InvalidInput("answer is empty: there is no reference to score against")
    shown = answer if len(answer) <= 80 else answer[:77] + "..."
    return InvalidInput(f"answer {shown!r} {why}")


def reference(answer: str, gold: str) -> tuple[Any, ...]:
    """math-verify's reading of `gold` (the reference value taken from `answer`).

    `InvalidInput` when `gold` is empty or math-verify finds no value in it: its parse
    then holds the text alone (its fallback), and equivalence would fall back to
    comparing strings, where a wrong reference cannot be told from a wrong completion."""
    parsed = _parse_gold(gold) if gold else ()
    if not any(not isinstance(value, str) for value in parsed):
        raise unusable_answer(answer, f"has no value math-verify can read (read {gold!r})")
    return parsed


def _verify(gold: tuple[Any, ...], pred: str) -> bool:
    pred_parsed = _parse(pred)
    if not pred_parsed:
        return False
    return bool(_mv().verify(list(gold), pred_parsed, timeout_seconds=None))


def math_equal(gold: str, pred: str) -> bool:
    """True when math-verify finds `pred` equivalent to `gold` (numbers, fractions,
    percentages, LaTeX expressions, sets, intervals); `InvalidInput` when `gold` has no
    value (see `reference`)."""
    return _verify(reference(gold, gold), pred)


def _numeric_candidate(candidate: str) -> str:
    """Reduce `18 dollars` / `$18.00 per week` to the number; keep LaTeX as it is. A number
    in scientific notation (`1e6 dollars`) is one number: all of it, never its mantissa."""
    if extract.to_fraction(candidate) is not None or "\\" in candidate:
        return candidate
    first = extract.first_number(candidate)
    return first if first is not None else candidate


def gsm8k_reward(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str,
    **kwargs: Any,
) -> float:
    """1.0 when the final answer (`#### N`, else `\\boxed{N}`, else "the answer is N", else
    the last number) equals the reference after `####` in `answer`, by math-verify.
    Scientific notation counts by its value: `#### 1e6` is 1000000 (and not 1)."""
    gold = reference(answer, _numeric_candidate(extract.gsm8k_gold(answer)))
    pred = extract.final_answer(completions)
    if pred is None:
        return 0.0
    return 1.0 if _verify(gold, _numeric_candidate(pred)) else 0.0


def math_reward(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str,
    **kwargs: Any,
) -> float:
    """MATH-style: the last `\\boxed{...}` (else the last expression math-verify finds in the
    tail of the completion) against the reference, equivalence by math-verify. Numbers in
    scientific notation are written out first: `\\boxed{2.5e3}` is 2500 (not 2.5, nor
    `2.5*e*3`)."""
    gold = reference(answer, extract.clean_answer(extract.last_boxed(answer) or answer))
    boxed = extract.last_boxed(completions)
    if boxed is not None:
        pred_parsed = _parse(boxed)
    else:
        # No box: let math-verify find the last LaTeX/number in the tail.
        tail = extract.expand_exponents(completions[-extract.TAIL_CHARS :])
        pred_parsed = _mv().parse(tail, parsing_timeout=None)
    if not pred_parsed:
        return 0.0
    return 1.0 if _mv().verify(list(gold), pred_parsed, timeout_seconds=None) else 0.0


def exact_match_reward(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str,
    ignore_case: bool = False,
    **kwargs: Any,
) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, is the answer exactly
    (`ignore_case=True` as a dataset field or config kwarg folds case); an empty answer
    is `InvalidInput` (an empty completion would match it)."""
    a, b = completions.strip(), answer.strip()
    if not b:
        raise unusable_answer(answer, "is empty")
    if ignore_case:
        a, b = a.casefold(), b.casefold()
    return 1.0 if a == b else 0.0


def geometry3k_reward(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str,
    **kwargs: Any,
) -> float:
    """Geometry3K-style: the answer in the last `[...]` (else the last box, else the last
    number), compared with math-verify, so `2\\sqrt{3}` matches `\\sqrt{12}` and `13.33`
    matches `\\frac{40}{3}` to math-verify's rounding."""
    gold = reference(answer, extract.clean_answer(extract.bracketed_answer(answer) or answer))
    pred = (
        extract.bracketed_answer(completions)
        or extract.last_boxed(completions)
        or extract.last_number(completions)
    )
    if pred is None:
        return 0.0
    pred = extract.clean_answer(pred)
    return 1.0 if pred and _verify(gold, pred) else 0.0


def clevr_count_reward(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str,
    **kwargs: Any,
) -> float:
    """CLEVR-count-style: the count in the last `[N]` (else the last box, else the last
    number) equals the reference count exactly; a reference that is not a number is
    `InvalidInput`."""
    want = extract.to_fraction(answer)
    if want is None:
        raise unusable_answer(answer, "is not a number")
    pred = (
        extract.bracketed_answer(completions)
        or extract.last_boxed(completions)
        or extract.last_number(completions)
    )
    if pred is None:
        return 0.0
    got = extract.to_fraction(extract.first_number(pred) or pred)
    return 1.0 if got is not None and got == want else 0.0


_THINK_ANSWER_RE = re.compile(r"\s*<think>.*?</think>\s*<answer>.+?</answer>\s*", re.DOTALL)
_HASH_LINE_RE = re.compile(r"####[ \t]*\S[^\n]*\s*")


def detect_format(prompt: str) -> str:
    """The answer form a prompt asks for: `tags` (<think>/<answer>), `boxed` or `hash`
    (`#### N`); `any` when the prompt does not say."""
    if "</answer>" in prompt or "<think>" in prompt:
        return "tags"  # a closing tag: "#### <answer>" alone is a placeholder, not a tag
    if "\\boxed" in prompt:
        return "boxed"
    if "####" in prompt:
        return "hash"
    return "any"


def format_ok(completion: str, style: str) -> bool:
    """Whether the completion gives its answer in `style` (see `detect_format`).

    `hash`: the last non-empty line starts with `####` followed by a value; `boxed`: a
    closed, non-empty `\\boxed{}`; `tags`: `<think>...</think><answer>...</answer>` and
    nothing else; `any`: one of `hash` or `boxed`.
    """
    if style == "tags":
        return _THINK_ANSWER_RE.fullmatch(completion) is not None
    if style == "boxed":
        box = extract.last_boxed(completion)
        return box is not None and box.strip() != ""
    if style == "hash":
        lines = [ln for ln in completion.rstrip().split("\n") if ln.strip()]
        return bool(lines) and _HASH_LINE_RE.fullmatch(lines[-1].strip() + "\n") is not None
    if style == "any":
        return format_ok(completion, "hash") or format_ok(completion, "boxed")
    raise ValueError(f"format_style must be one of tags, boxed, hash, any; got {style!r}")


def format_reward(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str,
    format_style: str | None = None,
    **kwargs: Any,
) -> float:
    """1.0 when the answer is in the form the prompt asked for, whatever its value.

    The form is `format_style` when given (a dataset field or config kwarg: `tags`,
    `boxed`, `hash`, `any`), else read from the prompt by `detect_format`.
    """
    style = format_style or detect_format(prompt)
    return 1.0 if format_ok(completions, style) else 0.0


def arithmetic_reward(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str,
    **kwargs: Any,
) -> float:
    """The built-in demo task (generated arithmetic, GSM8K-style `#### N` answers): exact
    rational equality of the final number, no sympy, so the demo's tiny model is scored
    in microseconds. The reference may be `N` or a worked answer ending in `#### N`; one
    without a number there is `InvalidInput`."""
    want = extract.to_fraction(extract.gsm8k_gold(answer))
    if want is None:
        raise unusable_answer(answer, "has no number (N or a last line '#### N')")
    pred = extract.final_answer(completions)
    if pred is None:
        return 0.0
    got = extract.to_fraction(extract.first_number(pred) or "")
    return 1.0 if got is not None and got == want else 0.0
