"""`flywheel doctor RUN_DIR [--json]`: the run-health checks of docs/troubleshooting.md.
`flywheel doctor --config FILE --experiments [--steps N] [overrides ...]`: the playbook's
experiments (services/doctor/experiments.py); exit 0 when the config learns, 1 otherwise.

Exit status: 0 when every check passes (or has nothing to judge), 1 when one warns, 2 when
one fails; 2 as well when RUN_DIR is not a run directory.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from services.doctor.checks import SEVERITY, Check, run_checks, verdict
from services.doctor.evidence import Evidence, gather

EXIT = {"pass": 0, "warn": 1, "fail": 2}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flywheel doctor",
        description="check a finished or live run against the RL troubleshooting playbook",
    )
    p.add_argument("run_dir", nargs="?", help="the run directory (<fileroot>/<experiment>/<trial>)")
    p.add_argument("--config", "-c", help="with --experiments: the config to diagnose")
    p.add_argument(
        "--experiments",
        action="store_true",
        help="run the playbook's short runs (async, sync, RL on the test set) and decide",
    )
    p.add_argument("--steps", type=int, help="with --experiments: total_train_steps of each run")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--scrape-timeout",
        type=float,
        default=3.0,
        help="seconds to wait for each service's /metrics of a live run",
    )
    return p


def report(ev: Evidence, checks: Sequence[Check]) -> dict:
    return {
        "run_dir": str(ev.run_dir),
        "live": ev.live,
        "steps": len(ev.records),
        "verdict": verdict(checks),
        "unreachable": ev.unreachable,
        "notes": ev.notes,
        "checks": [c.as_dict() for c in checks],
    }


def render(ev: Evidence, checks: Sequence[Check]) -> str:
    state = "live" if ev.live else ("finished" if ev.summary is not None else "stopped")
    lines = [f"flywheel doctor: {ev.run_dir} ({state}, {len(ev.records)} steps)"]
    lines += [f"  note: {n}" for n in ev.notes]
    if ev.unreachable:
        lines.append(f"  note: no /metrics from {', '.join(ev.unreachable)}")
    width = max(len(c.name) for c in checks)
    for c in checks:
        lines.append(f"{c.status.upper():<4}  {c.name:<{width}}  {c.summary}")
        if c.advice:
            lines.append(f"{'':<4}  {'':<{width}}  -> {c.advice}")
    counts = {s: sum(1 for c in checks if c.status == s) for s in SEVERITY}
    lines.append(
        f"verdict: {verdict(checks)} ({counts['pass']} pass, {counts['warn']} warn, "
        f"{counts['fail']} fail, {counts['n/a']} n/a)"
    )
    return "\n".join(lines)


def doctor_main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, overrides = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if args.experiments:
        if not args.config:
            parser.error("--experiments needs --config FILE")
        from services.doctor.experiments import decision_dict, render_decision, run_experiments

        decision = run_experiments(args.config, overrides, args.steps)
        if args.json:
            print(json.dumps(decision_dict(decision), indent=1))
        else:
            print(render_decision(decision))
        return 0 if decision.branch == "none" else 1
    if overrides or args.run_dir is None:
        parser.error("give RUN_DIR (overrides only with --config --experiments)")
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"flywheel doctor: {run_dir} is not a directory", file=sys.stderr)
        return 2
    if not any((run_dir / f).exists() for f in ("config.yaml", "metrics.jsonl", "summary.json")):
        print(
            f"flywheel doctor: {run_dir} has no config.yaml, metrics.jsonl or summary.json: "
            "not a run directory",
            file=sys.stderr,
        )
        return 2
    ev = gather(run_dir, scrape_timeout=args.scrape_timeout)
    checks = run_checks(ev)
    if args.json:
        print(json.dumps(report(ev, checks), indent=1, default=str))
    else:
        print(render(ev, checks))
    return EXIT[verdict(checks)]
