"""End-of-run checks and the learning-curve figure.

The invariants are the promises of the design, checked on every run rather than assumed:
the trainer never saw a token older than v - η, versions only moved forward, the buffer's
accounting adds up, and every service exported metrics over HTTP.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import httpx


def scrape_metrics(addresses: dict[str, Any]) -> dict[str, set[str]]:
    """Scrape each service's /metrics; returns the `flywheel_*` series names per service."""
    out: dict[str, set[str]] = {}
    targets: list[tuple[str, str, str]] = []
    for name in ("buffer", "reward", "trainer"):
        if name in addresses:
            targets.append((name, name, addresses[name]["metrics"]))
    for i, ep in enumerate(addresses.get("rollout", [])):
        targets.append((f"rollout-{i}", "rollout", ep["metrics"]))
    for key, service, url in targets:
        try:
            text = httpx.get(url, timeout=10).text
        except httpx.HTTPError:
            out[key] = set()
            continue
        out[key] = flywheel_series(text, service)
    return out


def flywheel_series(text: str, service: str) -> set[str]:
    """Names of the `flywheel_<service>_*` series in Prometheus text exposition format."""
    prefix = f"flywheel_{service}_"
    return {
        line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith(prefix)
    }


def check_invariants(
    records: Sequence[dict[str, Any]],
    eta: int,
    buffer_stats: dict[str, Any],
    scraped: dict[str, set[str]],
    n_rollout: int = 1,
    from_textfile: Collection[str] = (),
) -> dict[str, dict[str, Any]]:
    result: dict[str, dict[str, Any]] = {}
    worst = max((int(r.get("staleness_max", 0)) for r in records), default=0)
    result["staleness_within_eta"] = {
        "ok": bool(records) and worst <= eta,
        "detail": f"largest v - v_behave seen by the trainer {worst}, eta {eta}, "
        f"{len(records)} steps",
    }
    versions = [int(r["version"]) for r in records if "version" in r]
    increasing = all(b > a for a, b in zip(versions, versions[1:], strict=False))
    result["versions_increase"] = {
        "ok": bool(versions) and increasing,
        "detail": f"versions {versions[:3]}...{versions[-3:]}" if versions else "no steps",
    }
    put = int(buffer_stats.get("put_total", 0))
    acked = int(buffer_stats.get("acked_total", 0))
    dropped = {k: int(v) for k, v in (buffer_stats.get("dropped_total") or {}).items()}
    pending = int(buffer_stats.get("pending", 0))
    in_flight = int(buffer_stats.get("in_flight", 0))
    balance = acked + sum(dropped.values()) + pending + in_flight
    result["buffer_accounting"] = {
        "ok": put == balance and bool(buffer_stats.get("invariant_ok", False)),
        "detail": f"put {put} = acked {acked} + dropped {dropped} + pending {pending} "
        f"+ in_flight {in_flight} ({balance})",
    }
    expected = {"buffer", "reward", "trainer", *(f"rollout-{i}" for i in range(n_rollout))}
    missing = sorted(name for name in expected if not scraped.get(name))
    via_file = sorted(set(from_textfile) & expected)
    result["metrics_exported"] = {
        "ok": not missing,
        "detail": (
            "every service served flywheel_* series over HTTP"
            + (
                f" ({', '.join(via_file)}: read from its exit textfile, no scrape saw it)"
                if via_file
                else ""
            )
        )
        if not missing
        else f"no metrics from {missing}",
    }
    return result


def ledger_summary(run_dir: Path, buffer_stats: dict[str, Any]) -> dict[str, Any]:
    """The trainer's acknowledgement ledger (`<run_dir>/ledger.json`, written by
    services/trainer/ledger.py) beside the buffer's `acked_total`: the groups the final weights
    account for plus those acknowledged by trainers that died after their last checkpoint
    (`acked_lost_with_crash`, trained by weights that are gone) must equal what the buffer
    counts as acknowledged. No ledger file (a trainer that never acknowledged): all zero."""
    path = run_dir / "ledger.json"
    try:
        ledger = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        ledger = {}
    trainer = int(ledger.get("trainer_acked", 0))
    lost = int(ledger.get("acked_lost_with_crash", 0))
    buffer = int(buffer_stats.get("acked_total", 0))
    return {
        "trainer_acked": trainer,
        "acked_lost_with_crash": lost,
        "resumes": int(ledger.get("resumes", 0)),
        "buffer_acked": buffer,
        "ok": trainer + lost == buffer,
    }


def write_learning_curve(
    path: Path, records: Sequence[dict[str, Any]], evals: Sequence[dict[str, Any]]
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.get("step", i + 1) for i, r in enumerate(records)]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ax = axes[0][0]
    ax.plot(
        steps, [r.get("task_reward", float("nan")) for r in records], label="task reward (train)"
    )
    if evals:
        ax.plot(
            [e["step"] for e in evals],
            [e["accuracy"] for e in evals],
            "o-",
            label="held-out accuracy (T=1.0)",
        )
        for name, style in (("tool_call_rate", "s--"), ("tool_success_rate", "^--")):
            if any(e.get(name) is not None for e in evals):  # an agent run's evaluations
                points = [(e["step"], e[name]) for e in evals if e.get(name) is not None]
                ax.plot(*zip(*points, strict=True), style, label=f"held-out {name}")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step")
    ax.legend(loc="lower right")
    ax.set_title("reward and held-out accuracy")
    ax = axes[0][1]
    ax.plot(steps, [r.get("staleness_max", 0) for r in records], label="max")
    ax.plot(steps, [r.get("staleness_avg", 0) for r in records], label="mean")
    ax.set_title("staleness v - v_behave (tokens the trainer saw)")
    ax.set_xlabel("step")
    ax.legend()
    ax = axes[1][0]
    ax.plot(
        steps,
        [r.get("importance_weight", float("nan")) for r in records],
        label="importance_weight",
    )
    ax.plot(
        steps,
        [r.get("behave_imp_weight", float("nan")) for r in records],
        label="behave_imp_weight",
    )
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_title("importance weights (mean)")
    ax.set_xlabel("step")
    ax.legend()
    ax = axes[1][1]
    ax.plot(steps, [r.get("no_eos_ratio", float("nan")) for r in records], label="no_eos_ratio")
    ax.axhline(0.05, color="grey", lw=0.8, ls="--")
    ax.set_title("no-EOS ratio")
    ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
