"""services/api.py: the contracts import without torch, `load_dotted` says what is wrong,
and the filter adapter keeps its promises."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from services import api
from services.core.types import TrajectoryGroup
from services.rollout.workflows.base import build_trajectory
from tests.fresh_python import run_fresh

ROOT = Path(__file__).resolve().parents[1]


def test_contracts_import_without_torch() -> None:
    code = (
        "import sys; import services.api, services.core.filters, services.buffer.filters; "
        "import services.reward.registry; "
        "import services.rollout.workflows.base; "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]"
    )
    out = run_fresh(code)
    assert out.returncode == 0, out.stderr


def test_the_engines_implement_the_protocol(tmp_path: Path) -> None:
    from services.rollout.engine.torch_engine import TorchEngine

    # Not started: the protocol is about members, which the base class sets up.
    assert isinstance(TorchEngine(tmp_path, device="cpu"), api.InferenceEngine)
    assert not isinstance(object(), api.InferenceEngine)


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("os.path:join", None),
        ("os.path.join", None),
        ("collections:OrderedDict.fromkeys", None),  # an attribute path after the colon
        ("no_such_mod_xyz.fn", "k: cannot import module 'no_such_mod_xyz'"),
        ("os.path:nope", "k: 'os.path' has no attribute 'nope'"),
        ("collections:OrderedDict.nope", "'collections.OrderedDict' has no attribute 'nope'"),
        ("plain", "not a dotted path"),
        ("", "expected a dotted path"),
        ("os:sep", "is a str, not a callable"),
    ],
)
def test_load_dotted(path: str, words: str | None) -> None:
    if words is None:
        assert callable(api.load_dotted(path, "k", require_callable=True))
    else:
        with pytest.raises(api.DottedPathError, match=words.replace("(", r"\(")):
            api.load_dotted(path, "k", require_callable=True)


def test_load_dotted_reports_a_broken_user_module(tmp_path: Path) -> None:
    (tmp_path / "broken_user_mod.py").write_text("def f(:\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(api.DottedPathError, match="SyntaxError"):
            api.load_dotted("broken_user_mod.f", "reward.fn")
    finally:
        sys.path.remove(str(tmp_path))


def _group(*rewards: float) -> TrajectoryGroup:
    return TrajectoryGroup(
        "g",
        [
            build_trajectory([1], [([2], [0.0], [0], 0)], reward=r, stop_reason="stop")
            for r in rewards
        ],
    )


def test_rewards_filter_adapts_binds_and_checks_the_result() -> None:
    def above(rewards: list[float], floor: float) -> bool:
        return min(rewards) > floor

    keep = api.rewards_filter(above, floor=0.25)
    # the group, a bare list and AReaL's mapping all reach `above` as the rewards
    assert keep(_group(0.5, 1.0)) is True and keep(_group(0.0, 1.0)) is False
    assert keep([0.5, 0.75]) is True and keep({"rewards": [0.0]}) is False  # type: ignore[arg-type]

    def truthy(rewards: list[float]) -> bool:
        return 1  # type: ignore[return-value]

    with pytest.raises(TypeError, match="returned int, expected bool"):
        api.rewards_filter(truthy)(_group(1.0))


def test_is_rewards_filter_reads_the_first_parameter() -> None:
    def older(rewards: list[float]) -> bool:
        return True

    def newer(group: TrajectoryGroup) -> bool:
        return True

    assert api.is_rewards_filter(older) and not api.is_rewards_filter(newer)
    assert not api.is_rewards_filter(api.rewards_filter(older))  # already adapted
    assert api.accepts_positional(newer, 1) and not api.accepts_positional(newer, 2)
