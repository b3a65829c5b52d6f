"""The pinned SGLang contract (`tests/rollout/sglang_schema.json`) and its extractor.

The schema is read from SGLang 0.5.23's own source by `tools/sglang_schema.py` (the request
classes cannot be imported without torch, zmq, msgspec and GPU kernels). With the wheel
present (`FLYWHEEL_SGLANG_SRC`: the unpacked wheel or the `.whl`), `--check` proves the
pinned file is exactly what that wheel says; without it, the pinned file is what the
stand-in and the client are held to.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.core.types import SamplingParams
from services.rollout.engine.sglang_protocol import sampling_to_sglang
from tests.rollout.sglang_standin import SCHEMA, SCHEMA_PATH, contract_violations

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "sglang_schema.py"
PINNED_VERSION = "0.5.23"


def _wheel() -> Path:
    src = os.environ.get("FLYWHEEL_SGLANG_SRC", "")
    if not src or not Path(src).exists():
        pytest.skip(
            f"FLYWHEEL_SGLANG_SRC unset: point it at sglang=={PINNED_VERSION} "
            f"(pip download sglang=={PINNED_VERSION} --no-deps -d DIR; the .whl or unzipped)"
        )
    return Path(src)


def test_pinned_schema_names_the_pinned_version_and_every_route_used() -> None:
    assert SCHEMA["sglang_version"] == PINNED_VERSION
    routes = SCHEMA["routes"]
    assert routes["/generate"]["body"] == "GenerateReqInput"
    assert routes["/destroy_weights_update_group"]["body"] == "DestroyWeightsUpdateGroupReqInput"
    assert routes["/health"]["handler"] == "health_generate"  # it generates a token
    assert routes["/ping"]["body"] is None
    # SGLang's generated JSON contract refuses unknown sampling keys with HTTP 400.
    assert SCHEMA["classes"]["api.v1.SamplingParams"]["unknown_keys"] == "rejected"
    init = SCHEMA["classes"]["InitWeightsUpdateGroupReqInput"]["fields"]
    assert {k for k, f in init.items() if f["required"]} == {
        "master_address",
        "master_port",
        "rank_offset",
        "world_size",
    }
    assert SCHEMA["classes"]["PauseGenerationReqInput"]["fields"]["mode"]["default"] == "'abort'"


def test_every_sampling_field_the_client_sends_is_one_sglang_has() -> None:
    sp = SamplingParams(
        temperature=0.7, top_k=20, top_p=0.9, stop=["\n"], stop_token_ids=[5], seed=3
    )
    sent = set(sampling_to_sglang(sp, max_new_tokens=7, min_new_tokens=2))
    assert sent <= set(SCHEMA["classes"]["api.v1.SamplingParams"]["fields"])
    assert (
        contract_violations(
            "/generate", {"input_ids": [1], "sampling_params": dict.fromkeys(sent, 0)}
        )
        == []
    )


def test_the_standin_refuses_what_sglang_would() -> None:
    assert contract_violations(
        "/generate", {"input_ids": [1], "sampling_params": {"max_new_token": 3}}
    ) == ["/generate: sampling_params has unknown field 'max_new_token'"]
    assert contract_violations("/update_weights_from_disk", {"weight_version": "1"}) == [
        "/update_weights_from_disk: missing field 'model_path'"
    ]
    assert contract_violations("/abort_request", {"abort_all": True, "everything": 1}) == [
        "/abort_request: unknown field 'everything'"
    ]
    assert contract_violations("/not_a_route", {}) == [
        f"/not_a_route is not a route of SGLang {PINNED_VERSION}"
    ]


def test_check_mode_matches_the_wheel(tmp_path: Path) -> None:
    src = _wheel()
    ok = subprocess.run(
        [sys.executable, str(TOOL), "--src", str(src), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # A pinned file that drifted from the wheel (a field SGLang dropped) is caught.
    drifted = json.loads(SCHEMA_PATH.read_text())
    del drifted["classes"]["InitWeightsUpdateGroupReqInput"]["fields"]["rank_offset"]
    bad = tmp_path / "schema.json"
    bad.write_text(json.dumps(drifted, indent=1) + "\n")
    r = subprocess.run(
        [sys.executable, str(TOOL), "--src", str(src), "--check", "--out", str(bad)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 1 and '"rank_offset"' in r.stdout
