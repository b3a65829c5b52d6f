"""The Helm engines the launcher renders the chart with: helm-python-sdk (Helm's Go SDK,
installed here), and the `helm` binary when one is on PATH. No `helm` binary can be
installed on this machine, so its test puts a stand-in named `helm` on PATH: it checks the
command line the launcher gives (`helm template RELEASE CHART -n NS -f values.yaml`) and
renders with the same Go engine through the SDK, failing as `helm` fails (stderr, exit 1)."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from services.common.config import load_config
from services.launcher import helm_render, k8s_values

ROOT = Path(__file__).resolve().parents[2]

STAND_IN_HELM = textwrap.dedent(
    """\
    #!{python}
    # Stand-in `helm` (no binary on this machine): `helm template` through helm-python-sdk.
    import sys, yaml
    import helm_python as helm
    args = sys.argv[1:]
    assert args[0] == "template" and args[3] == "-n" and args[5] == "-f", args
    release, chart, namespace, values_file = args[1], args[2], args[4], args[6]
    with open("{log}", "w") as log:
        log.write(" ".join(args))
    values = yaml.safe_load(open(values_file))
    try:
        with helm.Chart.load(chart) as c:
            out = c.render(values, name=release, namespace=namespace, is_install=True)
    except helm.HelmError as exc:
        print("Error: " + str(exc), file=sys.stderr)
        sys.exit(1)
    for name, text in sorted(out.items()):
        if name.endswith(".yaml"):
            print("---\\n# Source: " + name + "\\n" + text)
    """
)


@pytest.fixture
def values():
    cfg = load_config(
        str(ROOT / "examples" / "grpo.yaml"),
        [
            "scheduler.type=kubernetes",
            "actor.path=/data/shared/models/tiny",
            "train_dataset.path=/data/shared/data/train.jsonl",
            "rollout.n_replicas=3",
        ],
    )
    return k8s_values.chart_values(cfg)


@pytest.fixture
def stand_in_helm(tmp_path):
    binary = tmp_path / "bin" / "helm"
    binary.parent.mkdir()
    log = tmp_path / "helm-args"
    binary.write_text(STAND_IN_HELM.format(python=sys.executable, log=log))
    binary.chmod(0o755)
    return binary, log


def summary(objects):
    return [(o["kind"], o["metadata"]["name"], o["metadata"]["namespace"]) for o in objects]


def test_the_sdk_renders_the_chart_with_the_values(values):
    objects = helm_render.render_chart(values, release="exp", namespace="team-a")
    names = summary(objects)
    assert ("StatefulSet", "exp-flywheel-rollout", "team-a") in names
    assert ("Deployment", "exp-flywheel-buffer", "team-a") in names
    [rollout] = [
        o for o in objects if o["kind"] == "StatefulSet" and "rollout" in o["metadata"]["name"]
    ]
    assert rollout["spec"]["replicas"] == 3


def test_the_binary_on_path_is_used_and_renders_the_same(values, stand_in_helm, monkeypatch):
    binary, log = stand_in_helm
    monkeypatch.setenv("PATH", f"{binary.parent}{os.pathsep}{os.environ['PATH']}")
    by_binary = helm_render.render_chart(values, release="exp", namespace="team-a")
    args = log.read_text().split()
    assert args[:6] == ["template", "exp", str(helm_render.CHART), "-n", "team-a", "-f"]
    monkeypatch.setenv("PATH", str(binary.parent.parent))  # no helm: the SDK
    by_sdk = helm_render.render_chart(values, release="exp", namespace="team-a")
    assert by_binary == by_sdk and len(by_binary) > 10
    # the values file (it holds the tokens) is gone after the render
    assert not Path(args[6]).exists()


def test_a_chart_refusal_is_reported_with_helms_message(values, stand_in_helm, monkeypatch):
    binary, _ = stand_in_helm
    monkeypatch.setenv("PATH", str(binary.parent.parent))  # None: no helm on PATH, the SDK
    values["config"]["actor"]["path"] = ""  # the chart fails without a model and no demo
    for engine in (str(binary), None):
        with pytest.raises(helm_render.HelmRenderError, match="config.actor.path is empty"):
            helm_render.render_chart(values, release="exp", namespace="ns", helm_binary=engine)


def test_without_any_engine_the_error_names_both(values, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no helm here
    monkeypatch.setitem(sys.modules, "helm_python", None)  # as if not installed
    with pytest.raises(helm_render.HelmRenderError) as raised:
        helm_render.render_chart(values, release="exp", namespace="ns")
    message = str(raised.value)
    assert "`helm` binary" in message and "helm-python-sdk" in message


def test_a_missing_chart_is_named(values, tmp_path):
    with pytest.raises(helm_render.HelmRenderError, match="no Helm chart at"):
        helm_render.render_chart(values, release="exp", namespace="ns", chart=tmp_path)
