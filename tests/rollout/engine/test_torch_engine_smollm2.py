"""The torch engine and the trainer on a real pretrained model: SmolLM2-135M-Instruct.

Reference: Hugging Face `generate` and a plain HF forward of the same checkpoint (the
tests of the tiny model check the same properties on 2 layers and a 24-symbol vocabulary;
here it is 30 layers, grouped-query attention 9/3, a 49,152-token BPE vocabulary, tied
embeddings and a chat template whose EOS is `<|im_end|>`).

Tolerance: float32 throughout. The engine's decoder (fused projections, paired RoPE, an
incremental KV cache) and the trainer's FSDP2 forward over the whole sequence add the same
products in a different order; over 30 layers the per-token log-probabilities differ by
up to a few 1e-5 (measured max 2.7e-5 on sampled completions), so they are compared with atol=1e-4 (rtol=0), the
figure the issue asks for.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from services.common.weights.disk import save_weights
from services.common.weights.grpc_stream import WeightAssembler, iter_weight_chunks
from services.common.weights.manifest import (
    TensorSpec,
    WeightManifest,
    make_manifest,
    state_dict_checksum,
)
from services.core.types import SamplingParams
from services.rollout.engine.torch_engine import TorchEngine, load_tokenizer
from tests import smollm2

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ATOL = 1e-4
PAIRS = [(3, 4), (8, 7), (2, 9), (6, 5)]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return smollm2.model_dir()


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    return smollm2.chat_prompts(load_tokenizer(model_dir), PAIRS)


@pytest.fixture
async def engine(model_dir: Path) -> AsyncIterator[TorchEngine]:
    eng = TorchEngine(model_dir, max_batch_size=8, device="cpu", runner="native", seed=3)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.stop()


@pytest.fixture(scope="module")
def trainer(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """The trainer's actor engine (FSDP2 over a 1-rank gloo group, float32, AdamW)."""
    from services.trainer.dist import init_distributed
    from services.trainer.engine import TrainEngine
    from tests.trainer.helpers import trainer_config

    cfg = trainer_config(
        model_dir,
        tmp_path_factory.mktemp("run"),
        "actor.optimizer.lr=1e-5",
        "actor.optimizer.gradient_clipping=1.0",
    )
    ctx = init_distributed("cpu")
    try:
        yield TrainEngine(cfg.actor, ctx, total_steps=10, temperature=1.0)
    finally:
        if ctx.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _completion_logprobs(trainer, prompt_ids, outputs, pad_id):  # noqa: ANN001, ANN202
    """The trainer's recomputed log-probabilities of each completion's tokens."""
    batch = smollm2.completion_batch(prompt_ids, outputs, pad_id)
    with torch.no_grad():
        logp, _ = trainer.logprobs(batch)
    return [
        logp[i, len(p) : len(p) + len(o)]
        for i, (p, o) in enumerate(zip(prompt_ids, outputs, strict=True))
    ]


async def _sample(engine: TorchEngine, prompts: list[list[int]], seed: int):  # noqa: ANN202
    sp = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, seed=seed)
    return await asyncio.gather(*(engine.agenerate(p, sp) for p in prompts for _ in range(2)))


def test_tokenizer_has_chat_template_and_im_end_as_eos(model_dir: Path) -> None:
    tok = load_tokenizer(model_dir)
    # SmolLM2's special tokens: <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2 (the GGUF
    # metadata's eos id; its loader reports <|im_start|>, which the conversion corrects).
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == ("<|im_end|>", 2, 2)
    ids = smollm2.chat_prompts(tok, [(3, 4)])[0]
    rendered = tok.decode(ids, skip_special_tokens=False)
    assert rendered.startswith("<|im_start|>system\n")
    assert rendered.endswith(
        "What is 3 + 4? Answer with just the number.<|im_end|>\n<|im_start|>assistant\n"
    )
    # No BOS is prepended to plain text (the GGUF tokenizer would prepend <|im_start|>).
    assert tok("3 + 4")["input_ids"] == tok("3 + 4", add_special_tokens=False)["input_ids"]
    # Byte-level BPE round-trips spaces, newlines and non-ASCII text.
    for s in ("3 + 4 = 7", " 7\n", "  two  spaces", "ünï €"):
        assert tok.decode(tok(s, add_special_tokens=False)["input_ids"]) == s


async def test_greedy_equals_hf_generate(
    engine: TorchEngine, model_dir: Path, prompts: list[list[int]]
) -> None:
    from transformers import AutoModelForCausalLM

    outs = await asyncio.gather(
        *(
            engine.agenerate(p, SamplingParams(greedy=True, max_new_tokens=NEW_TOKENS))
            for p in prompts
        )
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for p, o in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
            )[0, len(p) :].tolist()
        assert o.output_ids == ref
        assert o.stop_reason == ("stop" if ref[-1] == 2 else "length")
    # The model answers these greedily (the hand check: greedy 0.84 on single digits).
    texts = [engine.decode(o.output_ids) for o in outs]
    assert sum(str(a + b) in t for (a, b), t in zip(PAIRS, texts, strict=True)) >= 3, texts


async def test_engine_logprobs_equal_trainer_recompute_and_follow_an_update(
    engine: TorchEngine,
    trainer,
    prompts: list[list[int]],
    tmp_path: Path,  # noqa: ANN001
) -> None:
    pad = 2
    rows = [p for p in prompts for _ in range(2)]
    before = await _sample(engine, prompts, seed=1)
    outputs = [o.output_ids for o in before]
    assert all(o.versions == [0] * len(o.output_ids) for o in before)
    recomputed = _completion_logprobs(trainer, rows, outputs, pad)
    worst = 0.0
    for o, ref in zip(before, recomputed, strict=True):
        torch.testing.assert_close(torch.tensor(o.logprobs), ref, rtol=0, atol=ATOL)
        worst = max(worst, float((torch.tensor(o.logprobs) - ref).abs().max()))

    # One optimizer step (AdamW, lr 1e-5) on a policy-gradient-shaped loss, then the
    # update through the disk transport: the replica's parameters are the trainer's bits.
    batch = smollm2.completion_batch(rows, outputs, pad)
    logp, _ = trainer.logprobs(batch)
    loss = -(logp * batch.loss_mask).sum() / batch.loss_mask.sum()
    loss.backward()
    norm, stepped = trainer.clip_and_step()
    assert stepped and norm > 0
    sd = trainer.full_state_dict()
    assert list(sd) == [n for n, _ in engine.model.named_parameters()]  # tied: embed once
    assert "lm_head.weight" not in sd
    old = engine.current_weights()
    assert any(not torch.equal(old[n], sd[n]) for n in sd)  # the step changed weights
    manifest = save_weights(tmp_path / "v1", sd, 1)
    r = await engine.update_weights_from_disk(str(tmp_path / "v1"), manifest)
    assert r.ok and r.version == 1
    got = engine.current_weights()
    assert all(torch.equal(got[n], sd[n]) for n in sd)
    assert (
        engine.model.lm_head.weight.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()
    )

    after = await _sample(engine, prompts, seed=2)
    assert all(o.versions == [1] * len(o.output_ids) for o in after)
    recomputed = _completion_logprobs(trainer, rows, [o.output_ids for o in after], pad)
    for o, ref in zip(after, recomputed, strict=True):
        torch.testing.assert_close(torch.tensor(o.logprobs), ref, rtol=0, atol=ATOL)

    # The gRPC chunk stream (encode, reassemble, verify) delivers the same bits (version 2:
    # the trainer's weights again, after a second step).
    logp, _ = trainer.logprobs(batch)
    (-(logp * batch.loss_mask).sum() / batch.loss_mask.sum()).backward()
    trainer.clip_and_step()
    sd2 = trainer.full_state_dict()
    asm = WeightAssembler()
    for chunk in iter_weight_chunks(sd2, make_manifest(sd2, 2), chunk_bytes=1 << 22):
        asm.add(chunk)
    tensors, manifest2 = asm.finish()
    r2 = await engine.update_weights_from_tensors(tensors, manifest2)
    assert r2.ok and r2.version == 2
    got = engine.current_weights()
    assert all(torch.equal(got[n], sd2[n]) for n in sd2)
    print(f"max |engine - trainer| logprob at version 0: {worst:.2e}")


async def test_distributed_update_leaves_the_replica_bit_identical_to_the_trainer(
    engine: TorchEngine,
    model_dir: Path,
    prompts: list[list[int]],
    tmp_path: Path,
) -> None:
    """The `distributed` transport (torch.distributed broadcast over gloo): the trainer, in
    its own process, takes an AdamW step and broadcasts its full state dict in 16 MB
    buckets; the replica's parameters then hash to the trainer's manifest checksum, a
    SHA-256 over every tensor's bytes, i.e. they are the trainer's bits."""
    from services.trainer.dist import free_port

    g = torch.Generator().manual_seed(0)
    outputs = [torch.randint(3, 49152, (6,), generator=g).tolist() for _ in prompts]
    spec = {
        "model_dir": str(model_dir),
        "prompts": prompts,
        "outputs": outputs,
        "port": free_port(),
        "bucket_bytes": 16 << 20,
        "out": str(tmp_path),
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    before = state_dict_checksum(engine.current_weights())
    sender = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("smollm2_trainer_sender.py")),
            str(tmp_path / "spec.json"),
        ]
    )
    try:
        while not (tmp_path / "manifest.json").exists():  # the trainer loads and steps
            assert sender.poll() is None, f"the trainer side exited with {sender.returncode}"
            await asyncio.sleep(0.5)
        sent = json.loads((tmp_path / "manifest.json").read_text())
        manifest = WeightManifest.from_json(sent["manifest"])
        specs = [TensorSpec(n, d, tuple(s)) for n, d, s in sent["specs"]]
        assert [s.name for s in specs] == sorted(engine.current_weights())  # tied: once
        assert manifest.checksum != before  # the step changed the weights
        await engine.init_weights_group(
            master_address="127.0.0.1",
            master_port=spec["port"],
            rank=1,
            world_size=2,
            backend="gloo",
            group_name="flywheel_weights",
        )
        r = await engine.update_weights_from_distributed(manifest, specs, sent["bucket_bytes"])
        assert r.ok and r.version == 1
        assert state_dict_checksum(engine.current_weights()) == manifest.checksum
        assert (
            engine.model.lm_head.weight.data_ptr()
            == engine.model.model.embed_tokens.weight.data_ptr()
        )
        await engine.close_weights_group()
        assert await asyncio.to_thread(sender.wait, 300) == 0
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait()
