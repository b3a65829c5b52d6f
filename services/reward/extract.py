"""Answer extraction: find the final answer a model wrote, in linear time, without sympy.

Why a module of its own: extraction is the part of a verifier that sees raw model output —
megabytes of it, any bytes, half-written LaTeX — so it must never raise and never
backtrack. Every function here is a plain scan or a regex without nested quantifiers,
and returns `None` when there is nothing to find. Equivalence (is "1,000" the same as
"1000.0"?) is a separate step, done by `math-verify` in `services.reward.builtins`.

The forms handled are the ones models actually write:
- GSM8K's `#### 42` marker (the last one wins; the rest of its line is the answer);
- LaTeX `\\boxed{...}` / `\\fbox{...}` with nested braces (the last one wins);
- "the answer is 42" / "final answer: 42" phrases;
- bracketed answers `[42]` (CLEVR-count style prompts ask for them);
- as a last resort, the last number in the text (`1,234.5`, `-3`, `3/4`, `.5`, `1e6`).

A number in scientific notation (`1e6`, `2.5E-3`) is one number: it is read whole or not
at all, never as its mantissa. math-verify reads `1e6` as `1*e*6` (LaTeX's `e` is Euler's
number) or as `1`, so `plain_number` and `expand_exponents` write such numbers out in full
(`1000000`, `0.0025`) before math-verify sees them.
"""

from __future__ import annotations

import re
from decimal import Decimal
from fractions import Fraction

# A number as models write it: optional sign, digits with optional thousands commas,
# optional decimals, or a leading-dot decimal; an optional exponent (`1e6`, `2.5E-3`);
# optionally a simple fraction `a/b`. No nested quantifiers, so the scan stays linear on
# adversarial input.
_EXPONENT = r"(?:[eE][-+]?\d+)?"
_NUMBER = (
    rf"[-−]?(?:\d{{1,3}}(?:,\d{{3}})+|\d+)(?:\.\d+)?{_EXPONENT}(?:\s?/\s?\d+)?"
    rf"|[-−]?\.\d+{_EXPONENT}"
)
NUMBER_RE = re.compile(rf"(?<![\w.])(?:{_NUMBER})")
# Scientific notation alone: mantissa and exponent, as a whole token (not inside a word).
_SCIENTIFIC_RE = re.compile(r"(?<![\w.])([-+−]?(?:\d+(?:\.\d*)?|\.\d+))[eE]([-+]?\d+)(?!\w|\.\d)")
MAX_EXPONENT = 100
"""Largest |exponent| written out in full (`1e100` is 101 digits). Beyond it a number stays
as written: read whole, equal to nothing plain, and never expanded into megabytes."""
_ANSWER_PHRASE_RE = re.compile(
    r"(?:final answer|the answer|answer)\s*(?:is|:|=)\s*:?\s*",
    re.IGNORECASE,
)
_BRACKET_RE = re.compile(r"\[([^\[\]\n]{1,64})\]")
_BOX_COMMANDS = ("\\boxed", "\\fbox")
# How many unclosed boxes to step back over: bounded so that a text made of thousands of
# unclosed `\boxed{` stays linear (each step scans to the end at most once).
_MAX_BOX_FALLBACKS = 4
_PLAIN_NUMBER_RE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?(?:/\d+)?")
# Tails longer than this are not searched for phrases: answers sit at the end, and a bound
# keeps a 1 MB completion as cheap as a short one.
TAIL_CHARS = 4096


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`), braces balanced.

    An unclosed last box falls back to the previous closed one: a completion truncated
    inside its final box has not given that answer.
    """
    end = len(text)
    for _attempt in range(_MAX_BOX_FALLBACKS):
        start = max(text.rfind(cmd, 0, end) for cmd in _BOX_COMMANDS)
        if start < 0:
            return None
        cmd = "\\boxed" if text.startswith("\\boxed", start) else "\\fbox"
        i = start + len(cmd)
        n = len(text)
        if i < n and text[i] == " ":
            # `\boxed 5`: the argument is the next token.
            j = i + 1
            while j < n and not text[j].isspace() and text[j] not in "$":
                j += 1
            token = text[i + 1 : j]
            if token:
                return token
        elif i < n and text[i] == "{":
            depth = 0
            for j in range(i, n):
                ch = text[j]
                if ch == "{":
                    depth += 1
                elif ch == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j]
        end = start
        if end <= 0:
            return None
    return None


def hash_answer(text: str) -> str | None:
    """What follows the last `####` on its line (GSM8K's answer marker), stripped."""
    idx = text.rfind("####")
    if idx < 0:
        return None
    rest = text[idx + 4 :]
    line = rest.split("\n", 1)[0].strip()
    return line or None


def phrase_answer(text: str) -> str | None:
    """The number after the last "the answer is" / "final answer:" in the tail."""
    tail = text[-TAIL_CHARS:]
    last = None
    for m in _ANSWER_PHRASE_RE.finditer(tail):
        last = m
    if last is None:
        return None
    after = tail[last.end() : last.end() + 200]
    number = NUMBER_RE.search(after.replace("$", " "))
    return number.group(0) if number else None


def bracketed_answer(text: str) -> str | None:
    """Content of the last `[...]` on one line (up to 64 characters), stripped."""
    tail = text[-TAIL_CHARS:]
    last = None
    for m in _BRACKET_RE.finditer(tail):
        last = m
    if last is None:
        return None
    inner = last.group(1).strip()
    return inner or None


def last_number(text: str) -> str | None:
    """The last number in the text, as written (commas and all), or None."""
    # Search the tail first: it is where the answer is, and it keeps long inputs cheap.
    for chunk in (text[-TAIL_CHARS:], text):
        last = None
        for m in NUMBER_RE.finditer(chunk):
            last = m
        if last is not None:
            return last.group(0)
        if len(chunk) == len(text):
            break
    return None


def first_number(text: str) -> str | None:
    m = NUMBER_RE.search(text)
    return m.group(0) if m else None


def clean_answer(ans: str) -> str:
    """Drop the wrapping that is never part of the value: `$`, `\\$`, `\\!`, a final period,
    `\\text{...}` around the whole answer, surrounding spaces."""
    s = ans.strip()
    s = s.replace("\\$", "").replace("\\!", "").replace("$", "").strip()
    if s.startswith("\\text{") and s.endswith("}"):
        s = s[len("\\text{") : -1].strip()
    while s.endswith((".", "。")) and not s[:-1].endswith("."):
        s = s[:-1].rstrip()
    return s


def gsm8k_gold(answer: str) -> str:
    """The gold value of a GSM8K-style answer field: the part after `####` when present
    (the dataset's field carries the whole worked solution), else the field itself."""
    marked = hash_answer(answer)
    return clean_answer(marked if marked is not None else answer)


def final_answer(text: str) -> str | None:
    """A model's final answer, in the priority a grader expects: the `####` marker, then the
    last box, then an answer phrase, then the last number. Cleaned, or None."""
    for extractor in (hash_answer, last_boxed, phrase_answer, last_number):
        found = extractor(text)
        if found is not None:
            cleaned = clean_answer(found)
            if cleaned:
                return cleaned
    return None


def _written_out(m: re.Match[str]) -> str:
    """The full decimal form of one scientific-notation match, or the match unchanged when
    its exponent is beyond `MAX_EXPONENT`."""
    mantissa, exponent = m.group(1).replace("−", "-"), m.group(2)
    if len(exponent.lstrip("+-")) > 4 or abs(int(exponent)) > MAX_EXPONENT:
        return m.group(0)
    return format(Decimal(f"{mantissa}e{exponent}"), "f")


def plain_number(s: str) -> str:
    """`s` written out in full when it is one number in scientific notation (`1e6` ->
    `1000000`, `2.5E-3` -> `0.0025`), else `s` unchanged."""
    m = _SCIENTIFIC_RE.fullmatch(s.strip())
    return _written_out(m) if m is not None else s


def expand_exponents(text: str) -> str:
    """`text` with every number in scientific notation written out in full (`x = 2.5e3` ->
    `x = 2500`), for math-verify, which reads `2.5e3` as `2.5*e*3`. Exponents beyond
    `MAX_EXPONENT` stay as written, so the result grows at most ~25 times (`1e99`)."""
    if "e" not in text and "E" not in text:
        return text
    return _SCIENTIFIC_RE.sub(_written_out, text)


def to_fraction(s: str) -> Fraction | None:
    """An exact value for a plain number string (`1,234.50`, `-3`, `3/4`, `.5`, `2.5e3`),
    else None (also for an exponent beyond `MAX_EXPONENT`: `1e999999` would cost seconds).

    Used where math-verify would be overkill (integer demo answers, counts): exact rationals
    so that "0.1" + "0.2" style float noise cannot flip a reward.
    """
    t = clean_answer(s).replace(",", "").replace("−", "-").replace(" ", "")
    if t.endswith("%"):
        t = t[:-1]
    if len(t) > 64 or not _PLAIN_NUMBER_RE.fullmatch(t):
        return None
    if "e" in t or "E" in t:
        t = _SCIENTIFIC_RE.sub(_written_out, t)
        if "e" in t or "E" in t:  # an exponent beyond MAX_EXPONENT
            return None
    try:
        if "/" in t:
            num, _, den = t.partition("/")
            d = Fraction(den)
            if d == 0:
                return None
            return Fraction(num) / d
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None
