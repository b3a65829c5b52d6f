"""Replay: serve an exported JSONL file to a trainer, for a train-only debugging run.

The file is loaded into Redis under its own key prefix through the ordinary admission
script, so the trainer meets exactly the normal Claim/Ack/redelivery code path; only the
staleness check is off (the versions in the file belong to the run that produced it) and
puts are refused. The replay prefix is emptied first, so every replay starts from the file.
"""

from __future__ import annotations

import logging
import os

from services.buffer.export import read_jsonl
from services.buffer.store import RedisStore
from services.common.codec import group_to_proto

log = logging.getLogger(__name__)


async def load_replay(store: RedisStore, path: str | os.PathLike[str]) -> int:
    """Empty the store's prefix and admit every group of `path`; returns how many."""
    if store.settings.staleness_check:
        raise ValueError("a replay store must be built with staleness_check=False")
    await store.clear()
    n = 0
    for group in read_jsonl(path):
        out = await store.put(
            group_id=group.group_id,
            oldest_version=group.oldest_version,
            newest_version=group.newest_version,
            n_trajectories=len(group.trajectories),
            payload=group_to_proto(group).SerializeToString(),
        )
        if out.result == "admitted":
            n += 1
        else:
            log.warning(
                "replay skipped a group", extra={"group_id": group.group_id, "result": out.result}
            )
    log.info("replay loaded", extra={"path": str(path), "groups": n})
    return n
