"""The fleet simulator's model arithmetic, and a tiny run against the real buffer and Redis."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from scale_model import SGLANG_DECODE_S_PER_TOKEN, FleetModel  # noqa: E402


def test_group_time_is_the_longest_sample_at_the_decode_rate() -> None:
    m = FleetModel()
    lengths = np.array([1024, 4096, 2048])
    # 4,096 tokens x 9.0 ms = 36.864 s; a straggler takes 3 x that = 110.592 s
    assert m.group_seconds(lengths, straggler=False) == pytest.approx(36.864)
    assert m.group_seconds(lengths, straggler=True) == pytest.approx(110.592)
    assert SGLANG_DECODE_S_PER_TOKEN == 0.009


def test_lengths_stay_in_the_stated_range_with_the_stated_median() -> None:
    m = FleetModel()
    rng = np.random.default_rng(0)
    xs = np.concatenate([m.lengths(rng) for _ in range(2000)])
    assert xs.min() >= 1024 and xs.max() <= 8192
    # log-normal median 2,048 (clipping at 1,024 = median / 2 moves no mass across it)
    assert np.median(xs) == pytest.approx(2048, rel=0.03)


def test_the_trainer_takes_four_fifths_of_what_the_fleet_offers() -> None:
    m = FleetModel(batch_groups=16, trainer_share=0.8)
    # 64 replicas at 40 s a group offer 1.6 groups/s; the trainer takes 0.8 x 1.6 = 1.28
    # groups/s, i.e. a batch of 16 every 16 / 1.28 = 12.5 s
    assert m.offered_groups_per_s(64, 40.0) == pytest.approx(1.6)
    assert m.step_seconds(64, 40.0) == pytest.approx(12.5)
    assert m.wire_tokens(8192) == 256 and m.wire_tokens(10) == 1


def test_staleness_bound_share_from_the_capacity_formula() -> None:
    # AReaL's capacity: (max_head_offpolicyness + version + 1) * consumer_batch_size
    # - (accepted + running). 64 replicas, batch 16, trainer share 0.8: one group's
    # generation spans k = 0.8 * 64 / 16 = 3.2 steps; busy share u = (eta + 1) / (1 + k)
    m = FleetModel(batch_groups=16, trainer_share=0.8)
    assert m.staleness_bound_share(64, 0) == pytest.approx(1 / 4.2)
    assert m.staleness_bound_share(64, 2) == pytest.approx(3 / 4.2)
    assert m.staleness_bound_share(64, 3) == pytest.approx(1.0 - 0.2 / 4.2)
    assert m.staleness_bound_share(64, 4) == 1.0  # 5 / 4.2, capped: the bound does not bind


def test_the_simulated_replicas_hold_reserve_as_long_as_the_rollout_loop() -> None:
    from scale import RESERVE_WAIT_MS

    from services.rollout.loop import RESERVE_WAIT_MS as LOOP_RESERVE_WAIT_MS

    assert RESERVE_WAIT_MS == LOOP_RESERVE_WAIT_MS


@pytest.mark.integration
def test_four_replicas_with_faults_keep_the_invariant_and_the_staleness_bound() -> None:
    cmd = [sys.executable, "benchmarks/scale.py", "--replicas", "4", "--duration", "200"]
    cmd += ["--batch-groups", "2", "--eta", "1", "--die-p", "0.2"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180, check=True)
    (line,) = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert line["invariant_holds"] is True
    assert line["staleness_violations"] == 0 and line["max_served_staleness"] <= 1
    assert line["put_total"] > 0 and len(line["faults"]) == 2


def test_simulated_slots_behave_as_the_rollout_loops_episode_slots() -> None:
    import asyncio

    from scale import Slots

    from services.rollout.loop import EpisodeSlots

    async def trace(slots: Slots | EpisodeSlots) -> list[int]:
        out = [await slots.take_all()]  # all 3 free slots at once
        waiter = asyncio.ensure_future(slots.take_all())
        await asyncio.sleep(0)
        assert not waiter.done()  # nothing free: the next take waits
        slots.give()
        slots.give(2)
        out.append(await asyncio.wait_for(waiter, 5))
        slots.give()
        out.append(await slots.take_all())
        return out

    assert asyncio.run(trace(Slots(3))) == asyncio.run(trace(EpisodeSlots(3))) == [3, 3, 1]
