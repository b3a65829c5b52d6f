"""Encoded test images written by PIL (the reference encoder): PNG, JPEG and other formats."""

from __future__ import annotations

import io


def encoded(
    width: int, height: int, fmt: str = "PNG", colour: tuple[int, int, int] = (200, 30, 30)
) -> bytes:
    """A `width` x `height` image of one colour, encoded by PIL as `fmt`."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, format=fmt)
    return buf.getvalue()
