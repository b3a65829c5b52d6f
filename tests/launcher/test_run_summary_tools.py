"""An agent run's tool-call and tool-success rates in `summary.json` and the curve
(services/launcher/run_summary.py, services/launcher/report.py)."""

from __future__ import annotations

from pathlib import Path

from services.launcher.report import write_learning_curve
from services.launcher.run_summary import tool_rates

AGENT_EVALS = [
    {"step": 0, "accuracy": 0.1, "tool_call_rate": 0.5, "tool_success_rate": None},
    {"step": 4, "accuracy": 0.8, "tool_call_rate": 0.9, "tool_success_rate": 0.95},
]


def test_the_first_and_last_rates_of_an_agent_run() -> None:
    assert tool_rates(AGENT_EVALS) == {
        "initial_tool_call_rate": 0.5,
        "initial_tool_success_rate": None,
        "final_tool_call_rate": 0.9,
        "final_tool_success_rate": 0.95,
    }


def test_other_runs_get_no_tool_entries() -> None:
    assert tool_rates([{"step": 0, "accuracy": 0.3}]) == {}
    assert tool_rates([]) == {}


def test_the_curve_draws_the_rates_beside_accuracy(tmp_path: Path) -> None:
    records = [{"step": s, "task_reward": 0.1 * s} for s in range(1, 5)]
    path = tmp_path / "curve.png"
    write_learning_curve(path, records, AGENT_EVALS)
    with_rates = path.stat().st_size
    write_learning_curve(
        path, records, [{"step": e["step"], "accuracy": e["accuracy"]} for e in AGENT_EVALS]
    )
    assert path.stat().st_size != with_rates  # the two dashed series are drawn
