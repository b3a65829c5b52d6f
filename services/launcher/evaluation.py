"""Held-out accuracy through the running services: rollout `Generate`, reward `ScoreBatch`.

Evaluation uses the same machinery as training (the engine serving the latest weights and
the same verifier) but no buffer and no staleness control, so a number here is exactly
what the policy being trained would score. During a run the trainer trains on while the
launcher evaluates, so the replica may take new weights between (and within) the
evaluation's batches: the result names the oldest version that produced a token and the
newest version seen (`version_min`, `version`), the range its accuracy mixes.

A vision run's held-out rows hold images: `evaluate(processor=...)` renders each question
with the model's processor (chat template, each image's placeholder expanded to its image
tokens, as the `vision_rlvr` workflow renders training prompts) and sends the ids with the
row's encoded images (`GenerateRequest.images`); the reward function sees the question and
the completion as in training.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from flywheel_proto.v1 import reward_pb2, reward_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from services.common.config import FlywheelConfig
from services.common.grpc_client import make_sync_channel
from services.trainer.lifecycle import checkpoint_position
from services.trainer.paths import RunPaths


@dataclass
class EvalResult:
    accuracy: float
    mean_reward: float
    n: int
    version: int  # the newest version seen: the replica's at its last answer
    failures: int
    version_min: int = -1  # the oldest that produced a token (`version` if none did)


def resume_step(cfg: FlywheelConfig, paths: RunPaths) -> int | None:
    """The step a run resumes at (its latest checkpoint's), or None for a fresh start: the
    label of a resumed run's first evaluation."""
    if cfg.trainer.recover != "auto":
        return None
    pos = checkpoint_position(paths.checkpoint_dir)
    return None if pos is None else int(pos["step"])


def question_of(row: dict[str, Any], prompt_key: str) -> Any:
    """The row's question: `prompt_key`, else AReaL's `problem`, else `question` (the
    columns the vision data sets use)."""
    for key in (prompt_key, "problem", "question"):
        if key in row:
            return row[key]
    raise ValueError(f"held-out row has no {prompt_key!r}, 'problem' or 'question' column")


def vision_prompts(
    processor: Any, rows: Sequence[dict[str, Any]], prompt_key: str, base_dir: Path
) -> list[tuple[list[int], list[bytes]]]:
    """(prompt ids, encoded images) per row, rendered as the `vision_rlvr` workflow renders
    training prompts; image paths are relative to `base_dir`."""
    from services.common.vision_rows import load_images, vision_messages

    out = []
    for row in rows:
        images = load_images(row["images"] if "images" in row else row.get("image"), base_dir)
        messages = vision_messages(question_of(row, prompt_key), len(images))
        ids = processor.encode_prompt(processor.apply_chat_template(messages), images)
        out.append((list(ids), images))
    return out


def vision_eval_inputs(cfg: FlywheelConfig, data: str) -> dict[str, Any]:
    """`evaluate`'s `processor` and `base_dir` for a vision run's held-out file `data`
    (the served model's processor; image paths relative to the file's folder); {} for a
    text run."""
    if cfg.rollout.workflow != "vision_rlvr":
        return {}
    from services.common.vision_inputs import load_vision_processor

    path = Path(data)
    return {
        "processor": load_vision_processor(cfg.actor.path),
        "base_dir": path if path.is_dir() else path.parent,
    }


def evaluate(
    rollout_address: str,
    reward_address: str,
    rows: list[dict[str, Any]],
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    reward_fn: str = "",
    temperature: float = 1.0,
    max_new_tokens: int = 16,
    auth_token: str | None = None,
    max_message_bytes: int = 64 << 20,
    timeout: float = 600.0,
    batch: int = 64,
    seed: int = 0,
    processor: Any = None,
    base_dir: Path | None = None,
) -> EvalResult:
    """Sample one completion per prompt and score it; accuracy counts reward >= 1.
    `processor` (a `VisionProcessor`): the rows hold images (paths relative to
    `base_dir`), sent with the prompts rendered by it."""
    rendered = (
        vision_prompts(processor, rows, prompt_key, base_dir or Path("."))
        if processor is not None
        else None
    )
    rollout_ch = make_sync_channel(
        rollout_address, max_message_bytes=max_message_bytes, auth_token=auth_token
    )
    reward_ch = make_sync_channel(
        reward_address, max_message_bytes=max_message_bytes, auth_token=auth_token
    )
    rollout = rollout_pb2_grpc.RolloutServiceStub(rollout_ch)
    reward = reward_pb2_grpc.RewardServiceStub(reward_ch)
    rewards: list[float] = []
    failures = 0
    version = -1
    oldest: int | None = None
    try:
        for start in range(0, len(rows), batch):
            chunk = rows[start : start + batch]
            if rendered is None:
                inputs: dict[str, Any] = {"prompts": [str(r[prompt_key]) for r in chunk]}
            else:
                part = rendered[start : start + batch]
                inputs = {
                    "prompt_ids": [rollout_pb2.TokenIds(ids=ids) for ids, _ in part],
                    "images": [rollout_pb2.PromptImages(data=imgs) for _, imgs in part],
                }
            resp = rollout.Generate(
                rollout_pb2.GenerateRequest(
                    request_id=f"eval-{uuid.uuid4().hex}",
                    **inputs,
                    sampling=rollout_pb2.SamplingParams(
                        temperature=temperature,
                        greedy=temperature == 0.0,
                        top_p=1.0,
                        max_new_tokens=max_new_tokens,
                        n_samples=1,
                        seed=seed + start,
                    ),
                ),
                timeout=timeout,
            )
            version = max(version, int(resp.version))  # no token is newer: versions only grow
            lows = [min(c.versions) for c in resp.completions if c.versions]
            if lows:
                oldest = min(lows) if oldest is None else min(oldest, *lows)
            items = [
                reward_pb2.ScoreRequest(
                    request_id=f"eval-{uuid.uuid4().hex}",
                    fn=reward_fn,
                    prompt=str(question_of(r, prompt_key)),
                    completion=c.text.encode("utf-8"),
                    completion_ids=list(c.output_ids),
                    answer=str(r[answer_key]),
                )
                for r, c in zip(chunk, resp.completions, strict=True)
            ]
            scored = reward.ScoreBatch(
                reward_pb2.ScoreBatchRequest(request_id=f"eval-{uuid.uuid4().hex}", items=items),
                timeout=timeout,
            )
            for res in scored.results:
                if res.status != reward_pb2.REWARD_STATUS_OK:
                    failures += 1
                rewards.append(float(res.reward))
    except grpc.RpcError as err:
        raise RuntimeError(f"evaluation failed: {err.code().name}: {err.details()}") from err
    finally:
        rollout_ch.close()
        reward_ch.close()
    n = len(rewards)
    correct = sum(1 for r in rewards if r >= 1.0 - 1e-6)
    return EvalResult(
        accuracy=correct / n if n else 0.0,
        mean_reward=sum(rewards) / n if n else 0.0,
        n=n,
        version=version,
        failures=failures,
        version_min=version if oldest is None else oldest,
    )
