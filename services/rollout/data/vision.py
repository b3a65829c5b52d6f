"""Prompt data sets with images, in AReaL's shapes, for the `vision_rlvr` workflow.

A row holds a question, an answer and its images, as AReaL's VLM data sets have them
(`clevr_count_70k`: `problem`, `answer`, `images`; `geometry3k` the same):

- `images`: a list, one entry per image, each a file path (relative to the data set file's
  folder, or absolute), the encoded bytes, or a Hugging Face `Image` cell
  (`{"bytes": ..., "path": ...}`, how a parquet export of an HF data set stores it); a
  data set with one image per row may name the column `image` and hold a single entry;
- the question (`prompt_key`, else AReaL's `problem`, else `question`): text in which each
  `<image>` marks where an image goes (AReaL's convention), or chat messages whose content
  lists `{"type": "image"}` items; text without a marker gets its images before the text;
- the answer (`answer_key`), handed to the reward function unchanged.

Images are loaded once, at load, and checked against the same bounds a trajectory group's
images obey on the wire (`services.common.image_bytes.ImageLimits`: count and bytes per
prompt, pixels per image), so a row the buffer would refuse is refused here, naming the file,
row and image. PNG and JPEG pass as they are; another format PIL reads (WebP, BMP, GIF) is
re-encoded as PNG once. The prompt is rendered into token ids by the workflow with the
model's processor (its chat template expands each image into its image tokens); with
`max_length` set, rows are rendered here too, to skip the long ones, as AReaL's loaders do.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.common.image_bytes import ImageLimits
from services.common.vision_rows import (
    IMAGE_MARKER,
    PROMPT_KEYS,
    load_images,
    vision_messages,
)
from services.rollout.data.datasets import (
    DatasetError,
    PromptDataset,
    PromptRow,
    prompt_row,
    read_rows,
)


class VisionPromptDataset(PromptDataset):
    """Rows with images, served in (optionally shuffled) epochs forever, as `PromptDataset`.

    Each row's `extra["images"]` holds its encoded images; `prompt` holds the chat messages
    with image items; `prompt_ids` is empty unless `max_length` made this class render it
    (with `processor`, a `services.common.vision_inputs.VisionProcessor`)."""

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        *,
        processor: Any = None,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        max_length: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        source: str = "data",
        base_dir: str | Path = ".",
        limits: ImageLimits = ImageLimits(),
    ) -> None:
        if max_length is not None and processor is None:
            raise DatasetError(f"{source}: max_length with images needs the model's processor")
        self.rows: list[PromptRow] = []
        self.skipped_too_long = 0
        keys = (prompt_key, *PROMPT_KEYS)
        for i, raw in enumerate(rows):
            where = f"{source} row {i}"
            key = next((k for k in keys if k in raw), None)
            if key is None:
                raise DatasetError(
                    f"{where}: no question column ({', '.join(keys)}); columns are "
                    f"{sorted(raw)}; set the dataset's prompt_key"
                )
            prompt = raw[key]
            if not isinstance(prompt, str | list):
                raise DatasetError(f"{where}: {key!r} must be text or chat messages")
            try:
                cell = raw["images"] if "images" in raw else raw.get("image")
                images = load_images(cell, Path(base_dir), limits)
                messages = vision_messages(prompt, len(images))
            except DatasetError as exc:
                raise DatasetError(f"{where}: {exc}") from None
            text, ids = "", []
            if max_length is not None:
                text = processor.apply_chat_template(messages)
                ids = processor.encode_prompt(text, images)
                if len(ids) > max_length:
                    self.skipped_too_long += 1
                    continue
            self.rows.append(
                prompt_row(
                    raw, f"{source}:{i}", key, answer_key, messages, ids, text, images=images
                )
            )
        self._begin(f"{source}: no usable prompts (max_length={max_length})", shuffle, seed)

    @classmethod
    def from_vision_config(cls, cfg: Any, processor: Any, *, seed: int = 0) -> VisionPromptDataset:
        """From a `DatasetConfig` whose `path` is set; image paths are relative to the data
        set file's folder (or the folder itself)."""
        if not cfg.path:
            raise DatasetError("dataset path is null: a vision run needs train_dataset.path")
        path = Path(cfg.path)
        return cls(
            read_rows(path),
            processor=processor,
            prompt_key=cfg.prompt_key,
            answer_key=cfg.answer_key,
            max_length=cfg.max_length,
            shuffle=cfg.shuffle,
            seed=seed,
            source=str(path),
            base_dir=path if path.is_dir() else path.parent,
        )


__all__ = ["IMAGE_MARKER", "VisionPromptDataset", "load_images", "vision_messages"]
