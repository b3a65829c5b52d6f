"""The stand-in SGLang server's reading of `/generate`'s `image_data`, as SGLang 0.5.23 reads it.

What the stand-in holds a request's images to, each rule from the wheel's source:

- the shape: `GenerateReqInput.image_data` is `MultimodalDataInputFormat` (one item, a list
  of items, or a list of lists; `srt/managers/io_struct.py`), and the JSON contract's
  `MediaInput` (`api/v1/api_types.py`) admits a string, a `MediaRef` object (`{"url"}`), a
  list of optional ones, or a list of such lists; for a single prompt (1-D `input_ids`) the
  list holds that prompt's images in order;
- each string becomes bytes by `get_image_bytes` (`srt/utils/common.py`): `http(s)://` is
  downloaded, `file://` or `/...` is opened on the server, `data:...,` is the base64 after
  the comma, anything else is base64 itself, all decoded with `validate=True`; a string
  ending in an image extension is a path (`load_image`);
- the bytes are decoded as an image (PIL there); what fails to decode makes `/generate`
  answer HTTP 400 with the error's message (the tokenizer manager's `ValueError`).

The stand-in has no network and no shared files, so URLs and server paths are refused with
a message saying so: the client under test must send its images inline.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

_IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif")


class ImageDataError(ValueError):
    """`image_data` that SGLang would refuse; the message is the 400's."""


def _items(value: Any) -> list[Any]:
    """The image items of one prompt's `image_data` (None entries dropped)."""
    if value is None:
        return []
    if isinstance(value, str | dict):
        return [value]
    if not isinstance(value, list):
        raise ImageDataError(f"image_data must be a string, object or list, not {type(value)}")
    out: list[Any] = []
    for item in value:
        if isinstance(item, list):  # a list of lists: a batch of one prompt
            out.extend(i for i in item if i is not None)
        elif item is not None:
            out.append(item)
    return out


def _string_bytes(item: str) -> bytes:
    if item.startswith(("http://", "https://")):
        raise ImageDataError(f"the stand-in cannot download {item[:60]!r}: send the bytes inline")
    if item.startswith(("file://", "/")) or item.lower().endswith(_IMAGE_EXTENSIONS):
        raise ImageDataError(f"{item[:60]!r} is a path on the server: send the bytes inline")
    encoded = item.split(",", 1)[1] if item.startswith("data:") else item
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageDataError(f"Invalid image: not base64 ({exc})") from None


def decode_image_data(value: Any) -> list[bytes]:
    """The encoded images of one prompt's `image_data`, each checked to decode as an image."""
    from PIL import Image

    images = []
    for item in _items(value):
        if isinstance(item, dict):
            unknown = sorted(set(item) - {"url"} - _MEDIA_REF_OPTIONAL)
            if unknown:
                raise ImageDataError(f"MediaRef has unknown field {unknown[0]!r}")
            item = item.get("url", "")
        if not isinstance(item, str):
            raise ImageDataError(f"Invalid image: {type(item).__name__}")
        data = _string_bytes(item)
        try:
            with Image.open(io.BytesIO(data)) as img:
                img.load()
        except Exception as exc:  # noqa: BLE001 - PIL raises many kinds
            raise ImageDataError(f"Invalid image: cannot decode ({exc})") from None
        images.append(data)
    return images


# `MediaRef`'s other fields (all optional) in the pinned wheel's `api/v1/api_types.py`.
_MEDIA_REF_OPTIONAL = frozenset(
    {
        "detail",
        "max_dynamic_patch",
        "content_hash",
        "min_pixels",
        "max_pixels",
        "total_max_pixels",
        "fps",
        "num_frames",
        "min_frames",
        "max_frames",
        "max_tokens_per_frame",
        "max_image_tokens",
        "use_audio",
        "image_grid_thw",
    }
)
