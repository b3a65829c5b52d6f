"""Data set files and prompts, shared by every service that reads a data set: the rollout
(its prompt data sets), the trainer's SFT entry and the launcher (held-out evaluation).

`read_rows` reads local JSONL, JSON or parquet files (or a directory of them) into rows;
`render_prompt` turns a row's prompt (text, or a list of chat messages) into the text and
token ids a model sees, through the tokenizer's chat template when it has one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class DatasetError(ValueError):
    """A data set that cannot be used; the message names the file, row and field."""


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a `.jsonl`/`.json` or `.parquet` file, or of every such file in a directory."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".json", ".parquet"))
        if not files:
            raise DatasetError(f"{path} holds no .jsonl/.json/.parquet files")
        return [row for f in files for row in read_rows(f)]
    if not path.is_file():
        raise DatasetError(f"dataset file {path} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        rows = []
        with path.open() as fh:
            text = fh.read()
        if path.suffix == ".json" and text.lstrip().startswith("["):
            data = json.loads(text)
            if not isinstance(data, list):
                raise DatasetError(f"{path}: a .json data set must be a list of objects")
            return data
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{lineno}: a row must be a JSON object")
            rows.append(row)
        return rows
    raise DatasetError(f"{path}: unsupported file type {path.suffix!r}; use .jsonl or .parquet")


def render_prompt(tokenizer: Any, prompt: str | list[dict[str, Any]]) -> tuple[str, list[int]]:
    """Text and token ids of a prompt, through the chat template when there is one."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(prompt, list):
        if not template:
            raise DatasetError(
                "prompt is a list of chat messages but the tokenizer has no chat template"
            )
        messages = prompt
    elif template:
        messages = [{"role": "user", "content": prompt}]
    else:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return prompt, list(ids)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text, list(ids)
