"""Dashboards as code: builds the Grafana dashboards and copies them (and the alert rules)
to every place that serves them.

    python deploy/grafana/generate.py          # write
    python deploy/grafana/generate.py --check  # exit 1 when a committed file is stale

Writes `deploy/grafana/dashboards/*.json` (Grafana file provisioning of the compose stack)
and the same files under `deploy/helm/flywheel/files/dashboards/` (the chart's labelled
ConfigMaps), and copies `deploy/prometheus/alerts.yml` to
`deploy/helm/flywheel/files/alerts.yml` (the chart's PrometheusRule): Helm can only read
files inside the chart, and one source keeps compose and Kubernetes identical.

Dashboards are built with `grafana-foundation-sdk` (Grafana's typed builders), so a field
Grafana does not know cannot be written. Every query uses only series the services export
— `tests/deploy/test_dashboards.py` checks each expression parses (promtool) and each
metric name against the services' own registries.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import heatmap, prometheus, stat, timeseries
from grafana_foundation_sdk.builders.common import GraphThresholdsStyleConfig, StackingConfig
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import GraphTresholdsStyleMode, StackingMode
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    Threshold,
    ThresholdsMode,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_DIR = ROOT / "deploy" / "grafana" / "dashboards"
CHART_FILES = ROOT / "deploy" / "helm" / "flywheel" / "files"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"


# --- small builders -----------------------------------------------------------------------


def q(expr: str, legend: str = "__auto", ref: str = "A") -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).range()


def line_at(value: float, color: str = "red") -> db.ThresholdsConfig:
    """A threshold drawn as a dashed line: the healthy reference a reader compares against."""
    return (
        db.ThresholdsConfig()
        .mode(ThresholdsMode.ABSOLUTE)
        .steps([Threshold(value=None, color="green"), Threshold(value=value, color=color)])
    )


def ts(
    title: str,
    description: str,
    targets: list[tuple[str, str]],
    *,
    unit: str = "short",
    threshold: float | None = None,
    stacked: bool = False,
    span: int = 8,
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DS)
        .unit(unit)
        .span(span)
        .height(8)
        .line_width(1)
        .fill_opacity(10 if not stacked else 60)
    )
    for i, (expr, legend) in enumerate(targets):
        panel = panel.with_target(q(expr, legend, chr(ord("A") + i)))
    if threshold is not None:
        panel = panel.thresholds(line_at(threshold)).thresholds_style(
            GraphThresholdsStyleConfig().mode(GraphTresholdsStyleMode.DASHED)
        )
    if stacked:
        panel = panel.stacking(StackingConfig().mode(StackingMode.NORMAL))
    return panel


def single(
    title: str, description: str, expr: str, *, unit: str = "short", bad_below: float | None = None
) -> stat.Panel:
    panel = (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DS)
        .unit(unit)
        .span(4)
        .height(4)
        .with_target(q(expr, "__auto"))
    )
    if bad_below is not None:
        panel = panel.thresholds(
            db.ThresholdsConfig()
            .mode(ThresholdsMode.ABSOLUTE)
            .steps([Threshold(value=None, color="red"), Threshold(value=bad_below, color="green")])
        )
    return panel


def histogram_heatmap(title: str, description: str, bucket_metric: str) -> heatmap.Panel:
    expr = f"sum by (le) (increase({bucket_metric}[{RATE}]))"
    return (
        heatmap.Panel()
        .title(title)
        .description(description)
        .datasource(DS)
        .span(12)
        .height(8)
        .calculate(False)
        .with_target(q(expr, "{{le}}").format(PromQueryFormat.HEATMAP))
    )


def new_dashboard(uid: str, title: str, description: str) -> db.Dashboard:
    return (
        db.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["flywheel"])
        .refresh("30s")
        .time("now-3h", "now")
        .timezone("browser")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .readonly()
        .with_variable(db.DatasourceVariable("datasource").label("Data source").type("prometheus"))
    )


# --- the dashboards -----------------------------------------------------------------------


def rl_health() -> db.Dashboard:
    """Is the policy learning, and is the off-policy data still trustworthy?"""
    t = "flywheel_trainer"
    return (
        new_dashboard(
            "flywheel-rl-health",
            "Flywheel / RL health",
            "Training-health signals of the trainer's last step: off-policy corrections, "
            "truncation, lengths, reward, clipping, KL, entropy, gradients and staleness.",
        )
        .with_row(db.Row("Off-policy corrections"))
        .with_panel(
            ts(
                "Importance weight",
                "Mean pi_theta/pi_prox. Healthy: close to the 1.0 line; drifting away means each minibatch update moves too far.",
                [(f"{t}_importance_weight", "importance_weight")],
                threshold=1.0,
            )
        )
        .with_panel(
            ts(
                "Behaviour importance weight",
                "Mean pi_prox/pi_behave (decoupled loss). Away from the 1.0 line: stale rollouts or an engine that disagrees with the trainer.",
                [(f"{t}_behave_imp_weight", "behave_imp_weight")],
                threshold=1.0,
            )
        )
        .with_panel(
            ts(
                "Proximal log-prob approximation error",
                "Mean absolute error of each approximation of log pi_prox against the recomputed one (prox_logp_method=metrics). Growing: the approximation no longer tracks pi_prox.",
                [(f'{t}_stat{{name=~"prox_approx/.+/logp_abs_error"}}', "{{name}}")],
            )
        )
        .with_panel(
            ts(
                "Weight-sync parity",
                "Largest |log p| difference between each replica and the trainer on the parity probe after the last weight update, and the tolerance. Above the tolerance: the replica computes with other weights; the trainer paused it.",
                [
                    (f"{t}_weight_parity_max_abs_logprob_diff", "{{replica}}"),
                    (f"{t}_weight_parity_tolerance", "tolerance"),
                ],
            )
        )
        .with_row(db.Row("Samples"))
        .with_panel(
            ts(
                "No-EOS ratio",
                "Fraction of trained completions truncated at max_new_tokens. Above the 0.05 line: raise max_new_tokens or penalise overlong answers.",
                [(f"{t}_no_eos_ratio", "no_eos_ratio")],
                unit="percentunit",
                threshold=0.05,
            )
        )
        .with_panel(
            ts(
                "Sequence length",
                "Mean prompt+completion and completion tokens. A sudden explosion or collapse is the classic sign of reward hacking.",
                [(f"{t}_seq_len_tokens", "seq_len"), (f"{t}_response_len_tokens", "response_len")],
            )
        )
        .with_panel(
            ts(
                "Task reward",
                "Mean outcome reward of the trained sequences. Flat: nothing is being learnt.",
                [(f"{t}_task_reward", "task_reward")],
            )
        )
        .with_row(db.Row("Update"))
        .with_panel(
            ts(
                "Clip ratios",
                "Fraction of tokens where the PPO clip (and the dual clip) binds. High: lr too high or eps_clip too tight.",
                [(f"{t}_clip_ratio", "clip_ratio"), (f"{t}_dual_clip_ratio", "dual_clip_ratio")],
                unit="percentunit",
            )
        )
        .with_panel(
            ts(
                "Approximate KL",
                "Mean log pi_theta - log pi_prox. Growing: the step size is too large.",
                [(f"{t}_approx_kl", "approx_kl")],
            )
        )
        .with_panel(
            ts(
                "Entropy",
                "Mean token entropy of the policy. Collapsing towards 0: no exploration left.",
                [(f"{t}_entropy", "entropy")],
            )
        )
        .with_panel(
            ts(
                "Gradient norm",
                "Global gradient norm before clipping; spikes precede instabilities. Skipped (non-finite) steps are counted on the right axis's series.",
                [
                    (f"{t}_grad_norm", "grad_norm"),
                    (f"increase({t}_skipped_updates_total[{RATE}])", "skipped steps"),
                ],
            )
        )
        .with_panel(
            ts(
                "Learning rate and loss",
                "The optimizer's learning rate and the actor loss of the last step.",
                [(f"{t}_lr", "lr"), (f"{t}_loss", "loss")],
            )
        )
        .with_panel(
            ts(
                "Staleness",
                "Per trained sequence: trainer version - oldest behaviour version (mean and p99). Must stay within max_head_offpolicyness.",
                [
                    (
                        f"rate({t}_staleness_versions_sum[{RATE}]) / rate({t}_staleness_versions_count[{RATE}])",
                        "mean",
                    ),
                    (
                        f"histogram_quantile(0.99, sum by (le) (rate({t}_staleness_versions_bucket[{RATE}])))",
                        "p99",
                    ),
                ],
            )
        )
        .with_panel(
            histogram_heatmap(
                "Staleness histogram (trained sequences)",
                "How many versions old the trained data was, over time.",
                f"{t}_staleness_versions_bucket",
            )
        )
    )


def system() -> db.Dashboard:
    """Is every service doing its job, and where does the time go?"""
    b, r, ro, t = "flywheel_buffer", "flywheel_reward", "flywheel_rollout", "flywheel_trainer"
    return (
        new_dashboard(
            "flywheel-system",
            "Flywheel / System",
            "Buffer depth and accounting, rollout throughput and served versions, reward "
            "latency and failures, weight synchronisation and the phases of a training step.",
        )
        .with_row(db.Row("Services"))
        .with_panel(
            single(
                "Services up",
                "Scrape targets answering, of the four services.",
                'sum(up{job=~"flywheel-(buffer|reward|rollout|trainer)"})',
                bad_below=4,
            )
        )
        .with_panel(
            single(
                "Policy version",
                "The trainer's current version, as the buffer holds it.",
                f"max({b}_version)",
            )
        )
        .with_panel(
            single(
                "Accounting invariant",
                "1 when put = acked + dropped + pending + in flight.",
                f"min({b}_invariant_ok)",
                bad_below=1,
            )
        )
        .with_row(db.Row("Buffer"))
        .with_panel(
            ts(
                "Buffer depth",
                "Groups stored in Redis: waiting for the trainer (pending) and handed out but not yet acknowledged (in flight).",
                [
                    (f"sum({b}_pending_groups)", "pending"),
                    (f"sum({b}_in_flight_groups)", "in flight"),
                ],
                stacked=True,
            )
        )
        .with_panel(
            ts(
                "Capacity for rollout",
                "Groups the rollout may still start under the staleness budget, and reservations outstanding. 0 for long: rollout idles.",
                [
                    (f"sum({b}_capacity_groups)", "capacity"),
                    (f"sum({b}_reserved_groups)", "reserved"),
                ],
            )
        )
        .with_panel(
            ts(
                "Puts, claims, acks",
                "Groups per second through the buffer.",
                [
                    (f"sum(rate({b}_put_groups_total[{RATE}]))", "put"),
                    (f"sum(rate({b}_claimed_groups_total[{RATE}]))", "claimed"),
                    (f"sum(rate({b}_acked_groups_total[{RATE}]))", "acked"),
                ],
                unit="ops",
            )
        )
        .with_panel(
            ts(
                "Drops by reason",
                "Groups dropped without training: stale at put or claim, filtered, invalid.",
                [(f"sum by (reason) (rate({b}_dropped_groups_total[{RATE}]))", "{{reason}}")],
                unit="ops",
                stacked=True,
            )
        )
        .with_panel(
            ts(
                "Accounting gap",
                "put - (acked + dropped + pending + in flight): must be exactly 0 at all times.",
                [
                    (
                        f"sum({b}_put_groups_total) - (sum({b}_acked_groups_total) + sum({b}_dropped_groups_total) + sum({b}_pending_groups) + sum({b}_in_flight_groups))",
                        "gap",
                    )
                ],
                threshold=0.5,
            )
        )
        .with_panel(
            ts(
                "Served staleness",
                "Version - oldest token version of the groups served to the trainer (p50, p99).",
                [
                    (
                        f"histogram_quantile(0.5, sum by (le) (rate({b}_served_staleness_versions_bucket[{RATE}])))",
                        "p50",
                    ),
                    (
                        f"histogram_quantile(0.99, sum by (le) (rate({b}_served_staleness_versions_bucket[{RATE}])))",
                        "p99",
                    ),
                ],
            )
        )
        .with_panel(
            ts(
                "Claims served from memory",
                "Claimed groups whose bytes came from the buffer's read cache (hit) or were read back from Redis (miss). Many misses: buffer.read_cache_bytes too small, or puts and claims go through different replicas.",
                [(f"sum by (result) (rate({b}_read_cache_total[{RATE}]))", "{{result}}")],
                unit="ops",
                stacked=True,
            )
        )
        .with_row(db.Row("Rollout"))
        .with_panel(
            ts(
                "Generated tokens/s per replica",
                "Tokens generated per second by each rollout replica.",
                [
                    (
                        f"sum by (instance) (rate({ro}_generated_tokens_total[{RATE}]))",
                        "{{instance}}",
                    )
                ],
                unit="short",
            )
        )
        .with_panel(
            ts(
                "Served version per replica",
                "The weight version each replica serves, beside the trainer's version.",
                [(f"{ro}_weight_version", "{{instance}}"), (f"max({b}_version)", "trainer")],
            )
        )
        .with_panel(
            ts(
                "Weight updates",
                "Seconds a replica took to apply new weights, and how long decoding was paused (p90).",
                [
                    (
                        f"histogram_quantile(0.9, sum by (le) (rate({ro}_weight_update_seconds_bucket[{RATE}])))",
                        "update p90",
                    ),
                    (
                        f"histogram_quantile(0.9, sum by (le) (rate({ro}_weight_update_pause_seconds_bucket[{RATE}])))",
                        "pause p90",
                    ),
                ],
                unit="s",
            )
        )
        .with_panel(
            ts(
                "Groups produced and rejected",
                "Groups per second each replica got stored, and groups rejected by reason (stale, filtered, reward_failure, put_failed, error).",
                [
                    (
                        f"sum by (instance) (rate({ro}_groups_produced_total[{RATE}]))",
                        "produced {{instance}}",
                    ),
                    (
                        f"sum by (reason) (rate({ro}_groups_rejected_total[{RATE}]))",
                        "rejected {{reason}}",
                    ),
                ],
                unit="ops",
            )
        )
        .with_panel(
            ts(
                "Requests in flight",
                "Generation requests and groups in flight per replica; 1 in `paused` means the trainer holds generation (synchronous mode or a weight update).",
                [
                    (f"sum by (instance) ({ro}_requests_in_flight)", "requests {{instance}}"),
                    (f"sum by (instance) ({ro}_groups_in_flight)", "groups {{instance}}"),
                    (f"max by (instance) ({ro}_paused)", "paused {{instance}}"),
                ],
            )
        )
        .with_row(db.Row("Agents"))
        .with_panel(
            ts(
                "Agent episodes",
                "Agent episodes per second that finished, and failures by reason (error, timeout, max_turns, token_budget, ...); a failed episode is dropped from its group.",
                [
                    (f"sum(rate({ro}_agent_episodes_total[{RATE}]))", "finished"),
                    (
                        f"sum by (reason) (rate({ro}_agent_episode_failures_total[{RATE}]))",
                        "failed {{reason}}",
                    ),
                ],
                unit="ops",
            )
        )
        .with_panel(
            ts(
                "Turns and duration per episode",
                "Mean model calls per finished episode, and episode wall time (p50, p90).",
                [
                    (
                        f"sum(rate({ro}_agent_episode_turns_sum[{RATE}])) / sum(rate({ro}_agent_episode_turns_count[{RATE}]))",
                        "turns",
                    ),
                    (
                        f"histogram_quantile(0.5, sum by (le) (rate({ro}_agent_episode_seconds_bucket[{RATE}])))",
                        "seconds p50",
                    ),
                    (
                        f"histogram_quantile(0.9, sum by (le) (rate({ro}_agent_episode_seconds_bucket[{RATE}])))",
                        "seconds p90",
                    ),
                ],
            )
        )
        .with_panel(
            ts(
                "Tool calls and template drift",
                "Tool calls per second by tool and outcome (ok, error, timeout, memory, cpu), and session calls whose prompt re-rendered earlier turns (template drift: should stay 0).",
                [
                    (
                        f"sum by (tool, outcome) (rate({ro}_agent_tool_calls_total[{RATE}]))",
                        "{{tool}} {{outcome}}",
                    ),
                    (f"sum(rate({ro}_template_drift_total[{RATE}]))", "template drift"),
                ],
                unit="ops",
            )
        )
        .with_row(db.Row("Reward"))
        .with_panel(
            ts(
                "Reward latency",
                "Seconds per reward call in a worker, by function (p50, p99).",
                [
                    (
                        f"histogram_quantile(0.5, sum by (le, fn) (rate({r}_score_seconds_bucket[{RATE}])))",
                        "{{fn}} p50",
                    ),
                    (
                        f"histogram_quantile(0.99, sum by (le, fn) (rate({r}_score_seconds_bucket[{RATE}])))",
                        "{{fn}} p99",
                    ),
                ],
                unit="s",
            )
        )
        .with_panel(
            ts(
                "Reward results by status",
                "Scored completions per second by status; anything but OK becomes reward 0 or drops its group.",
                [(f"sum by (status) (rate({r}_results_total[{RATE}]))", "{{status}}")],
                unit="ops",
                stacked=True,
            )
        )
        .with_panel(
            ts(
                "Reward queue and workers",
                "Items waiting for a worker, live workers, and workers restarted (killed on deadline, crashed).",
                [
                    (f"sum({r}_queue_items)", "queued"),
                    (f"sum({r}_workers_ready)", "workers"),
                    (
                        f"sum by (reason) (increase({r}_worker_restarts_total[{RATE}]))",
                        "restarts {{reason}}",
                    ),
                ],
            )
        )
        .with_row(db.Row("Trainer"))
        .with_panel(
            ts(
                "Step phases",
                "Seconds per second spent in each phase of a training step; wait_batch large means the trainer is starved.",
                [(f"sum by (phase) (rate({t}_phase_seconds_sum[{RATE}]))", "{{phase}}")],
                unit="s",
                stacked=True,
            )
        )
        .with_panel(
            ts(
                "Weight sync",
                "Seconds from new weights to every replica serving them, by transport (p50, p90), and replicas skipped.",
                [
                    (
                        f"histogram_quantile(0.5, sum by (le, transport) (rate({t}_weight_broadcast_seconds_bucket[{RATE}])))",
                        "{{transport}} p50",
                    ),
                    (
                        f"histogram_quantile(0.9, sum by (le, transport) (rate({t}_weight_broadcast_seconds_bucket[{RATE}])))",
                        "{{transport}} p90",
                    ),
                    (f"increase({t}_unhealthy_replicas_total[{RATE}])", "unhealthy replicas"),
                ],
                unit="s",
            )
        )
        .with_panel(
            ts(
                "Training throughput",
                "Trained tokens per second of the train phase, and steps per minute.",
                [
                    (f"{t}_tokens_per_second", "tokens/s"),
                    (f"rate({t}_steps_total[{RATE}]) * 60", "steps/min"),
                ],
            )
        )
    )


DASHBOARDS = {
    "flywheel-rl-health.json": rl_health,
    "flywheel-system.json": system,
}


# --- rendering and checking ---------------------------------------------------------------


def render_dashboard(builder: db.Dashboard) -> dict[str, Any]:
    """The dashboard as Grafana's JSON model (a plain dict)."""
    return json.loads(json.dumps(builder.build(), cls=JSONEncoder))


def dashboards() -> dict[str, dict[str, Any]]:
    return {name: render_dashboard(build()) for name, build in DASHBOARDS.items()}


def queries(model: dict[str, Any]) -> list[str]:
    """Every PromQL expression of a dashboard, rows and nested panels included."""
    exprs: list[str] = []
    stack = list(model.get("panels") or [])
    while stack:
        panel = stack.pop()
        stack.extend(panel.get("panels") or [])
        exprs.extend(t["expr"] for t in panel.get("targets") or [] if t.get("expr"))
    return exprs


def outputs() -> dict[Path, str]:
    """Every generated file and its content."""
    files: dict[Path, str] = {}
    for name, model in dashboards().items():
        text = json.dumps(model, indent=2, sort_keys=True) + "\n"
        files[DASHBOARD_DIR / name] = text
        files[CHART_FILES / "dashboards" / name] = text
    files[CHART_FILES / "alerts.yml"] = ALERTS.read_text()
    return files


def stale_files() -> list[Path]:
    return [p for p, text in outputs().items() if not p.exists() or p.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail when a generated file is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for path in stale:
            print(
                f"stale: {path.relative_to(ROOT)} (run python deploy/grafana/generate.py)",
                file=sys.stderr,
            )
        return 1 if stale else 0
    for path, text in outputs().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
