"""The RolloutService over real gRPC on loopback: Generate, control RPCs, bad input."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from flywheel_proto.v1 import rollout_pb2
from services.common.weights.disk import MANIFEST_FILE, PATH_REFUSED, save_weights
from services.core.types import SamplingParams
from tests.rollout.conftest import load_model

pytestmark = pytest.mark.integration


async def test_generate_text_and_ids_prompt_major(served, tiny_model_dir) -> None:  # noqa: ANN001
    engine, client, _ = served
    tok = engine.tokenizer
    sp = SamplingParams(n_samples=3, max_new_tokens=5, ignore_eos=True, seed=1, temperature=0.9)
    res = await client.generate(prompts=["12+34=", "7+8="], sampling=sp)
    # 2 prompts x 3 samples, prompt-major; seeds 1, 2, 3 per prompt
    assert len(res.completions) == 6 and res.version == 0
    by_ids = await client.generate(
        prompt_ids=[tok("12+34=")["input_ids"], tok("7+8=")["input_ids"]], sampling=sp
    )
    assert [c.output_ids for c in by_ids.completions] == [c.output_ids for c in res.completions]
    first = res.completions[0]
    assert len(first.output_ids) == 5 and first.stop_reason == "length"
    assert first.text == tok.decode(first.output_ids, skip_special_tokens=True)
    # Logprobs match a fresh forward of the served model at temperature 0.9.
    model = load_model(tiny_model_dir)
    prompt = tok("12+34=")["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + first.output_ids])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits / 0.9, -1).gather(
        -1, torch.tensor(first.output_ids)[:, None]
    )[:, 0]
    torch.testing.assert_close(torch.tensor(first.logprobs), expected, rtol=0, atol=1e-5)


async def test_bad_requests_get_invalid_argument(served) -> None:  # noqa: ANN001
    engine, client, _ = served
    stub = client._stub
    cases = [
        rollout_pb2.GenerateRequest(request_id="a"),  # neither prompts nor ids
        rollout_pb2.GenerateRequest(
            prompts=["1+1="], sampling=rollout_pb2.SamplingParams(temperature=-1.0)
        ),
        rollout_pb2.GenerateRequest(prompt_ids=[rollout_pb2.TokenIds(ids=[3, 500])]),
        rollout_pb2.GenerateRequest(
            prompts=["1"], sampling=rollout_pb2.SamplingParams(n_samples=5000)
        ),
    ]
    for req in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Generate(req, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.UpdateWeights(
            rollout_pb2.UpdateWeightsRequest(transport=rollout_pb2.WEIGHT_TRANSPORT_DISK),
            timeout=10,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # A disk update of a directory that is not there is refused, not an RPC error.
    r = await client.update_weights("disk", _manifest(), path="/nonexistent/weights")
    assert not r.ok and r.message == f"disk: {PATH_REFUSED}"


def _manifest():  # noqa: ANN202
    from services.common.weights.manifest import WeightManifest

    return WeightManifest(1, "", 0, 0)


async def test_pause_resume_stats_and_version(served) -> None:  # noqa: ANN001
    engine, client, metrics = served
    assert await client.pause() == 0
    stats = await client.stats()
    assert stats.paused and stats.engine == "torch" and stats.rollout_id == "rollout-0"
    assert metrics.paused._value.get() == 1
    assert await client.resume() == 0
    res = await client.generate(
        prompts=["1+2="], sampling=SamplingParams(max_new_tokens=3, ignore_eos=True)
    )
    stats = await client.stats()
    assert not stats.paused and stats.tokens_generated == 3 and stats.requests_in_flight == 0
    assert stats.checksum == engine.checksum != ""
    assert len(res.completions[0].output_ids) == 3


async def test_every_weight_transport_is_capped(engine, tmp_path) -> None:  # noqa: ANN001
    """StreamWeights had a fixed 1 TiB cap and none at total_bytes = 0 (8 MiB passed
    a 1 MiB cap). Now `rollout.max_weight_bytes` bounds the gRPC stream, the distributed
    update and the disk update, and total_bytes must be > 0 and the sum of the specs."""
    from flywheel_proto.v1 import rollout_pb2_grpc
    from services.common.grpc_server import ServiceServer
    from services.common.weights.disk import save_weights
    from services.common.weights.manifest import WeightManifest, make_manifest, tensor_specs
    from services.rollout.client import RolloutClient
    from services.rollout.metrics import RolloutMetrics
    from services.rollout.servicer import RolloutServicer

    cap = 1 << 20
    server = ServiceServer("rollout", service_names=["flywheel.v1.RolloutService"])
    servicer = RolloutServicer(
        engine,
        rollout_id="r",
        metrics=RolloutMetrics(),
        max_weight_bytes=cap,
        weights_root=tmp_path,
    )
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server.server)
    client = RolloutClient(f"127.0.0.1:{await server.start()}", timeout=30)
    try:
        big = {"w": torch.zeros(8 << 20, dtype=torch.uint8)}
        m = make_manifest(big, 1)
        unsized = WeightManifest(m.version, m.checksum, m.num_tensors, 0)
        r = await client.stream_weights(big, unsized, chunk_bytes=1 << 20)
        assert not r.ok and "must announce its size" in r.message
        r = await client.stream_weights(big, m, chunk_bytes=1 << 20)
        assert not r.ok and "exceeds the limit 1048576" in r.message
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.update_weights_distributed(m, tensor_specs(big))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "exceeds the limit" in err.value.details()
        lying = WeightManifest(1, m.checksum, 1, 16)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.update_weights_distributed(lying, tensor_specs(big))
        assert "tensor specs hold 8388608 bytes" in err.value.details()
        on_disk = save_weights(tmp_path / "v1", big, 1)
        r = await client.update_weights_from_disk(str(tmp_path / "v1"), on_disk)
        assert not r.ok and "exceeds the limit" in r.message
        assert engine.version == 0 and engine.stats.weight_updates == 0
    finally:
        await client.close()
        await server.stop(grace=1)


async def test_disk_updates_load_only_from_the_weights_root(served, tmp_path) -> None:  # noqa: ANN001
    """docs/security.md: a disk update reads only the weights root (trainer.weight_dir).
    A directory elsewhere (one in /tmp was loaded), a manifest naming /etc/hostname four
    levels up (it was opened), a link out of the root, a path that does not
    exist: all get the same answer, so the messages no longer tell which paths exist. What
    is inside the root still applies."""
    import json
    import tempfile

    engine, client, metrics = served
    sd = {"w": torch.arange(16, dtype=torch.float32)}
    outside = Path(tempfile.mkdtemp(prefix="flywheel-outside-"))
    try:
        elsewhere = save_weights(outside / "v1", sd, 1)
        inside = save_weights(tmp_path / "v1", sd, 1)
        escaping = tmp_path / "v2"
        save_weights(escaping, sd, 2)
        manifest = json.loads((escaping / MANIFEST_FILE).read_text())
        manifest["files"] = ["/".join([".."] * 4 + ["etc", "hostname"])]
        (escaping / MANIFEST_FILE).write_text(json.dumps(manifest))
        (tmp_path / "link").symlink_to(outside / "v1")
        attempts = [
            (str(outside / "v1"), elsewhere),  # a complete weights directory, elsewhere
            (str(tmp_path / ".." / outside.name / "v1"), elsewhere),  # climbing out
            (str(tmp_path / "link"), elsewhere),  # a link inside the root to outside it
            (str(escaping), inside),  # a manifest naming a file outside its directory
            ("/etc", inside),  # exists, outside
            ("/nonexistent/weights", inside),  # does not exist
            (str(tmp_path / "missing"), inside),  # inside the root, does not exist
        ]
        for path, m in attempts:
            r = await client.update_weights_from_disk(path, m)
            assert (r.ok, r.message) == (False, f"disk: {PATH_REFUSED}"), path
        assert (await client.stats()).last_update_error == f"disk: {PATH_REFUSED}"
        assert engine.version == 0 and engine.stats.weight_updates == 0
        failed = metrics.registry.get_sample_value(
            "flywheel_rollout_weight_updates_total", {"transport": "disk", "result": "failed"}
        )
        assert failed == len(attempts)
    finally:
        import shutil

        shutil.rmtree(outside, ignore_errors=True)


async def test_a_replica_without_a_weights_root_refuses_every_disk_update(
    engine,
    tmp_path,  # noqa: ANN001
) -> None:
    from flywheel_proto.v1 import rollout_pb2_grpc
    from services.common.grpc_server import ServiceServer
    from services.rollout.client import RolloutClient
    from services.rollout.metrics import RolloutMetrics
    from services.rollout.servicer import RolloutServicer

    server = ServiceServer("rollout", service_names=["flywheel.v1.RolloutService"])
    servicer = RolloutServicer(engine, rollout_id="r", metrics=RolloutMetrics())
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server.server)
    client = RolloutClient(f"127.0.0.1:{await server.start()}", timeout=30)
    try:
        m = save_weights(tmp_path / "v1", {"w": torch.zeros(4)}, 1)
        r = await client.update_weights_from_disk(str(tmp_path / "v1"), m)
        assert (r.ok, r.message) == (False, f"disk: {PATH_REFUSED}")
    finally:
        await client.close()
        await server.stop(grace=1)
