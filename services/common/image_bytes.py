"""Encoded images as they travel: which format, how many pixels, and the bounds they obey.

A vision run's trajectory group carries its prompt's images as the encoded bytes a data set
row holds (PNG or JPEG), once per group. Every hop that accepts them (the codec, the
buffer's admission check, the data set loader) asks the same question before storing or
decoding anything: is this a PNG or JPEG whose header states a size within the bounds?
The answer comes from the header alone (a few dozen bytes), without an image library, so
the buffer can refuse a decompression bomb or a truncated file without decoding it, and the
torch-free layers can check images at all.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_JPEG_SOI = b"\xff\xd8"
# Start-of-frame markers carry the height and width; C4 (DHT), C8 (JPG) and CC (DAC) share
# the range but are not frames.
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_NO_LENGTH = frozenset({0x01, *range(0xD0, 0xD8)})  # TEM, RST0-7: no length field


@dataclass(frozen=True)
class ImageLimits:
    """Bounds on the images of one trajectory group (or one prompt), so one bad row or peer
    cannot exhaust memory. The defaults hold AReaL's VLM data sets (one image of a few
    hundred kilobytes per prompt) with room to spare, and keep a claimed batch of groups
    under the 64 MiB gRPC message bound."""

    max_images: int = 8
    """Images per group (per prompt)."""
    max_image_bytes: int = 2 << 20
    """Encoded bytes per image."""
    max_total_bytes: int = 8 << 20
    """Encoded bytes of all images of one group."""
    max_pixels: int = 1 << 24
    """Width x height per image, as its header states it (a decompression-bomb guard)."""


@dataclass(frozen=True)
class ImageHeader:
    """What an encoded image's header says."""

    format: str  # "png" or "jpeg"
    width: int
    height: int


def read_header(data: bytes) -> ImageHeader:
    """The format and size of a PNG or JPEG from its header; `ValueError` saying why not."""
    if data.startswith(_PNG_SIGNATURE):
        # The first chunk is IHDR: length (4), type (4), width (4), height (4), big-endian.
        if len(data) < 24 or data[12:16] != b"IHDR":
            raise ValueError("truncated PNG: no IHDR chunk after the signature")
        width, height = struct.unpack(">II", data[16:24])
        return _checked(ImageHeader("png", width, height))
    if data.startswith(_JPEG_SOI):
        return _checked(_jpeg_header(data))
    head = data[:8].hex()
    raise ValueError(f"not a PNG or JPEG image (first bytes {head!r}); encode images as PNG/JPEG")


def _jpeg_header(data: bytes) -> ImageHeader:
    """Walk the JPEG segments up to the first start-of-frame marker."""
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            raise ValueError(f"corrupt JPEG: expected a marker at byte {i}")
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in _JPEG_NO_LENGTH:
            i += 2
            continue
        (length,) = struct.unpack(">H", data[i + 2 : i + 4])
        if marker in _JPEG_SOF:
            if i + 9 > len(data):
                break
            height, width = struct.unpack(">HH", data[i + 5 : i + 9])
            return ImageHeader("jpeg", width, height)
        if length < 2:
            raise ValueError(f"corrupt JPEG: segment length {length} at byte {i}")
        i += 2 + length
    raise ValueError("truncated JPEG: no frame header (SOF) found")


def _checked(header: ImageHeader) -> ImageHeader:
    if header.width <= 0 or header.height <= 0:
        raise ValueError(
            f"{header.format} header states an empty image {header.width}x{header.height}"
        )
    return header


def images_problem(images: Sequence[bytes], limits: ImageLimits = ImageLimits()) -> str | None:
    """Why `images` cannot be one group's (or prompt's) images (None: they can)."""
    if len(images) > limits.max_images:
        return f"{len(images)} images (limit {limits.max_images} per group)"
    total = 0
    for i, data in enumerate(images):
        if len(data) > limits.max_image_bytes:
            return f"image {i} has {len(data)} bytes (limit {limits.max_image_bytes})"
        total += len(data)
        try:
            header = read_header(data)
        except ValueError as err:
            return f"image {i}: {err}"
        pixels = header.width * header.height
        if pixels > limits.max_pixels:
            return (
                f"image {i} is {header.width}x{header.height} = {pixels} pixels "
                f"(limit {limits.max_pixels})"
            )
    if total > limits.max_total_bytes:
        return f"images total {total} bytes (limit {limits.max_total_bytes} per group)"
    return None


__all__ = ["ImageHeader", "ImageLimits", "images_problem", "read_header"]
