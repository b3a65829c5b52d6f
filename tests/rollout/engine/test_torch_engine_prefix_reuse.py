"""KV-cache reuse across calls of one key (services/rollout/engine/torch_engine.py with the
native runner's `adopt`): the next call prefills only what its prompt adds, and generates
exactly what Hugging Face's `generate` and forward give for the whole prompt."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from services.common.weights.manifest import make_manifest, named_parameters_for_update
from services.core.types import SamplingParams
from services.rollout.engine.torch_engine import TorchEngine
from tests.rollout.conftest import load_model
from tests.rollout.engine.test_torch_engine import ATOL, PROMPTS, fresh_logprobs, hf_greedy

GREEDY = SamplingParams(greedy=True, max_new_tokens=5, ignore_eos=True)


async def test_a_second_call_reuses_the_first_calls_cache(tiny_model_dir: Path) -> None:
    engine = TorchEngine(tiny_model_dir, max_batch_size=2, device="cpu", runner="native")
    await engine.start()
    try:
        assert engine.keeps_prefix_cache
        first = await engine.agenerate(PROMPTS[0], GREEDY, cache_key="s")
        prompt = PROMPTS[0] + first.output_ids + [9, 16, 23]  # a tool result, say
        before = engine.prefill_tokens
        second = await engine.agenerate(prompt, GREEDY, cache_key="s")
        # Everything but the last sampled token (never run through the model) was cached.
        reused = len(PROMPTS[0]) + len(first.output_ids) - 1
        assert engine.reused_prefix_tokens == reused
        assert engine.prefill_tokens - before == len(prompt) - reused
        model = load_model(tiny_model_dir)
        assert second.output_ids == hf_greedy(model, prompt, 5)
        torch.testing.assert_close(
            torch.tensor(second.logprobs),
            fresh_logprobs(model, prompt, second.output_ids),
            rtol=0,
            atol=ATOL,
        )
        # Another key, or none, reuses nothing.
        await engine.agenerate(prompt, GREEDY, cache_key="other")
        await engine.agenerate(prompt, GREEDY)
        assert engine.reused_prefix_tokens == reused
    finally:
        await engine.stop()


async def test_kept_caches_yield_to_requests_and_weight_updates(
    tiny_model_dir: Path, other_model_dir: Path
) -> None:
    engine = TorchEngine(tiny_model_dir, max_batch_size=2, device="cpu", runner="native")
    await engine.start()
    try:
        first = await engine.agenerate(PROMPTS[1], GREEDY, cache_key="s")
        # Two requests need both slots: the kept cache is evicted, nothing fails.
        outs = await asyncio.gather(*(engine.agenerate(p, GREEDY) for p in PROMPTS[2:4]))
        model = load_model(tiny_model_dir)
        assert [o.output_ids for o in outs] == [hf_greedy(model, p, 5) for p in PROMPTS[2:4]]
        await engine.agenerate(PROMPTS[1] + first.output_ids, GREEDY, cache_key="s")
        assert engine.reused_prefix_tokens == 0
        # A weight update drops what the old weights computed.
        new = named_parameters_for_update(load_model(other_model_dir))
        assert (await engine.update_weights_from_tensors(new, make_manifest(new, 1))).ok
        prompt = PROMPTS[1] + first.output_ids + [9]
        after = await engine.agenerate(prompt, GREEDY, cache_key="s")
        assert engine.reused_prefix_tokens == 0
        assert after.output_ids == hf_greedy(load_model(other_model_dir), prompt, 5)
    finally:
        await engine.stop()


async def test_the_hf_runner_keeps_nothing(tiny_model_dir: Path) -> None:
    engine = TorchEngine(tiny_model_dir, max_batch_size=2, device="cpu", runner="hf")
    await engine.start()
    try:
        assert not engine.keeps_prefix_cache
        first = await engine.agenerate(PROMPTS[0], GREEDY, cache_key="s")
        await engine.agenerate(PROMPTS[0] + first.output_ids, GREEDY, cache_key="s")
        assert engine.reused_prefix_tokens == 0
    finally:
        await engine.stop()
