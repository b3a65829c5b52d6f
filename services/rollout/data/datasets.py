"""Prompt data sets for the rollout: local JSONL or parquet files, turned into token ids.

A row needs a prompt and (for RLVR) a reference answer. Column names come from the dataset
config (`prompt_key`, `answer_key`); GSM8K's own `question`/`answer` columns work as they are
(`question` is used when `prompt_key` is absent). A prompt is either text or a list of chat
messages (`[{"role": "user", "content": ...}]`); when the tokenizer has a chat template, text
prompts are wrapped as one user message and rendered with the generation prompt appended.
Everything else in a row travels as metadata to the reward function.

Reading the files and rendering a prompt are `services.common.datasets`'s (the trainer's SFT
entry and the launcher use them too); they are re-exported here.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common.datasets import DatasetError, read_rows, render_prompt


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


def prompt_row(
    raw: dict[str, Any],
    default_id: str,
    prompt_key: str,
    answer_key: str,
    prompt: str | list[dict[str, Any]],
    ids: list[int],
    text: str,
    **extra: Any,
) -> PromptRow:
    """A row's prompt as rendered, its answer, its id (`id`, `prompt_id`, else
    `default_id`) and its other columns (overridden by `extra`) for the reward function."""
    answer = raw.get(answer_key, "")
    rest = {k: v for k, v in raw.items() if k not in (prompt_key, answer_key)}
    pid = str(raw.get("id", raw.get("prompt_id", default_id)))
    return PromptRow(
        pid, prompt, "" if answer is None else str(answer), ids, text, {**rest, **extra}
    )


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
            self.rows.append(prompt_row(raw, f"{source}:{i}", key, answer_key, prompt, ids, text))
        self._begin(f"{source}: no usable prompts (max_length={max_length})", shuffle, seed)

    def _begin(self, empty: str, shuffle: bool, seed: int) -> None:
        """Serve the loaded rows from epoch 0; no rows is a `DatasetError` saying `empty`."""
        if not self.rows:
            raise DatasetError(empty)
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
