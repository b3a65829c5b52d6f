"""Checks of agent runs (`rollout.workflow: agent`): template drift in the sessions, episodes
that fail, and tool calls that fail. They read the rollout replicas' counters, so they
judge a live run (`n/a` otherwise, or when the run trains no agent)."""

from __future__ import annotations

from typing import Any

from services.doctor.evidence import Evidence, sum_by

from .base import Check, Status, rounded

DRIFT_FAIL = 0.05
"""Share of session calls whose prompt re-rendered earlier turns, above which drift fails
(any drift warns: those calls' context in a `concat` trajectory is approximate)."""
EPISODE_FAIL_WARN, EPISODE_FAIL_FAIL = 0.05, 0.25
"""Share of agent episodes that failed (dropped from their groups)."""
TOOL_FAIL_WARN, TOOL_FAIL_FAIL = 0.2, 0.5
"""Share of tool calls that did not succeed. Early in training a policy writes bad
arguments often, so the bar is higher than for episodes; limits (`timeout`, `memory`,
`cpu`) are named in the advice, since those are the sandbox's, not the policy's."""

_NO_AGENT = "no agent episodes in the rollout's counters (no agent workflow, or not live)"


def _status(frac: float, warn: float, fail: float) -> Status:
    return "fail" if frac > fail else "warn" if frac > warn else "pass"


def template_drift(ev: Evidence) -> Check:
    name = "template_drift"
    ro = ev.samples("rollout")
    drift = sum(sum_by(ro, "flywheel_rollout_template_drift_total").values())
    calls = sum_by(ro, "flywheel_rollout_openai_requests_total", "status").get("200", 0.0)
    nums: dict[str, Any] = {"drifted_calls": drift, "ok_calls": calls}
    if not calls:
        return Check(name, "n/a", "no OpenAI API calls in the rollout's counters", "", nums)
    frac = drift / calls
    nums["drift_fraction"] = rounded(frac)
    status: Status = "fail" if frac > DRIFT_FAIL else "warn" if drift > 0 else "pass"
    return Check(
        name,
        status,
        f"{drift:g} of {calls:g} API calls re-rendered earlier turns ({frac:.1%})",
        ""
        if status == "pass"
        else "the chat template renders earlier turns differently from what was sampled: "
        "the trajectories keep the sampled tokens, but `concat` context is approximate; "
        "prefer export_style: individual, or an agent that resends the assistant messages "
        "it received unchanged",
        nums,
    )


def agent_episode_failures(ev: Evidence) -> Check:
    name = "agent_episode_failures"
    ro = ev.samples("rollout")
    failures = sum_by(ro, "flywheel_rollout_agent_episode_failures_total", "reason")
    done = sum(sum_by(ro, "flywheel_rollout_agent_episodes_total").values())
    failed = sum(failures.values())
    nums: dict[str, Any] = {"episodes": done, "failures_by_reason": failures}
    if not done and not failed:
        return Check(name, "n/a", _NO_AGENT, "", nums)
    frac = failed / (done + failed)
    nums["failure_fraction"] = rounded(frac)
    status = _status(frac, EPISODE_FAIL_WARN, EPISODE_FAIL_FAIL)
    by = ", ".join(f"{k} {v:g}" for k, v in sorted(failures.items())) or "none"
    top = max(failures, key=lambda k: failures[k]) if failures else ""
    advice = {
        "error": "the agent raises: see the rollout log's 'agent episode failed' lines",
        "timeout": "episodes pass rollout.agent.episode_timeout: raise it or bound the agent",
        "max_turns": "the agent keeps calling the model: raise rollout.agent.max_turns or "
        "end its loop",
        "token_budget": "episodes spend rollout.agent.max_tokens_per_episode: raise it",
    }.get(top, "see the rollout log's 'agent episode failed' lines")
    return Check(
        name,
        status,
        f"{failed:g} of {done + failed:g} agent episodes failed ({frac:.1%}: {by})",
        "" if status == "pass" else advice,
        nums,
    )


def tool_failures(ev: Evidence) -> Check:
    name = "tool_failures"
    ro = ev.samples("rollout")
    by_outcome = sum_by(ro, "flywheel_rollout_agent_tool_calls_total", "outcome")
    total = sum(by_outcome.values())
    nums: dict[str, Any] = {"calls_by_outcome": by_outcome}
    if not total:
        return Check(name, "n/a", "no tool calls in the rollout's counters", "", nums)
    frac = 1.0 - by_outcome.get("ok", 0.0) / total
    nums["failure_fraction"] = rounded(frac)
    status = _status(frac, TOOL_FAIL_WARN, TOOL_FAIL_FAIL)
    limits = sum(by_outcome.get(k, 0.0) for k in ("timeout", "memory", "cpu"))
    advice = (
        "tools hit the sandbox's limits (deadline, memory, CPU): raise the agent's "
        "SandboxConfig or make the tools cheaper"
        if limits * 2 >= total * frac
        else "the policy calls tools with arguments they refuse: check the tool schema and "
        "the prompt, or let RL train it away"
    )
    by = ", ".join(f"{k} {v:g}" for k, v in sorted(by_outcome.items()))
    return Check(
        name,
        status,
        f"{total * frac:g} of {total:g} tool calls failed ({frac:.1%}: {by})",
        "" if status == "pass" else advice,
        nums,
    )
