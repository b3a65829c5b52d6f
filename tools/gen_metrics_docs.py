"""Generate the tables of `docs/metrics.md` from the services' own metrics and statistics.

Each service that has a `services/<service>/metrics.py` builds its `*Metrics` object on a
fresh `CollectorRegistry` (as it does at start), and every family registered there becomes
a row: the series name Prometheus stores, the type, the label names, the help text the
service serves on `/metrics`, and what to look at, taken from the table in the docstring
of the module that defines the metric (`services/<service>/metrics.py`,
`services/common/outage.py`, ...). The trainer's statistics come from
`services.trainer.algorithms.stats.STATS`, with the names the tracking writers
(`services/trainer/tracking.py`) and `/metrics` (`services/trainer/metrics.py`) give them.

Only the regions between `<!-- BEGIN GENERATED <name> -->` and `<!-- END GENERATED <name> -->`
are rewritten; the prose around them is edited by hand. A service with no region yet gets
one appended at the end. `--check` regenerates in memory and fails when the committed file
differs: a metric added, renamed or re-documented without regenerating fails CI.

    python tools/gen_metrics_docs.py          # rewrite the generated regions of docs/metrics.md
    python tools/gen_metrics_docs.py --check  # exit 1 when docs/metrics.md is stale
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prometheus_client import CollectorRegistry  # noqa: E402
from prometheus_client.metrics import MetricWrapperBase  # noqa: E402

OUT = ROOT / "docs" / "metrics.md"
NONE = "—"

# The series a histogram family adds to its name (a counter adds `_total`, shown in the name).
_HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")
_BEGIN = "<!-- BEGIN GENERATED {name}: tools/gen_metrics_docs.py, do not edit -->"
_END = "<!-- END GENERATED {name} -->"
_REGION = re.compile(
    r"<!-- BEGIN GENERATED (?P<name>[\w-]+)[^>]*-->\n.*?<!-- END GENERATED (?P=name) -->",
    re.S,
)


@dataclass(frozen=True)
class Family:
    """One exported metric family, as a reader of `/metrics` meets it."""

    series: str  # what PromQL selects: `<name>_total` for counters, `<name>` otherwise
    kind: str
    labels: tuple[str, ...]
    help: str
    watch: str  # what to look at, from the defining module's docstring table


class _RecordingRegistry(CollectorRegistry):
    """A fresh registry that remembers its collectors, so families a collector only
    describes (labelled metrics without children, gauges set on the first step) are
    listed too."""

    def __init__(self) -> None:
        super().__init__(auto_describe=True)
        self.collectors: list[Any] = []

    def register(self, collector: Any) -> None:
        super().register(collector)
        self.collectors.append(collector)


def services_with_metrics() -> list[str]:
    """Service packages that export `/metrics`: the ones whose metrics module defines a
    `*Metrics` class (`services/common/metrics.py` only holds helpers)."""
    return sorted(
        p.parent.name
        for p in (ROOT / "services").glob("*/metrics.py")
        if _metrics_classes(importlib.import_module(f"services.{p.parent.name}.metrics"))
    )


def services_without_metrics() -> list[str]:
    with_metrics = set(services_with_metrics())
    return sorted(
        p.parent.name
        for p in (ROOT / "services").glob("*/__init__.py")
        # common and core are the shared layers under the services, not services
        if p.parent.name not in with_metrics and p.parent.name not in ("common", "core")
    )


def _metrics_classes(module: Any) -> list[type]:
    return [
        obj
        for name, obj in vars(module).items()
        if isinstance(obj, type) and name.endswith("Metrics") and obj.__module__ == module.__name__
    ]


def _docstring_rows(module_name: str, service: str) -> list[tuple[list[str], str]]:
    """The metric table of a module's docstring: (names in the first cell, last cell).

    A cell may name several series (`flywheel_buffer_stored_groups` / `_stored_bytes`): a
    name starting with `_` replaces the tail of the row's first name (see `_expand`)."""
    doc = importlib.import_module(module_name).__doc__ or ""
    rows: list[tuple[list[str], str]] = []
    for line in doc.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if not line.lstrip().startswith("|") or len(cells) < 2:
            continue
        names = [
            re.sub(r"\{[^}]*\}", "", n).replace("<service>", service)
            for n in re.findall(r"`([^`]+)`", cells[0])
        ]
        if names and names[0].startswith("flywheel_"):
            rows.append((names, cells[-1].replace("\\|", "|")))
    return rows


def _expand(short: str, first: str, exported: set[str]) -> str | None:
    """`_stored_bytes` after `flywheel_buffer_stored_groups` -> `flywheel_buffer_stored_bytes`:
    the shortest replacement of the first name's trailing segments that is exported."""
    parts = first.split("_")
    for k in range(1, len(parts) - 1):
        candidate = "_".join(parts[:-k]) + short
        if candidate in exported:
            return candidate
    return None


def _hints_for(modules: list[str], service: str, exported: set[str]) -> dict[str, str]:
    """Series name -> what to look at; the service's own table wins over shared modules."""
    out: dict[str, str] = {}
    for module_name in modules:
        for names, hint in _docstring_rows(module_name, service):
            for name in names:
                full = _expand(name, names[0], exported) if name.startswith("_") else name
                if full:
                    out.setdefault(full, hint)
    return out


def _families_of(collector: Any) -> list[tuple[Any, tuple[str, ...]]]:
    if isinstance(collector, MetricWrapperBase):
        return [(m, tuple(collector._labelnames)) for m in collector.describe()]
    described = collector.describe() if hasattr(collector, "describe") else collector.collect()
    return [(m, tuple(getattr(m, "_labelnames", ()))) for m in described]


def _owner_modules(instance: Any, service: str) -> list[str]:
    """The service's metrics module, then every `services.*` module whose objects the
    metrics object holds (the shared outage series, ...)."""
    own = f"services.{service}.metrics"
    found = [own]
    for value in vars(instance).values():
        module = type(value).__module__
        if module.startswith("services.") and module not in found:
            found.append(module)
    return found


def families(service: str) -> list[Family]:
    """Every family the service's metrics object registers, in registration order."""
    module = importlib.import_module(f"services.{service}.metrics")
    out: list[Family] = []
    seen: set[str] = set()  # a part held by the service's object (AgentMetrics) is listed once
    for cls in _metrics_classes(module):
        registry = _RecordingRegistry()
        instance = cls(registry)
        rows: list[tuple[str, str, tuple[str, ...], str]] = []
        for collector in registry.collectors:
            for metric, labels in _families_of(collector):
                series = metric.name + ("_total" if metric.type == "counter" else "")
                rows.append((series, metric.type, labels, " ".join(metric.documentation.split())))
        exported = {r[0] for r in rows}
        hints = _hints_for(_owner_modules(instance, service), service, exported)
        for series, kind, labels, text in rows:
            if series not in seen:
                seen.add(series)
                out.append(Family(series, kind, labels, text, hints.get(series, "") or NONE))
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def service_table(service: str) -> str:
    rows = [
        "| series | type | labels | help (as served) | what to look at |",
        "| --- | --- | --- | --- | --- |",
    ]
    for f in families(service):
        kind = f.kind
        if kind == "histogram":
            kind += f" ({', '.join(f'`{s}`' for s in _HISTOGRAM_SERIES)})"
        labels = ", ".join(f"`{label}`" for label in f.labels) or NONE
        rows.append(f"| `{f.series}` | {kind} | {labels} | {_cell(f.help)} | {_cell(f.watch)} |")
    return "\n".join(rows)


def _tracking_names(stat: str) -> list[str]:
    from services.trainer.tracking import areal_metrics

    return sorted(areal_metrics({"stats": {stat: 1.0}}))


def _prometheus_name(stat: str) -> str:
    from services.trainer.metrics import NAMED_STATS, P

    if stat in NAMED_STATS:
        return f"`{P}_{NAMED_STATS[stat]}`"
    return f'`{P}_stat{{name="{stat}"}}`'


def _names(names: list[str]) -> str:
    return ", ".join(f"`{n}`" for n in names) or NONE


def statistics_table() -> str:
    """Every name of `STATS`: per-token statistics as one row with their three reductions,
    the proximal-approximation errors folded into one row (their names are the product of
    the three tuples the row lists)."""
    from services.trainer.algorithms import stats as s

    tokens = {**s.ACTOR_TOKEN_STATS, **s.CRITIC_TOKEN_STATS}
    rows = [
        "| statistic (`metrics.jsonl` `stats`) | what it is | a bad trend means "
        "| TensorBoard / W&B / MLflow | `/metrics` (trainer) |",
        "| --- | --- | --- | --- | --- |",
    ]
    folded = False
    for name, (what, bad) in s.STATS.items():
        base, _, red = name.rpartition("/")
        if base in tokens and red in s.TOKEN_STAT_REDUCTIONS:
            if red != s.TOKEN_STAT_REDUCTIONS[0]:
                continue
            ts = tokens[base]
            names = [f"{base}/{r}" for r in s.TOKEN_STAT_REDUCTIONS]
            tracked = [t for n in names for t in _tracking_names(n)]
            scraped = "; ".join(f"{n.rpartition('/')[2]}: {_prometheus_name(n)}" for n in names)
            rows.append(
                f"| {_names(names)} | over the `{ts.mask}` tokens: {_cell(ts.what)} "
                f"| {_cell(ts.bad)} | {_names(tracked)} | {scraped} |"
            )
            continue
        if name.startswith("prox_approx/"):
            if folded:
                continue
            folded = True
            pattern = "prox_approx/<method>/<quantity>_<error>"
            what = (
                f"method ∈ {', '.join(s.PROX_APPROX_METHODS)}; quantity ∈ "
                f"{', '.join(s.PROX_ERROR_QUANTITIES)}; error ∈ {', '.join(s.PROX_ERROR_KINDS)}: "
                "the error of the approximation against the recomputed pi_prox "
                "(`actor.prox_logp_method: metrics`), mean over generated tokens"
            )
            tracked = [t.replace(name, pattern) for t in _tracking_names(name)]
            scraped = _prometheus_name(name).replace(name, pattern)
            rows.append(f"| `{pattern}` | {what} | {_cell(bad)} | {_names(tracked)} | {scraped} |")
            continue
        rows.append(
            f"| `{name}` | {_cell(what)} | {_cell(bad)} | {_names(_tracking_names(name))} "
            f"| {_prometheus_name(name)} |"
        )
    return "\n".join(rows)


def no_metrics_line() -> str:
    names = ", ".join(f"`services/{s}/`" for s in services_without_metrics())
    return f"Packages under `services/` without a metrics module (no `/metrics` of their own): {names}."


def regions() -> dict[str, tuple[str, str]]:
    """Region name -> (heading used when the region is new, generated body)."""
    out = {
        svc: (f"## `{svc}` (`flywheel_{svc}_*`)", service_table(svc))
        for svc in services_with_metrics()
    }
    out["services-without-metrics"] = ("## Services without `/metrics`", no_metrics_line())
    out["statistics"] = ("## Trainer statistics", statistics_table())
    return out


def render(current: str) -> str:
    """`current` with every generated region rewritten; missing regions appended."""
    wanted = regions()
    seen: set[str] = set()

    def replace(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in wanted:
            return m.group(0)  # a region of a service that is gone: left for a human
        seen.add(name)
        return _block(name, wanted[name][1])

    text = _REGION.sub(replace, current)
    for name, (heading, body) in wanted.items():
        if name not in seen:
            text = text.rstrip("\n") + f"\n\n{heading}\n\n{_block(name, body)}\n"
    return text


def _block(name: str, body: str) -> str:
    return f"{_BEGIN.format(name=name)}\n{body}\n{_END.format(name=name)}"


def stale_regions(current: str) -> list[str]:
    """Regions whose generated content no longer matches the code (or that are missing or
    name a service that no longer exports metrics)."""
    wanted = regions()
    found = {m.group("name"): m.group(0) for m in _REGION.finditer(current)}
    stale = [n for n, (_, body) in wanted.items() if found.get(n) != _block(n, body)]
    return stale + [n for n in found if n not in wanted]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when docs/metrics.md is stale")
    args = parser.parse_args(argv)
    current = OUT.read_text(encoding="utf-8") if OUT.exists() else ""
    if args.check:
        stale = stale_regions(current)
        if stale:
            print(
                f"docs/metrics.md is out of date with the services' metrics ({', '.join(stale)}); "
                "run `python tools/gen_metrics_docs.py`",
                file=sys.stderr,
            )
            return 1
        return 0
    OUT.write_text(render(current), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
