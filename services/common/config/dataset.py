"""Dataset blocks (`train_dataset`, `valid_dataset`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ._base import FlywheelModel


class DatasetConfig(FlywheelModel):
    """Prompts fed to the rollout: a file, or a generated built-in set."""

    path: str | None = None
    """JSONL or parquet file (or directory) of prompts; null uses `builtin`."""

    type: str = "rl"
    """Kind of data set; `rl` rows carry a prompt and an answer for the reward."""

    builtin: Literal["arithmetic"] | None = "arithmetic"
    """Generated data set used when `path` is null (embedded default)."""

    builtin_size: int = Field(default=1024, ge=1)
    """Number of prompts the built-in generator writes."""

    prompt_key: str = "prompt"
    """Column holding the prompt (text, or chat messages)."""

    answer_key: str = "answer"
    """Column holding the reference answer passed to the reward function."""

    batch_size: int = Field(default=1, ge=1)
    """Prompts taken per rollout batch."""

    shuffle: bool = True
    """Shuffle prompts each epoch (seeded by the root `seed`)."""

    pin_memory: bool = False
    """Pin host memory of loaded batches."""

    num_workers: int = Field(default=0, ge=0)
    """Loader worker processes."""

    drop_last: bool = True
    """Drop the last incomplete batch of an epoch."""

    max_length: int | None = Field(default=None, ge=1)
    """Prompts longer than this many tokens are skipped; null keeps all."""
