"""Export groups to JSONL, and read such a file back (for replay).

One line per group, plain JSON a person or `jq` can read: token ids, masks, behaviour
log-probabilities, per-token versions, rewards and, when a tokenizer is configured, the
decoded prompt and completion text. Log-probabilities are float32 written as the shortest
decimal that reads back to the same float, so export followed by replay gives the trainer
bit-identical inputs.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from flywheel_proto.v1 import common_pb2
from services.common.codec import CodecError, group_from_proto
from services.core.types import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from services.buffer.store import GroupSummary, RedisStore

FORMAT = "flywheel.buffer.v1"


def _load_tokenizer(path: str | None) -> Any:
    """Only decoding is needed: a `tokenizer.json` is read as is (AutoTokenizer could pick
    a model-specific class whose pre-tokenizer differs); otherwise AutoTokenizer."""
    if not path:
        return None
    import transformers  # heavy; only when text is wanted

    if (Path(path) / "tokenizer.json").is_file():
        return transformers.PreTrainedTokenizerFast.from_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path)


def group_to_record(
    group: TrajectoryGroup, summary: GroupSummary | None = None, tokenizer: Any = None
) -> dict[str, Any]:
    trajectories = []
    for t in group.trajectories:
        rec: dict[str, Any] = {
            "trajectory_id": t.trajectory_id,
            "input_ids": t.input_ids.tolist(),
            "loss_mask": t.loss_mask.tolist(),
            "logprobs": t.logprobs.astype(np.float32).tolist(),
            "versions": t.versions.tolist(),
            "reward": t.reward,
            "no_eos": t.no_eos,
            "prompt_len": t.prompt_len,
            "stop_reason": t.stop_reason,
            "turn_ids": None if t.turn_ids is None else t.turn_ids.tolist(),
            "metadata": t.metadata,
        }
        if tokenizer is not None:
            rec["prompt_text"] = tokenizer.decode(t.input_ids[: t.prompt_len].tolist())
            rec["completion_text"] = tokenizer.decode(t.input_ids[t.prompt_len :].tolist())
        trajectories.append(rec)
    return {
        "format": FORMAT,
        "group_id": group.group_id,
        "prompt_id": group.prompt_id,
        "rollout_id": group.rollout_id,
        "created_unix_ms": group.created_unix_ms,
        "metadata": group.metadata,
        "state": summary.state if summary else "",
        "oldest_version": group.oldest_version,
        "newest_version": group.newest_version,
        "rewards": group.rewards,
        "trajectories": trajectories,
    }


def record_to_group(rec: dict[str, Any]) -> TrajectoryGroup:
    """Inverse of `group_to_record` (text fields are ignored: tokens are the truth)."""
    if rec.get("format") != FORMAT:
        raise CodecError(f"format is {rec.get('format')!r}, expected {FORMAT!r}")
    trajectories = [
        Trajectory(
            trajectory_id=t["trajectory_id"],
            group_id=rec["group_id"],
            input_ids=np.asarray(t["input_ids"], dtype=np.int64),
            loss_mask=np.asarray(t["loss_mask"], dtype=np.int8),
            logprobs=np.asarray(t["logprobs"], dtype=np.float32),
            versions=np.asarray(t["versions"], dtype=np.int64),
            reward=float(t["reward"]),
            no_eos=bool(t["no_eos"]),
            prompt_len=int(t["prompt_len"]),
            stop_reason=t.get("stop_reason", "stop"),
            turn_ids=None if t.get("turn_ids") is None else np.asarray(t["turn_ids"], np.int64),
            metadata=dict(t.get("metadata", {})),
        )
        for t in rec["trajectories"]
    ]
    return TrajectoryGroup(
        group_id=rec["group_id"],
        trajectories=trajectories,
        prompt_id=rec.get("prompt_id", ""),
        rollout_id=rec.get("rollout_id", ""),
        created_unix_ms=int(rec.get("created_unix_ms", 0)),
        metadata=dict(rec.get("metadata", {})),
    )


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[TrajectoryGroup]:
    """Groups of an exported file, in file order; a bad line raises naming its number."""
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield record_to_group(json.loads(line))
            except (ValueError, KeyError, TypeError) as err:
                raise CodecError(f"{path}:{lineno}: not an exported group: {err}") from err


async def export_jsonl(
    store: RedisStore,
    min_version: int,
    max_version: int,
    path: str | os.PathLike[str],
    tokenizer_path: str | None = None,
) -> int:
    """Write every stored group with oldest version in [min, max] to `path`; returns count.

    Written to a temporary file and renamed, so a reader never sees half an export.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    tokenizer = await asyncio.to_thread(_load_tokenizer, tokenizer_path)
    n = 0
    with open(tmp, "w", encoding="utf-8") as fh:
        async for summary, payload in store.iter_payloads(min_version, max_version):
            group = group_from_proto(common_pb2.TrajectoryGroup.FromString(payload))
            line = json.dumps(group_to_record(group, summary, tokenizer), separators=(",", ":"))
            fh.write(line + "\n")
            n += 1
    os.replace(tmp, target)
    return n
