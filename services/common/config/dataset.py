"""Dataset blocks (`train_dataset`, `valid_dataset`) and where a named data set lives.

A `path` that is a Hugging Face data set id as AReaL writes it (`openai/gsm8k`, with
`split: test`) and not a local file is looked up in the data set cache:
`$FLYWHEEL_DATASETS_DIR` (default `~/.cache/flywheel/datasets`) holds one directory per
id, as `hf download ID --repo-type dataset --local-dir DIR/ID` leaves it (for GSM8K:
`openai/gsm8k/main/test-00000-of-00001.parquet`); the split's `.parquet`/`.jsonl` file
there is used. Nothing is downloaded at load: an absent copy is an error that carries
the command fetching it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field

from ._base import FlywheelModel


class DatasetConfig(FlywheelModel):
    """Prompts fed to the rollout: a file, or a generated built-in set."""

    path: str | None = None
    """JSONL or parquet file (or directory) of prompts; null uses `builtin`. A Hugging
    Face data set id as AReaL names it (`openai/gsm8k`) is looked up, with `split`, in the
    local data set cache (`$FLYWHEEL_DATASETS_DIR`, default `~/.cache/flywheel/datasets`,
    one directory per id); when it is not there, loading fails with the command that
    fetches it."""

    split: str | None = None
    """Split of a Hugging Face data set named in `path` (AReaL's `split`); null means
    `train` for `train_dataset` and `test` for `valid_dataset`, as in AReaL."""

    type: str = "rl"
    """Kind of data set; `rl` rows carry a prompt and an answer for the reward."""

    builtin: Literal["arithmetic", "counting"] | None = "arithmetic"
    """Generated data set used when `path` is null: `arithmetic` (the text demo's sums) or
    `counting` (1-9 coloured shapes on a canvas, "how many?"; a vision run's,
    `rollout.workflow: vision_rlvr`, drawn at `launcher.tiny_vlm.image_size` pixels)."""

    builtin_size: int = Field(default=1024, ge=1)
    """Number of prompts the built-in generator writes."""

    prompt_key: str = "prompt"
    """Column holding the prompt (text, or chat messages). A data set with images
    (`rollout.workflow: vision_rlvr`) falls back to AReaL's `problem`, then `question`, and
    reads its images from an `images` column (docs/vision.md)."""

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


class ValidDatasetConfig(DatasetConfig):
    """Evaluation prompts: as `train_dataset`, with AReaL's `ValidDatasetConfig` defaults
    (the whole set, in order)."""

    shuffle: bool = False
    """Shuffle prompts each epoch; off, as in AReaL, so every evaluation sees the same
    prompts in the same order."""

    drop_last: bool = False
    """Drop the last incomplete batch; off, as in AReaL, so no prompt is left out."""


DATASETS_DIR_ENV = "FLYWHEEL_DATASETS_DIR"
"""Environment variable naming the local data set cache."""

_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_DATA_SUFFIXES = (".parquet", ".jsonl", ".json")

#: Reward function (registered name) of the data sets AReaL knows, by a part of the id,
#: as AReaL's `get_custom_dataset` recognises them (`"gsm8k" in path`).
KNOWN_REWARDS: dict[str, str] = {
    "gsm8k": "gsm8k",
    "geometry3k": "geometry3k",
    "clevr_count_70k": "clevr_count",
}

#: Sub-directory (HF config name) preferred when a data set ships several.
_PREFERRED_CONFIGS = ("main", "default", "")


def datasets_dir() -> Path:
    """The local data set cache (`$FLYWHEEL_DATASETS_DIR` or `~/.cache/flywheel/datasets`)."""
    env = os.environ.get(DATASETS_DIR_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "flywheel" / "datasets"


def is_hub_id(path: str) -> bool:
    """True when `path` names a Hugging Face data set (`org/name`) rather than a local
    file: the `org/name` form, no data-file suffix, and nothing at that path here."""
    return (
        bool(_HF_ID.match(path)) and not path.endswith(_DATA_SUFFIXES) and not Path(path).exists()
    )


def fetch_command(hub_id: str) -> str:
    """The command that puts `hub_id` where `resolve_hub_dataset` looks for it."""
    return f"hf download {hub_id} --repo-type dataset --local-dir {datasets_dir() / hub_id}"


def reward_for(path: str) -> str | None:
    """The reward function of a known data set named (or stored) at `path`, else None."""
    lowered = path.lower()
    for part, fn in KNOWN_REWARDS.items():
        if part in lowered:
            return fn
    return None


@dataclass(frozen=True)
class HubDataset:
    """Where a Hugging Face data set id resolved to."""

    hub_id: str
    """The id as written (`openai/gsm8k`)."""

    split: str
    """The split looked up."""

    local: Path | None
    """The local file of the split; None when the cache lacks it."""

    problem: str
    """Why `local` is None (with the fetch command); empty when found."""


def resolve_hub_dataset(hub_id: str, split: str) -> HubDataset:
    """Find `split` of `hub_id` in the local cache: a file named `<split>.*` or
    `<split>-*.parquet|jsonl` under `<cache>/<hub_id>/`, in the `main`/`default` config
    directory first."""
    root = datasets_dir() / hub_id
    command = fetch_command(hub_id)
    if not root.is_dir():
        return HubDataset(hub_id, split, None, f"no local copy at {root}; fetch it with: {command}")
    found: dict[str, list[Path]] = {}
    for file in sorted(root.rglob("*")):
        if not file.is_file() or file.suffix not in _DATA_SUFFIXES or ".cache" in file.parts:
            continue
        stem = file.name.split(".", 1)[0]
        if stem == split or stem.startswith(split + "-") or stem.startswith(split + "_"):
            config = str(file.parent.relative_to(root))
            found.setdefault("" if config == "." else config, []).append(file)
    for config in (*_PREFERRED_CONFIGS, *sorted(found)):
        files = found.get(config)
        if not files:
            continue
        if len(files) > 1:
            return HubDataset(
                hub_id,
                split,
                None,
                f"split {split!r} of {root / config} has {len(files)} files; set the path "
                "to one of them (or merge them into one)",
            )
        return HubDataset(hub_id, split, files[0], "")
    return HubDataset(
        hub_id,
        split,
        None,
        f"{root} holds no {split!r} split (a {split}*.parquet or .jsonl file); "
        f"fetch it with: {command}",
    )
