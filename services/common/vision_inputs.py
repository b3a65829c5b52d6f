"""Model inputs from images: one processor that the rollout engine and the trainer share.

A vision-language prompt reaches the model as token ids in which every image stands as a run
of image-pad tokens (one per merged patch), plus the patches themselves (`pixel_values`) and
each image's grid (`image_grid_thw`, frames x patch rows x patch columns). The rollout engine
builds them to generate and the trainer rebuilds them from the same encoded bytes to
recompute log-probabilities; both call this module, so the two sides cannot disagree on a
resize or a normalisation and the per-token log-probabilities match as they do for text.

`VisionProcessor` does what `Qwen2VLProcessor.__call__` does for images (its chat template,
the image processor, the expansion of `<|image_pad|>` to `grid.prod() // merge_size**2`
tokens) without its video processor, which in transformers 4.57 cannot be built without
torchvision. It loads the same files from a user's Qwen2-VL / Qwen2.5-VL directory
(`preprocessor_config.json`, the tokenizer, `chat_template.json`) as from the tiny VLM
(`tiny_vlm.py`). The image processor is the PIL one (`use_fast=False`).
"""

from __future__ import annotations

import io
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.common.model_source import load_tokenizer, resolve_model_path

DEFAULT_IMAGE_TOKEN = "<|image_pad|>"
# Decoded images beyond this many pixels are refused before PIL allocates them.
MAX_DECODED_PIXELS = 1 << 24
_CACHE_ENTRIES = 64


@dataclass(frozen=True)
class VisionInputs:
    """What a Qwen2-VL forward takes besides the token ids, for the images of one prompt."""

    pixel_values: torch.Tensor  # [patches, channels * temporal * patch * patch] float32
    image_grid_thw: torch.Tensor  # [images, 3] int64

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])


def is_vision_config(config: Any) -> bool:
    """Whether a Hugging Face model config describes a vision-language model."""
    return getattr(config, "vision_config", None) is not None


def decode_image(data: bytes | Any) -> Any:  # -> PIL.Image.Image
    """Encoded PNG/JPEG bytes (or a PIL image) as an RGB PIL image; a corrupt or oversized
    image raises `ValueError` naming the problem."""
    from PIL import Image

    if isinstance(data, Image.Image):
        return data.convert("RGB")
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ValueError(
            f"an image must be encoded bytes or a PIL image, got {type(data).__name__}"
        )
    try:
        img = Image.open(io.BytesIO(bytes(data)))
        width, height = img.size
        if width * height > MAX_DECODED_PIXELS:
            raise ValueError(
                f"image of {width}x{height} pixels exceeds {MAX_DECODED_PIXELS} pixels"
            )
        img.load()
    except (OSError, Image.DecompressionBombError) as exc:
        raise ValueError(f"unreadable image ({len(data)} bytes): {exc}") from exc
    return img.convert("RGB")


class VisionProcessor:
    """Chat template, image processor and tokenizer of one vision-language checkpoint."""

    def __init__(self, image_processor: Any, tokenizer: Any, chat_template: str | None) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        self.image_token = getattr(tokenizer, "image_token", None) or DEFAULT_IMAGE_TOKEN
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(self.image_token))
        self.merge_size = int(getattr(image_processor, "merge_size", 2))
        self._cache: OrderedDict[tuple[bytes, ...], VisionInputs] = OrderedDict()
        self._lock = threading.Lock()

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for HF-shaped messages (`content` a string or a list of
        `{"type": "image"}` / `{"type": "text", "text": ...}` items)."""
        if not self.chat_template:
            raise ValueError("the checkpoint has no chat template (chat_template.json)")
        text = self.tokenizer.apply_chat_template(
            list(messages),
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
        return str(text)

    def pixel_inputs(self, images: Sequence[bytes | Any]) -> VisionInputs:
        """Patches and grids of `images` (bytes or PIL), in order. Encoded images are
        processed once: the engine asks for every sample of a group, the trainer for every
        micro-batch, and the bytes are the key."""
        if not images:
            raise ValueError("pixel_inputs needs at least one image")
        key = tuple(bytes(i) for i in images) if all(isinstance(i, bytes) for i in images) else None
        if key is not None:
            with self._lock:
                hit = self._cache.get(key)
                if hit is not None:
                    self._cache.move_to_end(key)
                    return hit
        out = self.image_processor(images=[decode_image(i) for i in images], return_tensors="pt")
        result = VisionInputs(
            pixel_values=out["pixel_values"].float(),
            image_grid_thw=out["image_grid_thw"].to(torch.int64),
        )
        if key is not None:
            with self._lock:
                self._cache[key] = result
                while len(self._cache) > _CACHE_ENTRIES:
                    self._cache.popitem(last=False)
        return result

    def image_token_counts(self, inputs: VisionInputs) -> list[int]:
        """Prompt tokens each image takes: its patches over the merged 2x2 (merge_size^2)."""
        per = inputs.image_grid_thw.prod(dim=-1) // (self.merge_size**2)
        return [int(n) for n in per.tolist()]

    def expand_prompt(self, text: str, counts: Sequence[int]) -> str:
        """`text` with its i-th image token repeated `counts[i]` times."""
        parts = text.split(self.image_token)
        if len(parts) - 1 != len(counts):
            raise ValueError(
                f"the prompt has {len(parts) - 1} image placeholders ({self.image_token}) "
                f"for {len(counts)} image(s); put one placeholder per image"
            )
        out = [parts[0]]
        for n, rest in zip(counts, parts[1:], strict=True):
            out.append(self.image_token * n + rest)
        return "".join(out)

    def encode_prompt(self, text: str, images: Sequence[bytes | Any]) -> list[int]:
        """Token ids of a templated prompt with each image placeholder expanded to the
        image's token count (the ids the engine generates from and the trainer scores)."""
        counts = self.image_token_counts(self.pixel_inputs(images)) if images else []
        return [int(t) for t in self.tokenizer(self.expand_prompt(text, counts)).input_ids]

    def check_prompt(self, prompt_ids: Sequence[int], inputs: VisionInputs | None) -> None:
        """Raise `ValueError` unless the prompt holds exactly the image tokens of `inputs`
        (a prompt built for other images would put patches at the wrong places)."""
        have = sum(1 for t in prompt_ids if int(t) == self.image_token_id)
        want = sum(self.image_token_counts(inputs)) if inputs is not None else 0
        if have != want:
            raise ValueError(
                f"the prompt holds {have} image tokens but its images need {want}; build "
                "prompt ids with VisionProcessor.encode_prompt from the same images"
            )


_processors: dict[str, VisionProcessor] = {}
_processors_lock = threading.Lock()


def load_vision_processor(path: str | Path) -> VisionProcessor:
    """The processor of a vision-language checkpoint directory (or model source), built
    once per process and directory."""
    directory = resolve_model_path(path)
    with _processors_lock:
        hit = _processors.get(directory)
        if hit is not None:
            return hit
    from transformers import AutoImageProcessor

    image_processor = AutoImageProcessor.from_pretrained(directory, use_fast=False)
    tokenizer = load_tokenizer(directory)
    template = None
    for name in ("chat_template.json", "chat_template.jinja"):
        f = Path(directory) / name
        if f.is_file():
            raw = f.read_text()
            template = json.loads(raw)["chat_template"] if name.endswith(".json") else raw
            break
    processor = VisionProcessor(image_processor, tokenizer, template)
    with _processors_lock:
        return _processors.setdefault(directory, processor)


def vision_tower_prefix(model: torch.nn.Module) -> str | None:
    """The parameter-name prefix of the model's vision tower (`model.visual.` for Qwen2-VL
    and Qwen2.5-VL under transformers 4.57), or None for a model without one. The tower is
    what `freeze_vision_tower` freezes and what a weight update then leaves out."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("visual", "vision_tower", "vision_model") and any(
            True for _ in module.parameters()
        ):
            return f"{name}."
    return None


def vision_tower_names(model: torch.nn.Module) -> set[str]:
    """Names (as `named_parameters` gives them) of the vision tower's parameters."""
    prefix = vision_tower_prefix(model)
    if prefix is None:
        return set()
    return {n for n, _ in model.named_parameters() if n.startswith(prefix)}
