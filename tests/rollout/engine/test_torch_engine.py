"""The torch engine against the model it serves: greedy, logprobs, stops, interruption, updates.

Float tolerance: the engine's decoder and a fresh HF forward compute the same float32 sums in a
different order; on this 2-layer model they agree to ~3e-7, so logprobs are compared with
atol=1e-5 (rtol=0).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from services.common.weights.disk import save_weights
from services.common.weights.manifest import (
    WeightManifest,
    make_manifest,
    named_parameters_for_update,
    state_dict_checksum,
)
from services.core.types import SamplingParams
from services.rollout.engine.torch_engine import TorchEngine
from tests.rollout.conftest import load_model

ATOL = 1e-5
PROMPTS = [[14, 15, 9, 16, 17, 23], [15, 9, 16, 23], [20, 20, 20, 9, 21, 23, 3], [14, 23], [16, 9]]


def fresh_logprobs(model: torch.nn.Module, prompt: list[int], out: list[int], temp: float = 1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0].float()
    steps = logits[len(prompt) - 1 : -1] / temp
    return torch.log_softmax(steps, -1).gather(-1, torch.tensor(out)[:, None])[:, 0]


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=n,
            pad_token_id=0,
            eos_token_id=1,
        )[0, len(prompt) :].tolist()
    return out[: out.index(1) + 1] if 1 in out else out


@pytest.mark.parametrize("runner", ["native", "hf"])
async def test_greedy_equals_hf_generate_under_continuous_batching(
    tiny_model_dir: Path, runner: str
) -> None:
    eng = TorchEngine(tiny_model_dir, max_batch_size=2, runner=runner, device="cpu")
    await eng.start()
    try:
        # 5 concurrent requests, 2 rows: requests join as others finish (continuous batching).
        outs = await asyncio.gather(
            *(eng.agenerate(p, SamplingParams(greedy=True, max_new_tokens=16)) for p in PROMPTS)
        )
    finally:
        await eng.stop()
    model = load_model(tiny_model_dir)
    for p, o in zip(PROMPTS, outs, strict=True):
        ref = hf_greedy(model, p, 16)
        assert o.output_ids == ref
        assert o.stop_reason == ("stop" if ref[-1] == 1 else "length")
        torch.testing.assert_close(
            torch.tensor(o.logprobs), fresh_logprobs(model, p, o.output_ids), rtol=0, atol=ATOL
        )
        assert o.versions == [0] * len(o.output_ids)


async def test_sampled_logprobs_equal_a_fresh_forward(
    engine: TorchEngine, tiny_model_dir: Path
) -> None:
    sp = SamplingParams(
        temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=24, ignore_eos=True, seed=11
    )
    outs = await asyncio.gather(*(engine.agenerate(p, sp) for p in PROMPTS[:3]))
    model = load_model(tiny_model_dir)
    for p, o in zip(PROMPTS[:3], outs, strict=True):
        assert len(o.output_ids) == 24 and o.stop_reason == "length"
        torch.testing.assert_close(
            torch.tensor(o.logprobs), fresh_logprobs(model, p, o.output_ids, 0.7), rtol=0, atol=ATOL
        )
    # Same seed, same prompt: same completion whatever else shares the batch.
    again = await engine.agenerate(PROMPTS[0], sp)
    assert again.output_ids == outs[0].output_ids


@pytest.mark.parametrize("runner", ["native", "hf"])
async def test_update_mid_generation_switches_version_and_weights(
    tiny_model_dir: Path, other_model_dir: Path, runner: str
) -> None:
    engine = TorchEngine(tiny_model_dir, max_batch_size=4, runner=runner, device="cpu")
    await engine.start()
    try:
        await _update_mid_generation(engine, tiny_model_dir, other_model_dir)
    finally:
        await engine.stop()


async def _update_mid_generation(
    engine: TorchEngine, tiny_model_dir: Path, other_model_dir: Path
) -> None:
    new = load_model(other_model_dir)
    new_sd = named_parameters_for_update(new)
    manifest = make_manifest(new_sd, 1)

    def pause_after_six(eng: TorchEngine) -> None:
        outs = eng.active_outputs()
        if outs and len(outs[0]) >= 6:
            eng.request_pause()
            eng.on_step = None

    engine.on_step = pause_after_six
    prompt = PROMPTS[0]
    task = asyncio.create_task(
        engine.agenerate(prompt, SamplingParams(greedy=True, max_new_tokens=20, ignore_eos=True))
    )
    while not (engine.paused and engine.active_outputs()):
        await asyncio.sleep(0.001)
    result = await engine.update_weights_from_tensors(new_sd, manifest)
    assert result.ok, result.message
    await engine.resume()
    c = await task

    # The hook paused right after the 6th token: 6 tokens of v0, then 14 of v1.
    assert c.versions == [0] * 6 + [1] * 14
    old = load_model(tiny_model_dir)
    assert c.output_ids[:6] == hf_greedy(old, prompt, 6)
    # After the switch every token is the new model's arg-max given everything before it.
    for i in range(6, 20):
        with torch.no_grad():
            logits = new(torch.tensor([prompt + c.output_ids[:i]])).logits[0, -1]
        assert c.output_ids[i] == int(logits.argmax())
    lp = torch.tensor(c.logprobs)
    torch.testing.assert_close(
        lp[:6], fresh_logprobs(old, prompt, c.output_ids)[:6], rtol=0, atol=ATOL
    )
    torch.testing.assert_close(
        lp[6:], fresh_logprobs(new, prompt, c.output_ids)[6:], rtol=0, atol=ATOL
    )
    assert engine.version == 1 and engine.checksum == manifest.checksum


async def test_stop_tokens_strings_and_lengths(engine: TorchEngine, tiny_model_dir: Path) -> None:
    prompt = PROMPTS[2]
    base = await engine.agenerate(
        prompt, SamplingParams(greedy=True, max_new_tokens=12, ignore_eos=True)
    )
    assert len(base.output_ids) == 12 and base.stop_reason == "length"
    ids = base.output_ids
    # A stop id ends the completion at its first occurrence, the stop token included.
    stop_id = ids[3]
    first = ids.index(stop_id)
    c = await engine.agenerate(
        prompt,
        SamplingParams(greedy=True, max_new_tokens=12, ignore_eos=True, stop_token_ids=[stop_id]),
    )
    assert c.output_ids == ids[: first + 1] and c.stop_reason == "stop"
    # A stop string ends it once the decoded completion contains the string.
    text = engine.decode(ids, skip_special_tokens=False)
    needle = text[4:6]
    c = await engine.agenerate(
        prompt, SamplingParams(greedy=True, max_new_tokens=12, ignore_eos=True, stop=[needle])
    )
    assert c.stop_reason == "stop" and needle in engine.decode(
        c.output_ids, skip_special_tokens=False
    )
    assert needle not in engine.decode(c.output_ids[:-1], skip_special_tokens=False)
    # max_tokens caps prompt + completion: 7 prompt tokens, cap 10 -> 3 new tokens.
    c = await engine.agenerate(
        prompt, SamplingParams(greedy=True, max_new_tokens=12, max_tokens=10, ignore_eos=True)
    )
    assert c.output_ids == ids[:3] and c.stop_reason == "length"


async def test_eos_ends_and_min_new_tokens_defers_stops(engine: TorchEngine) -> None:
    # Temperature 3 makes the 24 tokens nearly uniform: with seed 5 EOS (id 1) comes early.
    c = await engine.agenerate(
        PROMPTS[0], SamplingParams(temperature=3.0, max_new_tokens=400, seed=5)
    )
    assert c.stop_reason == "stop" and c.output_ids[-1] == 1 and 1 not in c.output_ids[:-1]
    # min_new_tokens bans stop ids until that many tokens exist.
    ids = (
        await engine.agenerate(
            PROMPTS[2], SamplingParams(greedy=True, max_new_tokens=12, ignore_eos=True)
        )
    ).output_ids
    stop_id = ids[2]
    sp = SamplingParams(
        greedy=True, max_new_tokens=12, ignore_eos=True, stop_token_ids=[stop_id], min_new_tokens=5
    )
    c = await engine.agenerate(PROMPTS[2], sp)
    assert stop_id not in c.output_ids[:5]
    if c.stop_reason == "stop":
        assert c.output_ids[-1] == stop_id and stop_id not in c.output_ids[:-1]
    else:
        assert len(c.output_ids) == 12 and stop_id not in c.output_ids


async def test_cancel_and_abort_free_the_rows(engine: TorchEngine) -> None:
    engine.on_step = lambda eng: eng.request_pause() if eng.stats.tokens_generated >= 3 else None
    long = SamplingParams(max_new_tokens=400, ignore_eos=True)
    t1 = asyncio.create_task(engine.agenerate(PROMPTS[0], long))
    t2 = asyncio.create_task(engine.agenerate(PROMPTS[1], long))
    while not (engine.paused and engine.requests_in_flight == 2):
        await asyncio.sleep(0.001)
    engine.on_step = None
    t1.cancel()
    await engine.abort_all()
    c2 = await t2
    assert c2.stop_reason == "abort" and len(c2.output_ids) < 400
    assert len(c2.logprobs) == len(c2.output_ids) == len(c2.versions)
    await engine.resume()
    with pytest.raises(asyncio.CancelledError):
        await t1
    while engine.requests_in_flight:
        await asyncio.sleep(0.001)
    ok = await engine.agenerate(
        PROMPTS[0], SamplingParams(greedy=True, max_new_tokens=4, ignore_eos=True)
    )
    assert len(ok.output_ids) == 4


async def test_bad_prompts_are_refused_with_the_reason(engine: TorchEngine) -> None:
    with pytest.raises(ValueError, match="empty"):
        await engine.agenerate([], SamplingParams())
    with pytest.raises(ValueError, match="outside"):
        await engine.agenerate([3, 99], SamplingParams())
    with pytest.raises(ValueError, match="positions"):
        await engine.agenerate([3] * 600, SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        await engine.agenerate([3], SamplingParams(top_p=1.5))


async def test_refused_updates_keep_the_old_weights(
    engine: TorchEngine, other_model_dir: Path, tmp_path: Path
) -> None:
    before = state_dict_checksum(engine.current_weights())
    new_sd = named_parameters_for_update(load_model(other_model_dir))

    # Corrupted checkpoint on disk.
    d = tmp_path / "v1"
    m = save_weights(d, new_sd, 1)
    f = d / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-5] ^= 0x10
    f.write_bytes(bytes(raw))
    r = await engine.update_weights_from_disk(str(d), m)
    assert not r.ok and "checksum mismatch" in r.message and r.version == 0

    # Partial update: a tensor missing (its manifest is consistent, the names are not).
    partial = {k: v for k, v in new_sd.items() if k != "model.norm.weight"}
    r = await engine.update_weights_from_tensors(partial, make_manifest(partial, 1))
    assert not r.ok and "missing ['model.norm.weight']" in r.message

    # Wrong shape.
    bad = dict(new_sd, **{"model.norm.weight": torch.ones(3)})
    r = await engine.update_weights_from_tensors(bad, make_manifest(bad, 1))
    assert not r.ok and "shape" in r.message

    # Manifest that does not describe the tensors.
    lie = WeightManifest(1, "0" * 64, len(new_sd), 0)
    r = await engine.update_weights_from_tensors(new_sd, lie)
    assert not r.ok and "checksum" in r.message

    assert engine.version == 0
    assert state_dict_checksum(engine.current_weights()) == before
    assert engine.stats.weight_updates_failed == 4 and engine.stats.weight_updates == 0

    # A good update applies; going back to an older version afterwards is refused.
    assert (await engine.update_weights_from_tensors(new_sd, make_manifest(new_sd, 2))).ok
    r = await engine.update_weights_from_tensors(new_sd, make_manifest(new_sd, 1))
    assert not r.ok and "backwards" in r.message and engine.version == 2
