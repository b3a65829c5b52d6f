"""Per-bucket time of the `distributed` weight transport, measured on this machine.

The trainer's rank 0 and R local processes standing in for replicas join one `WeightsGroup`
over gloo (the group `trainer.weight_transport: distributed` builds), and rank 0 sends an
update of `--update-mib` through the transport's own `send_buckets` / `recv_buckets`, each
bucket made of four bf16 tensors. After each update every receiver answers with a one-element
broadcast of its own, so the time counts until the last receiver holds every byte; the
first update of each bucket size is checked bit for bit against the tensors the receiver
derives from the same seed (the answer carries the verdict) and not timed.

Prints one JSON line per (receivers, bucket size): the update's median wall time over
`--repeats`, the per-bucket time (update time / buckets) and the rate each receiver got.
With no arguments: the short run `make bench` makes (1 and 2 receivers, 1 and 16 MiB
buckets, 64 MiB updates).

    python benchmarks/weight_fanout.py --receivers 1,2,4 --bucket-mib 1,4,16,64 --update-mib 256

`--fanout two_level` measures the topology of `trainer.weight_fanout: two_level` instead:
the receivers form nodes of `--replicas-per-node`, rank 0 broadcasts to the first receiver
of each node (its relay) and each relay re-broadcasts every bucket to its node with the
transport's own `relay_buckets`, in groups that meet in one store hosted by rank 0, as the
trainer's do. A member answers its relay, and the relay answers rank 0 once its whole node
has answered, so the time again runs until the last receiver holds every byte.

    python benchmarks/weight_fanout.py --fanout flat,two_level --receivers 4 --bucket-mib 1,16

What it measures is gloo over loopback TCP on CPU cores: memory copies and the kernel's
socket path, shared with the other processes of the machine. It says how the transport's
own overheads (flattening, one collective per bucket, the per-rank cost of a broadcast)
grow with the bucket size and the number of receivers; it does not give NCCL's bandwidth
over NVLink or InfiniBand, where a broadcast is pipelined in chunks along a ring.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.common.redis_server import free_port  # noqa: E402
from services.common.weights.distributed import (  # noqa: E402
    WeightsGroup,
    host_store,
    recv_buckets,
    relay_buckets,
    send_buckets,
)
from services.common.weights.manifest import tensor_specs  # noqa: E402

TENSORS_PER_BUCKET = 4


def update_tensors(bucket_bytes: int, update_bytes: int, seed: int) -> dict[str, torch.Tensor]:
    """An update of `update_bytes` that packs into whole buckets of `bucket_bytes`: four
    bf16 tensors a bucket, values drawn from `seed` (both sides draw the same)."""
    gen = torch.Generator().manual_seed(seed)
    n = max(1, update_bytes // bucket_bytes) * TENSORS_PER_BUCKET
    numel = bucket_bytes // TENSORS_PER_BUCKET // 2
    return {
        f"layer{i:05d}.weight": torch.randn(numel, generator=gen, dtype=torch.bfloat16)
        for i in range(n)
    }


def answer_round(group: WeightsGroup, ok: bool = True) -> bool:
    """Every receiver broadcasts one flag in turn: returns on rank 0 only once each has
    finished receiving, and tells it whether all of them received the right bytes."""
    all_ok = True
    for src in range(1, group.world_size):
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        group.broadcast(flag, src)
        all_ok = all_ok and bool(flag.item())
    return all_ok


def node_layout(receivers: int, per_node: int) -> list[list[int]]:
    """Receivers 1..R in nodes of `per_node` (the last may be smaller); the first of each
    node is its relay."""
    ranks = list(range(1, receivers + 1))
    return [ranks[i : i + per_node] for i in range(0, receivers, per_node)]


def run_sender(args: argparse.Namespace, receivers: int, port: int, fanout: str) -> list[dict]:
    store = host_store(port, 300) if fanout == "two_level" else None
    world = receivers + 1
    if fanout == "two_level":
        world = 1 + len(node_layout(receivers, args.replicas_per_node))
    group = WeightsGroup(
        master_address="127.0.0.1",
        master_port=port,
        rank=0,
        world_size=world,
        backend="gloo",
        timeout_s=300,
        group_name="bench.top" if store is not None else "flywheel_weights",
        store=store,
    )
    out = []
    try:
        for mib in args.bucket_mib:
            bucket = int(mib * (1 << 20))
            tensors = update_tensors(bucket, args.update_mib << 20, seed=mib)
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            buckets = len(tensors) // TENSORS_PER_BUCKET
            send_buckets(group, tensors, bucket)  # checked, untimed: connections warm up
            identical = answer_round(group)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                send_buckets(group, tensors, bucket)
                answer_round(group)
                times.append(time.perf_counter() - t0)
            update_s = statistics.median(times)
            out.append(
                {
                    "bench": "weight_fanout",
                    "transport": "distributed",
                    "fanout": fanout,
                    "backend": "gloo",
                    "receivers": receivers,
                    "nodes": world - 1 if fanout == "two_level" else None,
                    "bucket_bytes": bucket,
                    "buckets_per_update": buckets,
                    "update_bytes": nbytes,
                    "repeats": args.repeats,
                    "update_s_p50": round(update_s, 4),
                    "update_s_min": round(min(times), 4),
                    "per_bucket_ms_p50": round(update_s / buckets * 1000.0, 3),
                    "per_receiver_gb_per_s": round(nbytes / update_s / 1e9, 3),
                    "bit_identical": identical,
                    "loadavg_1m": round(os.getloadavg()[0], 2),
                }
            )
    finally:
        group.close()
    return out


def run_relay(args: argparse.Namespace) -> None:
    """A node's relay: rank `--rank` of rank 0's group, rank 0 of its node's group."""
    top = WeightsGroup(
        master_address="127.0.0.1",
        master_port=args.port,
        rank=args.rank,
        world_size=args.world,
        backend="gloo",
        timeout_s=300,
        group_name="bench.top",
    )
    node = WeightsGroup(
        master_address="127.0.0.1",
        master_port=args.port,
        rank=0,
        world_size=args.node_world,
        backend="gloo",
        timeout_s=300,
        group_name=f"bench.node{args.node}",
        remote_store=True,
    )
    try:
        for mib in args.bucket_mib:
            bucket = int(mib * (1 << 20))
            expected = update_tensors(bucket, args.update_mib << 20, seed=mib)
            specs = tensor_specs(expected)
            relayed = relay_buckets(top, node, specs, bucket)
            ok = relayed.forward_error is None and all(
                torch.equal(relayed.tensors[k].view(torch.int16), v.view(torch.int16))
                for k, v in expected.items()
            )
            del relayed, expected
            answer_round(top, answer_round(node, ok) and ok)
            for _ in range(args.repeats):
                relay_buckets(top, node, specs, bucket)
                answer_round(top, answer_round(node))
    finally:
        node.close()
        top.close()


def run_receiver(args: argparse.Namespace) -> None:
    if args.role == "relay" and args.node_world > 1:
        run_relay(args)
        return
    if args.role == "relay":  # alone on its node: it only receives
        name = "bench.top"
    else:
        name = f"bench.node{args.node}" if args.node >= 0 else "flywheel_weights"
    group = WeightsGroup(
        master_address="127.0.0.1",
        master_port=args.port,
        rank=args.rank,
        world_size=args.world,
        backend="gloo",
        timeout_s=300,
        group_name=name,
    )
    try:
        for mib in args.bucket_mib:
            bucket = int(mib * (1 << 20))
            expected = update_tensors(bucket, args.update_mib << 20, seed=mib)
            specs = tensor_specs(expected)
            got = recv_buckets(group, specs, bucket)
            ok = all(
                torch.equal(got[k].view(torch.int16), v.view(torch.int16))
                for k, v in expected.items()
            )
            del got, expected  # each receiver holds one update at a time
            answer_round(group, ok)
            for _ in range(args.repeats):
                recv_buckets(group, specs, bucket)
                answer_round(group)
    finally:
        group.close()


def receiver_commands(
    args: argparse.Namespace, receivers: int, port: int, fanout: str
) -> list[list[str]]:
    """The command line of each receiver process of one point."""
    common = [
        "--bucket-mib",
        ",".join(map(str, args.bucket_mib)),
        "--update-mib",
        str(args.update_mib),
        "--repeats",
        str(args.repeats),
        "--port",
        str(port),
    ]
    me = [sys.executable, __file__]
    if fanout == "flat":
        world = ["--world", str(receivers + 1)]
        return [
            [*me, "--role", "recv", "--rank", str(r), *world, *common]
            for r in range(1, receivers + 1)
        ]
    nodes = node_layout(receivers, args.replicas_per_node)
    cmds = []
    for k, node in enumerate(nodes):
        at = ["--node", str(k), "--node-world", str(len(node))]
        top = ["--rank", str(k + 1), "--world", str(len(nodes) + 1)]
        cmds.append([*me, "--role", "relay", *top, *at, *common])
        for i in range(1, len(node)):
            member = ["--rank", str(i), "--world", str(len(node))]
            cmds.append([*me, "--role", "recv", *member, *at, *common])
    return cmds


def main(argv: list[str] | None = None) -> None:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--receivers", type=ints, default=[1, 2])
    parser.add_argument("--bucket-mib", type=ints, default=[1, 16])
    parser.add_argument("--update-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--fanout",
        type=lambda s: s.split(","),
        default=["flat"],
        help="flat, two_level or both (comma-separated)",
    )
    parser.add_argument("--replicas-per-node", type=int, default=2)
    parser.add_argument(
        "--role", choices=["send", "recv", "relay"], default="send", help=argparse.SUPPRESS
    )
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--node", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--node-world", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if unknown := set(args.fanout) - {"flat", "two_level"}:
        parser.error(f"--fanout {','.join(sorted(unknown))}: use flat, two_level or both")
    if args.replicas_per_node < 1:
        parser.error("--replicas-per-node must be >= 1")
    torch.set_num_threads(1)
    if args.role != "send":
        run_receiver(args)
        return
    for fanout in args.fanout:
        for receivers in args.receivers:
            port = free_port()
            procs = [
                subprocess.Popen(cmd, cwd=ROOT)
                for cmd in receiver_commands(args, receivers, port, fanout)
            ]
            try:
                for line in run_sender(args, receivers, port, fanout):
                    print(json.dumps(line), flush=True)
            finally:
                for p in procs:
                    if p.wait(timeout=120) != 0:
                        raise SystemExit(f"receiver exited with {p.returncode}")


if __name__ == "__main__":
    main()
