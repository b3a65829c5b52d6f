"""The SGLang client engine against a STAND-IN server (SGLang cannot run here).

The stand-in (`tests/rollout/sglang_standin.py`) checks every request against the fields of
SGLang 0.5.23's own request classes (`tests/rollout/sglang_schema.json`, extracted from the
wheel) and mimics the server's behaviours as its source has them (503 health while paused,
empty aborts before prefill, 400 on context overflow, unknown tensor names skipped with a
warning, group names that must be destroyed before reuse, `meta_info.weight_version`).
Checked here: the client's half of that contract: request fields, logprob parsing,
abort-and-resubmit across weight updates, per-token versions as the server reports them, a
restarted server noticed, control calls on their own connections.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch

from services.common.weights.disk import save_weights
from services.common.weights.manifest import (
    WeightManifest,
    WeightsError,
    make_manifest,
    named_parameters_for_update,
    tensor_specs,
)
from services.core.types import SamplingParams
from services.rollout.engine.sglang_engine import SGLangEngine
from services.rollout.engine.sglang_protocol import (
    ContextOverflowError,
    SGLangError,
    launch_command,
    parse_generate_response,
    sampling_to_sglang,
    server_version,
    token_versions,
)
from tests.rollout.conftest import load_model
from tests.rollout.engine.test_torch_engine import PROMPTS, fresh_logprobs, hf_greedy
from tests.rollout.sglang_standin import SCHEMA, SGLangStandIn
from tests.rollout.test_weight_transports import free_port

pytestmark = pytest.mark.integration

# What SGLang 0.5.23 answers a `min_new_tokens` above `max_new_tokens` with: the message of
# `SamplingParams.verify()` (`sglang/srt/sampling/sampling_params.py`), HTTP 400.
MIN_OVER_MAX = "min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}."


@pytest.fixture
def standin(tiny_model_dir: Path) -> Iterator[SGLangStandIn]:
    s = SGLangStandIn(tiny_model_dir).start()
    try:
        yield s
    finally:
        s.hold_prefill.clear()
        s.in_transit.clear()
        s.stop()
    # Every request the client sent fits SGLang's request classes.
    assert s.contract_errors == []


async def wait_for(pred: Callable[[], bool], what: str, limit: float = 60.0) -> None:
    """Poll `pred`; the limit only turns a hang into a failure naming `what`."""
    deadline = time.monotonic() + limit
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.005)


def hold_until_paused(
    standin: SGLangStandIn, *, after_tokens: int, step_s: float = 0.0
) -> list[bool]:
    """Make the stand-in's engine stop, once, after `after_tokens` tokens until the server
    is paused (bounded at 120 s), each step taking `step_s`; the list returned holds one
    entry from then on. The step lock is held meanwhile, so only the flag is waited for."""
    held: list[bool] = []

    def on_step(eng: object) -> None:
        if not held and standin.engine.stats.tokens_generated >= after_tokens:
            held.append(True)
            deadline = time.monotonic() + 120
            while not standin.paused and time.monotonic() < deadline:
                time.sleep(0.002)
        time.sleep(step_s)

    standin.engine.on_step = on_step
    return held


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
    path, body, _ = standin.calls[0]
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
    # At 3 ms a step alone, a loaded machine could finish all 60 tokens before the update's
    # pause arrives (k = 60, nothing resubmitted): hold the request in flight until it does.
    hold_until_paused(standin, after_tokens=5, step_s=0.003)
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
    gens = standin.bodies("/generate")
    assert len(gens) == 2 and gens[1]["input_ids"] == prompt + c.output_ids[:k]
    assert gens[1]["sampling_params"]["max_new_tokens"] == 60 - k
    i = paths.index("/pause_generation")
    # The version travels with the update: no separate /update_weight_version call.
    assert paths[i : i + 3] == [
        "/pause_generation",
        "/update_weights_from_disk",
        "/continue_generation",
    ]
    assert standin.bodies("/pause_generation") == [{"mode": "abort"}]
    [update] = standin.bodies("/update_weights_from_disk")
    # A folder prepared in scratch_dir (the stand-in, like SGLang, loads a folder with the
    # model's config.json), removed once loaded.
    assert update["weight_version"] == "1" and Path(update["model_path"]).parent == tmp_path
    assert list(tmp_path.glob("v00000001-*")) == []
    assert sgl.version == 1 and sgl.checksum == manifest.checksum
    assert torch.equal(
        standin.engine.current_weights()["model.norm.weight"], sd["model.norm.weight"]
    )


def record_load_file(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every file safetensors' `load_file` reads (the stand-in's reads included)."""
    import safetensors.torch

    real = safetensors.torch.load_file
    seen: list[Path] = []

    def spy(filename: str, *args: object, **kwargs: object) -> dict[str, torch.Tensor]:
        seen.append(Path(filename))
        return real(filename, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(safetensors.torch, "load_file", spy)
    return seen


async def test_disk_update_reads_only_headers_and_hands_sglang_the_path(
    sgl: SGLangEngine,
    standin: SGLangStandIn,
    other_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tensors are SGLang's to read: the rollout checks the manifest and the safetensors
    headers and sends the path, so a byte changed in the tensor data (same size, header
    intact) is not noticed here: proof that the data was never read into this process (a
    float32 model of billions of parameters would not fit beside SGLang's)."""
    reads = record_load_file(monkeypatch)
    sd = named_parameters_for_update(load_model(other_model_dir))
    manifest = save_weights(tmp_path / "published" / "v1", sd, 1)
    f = tmp_path / "published" / "v1" / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-7] ^= 0x01
    f.write_bytes(bytes(raw))
    r = await sgl.update_weights_from_disk(str(f.parent), manifest)
    assert r.ok, r.message
    assert sgl.version == 1
    [update] = standin.bodies("/update_weights_from_disk")
    handed = Path(update["model_path"])
    # A prepared folder in scratch_dir: the model's config beside a relative link to the
    # published file (nothing copied), removed once SGLang has loaded it.
    assert handed.parent == tmp_path and handed.name.startswith("v00000001-")
    assert not handed.exists()
    # The rollout never read the published file; the stand-in (SGLang) read it through the
    # link in the folder it was sent.
    assert reads == [handed / "model.safetensors"]


async def test_truncated_or_torn_weights_are_refused_from_the_headers(
    sgl: SGLangEngine, standin: SGLangStandIn, other_model_dir: Path, tmp_path: Path
) -> None:
    """What the headers show is refused before SGLang sees it: SGLang's own failed load
    would retry the same folder for its roll-back (`weight_updater.py`
    `update_weights_from_disk`)."""
    sd = named_parameters_for_update(load_model(other_model_dir))
    manifest = save_weights(tmp_path / "v1", sd, 1)
    f = tmp_path / "v1" / "model.safetensors"
    whole = f.read_bytes()
    f.write_bytes(whole[:-8])
    r = await sgl.update_weights_from_disk(str(tmp_path / "v1"), manifest)
    assert not r.ok and "truncated" in r.message and sgl.version == 0
    f.write_bytes(whole)
    fewer = dict(list(sd.items())[1:])
    save_weights(tmp_path / "v2", fewer, 2)
    (tmp_path / "v2" / "flywheel_weights.json").write_text(
        WeightManifest(2, "x", len(sd), manifest.total_bytes).to_json()
    )
    r = await sgl.update_weights_from_disk(str(tmp_path / "v2"), None)
    assert not r.ok and f"the manifest says {len(sd)}" in r.message
    r = await sgl.update_weights_from_disk(str(tmp_path / "v1"), make_manifest(sd, 3))
    assert not r.ok and "holds version 1" in r.message
    assert "/update_weights_from_disk" not in standin.paths()


async def test_weights_reach_a_server_that_mounts_only_the_shared_volume(
    tiny_model_dir: Path, other_model_dir: Path, tmp_path: Path
) -> None:
    """SGLang runs in its own container and opens the path it is sent there. With the
    configuration's defaults the handover folder is in the run directory on the shared
    volume (not the rollout's private /tmp), its links resolve on that volume, and both
    transports that go through disk reach the server."""
    from services.common.config import load_config

    shared = tmp_path / "shared"
    standin = SGLangStandIn(tiny_model_dir, mounts=[shared, tiny_model_dir]).start()
    cfg = load_config(
        None,
        [
            f"cluster.fileroot={shared}",
            f"actor.path={tiny_model_dir}",
            "rollout.engine=sglang",
            f"rollout.sglang.url={standin.url}",
        ],
    )
    eng = SGLangEngine.from_config(cfg, tokenizer_path=str(tiny_model_dir))
    assert eng.scratch_dir == str(shared / "flywheel" / "trial0" / "sglang_handover")
    await eng.start()
    try:
        sd = named_parameters_for_update(load_model(other_model_dir))
        published = shared / "flywheel" / "trial0" / "weights" / "v00000001"
        manifest = save_weights(published, sd, 1)
        r = await eng.update_weights_from_disk(str(published), manifest)
        assert r.ok, r.message
        sd2 = {k: v + 1 for k, v in sd.items()}
        r = await eng.update_weights_from_tensors(sd2, make_manifest(sd2, 2))
        assert r.ok, r.message
        got = standin.engine.current_weights()
        assert all(torch.equal(got[k], v) for k, v in sd2.items())
        sent = [Path(b["model_path"]) for b in standin.bodies("/update_weights_from_disk")]
        assert [p.parent for p in sent] == [Path(eng.scratch_dir)] * 2
        assert list(Path(eng.scratch_dir).iterdir()) == []  # nothing left behind
        # A folder outside the server's mounts (this container's /tmp, say) is not there
        # for the server: the update fails, as SGLang's does.
        eng.scratch_dir = str(tmp_path / "private")
        v3 = published.with_name("v00000003")
        r = await eng.update_weights_from_disk(str(v3), save_weights(v3, sd, 3))
        assert not r.ok and "not a local directory" in r.message and eng.version == 2
    finally:
        await eng.stop()
        standin.stop()
    assert standin.contract_errors == []


def start_sender(model_dir: Path, port: int, *buckets: int) -> subprocess.Popen[bytes]:
    """The trainer's rank 0 of a world of 2 in its own process, one broadcast per bucket."""
    args = ["-m", "tests.rollout.weights_sender", str(model_dir), str(port), "2"]
    return subprocess.Popen([sys.executable, *args, *map(str, buckets)])


async def join_as_rank_1(eng: SGLangEngine, port: int) -> None:
    await eng.init_weights_group(
        master_address="127.0.0.1",
        master_port=port,
        rank=1,
        world_size=2,
        backend="gloo",
        group_name="flywheel_weights",
    )


async def test_distributed_update_per_tensor_through_a_real_gloo_group(
    sgl: SGLangEngine, standin: SGLangStandIn, other_model_dir: Path
) -> None:
    sd = named_parameters_for_update(load_model(other_model_dir))
    specs = tensor_specs(sd)
    refused = await sgl.update_weights_from_distributed(make_manifest(sd, 1), specs, 4096)
    assert not refused.ok and "bucket_bytes=0" in refused.message
    port = free_port()
    sender = start_sender(other_model_dir, port, 0)
    try:
        await join_as_rank_1(sgl, port)
        # A group of that name left from an earlier attempt is destroyed first (here there
        # is none: SGLang answers 400 "does not exist", which the client accepts).
        assert standin.paths()[-2:] == [
            "/destroy_weights_update_group",
            "/init_weights_update_group",
        ]
        [init] = standin.bodies("/init_weights_update_group")
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
        [body] = standin.bodies("/update_weights_from_distributed")
        assert body["names"] == [s.name for s in specs] and body["group_name"] == "flywheel_weights"
        assert body["dtypes"][0] == "float32" and body["weight_version"] == "1"
        got = standin.engine.current_weights()
        assert all(torch.equal(got[k], v) for k, v in sd.items())
        group = standin.groups["flywheel_weights"]
        assert group is not None
        await asyncio.to_thread(group.close)  # the sender's closing barrier
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
    assert {"rid": "", "abort_all": True} in standin.bodies("/abort_request")


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


# --------------------------------------------------------------------- the real contract


def _publish(model_dir: Path, root: Path, version: int) -> tuple[Path, WeightManifest]:
    sd = named_parameters_for_update(load_model(model_dir))
    path = root / f"v{version}"
    return path, save_weights(path, sd, version)


async def test_tokens_carry_the_version_the_server_reports_not_the_clients_snapshot(
    sgl: SGLangEngine,
    standin: SGLangStandIn,
    other_model_dir: Path,
    tmp_path: Path,
) -> None:
    """A request that is still on the wire when a pause lands waits inside the server and
    runs after the update, on the new weights: its tokens must say version 1, although the
    client took its snapshot (0) before the update (SGLang labels them through
    `meta_info.weight_version`, `managers/tokenizer_manager.py`)."""
    path, manifest = _publish(other_model_dir, tmp_path, 1)
    standin.in_transit.set()
    prompt = PROMPTS[2]
    task = asyncio.create_task(
        sgl.agenerate(prompt, SamplingParams(greedy=True, max_new_tokens=8, ignore_eos=True))
    )
    await wait_for(lambda: standin.arrived == 1, "the request reached the server's socket")
    r = await sgl.update_weights_from_disk(str(path), manifest)
    assert r.ok, r.message
    standin.in_transit.clear()
    c = await task
    assert c.output_ids == hf_greedy(load_model(other_model_dir), prompt, 8)  # new weights
    assert c.versions == [1] * 8
    assert len(standin.bodies("/generate")) == 1  # it was never interrupted
    assert sgl.server_restarts == 0


async def test_a_restarted_server_on_base_weights_is_noticed_and_resynced(
    sgl: SGLangEngine,
    standin: SGLangStandIn,
    tiny_model_dir: Path,
    other_model_dir: Path,
    tmp_path: Path,
) -> None:
    """SGLang restarted (OOM-killed, rescheduled) comes back on its launch weights and
    reports `weight_version` "default" (`arg_groups/fields/serving.py`). The client must
    not keep labelling those tokens with the version it had installed: it reports version
    0 (what is served), forgets the lost group, and a later update brings it back."""
    greedy = SamplingParams(greedy=True, max_new_tokens=6, ignore_eos=True)
    path1, m1 = _publish(other_model_dir, tmp_path, 1)
    assert (await sgl.update_weights_from_disk(str(path1), m1)).ok
    c = await sgl.agenerate(PROMPTS[0], greedy)
    assert c.versions == [1] * 6 and sgl.version == 1

    standin.restart()
    c = await sgl.agenerate(PROMPTS[0], greedy)
    assert c.output_ids == hf_greedy(load_model(tiny_model_dir), PROMPTS[0], 6)  # base
    assert c.versions == [0] * 6
    assert sgl.version == 0 and sgl.checksum == "" and sgl.server_restarts == 1

    # Re-sync: the next published weights are accepted (the version moves forward again).
    path2, m2 = _publish(other_model_dir, tmp_path, 2)
    r = await sgl.update_weights_from_disk(str(path2), m2)
    assert r.ok and r.version == 2, r.message
    c = await sgl.agenerate(PROMPTS[0], greedy)
    assert c.versions == [2] * 6 and sgl.server_restarts == 1


async def test_a_client_restarted_against_a_running_server_takes_its_version(
    standin: SGLangStandIn, other_model_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The rollout process restarts, SGLang keeps running on published weights (version 1):
    the new client starts at version 1 (`GET /model_info`), not 0."""
    first = SGLangEngine(standin.url, model_path=str(tiny_model_dir), scratch_dir=str(tmp_path))
    await first.start()
    path, manifest = _publish(other_model_dir, tmp_path, 1)
    assert (await first.update_weights_from_disk(str(path), manifest)).ok
    await first.stop()  # the rollout process goes; the server keeps its weights
    second = SGLangEngine(standin.url, model_path=str(tiny_model_dir), scratch_dir=str(tmp_path))
    await second.start()
    try:
        assert second.version == 1
    finally:
        await second.stop()


async def test_control_calls_do_not_queue_behind_generation(
    sgl: SGLangEngine, standin: SGLangStandIn
) -> None:
    """100 generation requests in flight hold 100 connections (httpx's default pool size):
    a pause must still reach the server at once, on a connection of its own."""
    n = 100
    standin.in_transit.set()
    tasks = [
        asyncio.create_task(sgl.agenerate(PROMPTS[i % 5], SamplingParams(max_new_tokens=1)))
        for i in range(n)
    ]
    await wait_for(lambda: standin.arrived == n, "all generation requests reached the server")
    pause = asyncio.create_task(sgl.pause())
    await wait_for(lambda: "/pause_generation" in standin.paths(), "the pause reached the server")
    assert standin.arrived == n and not any(t.done() for t in tasks)  # all still held
    await pause
    assert standin.paused
    standin.in_transit.clear()
    await sgl.resume()
    done = await asyncio.gather(*tasks)
    assert all(len(c.output_ids) == 1 for c in done)
    gen_ports = {port for path, _, port in standin.calls if path == "/generate"}
    ctl_ports = {port for path, _, port in standin.calls if path != "/generate"}
    assert gen_ports.isdisjoint(ctl_ports)


async def test_health_is_503_while_paused_and_the_client_uses_ping(
    sgl: SGLangEngine, standin: SGLangStandIn
) -> None:
    """SGLang's `/health` generates one token, so a paused server answers 503 (after
    `SGLANG_HEALTH_CHECK_TIMEOUT`); a liveness check built on it would restart a server
    in the middle of a long update. The client's check is `/ping`, 200 while paused."""
    import httpx

    await sgl.pause()
    async with httpx.AsyncClient(base_url=standin.url) as raw:
        assert (await raw.get("/health")).status_code == 503
        assert (await raw.get("/ready")).status_code == 503
        assert (await raw.get("/ping")).status_code == 200
    assert await sgl.alive()
    await sgl.resume()
    async with httpx.AsyncClient(base_url=standin.url) as raw:
        assert (await raw.get("/health")).status_code == 200


async def test_abort_before_prefill_returns_no_tokens_and_is_not_resubmitted(
    sgl: SGLangEngine, standin: SGLangStandIn
) -> None:
    """An operator's `/abort_request` reaches a request still queued before prefill: SGLang
    pops it from the waiting queue and answers `abort` with no tokens
    (`managers/scheduler.py` `abort_request`). The client returns that as an aborted,
    empty completion; it does not resubmit a request it did not interrupt itself."""
    import httpx

    standin.hold_prefill.set()
    task = asyncio.create_task(sgl.agenerate(PROMPTS[1], SamplingParams(max_new_tokens=5)))
    await wait_for(lambda: standin.waiting == 1, "the request queued before prefill")
    async with httpx.AsyncClient(base_url=standin.url) as operator:
        r = await operator.post("/abort_request", json={"rid": "", "abort_all": True})
        assert r.status_code == 200
    standin.hold_prefill.clear()  # a resubmission would now generate tokens
    c = await task
    assert c.stop_reason == "abort" and c.output_ids == [] and c.versions == []
    assert len(standin.bodies("/generate")) == 1


async def test_abort_before_prefill_by_our_own_update_is_resubmitted(
    sgl: SGLangEngine, standin: SGLangStandIn, other_model_dir: Path, tmp_path: Path
) -> None:
    """The same empty abort caused by the client's own pause (a weight update) is
    resubmitted after the update and runs on the new weights, nothing lost."""
    path, manifest = _publish(other_model_dir, tmp_path, 1)
    standin.hold_prefill.set()
    task = asyncio.create_task(
        sgl.agenerate(PROMPTS[3], SamplingParams(greedy=True, max_new_tokens=5, ignore_eos=True))
    )
    await wait_for(lambda: standin.waiting == 1, "the request queued before prefill")
    assert (await sgl.update_weights_from_disk(str(path), manifest)).ok
    await wait_for(lambda: len(standin.bodies("/generate")) == 2, "the resubmission")
    standin.hold_prefill.clear()
    c = await task
    assert c.stop_reason == "length" and c.versions == [1] * 5
    assert c.output_ids == hf_greedy(load_model(other_model_dir), PROMPTS[3], 5)


async def test_context_overflow_is_a_clear_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    """SGLang answers HTTP 400 when prompt + max_new_tokens exceed the context length
    (`managers/tokenizer_manager.py` `_validate_one_request`)."""
    standin = SGLangStandIn(tiny_model_dir, context_len=16).start()
    eng = SGLangEngine(standin.url, model_path=str(tiny_model_dir), scratch_dir=str(tmp_path))
    await eng.start()
    try:
        with pytest.raises(ContextOverflowError, match="gconfig.max_tokens"):
            await eng.agenerate(PROMPTS[0], SamplingParams(max_new_tokens=20))
        capped = SamplingParams(max_new_tokens=20, max_tokens=16, ignore_eos=True)
        c = await eng.agenerate(PROMPTS[0], capped)
        assert len(PROMPTS[0]) + len(c.output_ids) == 16 and c.stop_reason == "length"
    finally:
        await eng.stop()
        standin.stop()
    assert standin.contract_errors == []


@pytest.mark.parametrize(
    ("sampling", "refusal"),
    [
        # Each message is the f-string of SGLang's `verify()`, filled in.
        ({"max_new_tokens": 3, "min_new_tokens": 5}, MIN_OVER_MAX.format(max_new=3, min_new=5)),
        ({"min_new_tokens": -1}, "min_new_tokens must be in [0, max_new_tokens], got -1."),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0."),
        ({"max_new_tokens": 3, "min_new_tokens": 3}, None),  # the bound itself is accepted
        ({"temperature": 0.0, "top_k": -1, "max_new_tokens": 2}, None),  # what greedy sends
    ],
)
async def test_the_standin_refuses_sampling_params_as_sglangs_verify_does(
    standin: SGLangStandIn, sampling: dict[str, object], refusal: str | None
) -> None:
    # The rule is SGLang's own source, pinned from the wheel (`tools/sglang_schema.py`).
    assert "min_new_tokens <= self.max_new_tokens" in SCHEMA["sampling_params"]["methods"]["verify"]
    async with httpx.AsyncClient(base_url=standin.url, timeout=60) as http:
        r = await http.post(
            "/generate", json={"input_ids": PROMPTS[0], "sampling_params": sampling}
        )
    if refusal is None:
        assert r.status_code == 200, r.text
        assert standin.refused_sampling == []
    else:
        assert r.status_code == 400
        assert r.json() == {"error": {"message": refusal}}
        assert standin.refused_sampling == [refusal]


async def test_min_new_tokens_is_capped_at_the_budget_max_tokens_leaves(
    sgl: SGLangEngine, standin: SGLangStandIn, tiny_model_dir: Path
) -> None:
    """A prompt 3 tokens short of `max_tokens` with `min_new_tokens=8`: the budget is 3, and
    SGLang refuses `min_new_tokens` 8 against `max_new_tokens` 3, so the client sends 3."""
    prompt = PROMPTS[1]
    sampling = SamplingParams(
        greedy=True, max_new_tokens=20, min_new_tokens=8, max_tokens=len(prompt) + 3
    )
    c = await sgl.agenerate(prompt, sampling)
    assert c.output_ids == hf_greedy(load_model(tiny_model_dir), prompt, 3)
    assert c.stop_reason == "length"
    [body] = standin.bodies("/generate")
    assert (
        body["sampling_params"]["max_new_tokens"],
        body["sampling_params"]["min_new_tokens"],
    ) == (
        3,
        3,
    )
    assert standin.refused_sampling == []


async def test_a_resubmission_caps_min_new_tokens_at_what_is_left(
    sgl: SGLangEngine, standin: SGLangStandIn, tiny_model_dir: Path
) -> None:
    """Interrupted by the client's own pause after k tokens, the request is resubmitted with
    12 - k tokens left of a budget `max_tokens` cut to 12, and `min_new_tokens` (30 asked,
    30 - k left) capped at those 12 - k; every token arrives once."""
    held = hold_until_paused(standin, after_tokens=4)
    prompt = PROMPTS[2]
    sampling = SamplingParams(
        greedy=True, max_new_tokens=40, min_new_tokens=30, max_tokens=len(prompt) + 12
    )
    task = asyncio.create_task(sgl.agenerate(prompt, sampling))
    await wait_for(lambda: bool(held) or task.done(), "4 tokens generated")
    assert not task.done(), await task  # a refused first request would end here
    await sgl.pause()
    await sgl.resume()
    c = await task
    standin.engine.on_step = None
    assert c.output_ids == hf_greedy(load_model(tiny_model_dir), prompt, 12)
    first, again = standin.bodies("/generate")
    k = len(again["input_ids"]) - len(prompt)
    assert 4 <= k < 12 and again["input_ids"] == prompt + c.output_ids[:k]
    assert (
        first["sampling_params"]["max_new_tokens"],
        first["sampling_params"]["min_new_tokens"],
    ) == (
        12,
        12,
    )
    assert (
        again["sampling_params"]["max_new_tokens"],
        again["sampling_params"]["min_new_tokens"],
    ) == (
        12 - k,
        12 - k,
    )
    assert standin.refused_sampling == []


async def test_unknown_tensor_names_warned_and_all_unknown_refused(
    sgl: SGLangEngine,
    standin: SGLangStandIn,
    other_model_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SGLang loads the names its model has and skips the rest with a warning. The client
    warns too, and refuses an update none of whose names is known (a prefix mismatch
    would otherwise leave the old weights serving under the new version)."""
    sd = named_parameters_for_update(load_model(other_model_dir))
    extra = {**sd, "not.a.weight": torch.zeros(3)}
    m1 = save_weights(tmp_path / "v1", extra, 1)
    with caplog.at_level("WARNING"):
        r = await sgl.update_weights_from_disk(str(tmp_path / "v1"), m1)
    assert r.ok, r.message
    assert any("not.a.weight" in w for w in standin.warnings)
    assert sgl.unknown_names == 1 and "ignore tensor names" in caplog.text
    assert torch.equal(
        standin.engine.current_weights()["model.norm.weight"], sd["model.norm.weight"]
    )
    prefixed = {f"_fsdp_wrapped_module.{k}": v for k, v in sd.items()}
    m2 = save_weights(tmp_path / "v2", prefixed, 2)
    r = await sgl.update_weights_from_disk(str(tmp_path / "v2"), m2)
    assert not r.ok and "none of the" in r.message and sgl.version == 1
    assert len(standin.bodies("/update_weights_from_disk")) == 1


async def test_a_group_is_destroyed_before_it_is_created_again(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """SGLang refuses a group name that is taken (torch: "The specified group name has
    already been used"); after a failed publication the trainer creates the group again,
    so the client destroys the old one first. (The real join over gloo is
    `test_distributed_update_per_tensor_through_a_real_gloo_group`; here the stand-in
    records groups without joining them.)"""
    import httpx

    standin = SGLangStandIn(tiny_model_dir, join_groups=False).start()
    eng = SGLangEngine(standin.url, model_path=str(tiny_model_dir), scratch_dir=str(tmp_path))
    await eng.start()
    try:
        await join_as_rank_1(eng, free_port())
        [first] = standin.bodies("/init_weights_update_group")
        async with httpx.AsyncClient(base_url=standin.url) as raw:
            again = await raw.post("/init_weights_update_group", json=first)
        assert again.status_code == 400 and "already been used" in again.text
        await join_as_rank_1(eng, free_port())  # the client's second attempt succeeds
        assert standin.paths()[-3:] == [
            "/init_weights_update_group",  # the raw one, refused
            "/destroy_weights_update_group",
            "/init_weights_update_group",
        ]
        assert standin.bodies("/destroy_weights_update_group")[-1] == {
            "group_name": "flywheel_weights"
        }
        assert list(standin.groups) == ["flywheel_weights"]
    finally:
        await eng.stop()
        standin.stop()
    assert standin.contract_errors == []


async def test_a_tp_replica_takes_ranks_offset_plus_tp_rank(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """SGLang ranks each TP worker at `rank_offset + tp_rank`
    (`model_runner_components/weight_updater.py`): a tp_size=2 replica at offset 3 of a
    world of 5 takes ranks 3 and 4, and one that would not fit is refused by the client."""
    standin = SGLangStandIn(tiny_model_dir, tp_size=2).start()
    eng = SGLangEngine(
        standin.url, model_path=str(tiny_model_dir), scratch_dir=str(tmp_path), tp_size=2
    )
    await eng.start()
    try:
        kw = {"master_address": "127.0.0.1", "master_port": free_port(), "backend": "gloo"}
        await eng.init_weights_group(rank=3, world_size=5, group_name="g", **kw)  # type: ignore[arg-type]
        assert standin.group_ranks["g"] == [3, 4]
        with pytest.raises(WeightsError, match="does not fit"):
            await eng.init_weights_group(rank=4, world_size=5, group_name="g", **kw)  # type: ignore[arg-type]
    finally:
        await eng.stop()
        standin.stop()
    assert standin.contract_errors == []


def test_versions_parsed_as_sglang_reports_them() -> None:
    """`meta_info.weight_versions` spans (`utils/weight_versions.py`
    `add_weight_versions_to_meta_info`: `[start, end)` per version) label each token; a
    bare `weight_version` labels all; "default" is the launch weights, version 0."""
    meta = {
        "weight_version": "4",
        "weight_versions": [
            {"version": "3", "start": 0, "end": 2},
            {"version": "4", "start": 2, "end": 5},
        ],
    }
    assert token_versions(meta, 5, fallback=9) == [3, 3, 4, 4, 4]
    assert token_versions({"weight_version": "default"}, 2, fallback=9) == [0, 0]
    assert token_versions({}, 2, fallback=9) == [9, 9]
    assert server_version("12") == 12 and server_version(None) is None
