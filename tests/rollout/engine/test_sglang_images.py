"""The SGLang client's prompts with images, against the STAND-IN server held to SGLang 0.5.23.

What SGLang takes: `GenerateReqInput.image_data` (the pinned schema's `/generate` body class),
one entry per image of a single prompt, each a string that SGLang's `get_image_bytes`
(`srt/utils/common.py`) turns back into the bytes: a `data:` URL's base64 here. The stand-in
reads `image_data` by those rules (`tests/rollout/sglang_media.py`) and generates with its torch
engine on the tiny Qwen2-VL, so the tokens the client gets back were generated from the images
it sent. `/model_info`'s `has_image_understanding` (SGLang's `http_server.py`) says whether
the served model reads images; a text model is sent none.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from services.core.types import SamplingParams
from services.rollout.engine.sglang_engine import SGLangEngine
from services.rollout.engine.sglang_protocol import image_data
from services.rollout.engine.torch_engine import TorchEngine
from tests.image_samples import encoded
from tests.rollout.sglang_media import decode_image_data
from tests.rollout.sglang_standin import SCHEMA, SGLangStandIn, contract_violations
from tests.vision_fixtures import scene_png, tiny_vlm_dir  # noqa: F401

pytestmark = pytest.mark.integration


@pytest.fixture
def vlm_standin(tiny_vlm_dir: Path) -> Iterator[SGLangStandIn]:  # noqa: F811
    s = SGLangStandIn(tiny_vlm_dir).start()
    try:
        yield s
    finally:
        s.stop()
    assert s.contract_errors == []  # every request fits SGLang's request classes


@pytest.fixture
async def vlm_sgl(
    vlm_standin: SGLangStandIn,
    tiny_vlm_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> AsyncIterator[SGLangEngine]:
    eng = SGLangEngine(vlm_standin.url, model_path=str(tiny_vlm_dir), scratch_dir=str(tmp_path))
    await eng.start()
    try:
        yield eng
    finally:
        await eng.stop()


def _prompt(processor, images: list[bytes]) -> list[int]:  # type: ignore[no-untyped-def]
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "How many?"}]
    text = processor.apply_chat_template([{"role": "user", "content": content}])
    return list(processor.encode_prompt(text, images))


def test_image_data_is_what_sglangs_request_class_and_image_loader_take() -> None:
    images = [encoded(20, 10, "PNG"), encoded(7, 9, "JPEG")]
    urls = image_data(images)
    assert [u.split(",", 1)[0] for u in urls] == [
        "data:image/png;base64",
        "data:image/jpeg;base64",
    ]
    assert decode_image_data(urls) == images  # SGLang's get_image_bytes rules
    body = {"input_ids": [1, 2], "sampling_params": {}, "rid": "r", "image_data": urls}
    assert contract_violations("/generate", body) == []
    assert "image_data" in SCHEMA["classes"]["GenerateReqInput"]["fields"]
    with pytest.raises(ValueError, match="not a PNG or JPEG"):
        image_data([b"GIF89a..."])


async def test_images_reach_the_server_and_steer_generation(
    vlm_sgl: SGLangEngine,
    vlm_standin: SGLangStandIn,
    tiny_vlm_dir: Path,  # noqa: F811
) -> None:
    assert vlm_sgl.accepts_images  # /model_info: has_image_understanding
    processor = vlm_standin.engine.vision
    three, seven = scene_png(3, 1), scene_png(7, 2)
    prompt = _prompt(processor, [three])
    sp = SamplingParams(max_new_tokens=5, greedy=True)
    got = await vlm_sgl.agenerate(prompt, sp, images=[three])
    assert vlm_standin.images == [[three]]  # the bytes the client was given, intact
    assert vlm_standin.bodies("/generate")[0]["input_ids"] == prompt
    # The same request straight to a torch engine on the same checkpoint (the stand-in's
    # own generator, outside HTTP): the same tokens and log-probabilities.
    direct = TorchEngine(tiny_vlm_dir, max_batch_size=2, device="cpu")
    await direct.start()
    try:
        want = await direct.agenerate(prompt, sp, images=[three])
        other = await direct.agenerate(_prompt(processor, [seven]), sp, images=[seven])
    finally:
        await direct.stop()
    assert got.output_ids == want.output_ids and got.logprobs == want.logprobs
    assert got.logprobs != other.logprobs  # the image is read, not ignored
    group = await vlm_sgl.agenerate_n(
        prompt, SamplingParams(n_samples=2, max_new_tokens=3), images=[three]
    )
    assert len(group) == 2 and vlm_standin.images[1:] == [[three], [three]]


async def test_the_stand_in_refuses_image_data_sglang_cannot_read(
    vlm_standin: SGLangStandIn,
) -> None:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}, "rid": "x"}
    async with httpx.AsyncClient(base_url=vlm_standin.url) as http:
        bad_b64 = await http.post("/generate", json={**body, "image_data": ["data:,%%%"]})
        not_image = await http.post(
            "/generate",
            json={**body, "image_data": [base64.b64encode(b"plain text").decode()]},
        )
        unknown = await http.post("/generate", json={**body, "image_bytes": []})
    assert bad_b64.status_code == not_image.status_code == unknown.status_code == 400
    assert "not base64" in bad_b64.json()["error"]["message"]
    assert "cannot decode" in not_image.json()["error"]["message"]
    assert vlm_standin.contract_errors == ["/generate: unknown field 'image_bytes'"]
    vlm_standin.contract_errors.clear()  # expected here; the fixture checks none other


async def test_a_text_model_is_sent_no_images(tiny_model_dir: Path, tmp_path: Path) -> None:
    standin = SGLangStandIn(tiny_model_dir).start()
    eng = SGLangEngine(standin.url, model_path=str(tiny_model_dir), scratch_dir=str(tmp_path))
    try:
        await eng.start()
        assert not eng.accepts_images
        with pytest.raises(ValueError, match="text-only model and was given 1 image"):
            await eng.agenerate_n(
                [1, 2, 3], SamplingParams(max_new_tokens=2), images=[encoded(4, 4)]
            )
        assert standin.bodies("/generate") == []  # refused before anything was sent
        # And the server, asked directly, refuses them as SGLang does for a text model.
        async with httpx.AsyncClient(base_url=standin.url) as http:
            r = await http.post(
                "/generate",
                json={
                    "input_ids": [1, 2],
                    "sampling_params": {"max_new_tokens": 1},
                    "image_data": image_data([encoded(4, 4)]),
                },
            )
        assert r.status_code == 400 and "does not support image inputs" in r.text
    finally:
        await eng.stop()
        standin.stop()
    assert standin.contract_errors == []
