"""The torch engine serving the tiny Qwen2-VL model, against HF transformers' `generate`.

Reference: `Qwen2VLForConditionalGeneration.generate` with the same ids, `pixel_values` and
`image_grid_thw` (one prompt at a time, no padding), and a fresh full forward for the
log-probabilities. Tolerance as for text (tests/rollout/engine/test_torch_engine.py): the
engine and a fresh forward sum the same float32 numbers in another order, atol=1e-5.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from services.common.model_source import auto_model_class
from services.common.vision_inputs import VisionInputs, load_vision_processor
from services.core.types import SamplingParams
from services.rollout.engine.torch_engine import TorchEngine
from tests.vision_fixtures import scene_png, tiny_vlm_dir  # noqa: F401  (fixture)

ATOL = 1e-5
QUESTION = "How many objects are there?"


def _prompt(proc, images: list[bytes]) -> list[int]:  # type: ignore[no-untyped-def]
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": QUESTION}]
    text = proc.apply_chat_template([{"role": "user", "content": content}])
    return proc.encode_prompt(text, images)


def _hf_inputs(proc, prompt: list[int], images: list[bytes]) -> dict:  # type: ignore[no-untyped-def]
    kw: dict = {"input_ids": torch.tensor([prompt])}
    if images:
        v: VisionInputs = proc.pixel_inputs(images)
        kw.update(pixel_values=v.pixel_values, image_grid_thw=v.image_grid_thw)
    return kw


def _hf_greedy(model, proc, prompt, images, n: int, eos: int) -> list[int]:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        out = model.generate(**_hf_inputs(proc, prompt, images), do_sample=False, max_new_tokens=n)[
            0, len(prompt) :
        ].tolist()
    return out[: out.index(eos) + 1] if eos in out else out


def _fresh_logprobs(model, proc, prompt, images, out: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    kw = _hf_inputs(proc, prompt + out, images)
    with torch.no_grad():
        logits = model(**kw).logits[0].float()
    steps = logits[len(prompt) - 1 : -1]
    return torch.log_softmax(steps, -1).gather(-1, torch.tensor(out)[:, None])[:, 0]


async def test_greedy_with_images_equals_hf_generate(tiny_vlm_dir: Path) -> None:  # noqa: F811
    proc = load_vision_processor(tiny_vlm_dir)
    cases = [
        [scene_png(3, 1)],
        [scene_png(7, 2)],
        [scene_png(1, 3), scene_png(9, 4)],  # two images in one prompt
        [],  # a text-only prompt to the same VLM
        [scene_png(5, 5)],
    ]
    prompts = [_prompt(proc, imgs) for imgs in cases]
    eng = TorchEngine(tiny_vlm_dir, max_batch_size=2, device="cpu")
    await eng.start()
    try:
        assert eng.accepts_images
        sp = SamplingParams(greedy=True, max_new_tokens=8)
        # 5 requests over 2 rows: prompts with and without images join the running batch.
        outs = await asyncio.gather(
            *(eng.agenerate(p, sp, images=imgs) for p, imgs in zip(prompts, cases, strict=True))
        )
    finally:
        await eng.stop()
    model = auto_model_class(tiny_vlm_dir).from_pretrained(tiny_vlm_dir).eval()
    eos = int(model.generation_config.eos_token_id)
    for p, imgs, o in zip(prompts, cases, outs, strict=True):
        assert o.output_ids == _hf_greedy(model, proc, p, imgs, 8, eos)
        torch.testing.assert_close(
            torch.tensor(o.logprobs),
            _fresh_logprobs(model, proc, p, imgs, o.output_ids),
            rtol=0,
            atol=ATOL,
        )
    # The images are read: the same prompt with another image scores its tokens differently.
    other = _fresh_logprobs(model, proc, prompts[0], [scene_png(8, 9)], outs[0].output_ids)
    assert not torch.allclose(torch.tensor(outs[0].logprobs), other, atol=1e-4)


async def test_image_tokens_must_match_the_images(tiny_vlm_dir: Path) -> None:  # noqa: F811
    proc = load_vision_processor(tiny_vlm_dir)
    prompt = _prompt(proc, [scene_png(2, 1)])
    eng = TorchEngine(tiny_vlm_dir, max_batch_size=1, device="cpu")
    await eng.start()
    try:
        with pytest.raises(ValueError, match="image tokens but its images need"):
            await eng.agenerate(prompt, SamplingParams(max_new_tokens=2))  # images left out
        with pytest.raises(ValueError, match="unreadable image"):
            await eng.agenerate(prompt, SamplingParams(max_new_tokens=2), images=[b"not a png"])
        assert eng.requests_in_flight == 0
    finally:
        await eng.stop()


async def test_placeholders_are_never_sampled(tiny_vlm_dir: Path) -> None:  # noqa: F811
    proc = load_vision_processor(tiny_vlm_dir)
    images = [scene_png(4, 6)]
    prompt = _prompt(proc, images)
    eng = TorchEngine(tiny_vlm_dir, max_batch_size=8, device="cpu")
    await eng.start()
    try:
        # The random model spreads its mass over all 87 ids: 8 x 40 draws would take the 4
        # placeholder ids ~15 times if they were allowed.
        sp = SamplingParams(
            temperature=2.0, max_new_tokens=40, ignore_eos=True, n_samples=8, seed=3
        )
        outs = await eng.agenerate_n(prompt, sp, images=images)
    finally:
        await eng.stop()
    cfg = auto_model_class(tiny_vlm_dir).from_pretrained(tiny_vlm_dir).config
    never = {
        cfg.image_token_id,
        cfg.video_token_id,
        cfg.vision_start_token_id,
        cfg.vision_end_token_id,
    }
    drawn = [t for o in outs for t in o.output_ids]
    assert len(drawn) == 320 and not never & set(drawn)
