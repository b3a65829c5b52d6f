"""Image headers read without an image library agree with PIL; bounds are refused by name."""

from __future__ import annotations

import io

import pytest

from services.common.image_bytes import ImageLimits, images_problem, read_header
from tests.image_samples import encoded


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
@pytest.mark.parametrize(("width", "height"), [(1, 1), (56, 56), (333, 17), (640, 480)])
def test_header_size_matches_what_pil_reads(fmt: str, width: int, height: int) -> None:
    from PIL import Image

    data = encoded(width, height, fmt)
    header = read_header(data)
    with Image.open(io.BytesIO(data)) as img:  # the reference: PIL's decoder
        assert (header.width, header.height) == img.size
        assert header.format == img.format.lower()


def test_progressive_jpeg_with_extra_segments_is_read() -> None:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (120, 77), (1, 2, 3)).save(
        buf, format="JPEG", progressive=True, dpi=(300, 300), comment=b"x" * 300
    )
    header = read_header(buf.getvalue())
    assert (header.format, header.width, header.height) == ("jpeg", 120, 77)


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "not a PNG or JPEG"),
        (b"GIF89a" + b"\0" * 20, "not a PNG or JPEG"),
        (encoded(4, 4, "PNG")[:20], "truncated PNG"),
        (encoded(4, 4, "JPEG")[:40], "truncated JPEG"),
        (b"\xff\xd8\x00\x00\x00\x00", "corrupt JPEG"),
    ],
)
def test_malformed_images_are_refused_with_the_reason(data: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        read_header(data)


def test_a_png_header_stating_an_empty_image_is_refused() -> None:
    data = bytearray(encoded(3, 3, "PNG"))
    data[16:20] = b"\0\0\0\0"  # IHDR width = 0
    with pytest.raises(ValueError, match="empty image 0x3"):
        read_header(bytes(data))


def test_each_bound_is_named() -> None:
    limits = ImageLimits(
        max_images=2, max_image_bytes=4000, max_total_bytes=5000, max_pixels=10_000
    )
    small = encoded(50, 50)  # 2,500 pixels, well under 4,000 bytes as a flat PNG
    assert len(small) < 2500
    assert images_problem([small, small], limits) is None
    assert "3 images (limit 2" in str(images_problem([small] * 3, limits))
    big_bytes = small + b"\0" * 4000  # trailing bytes: still a PNG header, too many bytes
    assert "image 1 has" in str(images_problem([small, big_bytes], limits))
    assert "image 0 is 101x100 = 10100 pixels" in str(images_problem([encoded(101, 100)], limits))
    assert "image 1: not a PNG or JPEG" in str(images_problem([small, b"junk"], limits))
    near = small + b"\0" * (3000 - len(small))
    assert "images total 6000 bytes (limit 5000" in str(images_problem([near, near], limits))
