"""A vision rollout through the services: the loop runs `vision_rlvr` on the tiny Qwen2-VL,
scores through the real reward service (`clevr_count`), and puts groups into the real buffer
(real redis-server), from which a trainer claims them with their images."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.common.tiny_vlm import image_tokens
from services.core.contracts import WorkflowContext
from services.core.types import SamplingParams
from services.rollout.data.counting import write_split
from services.rollout.data.datasets import read_rows
from services.rollout.data.vision import VisionPromptDataset
from services.rollout.engine.torch_engine import TorchEngine
from services.rollout.loop import RolloutLoop
from services.rollout.metrics import RolloutMetrics
from services.rollout.workflows.base import RewardServiceScorer, load_workflow
from tests.rollout.loop_services import LoopServices, loop_services
from tests.vision_fixtures import IMAGE_SIZE, tiny_vlm_dir  # noqa: F401


@pytest.mark.integration
@pytest.mark.slow
async def test_groups_reach_the_trainer_with_their_images(
    redis_server: Any,
    tiny_vlm_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    engine = TorchEngine(tiny_vlm_dir, max_batch_size=4, device="cpu")
    await engine.start()
    try:
        async with loop_services(redis_server.url, tmp_path, fn="clevr_count", eta=0) as svc:
            await _run(engine, svc, tmp_path)
    finally:
        await engine.stop()


async def _run(engine: TorchEngine, svc: LoopServices, tmp_path: Path) -> None:
    data = write_split(tmp_path / "data", "train", 4, seed=1, size=IMAGE_SIZE)
    dataset = VisionPromptDataset(read_rows(data), base_dir=data.parent, seed=0)
    metrics = RolloutMetrics()
    ctx = WorkflowContext(
        engine.tokenizer,
        SamplingParams(n_samples=2, max_new_tokens=3, temperature=1.0),
        RewardServiceScorer(svc.reward, fn="clevr_count"),
        processor=engine.vision,
        on_images=metrics.observe_images,
    )
    loop = RolloutLoop(
        engine=engine,
        workflow=load_workflow("vision_rlvr", ctx),
        dataset=dataset,
        buffer=svc.buffer,
        rollout_id="rollout-0",
        max_concurrent=2,
        metrics=metrics,
    )
    images_of = {r.prompt_id: r.extra["images"] for r in dataset.rows}
    loop.start()
    try:
        claimed = (await svc.trainer_side.claim(2, consumer_id="t0", wait_ms=60_000)).groups
        assert len(claimed) == 2
        for g in claimed:
            assert g.images == images_of[g.prompt_id]  # the data set's PNG, byte for byte
            assert len(g.trajectories) == 2
            assert all(t.metadata["reward_status"] == "OK" for t in g.trajectories)
        await loop.drain(timeout=30)
        assert metrics.images_per_group._sum.get() >= 2  # one image per rendered prompt
        assert metrics.image_tokens_per_sample._sum.get() >= 2 * image_tokens(IMAGE_SIZE)
        assert (await svc.trainer_side.stats()).invariant_ok
    finally:
        await loop.drain(timeout=30)
