"""`launcher.warm_start.rows_fn` targets of tests/launcher/test_warmstart_given.py."""

from __future__ import annotations

from typing import Any


def transcripts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Two rows per problem, taught as written: a call and an answer (no `####`)."""
    out: list[dict[str, Any]] = []
    for row in rows:
        out.append({"prompt": row["prompt"], "answer": "<call>x</call>"})
        out.append({"prompt": row["prompt"] + " result 7", "answer": "7"})
    return out


def not_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"prompt": r["prompt"]} for r in rows]
