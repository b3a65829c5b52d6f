"""Entry points the `flywheel` CLI dispatches to: run, eval, status."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from services.common.config import FlywheelConfig, load_config


def run(
    cfg: FlywheelConfig, config_path: str | None = None, overrides: list[str] | None = None
) -> int:
    from services.launcher.local import run as run_local

    return run_local(cfg, config_path, overrides)


def local_eval_endpoints(cfg: FlywheelConfig) -> None:
    """Reward and the rollout replica of `flywheel eval` run on this machine, whatever the
    config says of where a deployment's services live (the Helm chart's ConfigMap names
    Kubernetes DNS names): loopback, ports picked by `assign_ports`."""
    for ep in (cfg.services.reward, cfg.services.rollout):
        ep.host, ep.port, ep.metrics_port = "127.0.0.1", 0, 0


def eval_main(argv: list[str]) -> int:
    """`flywheel eval --config FILE [--checkpoint DIR] [--data FILE] [overrides]`.

    Starts reward and one rollout replica on the checkpoint, samples the data set once per
    prompt and prints one JSON line with the accuracy. No buffer, no trainer, no staleness.
    """
    from services.common.redis_server import RedisServer  # noqa: F401  (documented dependency)
    from services.launcher import assets
    from services.launcher.evaluation import evaluate, vision_eval_inputs
    from services.launcher.processes import ServiceProcess, wait_until_serving
    from services.rollout.data.datasets import read_rows

    parser = argparse.ArgumentParser(prog="flywheel eval")
    parser.add_argument("--config", required=True)
    parser.add_argument("--checkpoint", help="HF-format model directory to evaluate")
    parser.add_argument("--data", help="JSONL file of prompts (default: valid_dataset.path)")
    parser.add_argument("--n", type=int, default=None, help="evaluate the first N prompts")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if args.checkpoint:
        cfg.actor.path = args.checkpoint
        cfg.tokenizer_path = cfg.tokenizer_path or args.checkpoint
    run_dir = assets.run_dir_of(cfg) / "eval"
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.valid_dataset is None:
        raise SystemExit("flywheel eval: the config has no valid_dataset and --data was not given")
    assets.prepare_data(cfg, run_dir)
    assets.prepare_model(cfg, run_dir)
    local_eval_endpoints(cfg)
    assets.assign_ports(cfg)
    config_path = assets.write_resolved_config(cfg, run_dir)
    run_secrets = assets.RunSecrets.of(cfg)  # handed over through each child's environment
    procs = []
    try:
        for name, module, extra, address in (
            ("reward", "services.reward", [], cfg.services.reward.address),
            (
                "rollout-0",
                "services.rollout",
                ["--replica-index", "0", "--eval-only"],
                cfg.services.rollout.address,
            ),
        ):
            proc = ServiceProcess(
                name,
                [sys.executable, "-m", module, "--config", str(config_path), *extra],
                run_dir / "logs",
                env=run_secrets.environment(module.rpartition(".")[2]),
                drop=assets.SECRET_VARIABLES,
            ).start()
            procs.append(proc)
            wait_until_serving(proc, address, cfg.launcher.startup_timeout)
        data = args.data or cfg.valid_dataset.path
        if not data:
            raise SystemExit("flywheel eval: valid_dataset.path is empty and --data was not given")
        rows = read_rows(data)[: args.n or cfg.launcher.eval.n_prompts]
        result = evaluate(
            cfg.services.rollout.address,
            cfg.services.reward.address,
            rows,
            prompt_key=cfg.valid_dataset.prompt_key,
            answer_key=cfg.valid_dataset.answer_key,
            reward_fn=cfg.reward.fn,
            temperature=cfg.launcher.eval.temperature,
            max_new_tokens=cfg.launcher.eval.max_new_tokens or cfg.gconfig.max_new_tokens,
            auth_token=run_secrets.launcher_token,
            **vision_eval_inputs(cfg, data),
        )
        print(json.dumps({"checkpoint": cfg.actor.path, "data": data, **result.__dict__}))
        return 0
    finally:
        for proc in reversed(procs):
            proc.stop()


def status_main(argv: list[str]) -> int:
    """`flywheel status [RUN_DIR | --config FILE]`: the run's state (completed, running,
    stopped, failed) and what each service of a running job says. Exit 0 for a completed run
    or one whose services all answer SERVING, 1 otherwise, 2 when there is no run there."""
    from google.protobuf.json_format import MessageToDict
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from flywheel_proto.v1 import (
        buffer_pb2_grpc,
        common_pb2,
        rollout_pb2_grpc,
        trainer_pb2_grpc,
    )
    from services.common.grpc_client import make_sync_channel
    from services.launcher import assets

    parser = argparse.ArgumentParser(prog="flywheel status")
    parser.add_argument("run_dir", nargs="?")
    parser.add_argument("--config")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.run_dir:
        run_dir = Path(args.run_dir)
    else:
        run_dir = assets.run_dir_of(load_config(args.config, args.overrides))
    from services.launcher.status import run_summary

    info_path = run_dir / "services.json"
    if not info_path.exists():
        run = run_summary(run_dir, args.config, args.overrides, trainer_running=False)
        if run["state"] == "not started":
            print(f"no running job in {run_dir} (no services.json)", file=sys.stderr)
            return 2
        print(json.dumps({"run": run, "restarts": _restarts(run_dir)}, indent=1))
        return 0 if run["state"] == "completed" else 1
    info = json.loads(info_path.read_text())
    import os

    token = os.environ.get("FLYWHEEL_TOKEN")
    report: dict[str, dict[str, object]] = {}
    targets = [
        ("buffer", info["buffer"]["grpc"]),
        ("reward", info["reward"]["grpc"]),
        ("trainer", info["trainer"]["grpc"]),
    ]
    targets += [(f"rollout-{i}", ep["grpc"]) for i, ep in enumerate(info["rollout"])]
    for name, address in targets:
        ch = make_sync_channel(address, auth_token=token)
        entry: dict[str, object] = {"address": address}
        try:
            health = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=3
            )
            entry["health"] = health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)
            if name == "buffer":
                msg = buffer_pb2_grpc.BufferServiceStub(ch).Stats(common_pb2.Empty(), timeout=3)
            elif name == "trainer":
                msg = trainer_pb2_grpc.TrainerServiceStub(ch).Status(common_pb2.Empty(), timeout=3)
            elif name.startswith("rollout"):
                msg = rollout_pb2_grpc.RolloutServiceStub(ch).Stats(common_pb2.Empty(), timeout=3)
            else:
                msg = None
            if msg is not None:
                entry["stats"] = MessageToDict(msg, preserving_proto_field_name=True)
        except Exception as err:  # noqa: BLE001 - a down service is a status, not a crash
            entry["health"] = "UNREACHABLE"
            details = getattr(err, "details", None)
            entry["error"] = details() if callable(details) else str(err)
        finally:
            ch.close()
        report[name] = entry
    trainer_up = report["trainer"].get("health") != "UNREACHABLE"
    run = run_summary(run_dir, args.config, args.overrides, trainer_running=trainer_up)
    extra: dict[str, object] = {"restarts": _restarts(run_dir)}
    starvation = run_dir / "starvation.json"
    if starvation.is_file():  # the launcher's watchdog: the trainer waits for data now
        try:
            verdict = json.loads(starvation.read_text())
            extra["starvation"] = {k: verdict.get(k) for k in ("stage", "detail", "numbers")}
        except json.JSONDecodeError:  # being written
            pass
    print(json.dumps({"run": run, **extra, **report}, indent=1))
    if run["state"] == "completed":
        return 0
    return 0 if all(e.get("health") == "SERVING" for e in report.values()) else 1


def _restarts(run_dir: Path, last: int = 5) -> dict[str, object]:
    """What the launcher's supervision did so far (`restarts.jsonl`): restarts per service
    and the last few, each with how the process ended and how long it was down."""
    path = run_dir / "restarts.jsonl"
    records = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written
                continue
    per_service: dict[str, int] = {}
    for r in records:
        per_service[r["service"]] = per_service.get(r["service"], 0) + 1
    return {"total": len(records), "per_service": per_service, "last": records[-last:]}
