"""Trainer throughput: proximal-logprob methods, data-parallel ranks, weight transports.

Three side-by-side measurements in one run, on a small Qwen2 written locally (hidden 128,
2 layers by default: the demo's shape) and the same synthetic batches for every variant:

1. Decoupled PPO step time with `prox_logp_method=recompute` as a separate forward pass
   (`trainer.reuse_first_minibatch_logp=false`) vs `loglinear` (none), interleaved step by
   step so background load hits both alike; `loglinear_speedup` = median recompute step /
   median loglinear step in process CPU time (one torch thread, so this is the step's own
   cost even when other processes share the cores), `loglinear_speedup_wall` the same in
   wall-clock time. Beside them the default recompute, whose minibatch 0 takes pi_prox from
   its own training forward (with one minibatch no extra pass at all): `reuse_speedup`.
2. Training tokens per second of the real FSDP2 step with 2 ranks (gloo, one thread each)
   vs 1 rank on the same batches: `two_rank_speedup`. On a machine with fewer free cores
   than ranks this is below 1; the figure says what this machine gives.
3. Seconds to make a real rollout replica (`python -m services.rollout --eval-only`, torch
   engine) serve new weights over each transport (disk safetensors, torch.distributed
   broadcast, gRPC chunks), beside a plain `safetensors` save + load of the same tensors.

Prints exactly one JSON line:
    python benchmarks/trainer.py [--groups 16] [--group-size 8] [--steps 6] [--hidden 128]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.core.types import Trajectory, TrajectoryGroup  # noqa: E402


def make_groups(
    model_dir: Path, n_groups: int, group_size: int, seed: int, vocab: int
) -> list[TrajectoryGroup]:
    """Arithmetic-sized prompts (6-8 tokens) and completions (8-24 tokens), behaviour
    logprobs from the model itself, two policy versions behind, mixed rewards."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        prompt = rng.integers(3, vocab, size=int(rng.integers(6, 9)))
        trajs = []
        for k in range(group_size):
            comp = rng.integers(3, vocab, size=int(rng.integers(8, 25)))
            ids = np.concatenate([prompt, comp])
            with torch.no_grad():
                t = torch.as_tensor(ids).unsqueeze(0)
                lp = torch.log_softmax(model(input_ids=t).logits[0, :-1].float(), -1)
                lp = lp.gather(1, t[0, 1:].unsqueeze(1)).squeeze(1).numpy()
            mask = np.zeros(len(ids), dtype=np.int8)
            mask[len(prompt) :] = 1
            versions = np.where(mask == 1, 0, -1)
            trajs.append(
                Trajectory(
                    trajectory_id=f"s{seed}-{g}-{k}",
                    group_id=f"s{seed}-{g}",
                    input_ids=ids,
                    loss_mask=mask,
                    logprobs=np.where(mask == 1, np.concatenate([[0.0], lp]), 0.0),
                    versions=versions,
                    reward=float(rng.random() < 0.5),
                    no_eos=False,
                    prompt_len=len(prompt),
                )
            )
        groups.append(TrajectoryGroup(group_id=f"s{seed}-{g}", trajectories=trajs))
    return groups


def config(model_dir: Path, root: Path, *extra: str):
    from services.common.config.loader import load_config

    return load_config(
        None,
        [
            f"actor.path={model_dir}",
            "actor.dtype=float32",
            "actor.kl_ctl=0",
            "actor.optimizer.lr=5e-4",
            "actor.optimizer.warmup_steps=0",
            "actor.ppo_n_minibatches=1",
            "actor.use_decoupled_loss=true",
            "actor.recompute_logprob=true",
            "actor.adv_norm.mean_level=group",
            "actor.adv_norm.std_level=group",
            "trainer.device=cpu",
            f"cluster.fileroot={root}",
            "total_train_steps=1000",
            "services.auth_token=null",
            *extra,
        ],
    )


# ------------------------------------------------------------------- 1. prox methods


def bench_prox(model_dir: Path, root: Path, batches, steps: int) -> dict:
    from services.trainer.ppo import PPOTrainer

    variants = {
        # The classic separate proximal pass (what loglinear is meant to save).
        "recompute": [
            "actor.prox_logp_method=recompute",
            "trainer.reuse_first_minibatch_logp=false",
        ],
        # The default: minibatch 0 takes pi_prox from its own training forward.
        "recompute_reused": ["actor.prox_logp_method=recompute"],
        "loglinear": ["actor.prox_logp_method=loglinear"],
    }
    trainers = {m: PPOTrainer(config(model_dir, root, *extra)) for m, extra in variants.items()}
    wall: dict[str, list[float]] = {m: [] for m in trainers}
    cpu: dict[str, list[float]] = {m: [] for m in trainers}
    forwards = {m: 0 for m in trainers}
    for i in range(steps + 1):  # step 0 warms up
        for m, t in trainers.items():
            batch = batches[i % len(batches)]
            w0, c0 = time.perf_counter(), time.process_time()
            r = t.train_batch(batch)
            dw, dc = time.perf_counter() - w0, time.process_time() - c0
            if i > 0:
                wall[m].append(dw)
                cpu[m].append(dc)
                forwards[m] += r.prox_forwards
    w = {m: statistics.median(v) for m, v in wall.items()}
    c = {m: statistics.median(v) for m, v in cpu.items()}
    return {
        # One torch thread: the process CPU time is the step's own cost, unaffected by
        # other processes sharing the cores (the wall-clock ratio is reported beside it).
        "recompute_step_cpu_s": round(c["recompute"], 4),
        "loglinear_step_cpu_s": round(c["loglinear"], 4),
        "loglinear_speedup": round(c["recompute"] / c["loglinear"], 3),
        "recompute_step_wall_s": round(w["recompute"], 4),
        "loglinear_step_wall_s": round(w["loglinear"], 4),
        "loglinear_speedup_wall": round(w["recompute"] / w["loglinear"], 3),
        "recompute_reused_step_cpu_s": round(c["recompute_reused"], 4),
        "reuse_speedup": round(c["recompute"] / c["recompute_reused"], 3),
        "prox_forwards": forwards,
    }


# ------------------------------------------------------------------- 2. ranks


def rank_worker(spec_path: str) -> None:
    """One rank of the tokens/s measurement (`--rank-worker SPEC`)."""
    from flywheel_proto.v1 import buffer_pb2
    from services.common.codec import group_from_proto
    from services.trainer.dist import finish, init_distributed
    from services.trainer.ppo import PPOTrainer

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    ctx = init_distributed("cpu")
    trainer = PPOTrainer(config(Path(spec["model"]), Path(spec["root"])), ctx)
    batches = [
        [
            group_from_proto(g)
            for g in buffer_pb2.ClaimResponse.FromString(Path(p).read_bytes()).groups
        ]
        for p in spec["batches"]
    ]
    tokens, seconds = 0, 0.0
    for i in range(spec["steps"] + 1):
        b = batches[i % len(batches)]
        torch.distributed.barrier()
        t0 = time.perf_counter()
        r = trainer.train_batch(b)
        dt = time.perf_counter() - t0
        if i > 0:
            tokens += r.n_tokens
            seconds += dt
    if ctx.rank == 0:
        Path(spec["out"]).write_text(json.dumps({"tokens_per_s": tokens / seconds}))
    finish(0, ctx)


def bench_ranks(model_dir: Path, root: Path, batches, steps: int) -> dict:
    from flywheel_proto.v1 import buffer_pb2
    from services.common.codec import group_to_proto
    from services.trainer.launch import spawn_ranks

    paths = []
    for i, b in enumerate(batches):
        p = root / f"batch{i}.pb"
        p.write_bytes(
            buffer_pb2.ClaimResponse(groups=[group_to_proto(g) for g in b]).SerializeToString()
        )
        paths.append(str(p))
    out = {}
    for world in (1, 2):
        spec = {
            "model": str(model_dir),
            "root": str(root / f"ranks{world}"),
            "batches": paths,
            "steps": steps,
            "out": str(root / f"ranks{world}.json"),
        }
        sp = root / f"ranks{world}-spec.json"
        sp.write_text(json.dumps(spec))
        code = spawn_ranks([], world, command=[sys.executable, __file__, "--rank-worker", str(sp)])
        if code != 0:
            raise RuntimeError(f"{world}-rank run failed with exit code {code}")
        out[world] = json.loads(Path(spec["out"]).read_text())["tokens_per_s"]
    return {
        "tokens_per_s_1rank": round(out[1], 1),
        "tokens_per_s_2rank": round(out[2], 1),
        "two_rank_speedup": round(out[2] / out[1], 3),
    }


# ------------------------------------------------------------------- 3. transports


def wait_serving(address: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace").strip().splitlines()[-1:]
                raise RuntimeError(f"rollout replica exited ({proc.returncode}): {tail}")
            try:
                req = health_pb2.HealthCheckRequest(service="")
                if stub.Check(req, timeout=1.0).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout replica not serving after {timeout:.0f}s")
            time.sleep(0.2)


def bench_transports(model_dir: Path, root: Path, repeats: int) -> dict:
    from safetensors.torch import load_file, save_file

    from services.common.redis_server import free_port
    from services.trainer.io_loop import IOLoop
    from services.trainer.weight_sync import WeightPublisher

    port = free_port()
    cfg = config(
        model_dir,
        root,
        f"services.rollout.port={port}",
        f"services.rollout.metrics_port={free_port()}",
    )
    cfg_path = root / "rollout.yaml"
    import yaml

    cfg_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    log = (root / "rollout.log").open("wb")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.rollout", "--config", str(cfg_path), "--eval-only"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sd = {k: v.detach().clone() for k, v in model.named_parameters()}
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    result: dict = {"weights_mb": round(nbytes / 2**20, 2)}
    # Plain safetensors save + load of the same tensors: the floor of the disk transport.
    plain = []
    for i in range(repeats):
        f = root / f"plain{i}.safetensors"
        t0 = time.perf_counter()
        save_file(sd, str(f))
        load_file(str(f))
        plain.append(time.perf_counter() - t0)
    result["safetensors_save_load_s"] = round(statistics.median(plain), 4)
    io = IOLoop("bench")
    try:
        wait_serving(f"127.0.0.1:{port}", proc, root / "rollout.log", timeout=180)
        seconds: dict[str, float | None] = {}
        version = 0
        for transport in ("disk", "grpc", "distributed"):
            tcfg = cfg.model_copy(
                update={"trainer": cfg.trainer.model_copy(update={"weight_transport": transport})}
            )

            async def run(tcfg=tcfg, transport=transport) -> list[float]:
                pub = WeightPublisher(tcfg, weight_dir=root / f"w-{transport}")
                out = []
                nonlocal version
                try:
                    for _ in range(repeats + 1):  # the first one sets up (e.g. the group)
                        version += 1
                        rep = await pub.publish(sd, version)
                        if rep.failed:
                            raise RuntimeError(f"{transport}: {rep.failed}")
                        out.append(rep.seconds)
                finally:
                    await pub.close()
                return out[1:]

            seconds[transport] = round(statistics.median(io.run(run(), timeout=600)), 4)
        result["weight_broadcast_s"] = seconds
    except Exception as exc:  # noqa: BLE001 - report, keep the other figures
        result["weight_broadcast_s"] = None
        result["weight_broadcast_error"] = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        io.close()
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        rank_worker(args.rank_worker)
        return
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import logging

    logging.disable(logging.WARNING)
    from services.common.tiny_model import vocab_size, write_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        root = Path(tmp)
        model = write_tiny_model(
            root / "model", hidden_size=args.hidden, num_layers=args.layers, num_heads=4
        )
        batches = [
            make_groups(model, args.groups, args.group_size, seed, vocab_size()) for seed in (0, 1)
        ]
        n_tokens = sum(t.num_tokens for g in batches[0] for t in g.trajectories)
        line: dict = {
            "bench": "trainer",
            "model": {"hidden": args.hidden, "layers": args.layers},
            "batch": {"groups": args.groups, "group_size": args.group_size, "tokens": n_tokens},
            "steps": args.steps,
            "threads_per_rank": 1,
            "cpu": platform.processor() or platform.machine(),
            "goal_loglinear_speedup": 1.25,
        }
        line.update(bench_prox(model, root / "prox", batches, args.steps))
        line.update(bench_ranks(model, root, batches, args.steps))
        line.update(bench_transports(model, root, args.repeats))
    print(json.dumps(line))


if __name__ == "__main__":
    main()
