"""Supervised warm start of the tiny demo model on generated data.

Real RL recipes start from an instruction-tuned model that already answers in the asked
form and is sometimes right; RL then sharpens it. A freshly initialised tiny model never
produces `#### N`, so every reward would be 0 and GRPO would have nothing to rank. A short
answer-only supervised phase (loss on the answer tokens, not the prompt) gets sampled
accuracy to roughly a third, which leaves RL a clear job: lift it above 0.9.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.common.config.launcher import WarmStartConfig


def target_text(row: dict[str, Any]) -> str:
    """The completion the model is taught: the answer in the GSM8K `#### N` form."""
    answer = str(row["answer"]).strip()
    return answer if "####" in answer else f"#### {answer}"


def _encode(
    tokenizer: Any, rows: Sequence[dict[str, Any]], prompt_key: str
) -> list[tuple[list[int], list[int]]]:
    eos = tokenizer.eos_token_id
    out = []
    for row in rows:
        prompt = tokenizer.encode(str(row[prompt_key]), add_special_tokens=False)
        target = tokenizer.encode(target_text(row), add_special_tokens=False) + [eos]
        out.append((prompt, target))
    return out


def warm_start(
    model_dir: Path,
    out_dir: Path,
    train_rows: Sequence[dict[str, Any]],
    cfg: WarmStartConfig,
    *,
    prompt_key: str = "prompt",
    log: Any = print,
) -> dict[str, float]:
    """Train `model_dir` on (prompt → answer) pairs and save the result to `out_dir` (HF)."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.train()
    pairs = _encode(tokenizer, train_rows, prompt_key)
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    warmup = max(1, cfg.warmup_steps)
    decay = max(1, cfg.steps - warmup)

    def factor(step: int) -> float:
        # Linear warm-up (without it the first steps overshoot), then constant or a half
        # cosine to 10% of the peak.
        if step < warmup:
            return (step + 1) / warmup
        if not cfg.cosine_decay:
            return 1.0
        progress = min(1.0, (step - warmup) / decay)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    pad = tokenizer.pad_token_id
    start = time.monotonic()
    loss_value = math.nan
    for step in range(cfg.steps):
        batch = [pairs[rng.randrange(len(pairs))] for _ in range(cfg.batch_size)]
        length = max(len(p) + len(t) for p, t in batch)
        ids = torch.full((len(batch), length), pad, dtype=torch.long)
        labels = torch.full((len(batch), length), -100, dtype=torch.long)
        attn = torch.zeros((len(batch), length), dtype=torch.long)
        for i, (p, t) in enumerate(batch):
            seq = p + t
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, len(p) : len(seq)] = torch.tensor(t)
            attn[i, : len(seq)] = 1
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            labels[:, 1:].reshape(-1),
            ignore_index=-100,
            label_smoothing=cfg.label_smoothing,
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = float(loss.detach())
        if step % 50 == 0 or step == cfg.steps - 1:
            log(f"warm start step {step + 1}/{cfg.steps} loss {loss_value:.4f}")
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    stats = {"warm_start_loss": loss_value, "warm_start_seconds": time.monotonic() - start}
    (out_dir / "warm_start.json").write_text(json.dumps(stats))
    return stats
