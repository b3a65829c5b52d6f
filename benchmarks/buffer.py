"""Buffer throughput and latency through gRPC, beside raw Redis moving the same bytes.

One run starts a real `redis-server` (AOF everysec, as deployed) and the buffer as its own
process (`python -m services.buffer`), then measures from this client process, in
`--rounds` rounds. Each round moves `--groups` groups through both sides at every level of
`--concurrency` (requests in flight, the same on both sides), alternating between the sides
every `--chunk` groups so that both meet the same machine load: Redis rewrites its AOF in
the background every few hundred groups here, for longer than a whole phase of a round, so
phases run back to back would let it land on one side only (measured: raw writes swung
1,000-5,500 groups/s from round to round that way, the ratio 0.16-0.58). Per chunk:

- Put: the chunk's groups of `--samples` x `--tokens` tokens, serialized once before the
  phase like the raw side's, sent as PutMany calls of `--put-batch` groups (the raw side's
  pipeline size), that many calls in flight;
- raw write: redis-py pipelines SETting the same serialized group bytes, `--batch` a
  pipeline, one thread (with its own connection) per request in flight;
- Claim+Ack: batches of `--batch` groups claimed, then acknowledged, as a trainer does, by
  that many consumers;
- raw read: redis-py pipelines GETting and DELeting them, as the writes;
- no-op put and claim+ack: the same client calls against a gRPC server that only answers
  (`--noop-server`, its own process, malloc tuned as the buffer's): what the gRPC hop alone
  costs in Python;
- uncached put and claim+ack: a second buffer process, identical but for
  `buffer.read_cache_bytes: 0`, so its claims read every payload back out of Redis
  (`throughput_ratio_read_cache_off`): what the read cache is worth, in the same run.

Throughput is what a system sustains, so each phase counts at the concurrency where it is
fastest (the buffer gains from requests in flight; redis-py does not, its parsing holds the
GIL). `throughput_ratio_vs_raw_redis` is the median over rounds of the round-trip rate
(put, then claim and ack: 1 / (1/put + 1/claim)) divided by raw Redis's (write, then read).
`ratio_ceiling_serial` is the ratio a buffer would reach if it cost nothing but its gRPC
hop (the no-op round trip) and then the raw Redis work, one after the other: on a machine
with fewer cores than processes in the path that is close to an upper bound for a buffer
that reads its payloads from Redis (the uncached one); the default buffer's claims skip that
read when its cache holds the bytes, as here, where every group is claimed through the
buffer it was put through, seconds later, as in a deployment with one buffer. Latencies are
at the lowest concurrency. Because shared machines are noisy, the CPU time each path costs
per group (client, buffer, redis-server and no-op server processes, from /proc) is reported
too; it does not depend on other load. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import redis
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.buffer.client import BufferClient  # noqa: E402
from services.common.codec import group_to_proto  # noqa: E402
from services.common.grpc_client import wait_for_health  # noqa: E402
from services.common.redis_server import RedisServer, free_port  # noqa: E402
from services.core.types import Trajectory, TrajectoryGroup  # noqa: E402


def make_group(gid: str, samples: int, tokens: int, rng: np.random.Generator) -> TrajectoryGroup:
    prompt = tokens // 4
    trajectories = [
        Trajectory(
            trajectory_id=f"t{i}",
            group_id=gid,
            input_ids=rng.integers(0, 150_000, tokens),
            loss_mask=np.r_[np.zeros(prompt), np.ones(tokens - prompt)].astype(np.int8),
            logprobs=np.r_[np.zeros(prompt), -rng.random(tokens - prompt)].astype(np.float32),
            versions=np.r_[np.full(prompt, -1), np.zeros(tokens - prompt)].astype(np.int64),
            reward=float(i % 2),
            no_eos=False,
            prompt_len=prompt,
        )
        for i in range(samples)
    ]
    return TrajectoryGroup(group_id=gid, trajectories=trajectories)


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1000.0, q))


def cpu_seconds(pids: list[int]) -> np.ndarray:
    """User + system CPU of this process and of each of `pids` (all their threads), from
    /proc: [this, *pids]."""
    tick = os.sysconf("SC_CLK_TCK")
    out = [sum(os.times()[:2])]
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        out.append((int(fields[11]) + int(fields[12])) / tick)  # utime, stime
    return np.asarray(out)


async def buffer_put(
    client: BufferClient, groups: list[bytes], concurrency: int, batch: int
) -> list[float]:
    """`concurrency` calls in flight, each a PutMany of `batch` serialized groups (a Put
    when 1)."""
    queue = [groups[i : i + batch] for i in range(0, len(groups), batch)]
    latencies: list[float] = []

    async def putter() -> None:
        while queue:
            msgs = queue.pop()
            t0 = time.perf_counter()
            rs = [await client.put(msgs[0])] if len(msgs) == 1 else await client.put_many(msgs)
            latencies.append(time.perf_counter() - t0)
            assert all(r.result == "admitted" for r in rs), rs

    await asyncio.gather(*(putter() for _ in range(concurrency)))
    return latencies


async def buffer_claim_ack(
    client: BufferClient, n: int, concurrency: int, batch: int
) -> list[float]:
    """`concurrency` consumers (own consumer ids), each claiming `batch` groups and then
    acknowledging them, until `n` are done."""
    latencies: list[float] = []
    left = n

    async def consumer(cid: str) -> None:
        nonlocal left
        while left > 0:
            take = min(batch, left)
            left -= take
            t0 = time.perf_counter()
            out = await client.claim(take, consumer_id=cid)
            assert len(out) == take, (len(out), take)
            await client.ack(out.group_ids)
            latencies.append(time.perf_counter() - t0)

    await asyncio.gather(*(consumer(f"bench-{i}") for i in range(concurrency)))
    return latencies


def raw_write(r: redis.Redis, keys: list[str], payloads: list[bytes], batch: int) -> None:
    for i in range(0, len(keys), batch):
        pipe = r.pipeline(transaction=False)
        for k, p in zip(keys[i : i + batch], payloads[i : i + batch], strict=True):
            pipe.set(k, p)
        pipe.execute()


def raw_read(r: redis.Redis, keys: list[str], batch: int) -> None:
    for i in range(0, len(keys), batch):
        pipe = r.pipeline(transaction=False)
        for k in keys[i : i + batch]:
            pipe.get(k)
            pipe.delete(k)
        res = pipe.execute()
        assert all(x is not None for x in res[0::2])


def in_threads(fn, r: redis.Redis, keys: list[str], *rest, concurrency: int, batch: int) -> None:  # noqa: ANN001
    """`fn` over `concurrency` threads, each on its own connection with its share of the
    keys (and of the payloads in `rest`), pipelines of `batch` as before."""
    bounds = [len(keys) * i // concurrency for i in range(concurrency + 1)]
    shares = [slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
    with ThreadPoolExecutor(len(shares)) as pool:
        jobs = [pool.submit(fn, r, keys[s], *(x[s] for x in rest), batch) for s in shares]
        for job in jobs:
            job.result()


def run_noop_server(port: int, samples: int, tokens: int) -> None:
    """A BufferService that does nothing: puts are admitted unseen, claims get ready bytes."""
    import grpc

    from flywheel_proto.v1 import buffer_pb2
    from services.buffer.wire import encode_claim_response
    from services.common.grpc_server import ServiceServer
    from services.common.malloc_tuning import tune_for_large_messages

    tune_for_large_messages()  # as the buffer does by default (buffer.tune_malloc)

    group = group_to_proto(make_group("noop", samples, tokens, np.random.default_rng(0)))
    payload = group.SerializeToString()
    admitted = buffer_pb2.PutResponse(result=buffer_pb2.ADMISSION_RESULT_ADMITTED)

    async def put_many(request: bytes, context: object) -> bytes:
        n = len(buffer_pb2.PutManyRequest.FromString(request).puts)
        return buffer_pb2.PutManyResponse(results=[admitted] * n).SerializeToString()

    async def claim(request: buffer_pb2.ClaimRequest, context: object) -> bytes:
        return encode_claim_response(1, 0, [payload] * request.n_groups)

    async def ack(request: buffer_pb2.AckRequest, context: object) -> bytes:
        return buffer_pb2.AckResponse(acked=len(request.group_ids)).SerializeToString()

    def handler(fn, parse=None):  # noqa: ANN001, ANN202
        return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=parse)

    async def serve() -> None:
        server = ServiceServer("noop", port=port, service_names=["flywheel.v1.BufferService"])
        handlers = {
            "PutMany": handler(put_many),
            "Claim": handler(claim, buffer_pb2.ClaimRequest.FromString),
            "Ack": handler(ack, buffer_pb2.AckRequest.FromString),
        }
        generic = grpc.method_handlers_generic_handler("flywheel.v1.BufferService", handlers)
        server.server.add_generic_rpc_handlers((generic,))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def raw_client(url: str) -> redis.Redis:
    """redis-py on `url`; the password, when not in the URL, from FLYWHEEL_REDIS_PASSWORD as
    the buffer takes it."""
    password = os.environ.get("FLYWHEEL_REDIS_PASSWORD")
    return redis.Redis.from_url(url, **({"password": password} if password else {}))


def _delete_keys(url: str, tag: str) -> None:
    """Remove this run's keys (raw leftovers, the buffer's state and tombstones) from an
    external Redis."""
    r = raw_client(url)
    for key in r.scan_iter(match=f"*{tag}*", count=1000):
        r.unlink(key)
    r.close()


def round_trip(a: float, b: float) -> float:
    """Groups/s of doing a then b for every group: 1 / (1/a + 1/b)."""
    return 1.0 / (1.0 / a + 1.0 / b)


PHASES = (
    "put",
    "write",
    "claim",
    "read",
    "noop_put",
    "noop_claim",
    "uncached_put",
    "uncached_claim",
)


async def run_rounds(  # noqa: PLR0913
    address: str,
    noop_address: str,
    uncached_address: str,
    redis_url: str,
    pids: list[int],
    base: list,
    args,  # noqa: ANN001
) -> dict:
    """Every round, chunk by chunk and at every concurrency level: buffer put, raw write,
    buffer claim+ack, raw read, then the same calls against the no-op server, each timed and
    costed. Returns per (phase, level) the groups/s and CPU per group of every round."""
    keys_ = [(name, c) for c in args.concurrency for name in PHASES]
    rates: dict[tuple[str, int], list[float]] = {k: [] for k in keys_}
    cpu: dict[tuple[str, int], list[np.ndarray]] = {k: [] for k in keys_}
    put_lat: list[float] = []
    claim_lat: list[float] = []
    raw = raw_client(redis_url)
    n = args.groups
    async with (
        BufferClient(address, timeout=60) as client,
        BufferClient(noop_address, timeout=60) as noop,
        BufferClient(uncached_address, timeout=60) as uncached,
    ):
        warm = [_renamed(base[0], "warm").SerializeToString()]
        for buffer in (client, uncached):  # channels and scripts warm
            await buffer_put(buffer, warm, 1, 1)
            await buffer_claim_ack(buffer, 1, 1, 1)
        for rnd in range(args.rounds):
            seconds = dict.fromkeys(keys_, 0.0)
            cpu_used = {k: np.zeros(len(pids) + 1) for k in keys_}
            for c in args.concurrency:
                tag = f"{rnd}-{c}"
                payloads = [
                    _renamed(base[i % len(base)], f"r{tag}-{i}").SerializeToString()
                    for i in range(n)
                ]
                keys = [f"{args.tag}:raw:{tag}:{i}" for i in range(n)]
                threads = {"concurrency": c, "batch": args.batch}
                for lo in range(0, n, args.chunk):
                    part = slice(lo, min(n, lo + args.chunk))
                    m = part.stop - part.start
                    phases = {
                        "put": partial(buffer_put, client, payloads[part], c, args.put_batch),
                        "write": partial(
                            asyncio.to_thread,
                            in_threads,
                            raw_write,
                            raw,
                            keys[part],
                            payloads[part],
                            **threads,
                        ),
                        "claim": partial(buffer_claim_ack, client, m, c, args.batch),
                        "read": partial(
                            asyncio.to_thread, in_threads, raw_read, raw, keys[part], **threads
                        ),
                        "noop_put": partial(buffer_put, noop, payloads[part], c, args.put_batch),
                        "noop_claim": partial(buffer_claim_ack, noop, m, c, args.batch),
                        "uncached_put": partial(
                            buffer_put, uncached, payloads[part], c, args.put_batch
                        ),
                        "uncached_claim": partial(buffer_claim_ack, uncached, m, c, args.batch),
                    }
                    for name, phase in phases.items():
                        c0, t0 = cpu_seconds(pids), time.perf_counter()
                        lat = await phase()
                        seconds[name, c] += time.perf_counter() - t0
                        cpu_used[name, c] += cpu_seconds(pids) - c0
                        if c == args.concurrency[0] and name == "put":
                            put_lat += lat
                        elif c == args.concurrency[0] and name == "claim":
                            claim_lat += lat
            for k in keys_:
                rates[k].append(n / seconds[k])
                cpu[k].append(cpu_used[k] / n)
        for buffer in (client, uncached):
            stats = await buffer.stats()
            assert stats.invariant_ok and stats.pending == stats.in_flight == 0
            assert stats.acked_total == args.rounds * n * len(args.concurrency) + 1
    raw.close()
    return {"rates": rates, "cpu": cpu, "put_lat": put_lat, "claim_lat": claim_lat}


def summarize(res: dict, args, base: list, *, with_redis: bool) -> dict:  # noqa: ANN001
    """The JSON line. Each side is taken at the concurrency where it is fastest, round by
    round (throughput is what a system sustains, and the raw side is not always helped by
    more threads: redis-py's parsing holds the GIL)."""
    med = statistics.median
    r, c = res["rates"], res["cpu"]
    levels = args.concurrency
    rounds = range(args.rounds)

    def best(phase: str, i: int) -> float:
        return max(r[phase, lv][i] for lv in levels)

    def ratios_of(put: str, claim: str) -> list[float]:
        return [
            round_trip(best(put, i), best(claim, i)) / round_trip(best("write", i), best("read", i))
            for i in rounds
        ]

    ratios = ratios_of("put", "claim")
    uncached = ratios_of("uncached_put", "uncached_claim")
    ceilings = [
        round_trip(round_trip(best("noop_put", i), best("noop_claim", i)), rt) / rt
        for i in rounds
        for rt in [round_trip(best("write", i), best("read", i))]
    ]
    top = {p: max(levels, key=lambda lv, p=p: med(r[p, lv])) for p in PHASES}
    rate = {p: med(r[p, top[p]]) for p in PHASES}
    # The median round's CPU per group of each process, at each phase's best level.
    split = {p: np.median(np.asarray(c[p, top[p]]), axis=0) * 1000 for p in PHASES}
    buffer_cpu = float(split["put"].sum() + split["claim"].sum())
    raw_cpu = float(split["write"].sum() + split["read"].sum())
    return {
        "bench": "buffer",
        "groups_per_round": args.groups,
        "rounds": args.rounds,
        "chunk": args.chunk,
        "group_shape": f"{args.samples}x{args.tokens}",
        "group_bytes": int(statistics.mean(m.ByteSize() for m in base)),
        "concurrency_levels": levels,
        "best_concurrency": top,
        "put_batch": args.put_batch,
        "batch": args.batch,
        "put_groups_per_s": round(rate["put"], 1),
        "claim_ack_groups_per_s": round(rate["claim"], 1),
        "raw_write_groups_per_s": round(rate["write"], 1),
        "raw_read_groups_per_s": round(rate["read"], 1),
        f"put_p50_ms_at_{levels[0]}": round(pct(res["put_lat"], 50), 2),
        f"put_p99_ms_at_{levels[0]}": round(pct(res["put_lat"], 99), 2),
        f"claim_ack_p50_ms_at_{levels[0]}": round(pct(res["claim_lat"], 50), 2),
        f"claim_ack_p99_ms_at_{levels[0]}": round(pct(res["claim_lat"], 99), 2),
        "buffer_round_trip_groups_per_s": round(round_trip(rate["put"], rate["claim"]), 1),
        "raw_round_trip_groups_per_s": round(round_trip(rate["write"], rate["read"]), 1),
        "throughput_ratio_vs_raw_redis": round(med(ratios), 3),
        "throughput_ratio_per_round": [round(x, 3) for x in ratios],
        "throughput_ratio_read_cache_off": round(med(uncached), 3),
        "uncached_put_groups_per_s": round(rate["uncached_put"], 1),
        "uncached_claim_ack_groups_per_s": round(rate["uncached_claim"], 1),
        "groups_per_s_by_concurrency": {
            str(lv): {p: round(med(r[p, lv]), 1) for p in PHASES} for lv in levels
        },
        "noop_round_trip_groups_per_s": round(round_trip(rate["noop_put"], rate["noop_claim"]), 1),
        "ratio_ceiling_serial": round(med(ceilings), 3),
        "buffer_cpu_ms_per_group": round(buffer_cpu, 3),
        "raw_cpu_ms_per_group": round(raw_cpu, 3),
        "cpu_ratio_raw_vs_buffer": round(raw_cpu / buffer_cpu, 3),
        "cpu_ms_per_group": {
            "processes": [
                "client",
                "buffer",
                *(["redis-server"] if with_redis else []),
                "noop",
                "buffer_read_cache_off",
            ],
            **{p: [round(float(x), 3) for x in v] for p, v in split.items()},
        },
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def distinct_free_ports(n: int) -> list[int]:
    """Ports for servers started at once: none may draw another's (it has not bound yet)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def write_buffer_config(  # noqa: PLR0913
    tmp: Path,
    name: str,
    redis_url: str,
    port: int,
    args: argparse.Namespace,
    read_cache_bytes: int | None,
) -> Path:
    """A buffer config on the embedded defaults, but for its limits (a round must fit) and,
    if given, its read cache."""
    buffer: dict = {
        "redis_url": redis_url,
        "max_stored_groups": args.groups + 10,
        "max_stored_bytes": 4 << 30,
    }
    if read_cache_bytes is not None:
        buffer["read_cache_bytes"] = read_cache_bytes
    cfg = tmp / f"buffer{name}.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "experiment_name": "bench",
                "trial_name": args.tag + name,
                "cluster": {"fileroot": str(tmp)},
                "actor": {"kl_ctl": 0.0},
                "rollout": {"max_head_offpolicyness": 1000, "consumer_batch_size": args.batch},
                "buffer": buffer,
                "services": {"buffer": {"port": port}, "auth_token": None},
            }
        )
    )
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--groups", type=int, default=256, help="groups per round")
    parser.add_argument(
        "--rounds",
        type=int,
        default=15,
        help="rounds (the ratio is their median; single rounds swing 0.35-0.75 on 2 cores)",
    )
    parser.add_argument(
        "--chunk", type=int, default=64, help="groups per side before switching to the other"
    )
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8, help="groups per claim / per pipeline")
    parser.add_argument(
        "--concurrency",
        type=lambda x: sorted({int(v) for v in x.split(",")}),
        default=[1, 2, 4],
        help="comma-separated levels of requests in flight, the same on every side: PutMany "
        "calls, claiming consumers (own ids), raw pipelines (threads, a connection each)",
    )
    parser.add_argument(
        "--put-batch", type=int, default=8, help="groups per PutMany call (1: plain Put)"
    )
    parser.add_argument(
        "--redis-url",
        help="an external Redis instead of a local redis-server (password in the URL or in "
        "FLYWHEEL_REDIS_PASSWORD); the run uses its own keys and deletes them at the end",
    )
    args = parser.parse_args()
    args.tag = f"bench-{uuid.uuid4().hex[:12]}"

    rng = np.random.default_rng(0)
    # Encoded once, as raw Redis gets its bytes ready-made: both sides move the same bytes.
    base = [group_to_proto(make_group("", args.samples, args.tokens, rng)) for _ in range(16)]
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        if args.redis_url:  # external: its CPU is not ours to read; our keys go at the end
            redis_url, redis_pids = args.redis_url, []
            stack.callback(_delete_keys, redis_url, args.tag)
        else:
            rs = stack.enter_context(RedisServer(dir=Path(tmp) / "redis"))
            assert rs.proc is not None
            redis_url, redis_pids = rs.url, [rs.proc.pid]
        port, uncached_port, noop_port = distinct_free_ports(3)
        # The second buffer differs only in its read cache: what the cache is worth.
        buffers = [
            subprocess.Popen(
                [sys.executable, "-m", "services.buffer", "--log-level", "WARNING", "--config"]
                + [str(write_buffer_config(Path(tmp), name, redis_url, bport, args, cache))],
                cwd=ROOT,
            )
            for name, bport, cache in (("", port, None), ("-uncached", uncached_port, 0))
        ]
        shape = [str(args.samples), str(args.tokens)]
        noop = subprocess.Popen([sys.executable, __file__, "--noop-server", str(noop_port), *shape])
        addresses = [f"127.0.0.1:{p}" for p in (port, noop_port, uncached_port)]
        try:
            for address in addresses:
                asyncio.run(wait_for_health(address, timeout=60))
            res = asyncio.run(
                run_rounds(
                    *addresses,
                    redis_url,
                    [buffers[0].pid, *redis_pids, noop.pid, buffers[1].pid],
                    base,
                    args,
                )
            )
        finally:
            for p in (*buffers, noop):
                p.terminate()
                p.wait(timeout=30)

    line = summarize(res, args, base, with_redis=bool(redis_pids))
    print(json.dumps(line))


def _renamed(msg, group_id: str):  # noqa: ANN001, ANN202 - protobuf message in and out
    out = type(msg)()
    out.CopyFrom(msg)
    out.group_id = group_id
    return out


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--noop-server":
        run_noop_server(*(int(x) for x in sys.argv[2:]))
    else:
        main()
