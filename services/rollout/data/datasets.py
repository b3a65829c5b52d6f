"""Prompt data sets for the rollout: local JSONL or parquet files, turned into token ids.

A row needs a prompt and (for RLVR) a reference answer. Column names come from the dataset
config (`prompt_key`, `answer_key`); GSM8K's own `question`/`answer` columns work as they are
(`question` is used when `prompt_key` is absent). A prompt is either text or a list of chat
messages (`[{"role": "user", "content": ...}]`); when the tokenizer has a chat template, text
prompts are wrapped as one user message and rendered with the generation prompt appended.
Everything else in a row travels as metadata to the reward function.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class DatasetError(ValueError):
    """A data set that cannot be used; the message names the file, row and field."""


@dataclass
class PromptRow:
    """One prompt ready to generate from."""

    prompt_id: str
    prompt: str | list[dict[str, Any]]
    answer: str
    prompt_ids: list[int]
    prompt_text: str
    extra: dict[str, Any] = field(default_factory=dict)

    def as_data(self) -> dict[str, Any]:
        """The `data` dict workflows receive (AReaL passes dataset rows as dicts)."""
        return {
            **self.extra,
            "prompt_id": self.prompt_id,
            "prompt": self.prompt,
            "answer": self.answer,
            "prompt_ids": self.prompt_ids,
            "prompt_text": self.prompt_text,
        }


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


class PromptDataset:
    """Rows of a file, tokenized once, served in (optionally shuffled) epochs forever."""

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        tokenizer: Any,
        *,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        max_length: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        source: str = "data",
    ) -> None:
        self.rows: list[PromptRow] = []
        self.skipped_too_long = 0
        for i, raw in enumerate(rows):
            key = prompt_key if prompt_key in raw else ("question" if "question" in raw else None)
            if key is None:
                raise DatasetError(
                    f"{source} row {i}: no {prompt_key!r} column (nor GSM8K's 'question'); "
                    f"columns are {sorted(raw)}; set the dataset's prompt_key"
                )
            prompt = raw[key]
            if not isinstance(prompt, str | list):
                raise DatasetError(f"{source} row {i}: {key!r} must be text or chat messages")
            text, ids = render_prompt(tokenizer, prompt)
            if not ids:
                raise DatasetError(f"{source} row {i}: prompt tokenizes to nothing")
            if max_length is not None and len(ids) > max_length:
                self.skipped_too_long += 1
                continue
            answer = raw.get(answer_key, "")
            extra = {k: v for k, v in raw.items() if k not in (key, answer_key)}
            pid = str(raw.get("id", raw.get("prompt_id", f"{source}:{i}")))
            self.rows.append(
                PromptRow(pid, prompt, "" if answer is None else str(answer), ids, text, extra)
            )
        if not self.rows:
            raise DatasetError(f"{source}: no usable prompts (max_length={max_length})")
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._make_order()

    @classmethod
    def from_config(cls, cfg: Any, tokenizer: Any, *, seed: int = 0) -> PromptDataset:
        """From a `DatasetConfig` whose `path` is set (the launcher writes built-in data to
        files, so services only ever read files)."""
        if not cfg.path:
            raise DatasetError(
                "dataset path is null: the launcher writes the built-in data set to a file and "
                "puts its path into the config; set train_dataset.path"
            )
        return cls(
            read_rows(cfg.path),
            tokenizer,
            prompt_key=cfg.prompt_key,
            answer_key=cfg.answer_key,
            max_length=cfg.max_length,
            shuffle=cfg.shuffle,
            seed=seed,
            source=str(cfg.path),
        )

    def _make_order(self) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(f"{self.seed}-{self.epoch}").shuffle(order)
        return order

    def __len__(self) -> int:
        return len(self.rows)

    def next(self) -> PromptRow:
        if self.position >= len(self._order):
            self.epoch += 1
            self.position = 0
            self._order = self._make_order()
        row = self.rows[self._order[self.position]]
        self.position += 1
        return row

    def __iter__(self) -> Iterator[PromptRow]:
        while True:
            yield self.next()
