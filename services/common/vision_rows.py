"""Rows with images in AReaL's shapes: the question as chat messages, the images as bytes.

Shared by the rollout's prompt data set (`services.rollout.data.vision`) and supervised
fine-tuning (`services.trainer.sft`), so a row means the same images and the same
placeholders whether RL samples from it or SFT trains on it. A row's `images` cell is a
list, one entry per image: a file path (relative to the data set file's folder, or
absolute), the encoded bytes, or a Hugging Face `Image` cell (`{"bytes": ..., "path":
...}`). Images are checked against the bounds a trajectory group's images obey on the wire
(`services.common.image_bytes.ImageLimits`); PNG and JPEG pass as they are, another format
PIL reads is re-encoded as PNG once.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.common.datasets import DatasetError
from services.common.image_bytes import ImageLimits, images_problem, read_header

IMAGE_MARKER = "<image>"
"""Where an image goes in a text question (AReaL's data sets write it so)."""

PROMPT_KEYS = ("problem", "question")
"""Question columns tried, in order, when the configured `prompt_key` is absent."""


def vision_messages(prompt: str | list[dict[str, Any]], n_images: int) -> list[dict[str, Any]]:
    """HF chat messages for a question and its `n_images` images.

    A text question becomes one user message whose content alternates text and image items
    at the `<image>` markers; without markers the images come first. Chat messages are
    taken as they are. Either way the number of image items must equal `n_images`."""
    if isinstance(prompt, list):
        messages = prompt
    else:
        pieces = prompt.split(IMAGE_MARKER)
        content: list[dict[str, Any]] = []
        if len(pieces) == 1:
            content = [{"type": "image"} for _ in range(n_images)]
            content.append({"type": "text", "text": prompt})
        else:
            for i, text in enumerate(pieces):
                if i:
                    content.append({"type": "image"})
                if text:
                    content.append({"type": "text", "text": text})
        messages = [{"role": "user", "content": content}]
    found = sum(
        1
        for m in messages
        if isinstance(m.get("content"), list)
        for item in m["content"]
        if isinstance(item, dict) and item.get("type") == "image"
    )
    if found != n_images:
        raise DatasetError(
            f"the question has {found} image placeholders for {n_images} image(s); "
            f"write one {IMAGE_MARKER} (or one {{'type': 'image'}} item) per image"
        )
    return messages


def _read_file(path: Path, limits: ImageLimits) -> bytes:
    if not path.is_file():
        raise DatasetError(f"image file {path} does not exist")
    size = path.stat().st_size
    if size > limits.max_image_bytes:
        raise DatasetError(f"image file {path} has {size} bytes (limit {limits.max_image_bytes})")
    return path.read_bytes()


def _png_or_jpeg(data: bytes, limits: ImageLimits) -> bytes:
    """`data` itself when it is PNG or JPEG, else the image re-encoded as PNG."""
    try:
        read_header(data)
        return data
    except ValueError as not_png_or_jpeg:
        from PIL import Image

        try:
            with Image.open(io.BytesIO(data)) as img:
                if img.width * img.height > limits.max_pixels:
                    raise DatasetError(
                        f"image of {img.width}x{img.height} pixels (limit {limits.max_pixels})"
                    ) from None
                out = io.BytesIO()
                img.convert("RGB").save(out, format="PNG")
                return out.getvalue()
        except (OSError, Image.DecompressionBombError):
            raise DatasetError(str(not_png_or_jpeg)) from None


def load_images(entries: Any, base_dir: Path, limits: ImageLimits = ImageLimits()) -> list[bytes]:
    """The encoded images of one row's `images` cell, within `limits`."""
    if entries is None:
        return []
    if isinstance(entries, str | bytes | dict):
        entries = [entries]
    if not isinstance(entries, Sequence):
        raise DatasetError(f"images must be a list of paths or bytes, not {type(entries).__name__}")
    if len(entries) > limits.max_images:
        raise DatasetError(f"{len(entries)} images (limit {limits.max_images} per prompt)")
    images = []
    for i, entry in enumerate(entries):
        if isinstance(entry, dict):  # an HF Image cell: bytes when embedded, else a path
            entry = entry.get("bytes") or entry.get("path")
        if isinstance(entry, bytes | bytearray):
            data = bytes(entry)
        elif isinstance(entry, str) and entry:
            path = Path(entry).expanduser()
            data = _read_file(path if path.is_absolute() else base_dir / path, limits)
        else:
            raise DatasetError(f"image {i}: expected a path or bytes, got {type(entry).__name__}")
        images.append(_png_or_jpeg(data, limits))
    problem = images_problem(images, limits)
    if problem is not None:
        raise DatasetError(problem)
    return images
