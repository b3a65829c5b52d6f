"""A tiny Qwen2-VL vision-language model, its tokenizer and image processor, in HF format.

The vision demo and the vision tests need a real Hugging Face VLM checkpoint without
downloading one. This module writes a `Qwen2VLForConditionalGeneration` (the architecture of
a user's Qwen2-VL checkpoint; Qwen2.5-VL differs in the vision tower only) with tiny
dimensions: a 2-block vision transformer over 14x14 patches whose 2x2 merger feeds a 2-layer
language model, multimodal RoPE (`mrope`) as in the released models.

- Tokenizer: one token per character over letters, digits and punctuation, plus Qwen's
  special tokens (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, `<|vision_start|>`,
  `<|vision_end|>`, `<|image_pad|>`, `<|video_pad|>`) and a chat template that writes
  `<|vision_start|><|image_pad|><|vision_end|>` where a message holds an image, as Qwen's does.
- Image processor: `Qwen2VLImageProcessor` fixed at `image_size` x `image_size` pixels
  (`min_pixels = max_pixels`), so an 84x84 image is 6x6 patches, 2x2 merged: 9 image tokens
  (one per cell of the counting task's 3 x 3 grid).
- Initialisation: the vision tower's linear and convolution weights are drawn with standard
  deviation 0.1 instead of HF's 0.02. A random tower at 0.02 gives image features about 40x
  smaller than the text embeddings, and the language model then learns to read them only
  after a long plateau (a counting warm start stayed at chance for 300 steps); at 0.1 it
  learns within a hundred steps. A pretrained checkpoint is unaffected (this is a tiny
  model's random start).

The directory loads like a user's: `services.common.vision_inputs.load_vision_processor` and
`AutoModelForImageTextToText.from_pretrained`. Writing is idempotent, as for the tiny text
model (`tiny_model.py`): the same settings already written are left as they are.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from services.common.tiny_model import (
    _already_written,
    build_char_tokenizer,
    publish_dir,
    refuse_foreign_dir,
)

PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
IMAGE_TOKEN = "<|image_pad|>"
SPECIAL_TOKENS: tuple[str, ...] = (
    PAD_TOKEN,
    "<|im_start|>",
    EOS_TOKEN,
    "<|vision_start|>",
    "<|vision_end|>",
    IMAGE_TOKEN,
    "<|video_pad|>",
)
ALPHABET: tuple[str, ...] = tuple(
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ?.,:;!'\"-+=*/#()[]<>\n"
)
MARKER_FILE = "flywheel_tiny_vlm.json"
_FORMAT_VERSION = 1
PATCH_SIZE = 14
MERGE_SIZE = 2

# Qwen's chat format with image placeholders (system message only when given).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def vocab_size() -> int:
    """Number of token ids (specials + alphabet)."""
    return len(SPECIAL_TOKENS) + len(ALPHABET)


def build_tokenizer() -> Any:  # tokenizers.Tokenizer
    """A character-level BPE tokenizer with no merges; the specials are matched whole."""
    return build_char_tokenizer(SPECIAL_TOKENS, ALPHABET, None)


def _settings(
    image_size: int,
    hidden_size: int,
    num_layers: int,
    vision_dim: int,
    vision_depth: int,
    seed: int,
    max_position_embeddings: int,
) -> dict[str, int]:
    return {
        "format_version": _FORMAT_VERSION,
        "image_size": image_size,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "vision_dim": vision_dim,
        "vision_depth": vision_depth,
        "seed": seed,
        "max_position_embeddings": max_position_embeddings,
        "vocab_size": vocab_size(),
    }


def image_tokens(image_size: int) -> int:
    """Image tokens one `image_size` square image takes in the prompt."""
    side = image_size // (PATCH_SIZE * MERGE_SIZE)
    return side * side


def write_tiny_vlm(
    path: str | os.PathLike[str],
    *,
    image_size: int = 84,
    hidden_size: int = 64,
    num_layers: int = 2,
    vision_dim: int = 32,
    vision_depth: int = 2,
    seed: int = 0,
    max_position_embeddings: int = 512,
    vision_init_std: float = 0.1,
) -> Path:
    """Write model, tokenizer and image processor into `path` unless already there.

    `image_size` must be a multiple of 28 (patch 14 x merge 2): every image is resized to
    that square. Parameters are drawn from `seed` without touching the global RNG. A
    directory holding anything else is an error rather than being overwritten.
    """
    unit = PATCH_SIZE * MERGE_SIZE
    if image_size < unit or image_size % unit:
        raise ValueError(f"image_size={image_size} must be a positive multiple of {unit}")
    if hidden_size % 4 or (hidden_size // 4) % 8:
        raise ValueError(f"hidden_size={hidden_size}: use a multiple of 32 (4 heads, mrope)")
    path = Path(path)
    settings = _settings(
        image_size, hidden_size, num_layers, vision_dim, vision_depth, seed, max_position_embeddings
    )
    settings["vision_init_milli_std"] = round(vision_init_std * 1000)
    if _already_written(path, settings, MARKER_FILE):
        return path
    refuse_foreign_dir(path, settings)
    return publish_dir(path, settings, _build(settings), MARKER_FILE)


def _build(settings: dict[str, int]) -> tuple[Any, Any, Any]:
    import torch
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
    )

    tok = build_tokenizer()
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    hidden = settings["hidden_size"]
    heads = 4
    half = hidden // heads // 2  # rotary frequencies per head, split over (t, h, w)
    section = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    text = {
        "vocab_size": settings["vocab_size"],
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": settings["num_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "max_position_embeddings": settings["max_position_embeddings"],
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": section},
        "tie_word_embeddings": True,
        "pad_token_id": ids[PAD_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "bos_token_id": ids[EOS_TOKEN],
    }
    vision = {
        "depth": settings["vision_depth"],
        "embed_dim": settings["vision_dim"],
        "hidden_size": hidden,
        "num_heads": 2,
        "mlp_ratio": 2,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": 2,
    }
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[IMAGE_TOKEN],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
        pad_token_id=ids[PAD_TOKEN],
        eos_token_id=ids[EOS_TOKEN],
        bos_token_id=ids[EOS_TOKEN],
        torch_dtype="float32",
        use_cache=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings["seed"])
        model = Qwen2VLForConditionalGeneration(config)
        std = settings["vision_init_milli_std"] / 1000
        with torch.no_grad():
            for module in model.model.visual.modules():
                if isinstance(module, torch.nn.Linear | torch.nn.Conv3d):
                    module.weight.normal_(0.0, std)
    generation = model.generation_config
    assert generation is not None
    generation.pad_token_id = ids[PAD_TOKEN]
    generation.eos_token_id = ids[EOS_TOKEN]
    generation.bos_token_id = ids[EOS_TOKEN]
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        model_max_length=settings["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    pixels = settings["image_size"] ** 2
    image_processor = Qwen2VLImageProcessor(
        min_pixels=pixels,
        max_pixels=pixels,
        patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE,
        temporal_patch_size=2,
    )
    return model, hf_tok, image_processor
