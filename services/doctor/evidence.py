"""What `flywheel doctor` knows about a run: the files in its directory and, while it is live,
what its services export on /metrics.

Files read (each may be missing; a check without its input says so rather than guessing):

| file | written by | used for |
| --- | --- | --- |
| `config.yaml` | launcher | η, minibatches, the loss options, `max_new_tokens`, the filter |
| `metrics.jsonl` | trainer, one record per step | every per-step statistic |
| `summary.json` | launcher, at the end of a run | the buffer's ledger (put, dropped by reason) |
| `restarts.jsonl` | launcher | services that died and came back |
| `starvation.json` | launcher, while the trainer waits too long | the stage that holds the run |
| `evals.jsonl` | launcher | held-out accuracy before, during and after training |
| `services.json` | launcher | the /metrics addresses of a live run |
| `weight_parity.jsonl` | trainer, one line per replica and update | the weight-sync parity probe |

A run is live when it has no `summary.json` yet and its services answer on the addresses in
`services.json`; only then are they scraped (the ports of a finished run may belong to
someone else by now).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.common.config import ConfigError, FlywheelConfig, load_config
from services.launcher.metrics_log import MetricsTail

PARITY_FILE = "weight_parity.jsonl"
"""services/trainer/parity.py's `PARITY_FILE`, named here so the doctor needs no torch."""


@dataclass(frozen=True)
class Sample:
    """One Prometheus sample: `name` as exposed (counters end in `_total`)."""

    name: str
    labels: dict[str, str]
    value: float


def parse_exposition(text: str) -> list[Sample]:
    """The samples of a Prometheus text exposition."""
    return [
        Sample(s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def sum_by(samples: Iterable[Sample], name: str, label: str | None = None) -> dict[str, float]:
    """`name` summed over everything but `label` (one key, "" when `label` is None)."""
    out: dict[str, float] = {}
    for s in samples:
        if s.name == name:
            key = s.labels.get(label, "") if label else ""
            out[key] = out.get(key, 0.0) + s.value
    return out


@dataclass
class Evidence:
    run_dir: Path
    config: FlywheelConfig | None
    records: list[dict[str, Any]]
    summary: dict[str, Any] | None = None
    restarts: list[dict[str, Any]] = field(default_factory=list)
    starvation: dict[str, Any] | None = None
    evals: list[dict[str, Any]] = field(default_factory=list)
    parity: list[dict[str, Any]] = field(default_factory=list)
    """The parity probe's results (services/trainer/parity.py), oldest first."""
    live: bool = False
    scraped: dict[str, list[Sample]] = field(default_factory=dict)
    """Per service (`buffer`, `reward`, `trainer`, `rollout-0`, ...), what it exported."""
    unreachable: list[str] = field(default_factory=list)
    """Services of a live run that did not answer the scrape."""
    notes: list[str] = field(default_factory=list)

    def samples(self, prefix: str) -> list[Sample]:
        """Every scraped sample of the services whose key starts with `prefix`."""
        return [s for key, v in self.scraped.items() if key.startswith(prefix) for s in v]

    def series(self, key: str) -> list[Any]:
        """`key` of every step record that has it (None values left out)."""
        return [r[key] for r in self.records if r.get(key) is not None]

    def stat(self, key: str) -> list[float]:
        """The trainer statistic `key` (`stats` in the record) of every step that has it."""
        out = []
        for r in self.records:
            v = (r.get("stats") or {}).get(key)
            if isinstance(v, int | float):
                out.append(float(v))
        return out


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file the run is still writing: none when it is absent, a
    line cut short (by a crash, or mid-write) left out."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut short by a crash
            continue
    return out


def _scrape(addresses: dict[str, Any], timeout: float) -> tuple[dict[str, list[Sample]], list[str]]:
    targets: list[tuple[str, str]] = [
        (name, addresses[name]["metrics"])
        for name in ("buffer", "reward", "trainer")
        if isinstance(addresses.get(name), dict) and addresses[name].get("metrics")
    ]
    targets += [
        (f"rollout-{i}", ep["metrics"])
        for i, ep in enumerate(addresses.get("rollout") or [])
        if ep.get("metrics")
    ]
    scraped: dict[str, list[Sample]] = {}
    missing: list[str] = []
    for key, url in targets:
        try:
            scraped[key] = parse_exposition(httpx.get(url, timeout=timeout).text)
        except (httpx.HTTPError, ValueError):
            missing.append(key)
    return scraped, missing


def gather(run_dir: Path, *, scrape_timeout: float = 3.0) -> Evidence:
    """Read what the run directory holds, and scrape the services if the run is live."""
    config: FlywheelConfig | None = None
    notes: list[str] = []
    if (run_dir / "config.yaml").is_file():
        try:
            config = load_config(str(run_dir / "config.yaml"), [])
        except ConfigError as exc:
            notes.append(f"config.yaml does not load ({exc}); checks that need it are skipped")
    else:
        notes.append("no config.yaml; checks that need the config are skipped")
    metrics = (
        Path(config.trainer.metrics_jsonl)
        if config is not None and config.trainer.metrics_jsonl
        else run_dir / "metrics.jsonl"
    )
    tail = MetricsTail(metrics)
    try:
        tail.poll()
    except ValueError:
        notes.append(f"{metrics.name} has a line that is not JSON")
    summary = _json(run_dir / "summary.json")
    ev = Evidence(
        run_dir=run_dir,
        config=config,
        records=tail.records,
        summary=summary if isinstance(summary, dict) else None,
        restarts=read_jsonl(run_dir / "restarts.jsonl"),
        starvation=_json(run_dir / "starvation.json"),
        evals=read_jsonl(run_dir / "evals.jsonl"),
        parity=read_jsonl(run_dir / PARITY_FILE),
        notes=notes,
    )
    addresses = _json(run_dir / "services.json")
    if ev.summary is None and isinstance(addresses, dict):
        ev.scraped, ev.unreachable = _scrape(addresses, scrape_timeout)
        ev.live = bool(ev.scraped)
    return ev
