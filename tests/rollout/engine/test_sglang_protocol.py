"""SGLang's vocabulary (services/rollout/engine/sglang_protocol.py) held to SGLang 0.5.23.

The reference is SGLang's own code, pinned in `tests/rollout/sglang_schema.json` by
`tools/sglang_schema.py`: `sampling_error` runs SGLang's `SamplingParams.__post_init__` and
`verify()` from that source on what we send, the way `/generate` does before it generates.
The answer parsing is held to the shapes of SGLang's `meta_info` (`output_token_logprobs`
triples, `finish_reason.type`, `weight_versions` spans) as the pinned classes declare them.
"""

from __future__ import annotations

import itertools

import httpx
import pytest

from services.core.types import SamplingParams
from services.rollout.engine.sglang_protocol import (
    BASE_WEIGHT_VERSION,
    SGLangError,
    answer_json,
    meta_info,
    parse_generate_response,
    sampling_to_sglang,
    server_version,
    token_versions,
)
from tests.rollout.sglang_standin import SCHEMA, sampling_error

VOCAB = 49_152  # SmolLM2's vocabulary; verify() only uses it for logit_bias


SAMPLINGS = [
    SamplingParams(),
    SamplingParams(greedy=True),
    SamplingParams(temperature=0.0, top_k=50),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=3),
    SamplingParams(top_k=-1, stop=["\n\n", "</answer>"], stop_token_ids=[0, 2]),
    SamplingParams(frequency_penalty=1.5, ignore_eos=True, skip_special_tokens=False),
    SamplingParams(seed=2**63 - 1),
]


@pytest.mark.parametrize(
    ("sampling", "budget"),
    list(itertools.product(SAMPLINGS, [(1, 0), (7, 2), (3, 8), (512, 512)])),
)
def test_sglangs_own_verify_accepts_every_request_we_build(
    sampling: SamplingParams, budget: tuple[int, int]
) -> None:
    max_new, min_new = budget  # (3, 8): a request whose budget fell below the minimum
    sent = sampling_to_sglang(sampling, max_new_tokens=max_new, min_new_tokens=min_new)
    assert sampling_error(sent, VOCAB) is None, sent
    assert sent["max_new_tokens"] == max_new
    assert sent["min_new_tokens"] == min(min_new, max_new)


def test_the_reference_refuses_what_the_cap_prevents() -> None:
    # Without the cap SGLang answers HTTP 400: the reference can fail, and fails here.
    sent = sampling_to_sglang(SamplingParams(), max_new_tokens=3, min_new_tokens=8)
    error = sampling_error({**sent, "min_new_tokens": 8}, VOCAB)
    assert error is not None and "min_new_tokens must be in [0, max_new_tokens(3)]" in error
    # SGLang's top_k: -1 disables it and 0 is refused; our "no limit" (0) must become -1.
    assert sampling_to_sglang(SamplingParams(top_k=0), 4, 0)["top_k"] == -1
    assert "top_k" in (sampling_error({**sent, "top_k": 0}, VOCAB) or "")


def test_sglangs_answer_fields_we_read_are_declared_by_its_classes() -> None:
    # meta_info's per-version spans and the version field of the disk update request
    gen_out = SCHEMA["classes"]["GenerateReqInput"]["fields"]
    assert "return_logprob" in gen_out and "image_data" in gen_out and "rid" in gen_out
    disk = SCHEMA["classes"]["UpdateWeightFromDiskReqInput"]["fields"]
    assert disk["weight_version"]["type"] == "Optional[str]"  # a label, not a number
    assert any("weight_versions" in c["fields"] for c in SCHEMA["classes"].values())


def test_weight_version_labels_map_to_flywheel_versions() -> None:
    # SGLang tags launch weights "default" unless launched with --weight-version
    assert server_version("default") == BASE_WEIGHT_VERSION == 0
    assert server_version("7") == 7 and server_version(12) == 12
    assert server_version("v-anything") == BASE_WEIGHT_VERSION
    assert server_version(None) is None  # an older server: unknown


def test_token_versions_follow_sglangs_half_open_spans() -> None:
    meta = {
        "weight_versions": [
            {"version": "3", "start": 0, "end": 2},
            {"version": "4", "start": 2, "end": 5},
        ],
        "weight_version": "4",
    }
    # [0, 2) at 3, [2, 5) at 4; the spans win over the single label
    assert token_versions(meta, 5, fallback=-9) == [3, 3, 4, 4, 4]
    # a span past the piece's end is cut at n_tokens; uncovered tokens keep the fallback
    short = {"weight_versions": [{"version": "6", "start": 1, "end": 99}]}
    assert token_versions(short, 3, fallback=5) == [5, 6, 6]
    assert token_versions({"weight_version": "default"}, 2, fallback=5) == [0, 0]
    assert token_versions({}, 2, fallback=5) == [5, 5]


def test_answers_unwrap_batches_and_refuse_what_sglang_would_not_send() -> None:
    one = {
        "output_ids": [11, 12, 13],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 2},
            "output_token_logprobs": [[-0.25, 11, None], [-1.5, 12, None], [0.0, 13, None]],
            "weight_version": "2",
        },
    }
    assert parse_generate_response([one]) == ([11, 12, 13], [-0.25, -1.5, 0.0], "stop")
    assert meta_info([one])["weight_version"] == "2"
    assert meta_info({"no": "meta"}) == {}
    with pytest.raises(SGLangError, match="2 results for one prompt"):
        parse_generate_response([one, one])
    with pytest.raises(SGLangError, match="without logprobs"):
        parse_generate_response({"output_ids": [1], "meta_info": {"finish_reason": "stop"}})


def test_http_failures_raise_with_the_servers_words() -> None:
    req = httpx.Request("POST", "http://sglang/update_weights_from_disk")
    bad = httpx.Response(400, json={"success": False, "message": "shape mismatch"}, request=req)
    with pytest.raises(SGLangError, match=r"/update_weights_from_disk: HTTP 400: .*shape"):
        answer_json("/update_weights_from_disk", bad)
    ok = httpx.Response(200, json={"success": True, "message": ""}, request=req)
    assert answer_json("/update_weights_from_disk", ok) == {"success": True, "message": ""}
    empty = httpx.Response(200, content=b"", request=req)
    assert answer_json("/continue_generation", empty) == {}
