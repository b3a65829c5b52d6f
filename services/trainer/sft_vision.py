"""Supervised fine-tuning rows with images: prompt ids through the model's processor.

A vision-language checkpoint is fine-tuned on AReaL's VLM rows (a question, an answer, the
images; `services.common.vision_rows`) the way RL samples from them: the question becomes
chat messages with one image item per image, the processor's chat template writes each
image's placeholder with the generation prompt, and each placeholder is expanded to the
image's token count (`VisionProcessor.encode_prompt`, the ids the rollout engine generates
from). The answer follows with EOS, and only its tokens are in the loss, as for text.

Each example keeps its encoded images; the batch carries them per row (`SeqBatch.images`)
and the trainer's engine rebuilds the pixel inputs with the same processor at every
forward (`services.trainer.vision.VisionBatcher`), exactly as it does for RL groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.common.datasets import DatasetError
from services.common.image_bytes import ImageLimits
from services.common.vision_rows import PROMPT_KEYS, load_images, vision_messages


def encode_vision_rows(
    processor: Any,
    rows: Sequence[dict[str, Any]],
    prompt_key: str,
    answer_key: str,
    *,
    base_dir: Path,
    limits: ImageLimits = ImageLimits(),
) -> tuple[list[tuple[list[int], list[int]]], list[tuple[bytes, ...]]]:
    """(prompt ids, answer ids + EOS) per row and the row's encoded images.

    `processor` is a `services.common.vision_inputs.VisionProcessor`; image paths are
    relative to `base_dir` (the data set file's folder). The question is `prompt_key`, else
    AReaL's `problem`, else `question`; a row without images is a text prompt to the same
    model. A bad row raises `DatasetError` naming it."""
    tokenizer = processor.tokenizer
    examples: list[tuple[list[int], list[int]]] = []
    images: list[tuple[bytes, ...]] = []
    keys = (prompt_key, *PROMPT_KEYS)
    for i, row in enumerate(rows):
        key = next((k for k in keys if k in row), None)
        if key is None or answer_key not in row:
            raise DatasetError(
                f"row {i} has no question ({', '.join(keys)}) or no {answer_key!r} column"
            )
        try:
            cell = row["images"] if "images" in row else row.get("image")
            row_images = load_images(cell, base_dir, limits)
            messages = vision_messages(row[key], len(row_images))
        except DatasetError as exc:
            raise DatasetError(f"row {i}: {exc}") from None
        text = processor.apply_chat_template(messages)
        prompt = processor.encode_prompt(text, row_images)
        answer = tokenizer(str(row[answer_key]), add_special_tokens=False)["input_ids"]
        examples.append((list(prompt), [*answer, tokenizer.eos_token_id]))
        images.append(tuple(row_images))
    return examples, images
