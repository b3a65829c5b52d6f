"""The SGLang client engine against a STAND-IN server (SGLang cannot be installed here).

The stand-in (`tests/rollout/sglang_standin.py`) follows SGLang's documented HTTP fields and
generates with the torch engine, so what is checked here is the client's half of the
contract: request fields, logprob parsing, abort-and-resubmit across weight updates with
per-token versions, verification before SGLang is asked to load anything.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch

from services.common.weights import (
    make_manifest,
    named_parameters_for_update,
    save_weights,
    tensor_specs,
)
from services.rollout.engine.sglang_engine import (
    SGLangEngine,
    SGLangError,
    launch_command,
    parse_generate_response,
    sampling_to_sglang,
)
from services.rollout.types import SamplingParams
from tests.rollout.conftest import load_model
from tests.rollout.engine.test_torch_engine import PROMPTS, fresh_logprobs, hf_greedy
from tests.rollout.sglang_standin import SGLangStandIn
from tests.rollout.test_weight_transports import free_port

pytestmark = pytest.mark.integration


@pytest.fixture
def standin(tiny_model_dir: Path) -> Iterator[SGLangStandIn]:
    s = SGLangStandIn(tiny_model_dir).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
async def sgl(
    standin: SGLangStandIn, tiny_model_dir: Path, tmp_path: Path
) -> AsyncIterator[SGLangEngine]:
    eng = SGLangEngine(standin.url, model_path=str(tiny_model_dir), scratch_dir=str(tmp_path))
    await eng.start()
    try:
        yield eng
    finally:
        await eng.stop()


async def test_greedy_and_logprobs_through_the_http_api(
    sgl: SGLangEngine, standin: SGLangStandIn, tiny_model_dir: Path
) -> None:
    model = load_model(tiny_model_dir)
    for p in PROMPTS[:3]:
        c = await sgl.agenerate(p, SamplingParams(greedy=True, max_new_tokens=10))
        assert c.output_ids == hf_greedy(model, p, 10)
        torch.testing.assert_close(
            torch.tensor(c.logprobs), fresh_logprobs(model, p, c.output_ids), rtol=0, atol=1e-5
        )
        assert c.versions == [0] * len(c.output_ids)
    path, body = standin.calls[0]
    assert (
        path == "/generate" and body["return_logprob"] is True and body["input_ids"] == PROMPTS[0]
    )
    assert body["sampling_params"]["temperature"] == 0.0 and body["sampling_params"]["top_k"] == -1
    assert body["sampling_params"]["max_new_tokens"] == 10


def test_sampling_fields_use_sglang_names() -> None:
    sp = SamplingParams(
        temperature=0.7,
        top_k=20,
        top_p=0.9,
        stop=["\n"],
        stop_token_ids=[5],
        seed=3,
        ignore_eos=True,
    )
    out = sampling_to_sglang(sp, max_new_tokens=7, min_new_tokens=2)
    assert out == {
        "max_new_tokens": 7,
        "min_new_tokens": 2,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "ignore_eos": True,
        "skip_special_tokens": True,
        "no_stop_trim": True,
        "frequency_penalty": 0.0,
        "stop": ["\n"],
        "stop_token_ids": [5],
        "sampling_seed": 3,
    }


async def test_update_mid_generation_resubmits_and_tags_versions(
    sgl: SGLangEngine,
    standin: SGLangStandIn,
    other_model_dir: Path,
    tmp_path: Path,
    tiny_model_dir: Path,
) -> None:
    standin.engine.on_step = lambda eng: time.sleep(0.003)  # keep the request in flight
    new = load_model(other_model_dir)
    sd = named_parameters_for_update(new)
    manifest = save_weights(tmp_path / "v1", sd, 1)  # no config.json: the client supplies it
    prompt = PROMPTS[0]
    task = asyncio.create_task(
        sgl.agenerate(prompt, SamplingParams(greedy=True, max_new_tokens=60, ignore_eos=True))
    )
    while standin.engine.stats.tokens_generated < 5:
        await asyncio.sleep(0.002)
    r = await sgl.update_weights_from_disk(str(tmp_path / "v1"), manifest)
    assert r.ok, r.message
    standin.engine.on_step = None
    c = await task
    k = c.versions.count(0)
    assert 5 <= k < 60 and c.versions == [0] * k + [1] * (60 - k)
    assert c.output_ids[:k] == hf_greedy(load_model(tiny_model_dir), prompt, k)
    for i in range(k, 60):  # after the switch: the new model's arg-max on everything before
        with torch.no_grad():
            assert c.output_ids[i] == int(
                new(torch.tensor([prompt + c.output_ids[:i]])).logits[0, -1].argmax()
            )
    paths = standin.paths()
    gens = [b for p, b in standin.calls if p == "/generate"]
    assert len(gens) == 2 and gens[1]["input_ids"] == prompt + c.output_ids[:k]
    assert gens[1]["sampling_params"]["max_new_tokens"] == 60 - k
    i = paths.index("/pause_generation")
    assert paths[i : i + 4] == [
        "/pause_generation",
        "/update_weights_from_disk",
        "/update_weight_version",
        "/continue_generation",
    ]
    update = dict(standin.calls)["/update_weights_from_disk"]
    assert update["weight_version"] == "1" and Path(update["model_path"], "config.json").is_file()
    assert sgl.version == 1 and sgl.checksum == manifest.checksum
    assert torch.equal(
        standin.engine.current_weights()["model.norm.weight"], sd["model.norm.weight"]
    )


async def test_corrupted_checkpoint_is_refused_before_sglang_sees_it(
    sgl: SGLangEngine, standin: SGLangStandIn, other_model_dir: Path, tmp_path: Path
) -> None:
    sd = named_parameters_for_update(load_model(other_model_dir))
    manifest = save_weights(tmp_path / "v1", sd, 1)
    f = tmp_path / "v1" / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-7] ^= 0x01
    f.write_bytes(bytes(raw))
    r = await sgl.update_weights_from_disk(str(tmp_path / "v1"), manifest)
    assert not r.ok and "checksum mismatch" in r.message and sgl.version == 0
    assert "/update_weights_from_disk" not in standin.paths()


async def test_distributed_update_per_tensor_through_a_real_gloo_group(
    sgl: SGLangEngine, standin: SGLangStandIn, other_model_dir: Path
) -> None:
    sd = named_parameters_for_update(load_model(other_model_dir))
    specs = tensor_specs(sd)
    refused = await sgl.update_weights_from_distributed(make_manifest(sd, 1), specs, 4096)
    assert not refused.ok and "bucket_bytes=0" in refused.message
    port = free_port()
    sender = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.rollout.weights_sender",
            str(other_model_dir),
            str(port),
            "2",
            "0",
        ]
    )
    try:
        await sgl.init_weights_group(
            master_address="127.0.0.1",
            master_port=port,
            rank=1,
            world_size=2,
            backend="gloo",
            group_name="flywheel_weights",
        )
        init = dict(standin.calls)["/init_weights_update_group"]
        assert init == {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "flywheel_weights",
            "backend": "gloo",
        }
        r = await sgl.update_weights_from_distributed(make_manifest(sd, 1), specs, 0)
        assert r.ok, r.message
        body = dict(standin.calls)["/update_weights_from_distributed"]
        assert body["names"] == [s.name for s in specs] and body["group_name"] == "flywheel_weights"
        assert body["dtypes"][0] == "float32" and body["weight_version"] == "1"
        got = standin.engine.current_weights()
        assert all(torch.equal(got[k], v) for k, v in sd.items())
        await standin.engine.close_weights_group()
        assert await asyncio.to_thread(sender.wait, 60) == 0
    finally:
        if sender.poll() is None:
            sender.kill()


async def test_abort_all_returns_partial_output(sgl: SGLangEngine, standin: SGLangStandIn) -> None:
    standin.engine.on_step = lambda eng: time.sleep(0.003)
    task = asyncio.create_task(
        sgl.agenerate(PROMPTS[1], SamplingParams(max_new_tokens=300, ignore_eos=True))
    )
    while standin.engine.stats.tokens_generated < 3:
        await asyncio.sleep(0.002)
    await sgl.abort_all()
    c = await task
    assert c.stop_reason == "abort" and 3 <= len(c.output_ids) < 300
    assert ("/abort_request", {"rid": "", "abort_all": True}) in standin.calls


def test_launch_command_and_response_parsing() -> None:
    cmd = launch_command(
        "/m",
        "127.0.0.1",
        30000,
        2,
        {"mem_fraction_static": 0.8, "enable_metrics": True, "x": False},
    )
    assert cmd[1:] == [
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/m",
        "--host",
        "127.0.0.1",
        "--port",
        "30000",
        "--tp-size",
        "2",
        "--mem-fraction-static",
        "0.8",
        "--enable-metrics",
    ]
    ok = {
        "output_ids": [5, 6],
        "meta_info": {
            "finish_reason": {"type": "length", "length": 2},
            "output_token_logprobs": [[-0.5, 5, None], [-1.0, 6, None]],
        },
    }
    assert parse_generate_response(ok) == ([5, 6], [-0.5, -1.0], "length")
    with pytest.raises(SGLangError, match="disagree"):
        parse_generate_response(dict(ok, output_ids=[5, 7]))
    with pytest.raises(SGLangError, match="finish_reason"):
        parse_generate_response({"meta_info": {"finish_reason": {"type": "weird"}}})
