"""Held-out evaluation of a vision run: `evaluate(processor=...)` renders each row with the
model's processor and sends its images in `GenerateRequest.images` to a real rollout server
(the tiny Qwen2-VL on the torch engine, gRPC on loopback), scored by the real reward service
with `clevr_count`; and the servicer's refusals of bad image requests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from flywheel_proto.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.grpc_server import ServiceServer
from services.common.vision_inputs import load_vision_processor
from services.core.types import SamplingParams
from services.launcher.evaluation import evaluate, vision_prompts
from services.reward.builtins import clevr_count_reward
from services.rollout.data.counting import write_split
from services.rollout.data.datasets import read_rows
from services.rollout.engine.torch_engine import TorchEngine
from services.rollout.metrics import RolloutMetrics
from services.rollout.servicer import RolloutServicer
from tests.reward.conftest import RunningReward, service_config
from tests.vision_fixtures import IMAGE_SIZE, scene_png, tiny_vlm_dir  # noqa: F401

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def reward_address() -> Iterator[str]:
    svc = RunningReward(service_config(num_workers=1))
    try:
        yield svc.address
    finally:
        svc.stop()


@pytest.fixture
async def vlm_served(
    tiny_vlm_dir: Path,  # noqa: F811
) -> AsyncIterator[tuple[TorchEngine, str]]:
    engine = TorchEngine(tiny_vlm_dir, max_batch_size=8, device="cpu")
    await engine.start()
    server = ServiceServer("rollout", service_names=["flywheel.v1.RolloutService"])
    servicer = RolloutServicer(engine, rollout_id="rollout-0", metrics=RolloutMetrics())
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server.server)
    port = await server.start()
    try:
        yield engine, f"127.0.0.1:{port}"
    finally:
        await server.stop(grace=1)
        await engine.stop()


async def test_greedy_evaluation_scores_what_the_engine_answers_with_the_images(
    vlm_served: tuple[TorchEngine, str],
    reward_address: str,
    tiny_vlm_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    engine, address = vlm_served
    data = write_split(tmp_path, "valid", 6, seed=3, size=IMAGE_SIZE)
    rows = read_rows(data)
    processor = load_vision_processor(tiny_vlm_dir)
    result = await asyncio.to_thread(
        evaluate,
        address,
        reward_address,
        rows,
        reward_fn="clevr_count",
        temperature=0.0,
        max_new_tokens=3,
        batch=4,  # two Generate calls
        processor=processor,
        base_dir=tmp_path,
    )
    assert (result.n, result.failures) == (6, 0)
    # The same prompts generated in process, greedily, with each row's image, scored by the
    # same function: the evaluation sent these ids and these images.
    want = []
    greedy = SamplingParams(n_samples=1, max_new_tokens=3, temperature=0.0, greedy=True)
    for (ids, images), row in zip(
        vision_prompts(processor, rows, "prompt", tmp_path), rows, strict=True
    ):
        assert images == [(tmp_path / str(row["images"][0])).read_bytes()]
        (c,) = await engine.agenerate_n(ids, greedy, images=images)
        text = processor.tokenizer.decode(c.output_ids, skip_special_tokens=True)
        want.append(clevr_count_reward("", text, ids, list(c.output_ids), str(row["answer"])))
    assert result.mean_reward == pytest.approx(sum(want) / len(want), abs=1e-9)


async def test_bad_image_requests_get_invalid_argument(
    vlm_served: tuple[TorchEngine, str],
    tiny_vlm_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    _, address = vlm_served
    processor = load_vision_processor(tiny_vlm_dir)
    png = scene_png(3, seed=1)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}
    ]
    ids = processor.encode_prompt(processor.apply_chat_template(messages), [png])
    sampling = rollout_pb2.SamplingParams(temperature=1.0, max_new_tokens=2, n_samples=1)
    one = [rollout_pb2.TokenIds(ids=ids)]
    cases = {
        "images go with prompt_ids": rollout_pb2.GenerateRequest(
            prompts=["How many?"], images=[rollout_pb2.PromptImages(data=[png])], sampling=sampling
        ),
        "2 image entries for 1 prompts": rollout_pb2.GenerateRequest(
            prompt_ids=one, images=[rollout_pb2.PromptImages(data=[png])] * 2, sampling=sampling
        ),
        "prompt 0: ": rollout_pb2.GenerateRequest(  # not a PNG or JPEG
            prompt_ids=one,
            images=[rollout_pb2.PromptImages(data=[b"not an image"])],
            sampling=sampling,
        ),
        "9 images (limit 8": rollout_pb2.GenerateRequest(
            prompt_ids=one, images=[rollout_pb2.PromptImages(data=[png] * 9)], sampling=sampling
        ),
        "image tokens": rollout_pb2.GenerateRequest(  # ids without the image's tokens
            prompt_ids=[rollout_pb2.TokenIds(ids=[ids[0], ids[1]])],
            images=[rollout_pb2.PromptImages(data=[png])],
            sampling=sampling,
        ),
    }
    channel = grpc.aio.insecure_channel(address)
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
    try:
        for needle, req in cases.items():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(req, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, needle
            assert needle in (err.value.details() or ""), (needle, err.value.details())
        # The well-formed request is answered.
        ok = await stub.Generate(
            rollout_pb2.GenerateRequest(
                prompt_ids=one, images=[rollout_pb2.PromptImages(data=[png])], sampling=sampling
            ),
            timeout=30,
        )
        assert len(ok.completions) == 1
    finally:
        await channel.close()
