"""What a reward function raises when the item, not the function, is at fault.

`InvalidInput` turns into the item's `INVALID_INPUT` status with the exception's message,
the same status the service gives to a completion that is not UTF-8 or kwargs that are
not a JSON object. The built-in functions raise it when the reference answer is missing
or has no value they can read: scoring against it would give a confident `0.0` (or a
`1.0` for an empty completion) that says nothing about the completion. A completion
without an answer is not invalid input: it is wrong, and scores 0.0.

It is a `ValueError`, so code that calls a reward function in-process and catches
`ValueError` keeps working.
"""

from __future__ import annotations


class InvalidInput(ValueError):  # noqa: N818 - named for the status the caller reads
    """The item cannot be scored as given (the message says which field and why)."""
