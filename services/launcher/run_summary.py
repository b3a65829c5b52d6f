"""What a finished local run leaves behind: `summary.json`, `learning_curve.png` and the
closing lines on the terminal.

Apart from the supervisor (`local.py`) because it is the run's verdict, not its conduct: it
reads only what the run recorded (step lines, evaluations, scraped metrics, restarts) and the
buffer's final statistics, and checks the invariants a correct run keeps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.common.config import FlywheelConfig
from services.launcher.report import (
    check_invariants,
    flywheel_series,
    ledger_summary,
    write_learning_curve,
)
from services.launcher.restarts import say
from services.trainer.paths import RunPaths


def buffer_stats(address: str, auth_token: str | None) -> dict[str, Any]:
    """The buffer's `Stats`, as JSON field names and values."""
    from google.protobuf.json_format import MessageToDict

    from flywheel_proto.v1 import buffer_pb2_grpc, common_pb2
    from services.common.grpc_client import make_sync_channel

    ch = make_sync_channel(address, auth_token=auth_token)
    try:
        stats = buffer_pb2_grpc.BufferServiceStub(ch).Stats(common_pb2.Empty(), timeout=10)
        return MessageToDict(
            stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
    finally:
        ch.close()


def tool_rates(evals: list[dict[str, Any]]) -> dict[str, Any]:
    """An agent run's first and last held-out tool-call and tool-success rates (the
    evaluations of `agent_eval.py` carry them); nothing for other runs."""
    if not evals or "tool_call_rate" not in evals[0]:
        return {}
    return {
        f"{when}_{name}": evals[i].get(name)
        for when, i in (("initial", 0), ("final", -1))
        for name in ("tool_call_rate", "tool_success_rate")
    }


def write(
    cfg: FlywheelConfig,
    run_dir: Path,
    *,
    records: list[dict[str, Any]],
    evals: list[dict[str, Any]],
    scraped: dict[str, set[str]],
    trainer_paths: RunPaths,
    buffer_stats: dict[str, Any],
    restarts: list[dict[str, Any]],
    steps: int,
    wall_seconds: float,
) -> dict[str, Any]:
    """Check the run's invariants, write `summary.json` and the learning curve into
    `run_dir`, say the verdict; returns the summary. `scraped` gains the trainer's series
    from its textfile when no scrape caught them."""
    eta = cfg.rollout.max_head_offpolicyness
    from_textfile = []
    textfile = trainer_paths.metrics_textfile
    if not scraped.get("trainer") and textfile.is_file():
        # A trainer quick enough to finish between two scrapes leaves its series here.
        scraped["trainer"] = flywheel_series(textfile.read_text(), "trainer")
        from_textfile.append("trainer")
    invariants = check_invariants(
        records,
        eta,
        buffer_stats,
        scraped,
        n_rollout=cfg.rollout.n_replicas,
        from_textfile=from_textfile,
    )
    initial = evals[0]["accuracy"] if evals else None
    final = evals[-1]["accuracy"] if evals else None
    summary = {
        "initial_eval_accuracy": initial,
        "final_eval_accuracy": final,
        "steps": steps,
        "wall_seconds": wall_seconds,
        "max_staleness_seen": max((r.get("staleness_max", 0) for r in records), default=0),
        "eta": eta,
        "invariants_ok": all(v["ok"] for v in invariants.values()),
        "invariants": invariants,
        "final_task_reward": records[-1].get("task_reward") if records else None,
        **tool_rates(evals),
        "samples": sum(r.get("samples", 0) for r in records),
        "evals": evals,
        "buffer": buffer_stats,
        "ledger": ledger_summary(trainer_paths.run_dir, buffer_stats),
        "restarts_total": len(restarts),
        "restarts": restarts,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    write_learning_curve(run_dir / "learning_curve.png", records, evals)
    say(
        f"done: {summary['steps']} steps in {summary['wall_seconds']:.0f}s; held-out accuracy "
        f"{initial} -> {final}; max staleness {summary['max_staleness_seen']} (eta {eta}); "
        f"invariants {'OK' if summary['invariants_ok'] else 'VIOLATED'}"
    )
    ledger = summary["ledger"]
    if ledger.get("acked_lost_with_crash") or not ledger["ok"]:
        say(
            f"  ledger: {ledger['trainer_acked']} groups in the trained weights + "
            f"{ledger['acked_lost_with_crash']} acknowledged by trainers that died after "
            f"their checkpoint = {ledger['buffer_acked']} acknowledged by the buffer "
            f"({'ok' if ledger['ok'] else 'MISMATCH'})"
        )
    for r in restarts:
        down = "never came back" if r["downtime_seconds"] is None else f"{r['downtime_seconds']}s"
        say(f"  restart: {r['service']} ({r['exit']}), down {down}")
    for name, res in invariants.items():
        say(f"  invariant {name}: {'ok' if res['ok'] else 'VIOLATED'} - {res['detail']}")
    say(f"summary: {run_dir / 'summary.json'}; curve: {run_dir / 'learning_curve.png'}")
    return summary
