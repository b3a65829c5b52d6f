"""Fleet simulator: N rollout replicas against the real buffer service and a real Redis.

Each replica is an asyncio task that uses the real `BufferClient` over gRPC on loopback:
it reserves capacity for its free slots with the version it serves, in one call the buffer
holds until capacity frees (`wait_ms`, as the rollout loop asks), "generates" for the time
`benchmarks/scale_model.py` draws (SGLang's measured decode rate, long-tailed lengths,
stragglers), puts the group (16 samples with per-token log-probabilities and versions,
token counts scaled down as the model states), and serves the newest version it heard of
(from the trainer's publication, pushed to every replica, or from its own answers) after
the model's weight-update delay; new weights during a held Reserve make it ask again
under the same request id (as the rollout loop does; `--no-reissue`: wait the hold out).
A trainer task claims batches, "steps" for the model's step time, acknowledges, bumps the
version and publishes it. Replicas share one gRPC channel per
`--replicas-per-channel` (a channel per replica would spend this machine on HTTP/2
housekeeping, not on the control plane being measured).

Faults: every group a replica finishes it dies with `--die-p`, holding its reservation,
and comes back after a while releasing what it held (or the reservation expires); the
buffer process is killed and restarted at 30 % of the run and redis-server at 60 %.

Prints one JSON line per (replicas, eta) point. With no arguments: the short sweep that
`make bench` runs (8 and 64 replicas, eta 2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import grpc
import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from scale_model import FleetModel  # noqa: E402

from services.buffer.client import BufferClient  # noqa: E402
from services.common.codec import Trajectory, TrajectoryGroup, group_to_proto  # noqa: E402
from services.common.grpc_client import wait_for_health  # noqa: E402
from services.common.redis_server import RedisServer, free_port  # noqa: E402

RESERVE_WAIT_MS = 2000
"""The rollout loop's `RESERVE_WAIT_MS` (services/rollout/loop.py; a test keeps them equal):
not imported, so that the simulator does not load the rollout service's engine stack."""


def make_payload(gid: str, rid: str, lengths: np.ndarray, version: int, model: FleetModel) -> bytes:
    """One group's wire bytes: `len(lengths)` samples of a 64-token prompt and a response of
    `lengths / token_scale` tokens, each token with a log-probability and its version."""
    trajectories = []
    for i, n in enumerate(lengths):
        resp = model.wire_tokens(int(n))
        prompt = 64 // model.token_scale + 1
        total = prompt + resp
        trajectories.append(
            Trajectory(
                trajectory_id=f"t{i}",
                group_id=gid,
                input_ids=np.arange(total, dtype=np.int64) % 50_000,
                loss_mask=np.r_[np.zeros(prompt), np.ones(resp)].astype(np.int8),
                logprobs=np.r_[np.zeros(prompt), np.full(resp, -0.5)].astype(np.float32),
                versions=np.r_[np.full(prompt, -1), np.full(resp, version)].astype(np.int64),
                reward=float(i % 2),
                no_eos=False,
                prompt_len=prompt,
            )
        )
    msg = group_to_proto(TrajectoryGroup(group_id=gid, trajectories=trajectories))
    msg.reservation_id = rid
    return msg.SerializeToString()


class Slots:
    """A replica's free episode slots (its `max_concurrent_rollouts`), one token each in a
    queue: as the rollout loop's `EpisodeSlots`, taken all at once for one reservation call
    and given back one by one as episodes end."""

    def __init__(self, n: int) -> None:
        self._tokens: asyncio.Queue[None] = asyncio.Queue()
        self.give(n)

    async def take_all(self) -> int:
        await self._tokens.get()
        n = 1
        while not self._tokens.empty():
            self._tokens.get_nowait()
            n += 1
        return n

    def give(self, n: int = 1) -> None:
        for _ in range(n):
            self._tokens.put_nowait(None)


class Fleet:
    def __init__(self, args: argparse.Namespace, address: str, model: FleetModel) -> None:
        self.args = args
        self.model = model
        self.address = address
        per = args.replicas_per_channel
        self.clients = [
            BufferClient(address, timeout=30) for _ in range((args.replicas + per - 1) // per)
        ]
        self.lat: dict[str, list[float]] = defaultdict(list)
        self.stop = asyncio.Event()
        self.version_seen = 0
        self.set_at: dict[int, float] = {}
        self.adopted: list[dict[int, float]] = [{} for _ in range(args.replicas)]
        self.offered_groups = 0
        self.offered_tokens = 0
        self.admitted_groups = 0
        self.admitted_tokens = 0
        self.results: dict[str, int] = defaultdict(int)
        self.deaths = 0
        self.seq = [0] * args.replicas
        self.errors: dict[str, int] = defaultdict(int)
        self.starved: list[tuple[float, float]] = []  # the trainer's waits on Claim
        self.outages: list[tuple[float, float]] = []  # fault injected -> buffer SERVING again
        self.trainer_s = 0.0
        self.first_batch_at = 0.0
        self.staleness_violations = 0
        self.max_staleness = 0
        self.claimed = 0
        self.serving = [0] * args.replicas
        self.heard = [0] * args.replicas
        self.mean_group_s = model.mean_group_seconds(np.random.default_rng(args.seed))
        self.updating: list[asyncio.Task[None] | None] = [None] * args.replicas
        self.new_weights = [asyncio.Event() for _ in range(args.replicas)]
        self.incarnation = [0] * args.replicas
        self.reissued = 0

    async def timed(self, name: str, coro):  # noqa: ANN001, ANN201
        t0 = time.perf_counter()
        out = await coro  # a call cancelled or failed is not a latency sample
        self.lat[name].append(time.perf_counter() - t0)
        return out

    async def replica(self, i: int) -> None:
        """One replica; when it dies (or an RPC fails past the client's retries) every group
        it runs is lost with it and it starts over as a restarted one would."""
        rng = np.random.default_rng(self.args.seed * 100_003 + i)
        await asyncio.sleep(rng.random() * 0.5)  # replicas do not start in lockstep
        self.adopted[i][0] = time.monotonic()
        while not self.stop.is_set():
            self.incarnation[i] += 1
            died = asyncio.Event()
            episodes: set[asyncio.Task[None]] = set()
            run = asyncio.create_task(self._replica(i, rng, died, episodes))
            dead = asyncio.create_task(died.wait())
            await asyncio.wait({run, dead}, return_when=asyncio.FIRST_COMPLETED)
            for t in (run, dead, *episodes):
                t.cancel()
            await asyncio.gather(run, dead, *episodes, return_exceptions=True)
            err = None if run.cancelled() else run.exception()
            if isinstance(err, grpc.RpcError):
                self.errors[err.code().name] += 1
                await asyncio.sleep(1.0)
            elif err is not None:
                raise err
            elif died.is_set():  # dead holding its reservations; restarts later
                self.deaths += 1
                await asyncio.sleep(rng.uniform(1.0, 3.0))
                if rng.random() < 0.5:  # a restarted replica releases what it held
                    client = self.clients[i // self.args.replicas_per_channel]
                    await self.timed("release", client.release([], rollout_id=f"sim{i}"))
                # the other half's reservations expire

    def _hear(self, i: int, v: int) -> None:
        """A replica heard of version `v`: it serves the newest version it heard of, each
        after the weight-update delay."""
        self.heard[i] = max(self.heard[i], v)
        updating = self.updating[i]
        if v > self.serving[i] and (updating is None or updating.done()):
            self.updating[i] = asyncio.create_task(self._adopt(i))

    async def _adopt(self, i: int) -> None:
        while self.serving[i] < self.heard[i]:
            v = self.heard[i]
            await asyncio.sleep(self.model.weight_update_s / self.model.time_scale)
            self.serving[i] = max(self.serving[i], v)
            self.adopted[i].setdefault(v, time.monotonic())
            self.new_weights[i].set()

    def publish(self, v: int) -> None:
        """The trainer's weight publication reaches every replica (the disk and distributed
        transports push to each one); each serves it `weight_update_s` later."""
        for i in range(self.args.replicas):
            self._hear(i, v)

    async def _replica(
        self,
        i: int,
        rng: np.random.Generator,
        died: asyncio.Event,
        episodes: set[asyncio.Task[None]],
    ) -> None:
        """Reserve the way `services/rollout/loop.py` does: take every free slot, ask for
        them in one call that the buffer may hold up to `--reserve-wait-ms` until capacity
        frees, start one episode per granted id, give the other slots back."""
        a = self.args
        client = self.clients[i // a.replicas_per_channel]
        slots = Slots(a.slots)
        asked = 0
        while not self.stop.is_set():
            held = await slots.take_all()
            asked += 1
            while True:  # one request id per reservation: a call asked again is harmless
                new_weights = self.new_weights[i]
                new_weights.clear()
                call = asyncio.ensure_future(
                    self.timed(
                        "reserve",
                        client.reserve(
                            held,
                            rollout_id=f"sim{i}",
                            request_id=f"sim{i}-{self.incarnation[i]}-{asked}",
                            served_version=self.serving[i],
                            wait_ms=a.reserve_wait_ms,
                        ),
                    )
                )
                woke = asyncio.ensure_future(new_weights.wait())
                try:
                    await asyncio.wait({call, woke}, return_when=asyncio.FIRST_COMPLETED)
                except asyncio.CancelledError:  # the replica died: its call dies with it
                    call.cancel()
                    raise
                finally:
                    woke.cancel()
                if call.done() or not a.reissue:
                    r = await call
                    break
                # New weights while the call is held: ask again with the new served version
                # (the buffer hands back what it granted under this id, if it did).
                call.cancel()
                await asyncio.gather(call, return_exceptions=True)
                self.reissued += 1
            self._hear(i, r.version)
            granted = list(r.reservation_ids)[:held]
            slots.give(held - len(granted))
            for rid in granted:
                task = asyncio.create_task(self._episode(i, rng, client, rid, slots, died))
                episodes.add(task)
                task.add_done_callback(episodes.discard)
            if not granted:  # a held call answers retry_after_ms 0: ask again at once
                await asyncio.sleep(max(r.retry_after_ms, 10) / 1000.0 * rng.uniform(0.5, 1.5))

    async def _episode(
        self,
        i: int,
        rng: np.random.Generator,
        client: BufferClient,
        rid: str,
        slots: Slots,
        died: asyncio.Event,
    ) -> None:
        m = self.model
        try:
            version = self.serving[i]
            lengths = m.lengths(rng)
            await asyncio.sleep(
                m.group_seconds(lengths, rng.random() < m.straggler_p) / m.time_scale
            )
            if rng.random() < self.args.die_p:
                died.set()
                return
            self.seq[i] += 1
            tokens = int(lengths.sum())
            self.offered_groups += 1
            self.offered_tokens += tokens
            payload = make_payload(f"g{i}-{self.seq[i]}-v{version}", rid, lengths, version, m)
            res = (await self.timed("put", client.put_many([payload])))[0]
            self.results[res.result] += 1
            self._hear(i, res.version)
            if res.result == "admitted":
                self.admitted_groups += 1
                self.admitted_tokens += tokens
        finally:
            slots.give()

    async def trainer(self) -> None:
        m, a = self.model, self.args
        client = BufferClient(self.address, timeout=30)
        step_s = m.step_seconds(a.replicas, self.mean_group_s) / m.time_scale
        version = 0
        try:
            ready = time.monotonic()  # the trainer wants its next batch from here on
            while not self.stop.is_set():
                out = await self.timed(
                    "claim", client.claim(m.batch_groups, consumer_id="trainer", wait_ms=500)
                )
                # Only the waits after the first step count (the fleet needs one generation
                # time to fill the first batch); a wait spans every empty Claim before the
                # batch came, and the one the end of the run cut short.
                if version > 0 and (len(out) or self.stop.is_set()):
                    self.starved.append((ready, time.monotonic()))
                if len(out) == 0:
                    continue
                self.first_batch_at = self.first_batch_at or time.monotonic()
                self.claimed += len(out)
                for gid in out.group_ids:  # "g<replica>-<seq>-v<version its tokens have>"
                    lag = out.version - int(gid.rsplit("-v", 1)[1])
                    self.max_staleness = max(self.max_staleness, lag)
                    self.staleness_violations += lag > a.eta
                s0 = time.monotonic()
                await asyncio.sleep(step_s)
                await self.timed("ack", client.ack(out.group_ids, consumer_id="trainer"))
                version = out.version + 1
                self.set_at[version] = time.monotonic()
                await self.timed("set_version", client.set_version(version))
                self.publish(version)
                self.version_seen = version
                if version > 1:
                    self.trainer_s += time.monotonic() - s0
                ready = time.monotonic()
        finally:
            await client.close()

    def starved_seconds(self, outside_outages: bool = False) -> float:
        """The trainer's time waiting on Claim; with `outside_outages`, less the parts of
        those waits that fall inside an injected outage."""
        total = 0.0
        for a, b in self.starved:
            total += b - a
            if outside_outages:
                total -= sum(max(0.0, min(b, d) - max(a, c)) for c, d in self.outages)
        return total

    def fanout_seconds(self) -> list[float]:
        """Per version (set before the last fifth of the run): time from SetVersion to every
        replica serving it or a newer one."""
        out = []
        end = time.monotonic()
        for v, t in sorted(self.set_at.items()):
            if end - t < 5 * (self.model.weight_update_s / self.model.time_scale) + 2:
                continue
            times = []
            for adopted in self.adopted:
                got = [ts for ver, ts in adopted.items() if ver >= v]
                if not got:
                    break
                times.append(min(got))
            else:
                out.append(max(times) - t)
        return out


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def redis_cpu_seconds(rs: RedisServer) -> float:
    assert rs.proc is not None, "redis-server is not running"
    return cpu_seconds(rs.proc.pid)


def pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(np.asarray(xs) * 1000.0, q)), 2) if xs else None


def series_count(port: int) -> int:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def buffer_config(tmp: Path, redis_url: str, port: int, mport: int, args) -> Path:  # noqa: ANN001
    cfg = tmp / "buffer.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "experiment_name": "scale",
                "trial_name": f"n{args.replicas}-e{args.eta}",
                "cluster": {"fileroot": str(tmp)},
                "actor": {"kl_ctl": 0.0},
                "rollout": {
                    "max_head_offpolicyness": args.eta,
                    "consumer_batch_size": args.batch_groups
                    or min(256, max(4, args.replicas // 4)),
                    "max_concurrent_rollouts": args.replicas,
                },
                "buffer": {
                    "redis_url": redis_url,
                    "max_stored_groups": 1_000_000,
                    "max_stored_bytes": 8 << 30,
                    "reservation_timeout_s": 10.0,
                    "retry_after_ms": 200,
                },
                "services": {"buffer": {"port": port, "metrics_port": mport}, "auth_token": None},
            }
        )
    )
    return cfg


async def run_point(args: argparse.Namespace) -> dict:
    batch = args.batch_groups or min(256, max(4, args.replicas // 4))
    model = FleetModel(batch_groups=batch, time_scale=args.time_scale, token_scale=args.token_scale)
    wall = args.duration / model.time_scale
    with tempfile.TemporaryDirectory() as tmp_, RedisServer(dir=Path(tmp_) / "redis") as rs:
        tmp = Path(tmp_)
        port, mport = free_port(), free_port()
        cfg = buffer_config(tmp, rs.url, port, mport, args)
        cmd = [
            sys.executable,
            "-m",
            "services.buffer",
            "--log-level",
            "ERROR",
            "--config",
            str(cfg),
        ]
        buf = subprocess.Popen(cmd, cwd=ROOT)
        buffer_cpu = 0.0
        address = f"127.0.0.1:{port}"
        try:
            await wait_for_health(address, timeout=60)
            fleet = Fleet(args, address, model)
            redis_cpu0 = redis_cpu_seconds(rs)
            tasks = [asyncio.create_task(fleet.replica(i)) for i in range(args.replicas)]
            trainer = asyncio.create_task(fleet.trainer())
            t0 = time.monotonic()
            faults: list[str] = []
            await asyncio.sleep(wall * 0.3)
            healed: list[asyncio.Task[None]] = []

            async def back_up(since: float) -> None:
                await wait_for_health(address, timeout=120)
                fleet.outages.append((since, time.monotonic()))

            if args.faults:
                since = time.monotonic()
                buffer_cpu += cpu_seconds(buf.pid)
                buf.kill()
                buf.wait()
                buf = subprocess.Popen(cmd, cwd=ROOT)
                healed.append(asyncio.create_task(back_up(since)))
                faults.append(f"buffer killed at {since - t0:.1f}s")
            await asyncio.sleep(wall * 0.3)
            if args.faults:
                since = time.monotonic()
                redis_cpu0 -= redis_cpu_seconds(rs)
                await asyncio.to_thread(rs.restart)
                redis_cpu0 += redis_cpu_seconds(rs)
                healed.append(asyncio.create_task(back_up(since)))
                faults.append(f"redis restarted at {since - t0:.1f}s")
            await asyncio.sleep(wall * 0.4)
            series = series_count(mport)
            fleet.stop.set()
            elapsed = time.monotonic() - t0
            await asyncio.wait([*tasks, trainer], timeout=120)
            await asyncio.gather(*healed)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            client = fleet.clients[0]
            stats = await client.stats()
            import redis as redis_sync

            mem = redis_sync.Redis.from_url(rs.url).info("memory")["used_memory"]
            buffer_cpu += cpu_seconds(buf.pid)
            redis_cpu = redis_cpu_seconds(rs) - redis_cpu0
            for c in fleet.clients:
                await c.close()
        finally:
            buf.terminate()
            buf.wait(timeout=30)
    real = elapsed * model.time_scale
    dropped = sum(stats.dropped_total.values())
    balance = stats.acked_total + dropped + stats.pending + stats.in_flight
    fan = fleet.fanout_seconds()
    # The trainer's wall time from its first batch to the end: the share it spent waiting.
    trained = max(t0 + elapsed - (fleet.first_batch_at or t0 + elapsed), 1e-9)
    k = max(stats.put_total, 1) / 1000.0
    return {
        "bench": "scale",
        "replicas": args.replicas,
        "eta": args.eta,
        "batch_groups": model.batch_groups,
        "time_scale": model.time_scale,
        "token_scale": model.token_scale,
        "wall_s": round(elapsed, 1),
        "simulated_s": round(real, 1),
        "mean_group_s": round(fleet.mean_group_s, 2),
        "offered_groups_per_s": round(fleet.offered_groups / real, 3),
        "admitted_groups_per_s": round(fleet.admitted_groups / real, 3),
        "offered_tokens_per_s": round(fleet.offered_tokens / real, 1),
        "admitted_tokens_per_s": round(fleet.admitted_tokens / real, 1),
        "wire_groups_per_s": round(fleet.offered_groups / elapsed, 1),
        "put_results": dict(fleet.results),
        "versions": fleet.version_seen,
        "trainer_starved_fraction": round(fleet.starved_seconds() / trained, 4),
        "trainer_starved_fraction_outside_outages": round(
            fleet.starved_seconds(outside_outages=True) / trained, 4
        ),
        "outage_wall_s": [round(b - a, 2) for a, b in fleet.outages],
        "trainer_steps": fleet.version_seen,
        **{
            f"{name}_p{q}_ms": pct(fleet.lat[name], q)
            for name in ("reserve", "put", "claim", "ack", "set_version")
            for q in (50, 99)
        },
        "calls_per_wall_s": {k: round(len(v) / elapsed, 1) for k, v in fleet.lat.items()},
        "reserve_calls_per_group": round(
            len(fleet.lat["reserve"]) / max(fleet.offered_groups, 1), 2
        ),
        "slots": args.slots,
        "reserve_wait_ms": args.reserve_wait_ms,
        "reserve_reissued_on_new_weights": fleet.reissued,
        "buffer_cpu_s_per_1000_groups": round(buffer_cpu / k, 3),
        "redis_cpu_s_per_1000_groups": round(redis_cpu / k, 3),
        "redis_used_memory_bytes": int(mem),
        "redis_memory_bytes_per_1000_groups": int(mem / k),
        "put_total": stats.put_total,
        "acked": stats.acked_total,
        "dropped": dict(stats.dropped_total),
        "pending": stats.pending,
        "in_flight": stats.in_flight,
        "invariant_holds": bool(stats.invariant_ok and stats.put_total == balance),
        "staleness_violations": fleet.staleness_violations,
        "max_served_staleness": fleet.max_staleness,
        "setversion_to_all_replicas_s_p50": (
            round(float(np.median(fan)) * model.time_scale, 1) if fan else None
        ),
        "setversion_to_all_replicas_s_max": round(max(fan) * model.time_scale, 1) if fan else None,
        "replica_deaths": fleet.deaths,
        "replica_rpc_errors": dict(fleet.errors),
        "faults": faults,
        "buffer_metrics_series": series,
    }


def plot(lines_path: str, out: str) -> None:
    """Draw the sweep's curves (JSON lines from `lines_path`) against N, one line per eta."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [json.loads(x) for x in Path(lines_path).read_text().splitlines() if x.strip()]
    panels = [
        ("admitted_groups_per_s", "groups/s admitted (real time)"),
        ("trainer_starved_fraction", "trainer starved (share of its time after batch 1)"),
        ("reserve_calls_per_group", "Reserve calls per group offered"),
        ("put_p50_ms", "PutMany p50 (ms)"),
        ("buffer_cpu_s_per_1000_groups", "buffer CPU s / 1,000 groups"),
        ("setversion_to_all_replicas_s_p50", "SetVersion to every replica, p50 (s)"),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))

    def arm(p: dict) -> str:  # polling replicas (the sweep before the waiting Reserve)
        return f"eta={p['eta']}" + ("" if p.get("reserve_wait_ms", 0) else ", polling")

    for ax, (key, title) in zip(axes.flat, panels, strict=True):
        for name in sorted({arm(p) for p in points}):
            xs = [(p["replicas"], p[key]) for p in points if arm(p) == name and p[key] is not None]
            xs.sort()
            ax.plot([x for x, _ in xs], [y for _, y in xs], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--replicas", type=lambda s: [int(x) for x in s.split(",")], default=[8, 64]
    )
    parser.add_argument("--eta", type=lambda s: [int(x) for x in s.split(",")], default=[2])
    parser.add_argument("--duration", type=float, default=600.0, help="simulated seconds")
    parser.add_argument("--time-scale", type=float, default=20.0)
    parser.add_argument("--token-scale", type=int, default=32)
    parser.add_argument(
        "--batch-groups", type=int, default=0, help="groups a step (0: N/4 in [4, 256])"
    )
    parser.add_argument("--replicas-per-channel", type=int, default=64)
    parser.add_argument(
        "--slots", type=int, default=1, help="groups one replica runs at once (1: one GPU's group)"
    )
    parser.add_argument(
        "--reserve-wait-ms",
        type=int,
        default=RESERVE_WAIT_MS,
        help="how long the buffer may hold a Reserve (0: the old polling replicas)",
    )
    parser.add_argument(
        "--no-reissue",
        dest="reissue",
        action="store_false",
        help="a replica that takes new weights during a held Reserve waits the hold out",
    )
    parser.add_argument("--die-p", type=float, default=0.01)
    parser.add_argument("--no-faults", dest="faults", action="store_false")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--plot", nargs=2, metavar=("LINES", "PNG"), help="draw LINES (JSON lines) to PNG, exit"
    )
    args = parser.parse_args(argv)
    if args.plot:
        plot(*args.plot)
        return
    for n in args.replicas:
        for eta in args.eta:
            point = argparse.Namespace(**{**vars(args), "replicas": n, "eta": eta})
            print(json.dumps(asyncio.run(run_point(point))), flush=True)


if __name__ == "__main__":
    main()
