"""Supervised fine-tuning with the trainer's engine: `flywheel sft --config FILE`.

Rows of `train_dataset` (JSONL or parquet) carry a prompt (`prompt_key`, text or chat
messages; GSM8K's `question` when the key is absent) and an answer (`answer_key`). The
prompt goes through the tokenizer's chat template with the generation prompt (as the
rollout renders it), the answer follows with EOS, and the loss is the mean negative
log-likelihood of the answer tokens only (AReaL's SFT loss: prompt tokens are masked).

The model is `actor` on the trainer's `TrainEngine` (FSDP2 over `torchrun` ranks or one
process, `actor.optimizer` and its schedule, gradient clipping), so an SFT checkpoint is
the same Hugging Face directory an RL run starts from. Each epoch shuffles the rows
(seeded by `seed`); `train_dataset.batch_size` rows make one optimizer step;
`total_train_steps` (or `total_train_epochs`) bounds the run. Rank 0 writes
`<run_dir>/sft_metrics.jsonl`, the tracking block's writers (`sft/loss`, `sft/lr`,
`sft/grad_norm`, `sft/n_tokens`) and, at the end, `<run_dir>/sft/hf` (the model).

Label smoothing (`--label-smoothing E`, `run_sft(label_smoothing=E)`, default 0) is a
Flywheel option AReaL's SFT loss does not have: each answer token's target is
(1 - E) on the token and E spread evenly over the vocabulary, torch's
`cross_entropy(label_smoothing=E)`. With E = 0 the loss is AReaL's. The launcher's demo
warm start uses it (services/launcher/warmstart.py): the policy learns to rank the right
answer first while staying unsure, the gap between greedy and sampled accuracy RL closes.

A vision-language `actor.path` (a local checkpoint whose config has a `vision_config`)
trains on rows with images (AReaL's VLM shape: question, answer, `images`): the prompt goes
through the model's processor, each image's placeholder expanded to its image tokens, and
every row carries its images to the engine, which rebuilds the pixel inputs
(`sft_vision.py`). Rows with images for a text model are refused.

A config written for AReaL (`examples/math/gsm8k_sft.yaml`) loads as `flywheel run`
loads it (translated); `--dry-run` prints the resolved config and exits.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

EXIT_BAD_CONFIG = 2


def encode_rows(
    tokenizer: Any, rows: Sequence[dict[str, Any]], prompt_key: str, answer_key: str
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids + EOS) per row; the prompt through the chat template."""
    from services.common.datasets import render_prompt

    out = []
    for i, row in enumerate(rows):
        key = prompt_key if prompt_key in row else "question"
        if key not in row or answer_key not in row:
            raise ValueError(f"row {i} has no {prompt_key!r} or {answer_key!r} column")
        _, prompt = render_prompt(tokenizer, row[key])
        answer = tokenizer(str(row[answer_key]), add_special_tokens=False)["input_ids"]
        out.append((list(prompt), [*answer, tokenizer.eos_token_id]))
    return out


def sft_batch(
    examples: Sequence[tuple[list[int], list[int]]],
    pad_id: int,
    images: Sequence[tuple[bytes, ...]] | None = None,
) -> Any:
    """A right-padded `SeqBatch` whose loss mask covers the answer tokens; `images`, one
    tuple per row, rides along for a vision-language model (`SeqBatch.images`)."""
    import torch

    from services.trainer.batch import SeqBatch

    width = max(len(p) + len(a) for p, a in examples)
    b = len(examples)
    ids = torch.full((b, width), pad_id, dtype=torch.int64)
    attn = torch.zeros((b, width), dtype=torch.bool)
    mask = torch.zeros((b, width), dtype=torch.float32)
    lens, plens = [], []
    for row, (prompt, answer) in enumerate(examples):
        seq = prompt + answer
        ids[row, : len(seq)] = torch.tensor(seq)
        attn[row, : len(seq)] = True
        mask[row, len(prompt) : len(seq)] = 1.0
        lens.append(len(seq))
        plens.append(len(prompt))
    zeros = torch.zeros((b, width))
    return SeqBatch(
        input_ids=ids,
        attention_mask=attn,
        loss_mask=mask,
        behave_logp=zeros,
        versions=torch.zeros((b, width), dtype=torch.int64),
        rewards=torch.zeros(b),
        no_eos=torch.zeros(b, dtype=torch.bool),
        seq_lens=torch.tensor(lens),
        prompt_lens=torch.tensor(plens),
        group_index=torch.arange(b),
        images=tuple(images) if images is not None and any(images) else None,
    )


def smoothed_token_loss(
    logits: Any, input_ids: Any, label_smoothing: float, *, first_position: int = 0
) -> Any:
    """Per-token loss `[B, T]` of predicting `input_ids[:, t]` from the model's outputs
    `logits` `[B, T - first_position, V]` (at positions `first_position` onwards), with
    label smoothing e (torch's `cross_entropy(label_smoothing=e)` at each position):

        loss_t = (1 - e) * (-log p(ids[t])) + e * mean_v(-log p(v)),  log p = log_softmax

    and 0 at t <= first_position (nothing there is predicted by these outputs). In float32.
    """
    import torch
    import torch.nn.functional as F

    pred = logits[:, :-1, :].float()
    target = input_ids[:, first_position + 1 :]
    loss = torch.zeros(input_ids.shape, dtype=pred.dtype, device=pred.device)
    loss[:, first_position + 1 :] = F.cross_entropy(
        pred.transpose(1, 2), target, label_smoothing=label_smoothing, reduction="none"
    )
    return loss


def answer_token_loss(engine: Any, mb: Any, label_smoothing: float = 0.0) -> Any:
    """Per-token loss `[b, t]` of `mb` under `engine` (the caller masks it to the answer):
    -log p of each token (AReaL's SFT loss), or with `label_smoothing` > 0
    `smoothed_token_loss`."""
    import torch

    from services.trainer.logprobs import first_scored_position

    if label_smoothing <= 0.0:
        logp, _ = engine.logprobs(mb)
        return -logp
    if mb is None or mb.size == 0:
        logits = engine.logits(mb)  # one dummy position: joins the collectives
        ids = torch.zeros(logits.shape[:2], dtype=torch.int64, device=logits.device)
        return smoothed_token_loss(logits, ids, label_smoothing)
    first = first_scored_position(mb.loss_mask)
    logits = engine.logits(mb, first_position=first)
    ids = mb.input_ids.to(logits.device)
    return smoothed_token_loss(logits, ids, label_smoothing, first_position=first)


def check_sft_inputs(cfg: Any, label_smoothing: float) -> None:
    """Raise `ValueError` for what SFT cannot train on: no optimizer, no data file, a
    smoothing outside [0, 1), or rows with images for a model that is not known to be a
    vision-language one (a text model would be trained on the questions without the
    pictures; a hub id with no local copy cannot be told apart)."""
    from services.common.config.areal_vision import dataset_has_images, model_has_vision

    if cfg.actor.optimizer is None:
        raise ValueError("actor.optimizer is null: supervised fine-tuning needs one")
    if not cfg.train_dataset.path:
        raise ValueError(
            "train_dataset.path: SFT needs a JSONL/parquet file of prompts and answers"
        )
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing}: expected a value in [0, 1)")
    if dataset_has_images(cfg.train_dataset.path) and not model_has_vision(cfg.actor.path):
        raise ValueError(
            f"train_dataset.path {cfg.train_dataset.path} has images but actor.path "
            f"{cfg.actor.path} is not a local vision-language checkpoint (no vision_config "
            "in its config.json): a text model would be trained without the images; point "
            "actor.path at a VLM directory (docs/vision.md)"
        )


def _encode(
    cfg: Any, tokenizer: Any, rows: Sequence[dict[str, Any]]
) -> tuple[list[tuple[list[int], list[int]]], list[tuple[bytes, ...]] | None]:
    """The examples of `rows` and, for a vision-language `actor.path`, each row's images
    (the prompt ids then come from the model's processor, `sft_vision.py`)."""
    from services.common.config.areal_vision import model_has_vision

    ds = cfg.train_dataset
    if not model_has_vision(cfg.actor.path):
        return encode_rows(tokenizer, rows, ds.prompt_key, ds.answer_key), None
    from services.common.vision_inputs import load_vision_processor
    from services.trainer.sft_vision import encode_vision_rows

    path = Path(ds.path)
    return encode_vision_rows(
        load_vision_processor(cfg.actor.path),
        rows,
        ds.prompt_key,
        ds.answer_key,
        base_dir=path if path.is_dir() else path.parent,
    )


def run_sft(
    cfg: Any,
    *,
    run_dir: Path | None = None,
    label_smoothing: float = 0.0,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Train `cfg.actor` on `cfg.train_dataset`; returns the summary rank 0 writes.

    `run_dir` replaces `<cluster.fileroot>/<experiment_name>/<trial_name>` as the place of
    the metrics, event files and export (the launcher's warm start writes next to its
    model). `label_smoothing` in [0, 1) smooths the answer tokens' targets (see the module
    docstring); 0 is AReaL's SFT loss. `on_step` gets each step's record on rank 0 (the
    launcher's progress lines)."""
    import torch
    import torch.distributed as dist

    from services.common.datasets import read_rows
    from services.common.model_source import load_tokenizer
    from services.trainer.checkpoint import export_hf
    from services.trainer.dist import init_distributed
    from services.trainer.engine import TrainEngine
    from services.trainer.tracking import Tracker

    check_sft_inputs(cfg, label_smoothing)
    ctx = init_distributed(cfg.trainer.device)
    # The rollout engines' loader: the same ids as the rollouts, on either transformers major.
    tokenizer = load_tokenizer(cfg.tokenizer_path or cfg.actor.path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ds = cfg.train_dataset
    examples, images = _encode(cfg, tokenizer, read_rows(ds.path))
    if ds.max_length is not None:
        keep = [i for i, e in enumerate(examples) if len(e[0]) + len(e[1]) <= ds.max_length]
        examples = [examples[i] for i in keep]
        images = [images[i] for i in keep] if images is not None else None
    # Each rank takes every world_size-th row of the global batch (data parallel).
    batch_size = ds.batch_size
    per_epoch = (
        len(examples) // batch_size if ds.drop_last else math.ceil(len(examples) / batch_size)
    )
    if per_epoch == 0:
        raise ValueError(
            f"train_dataset has {len(examples)} usable rows, fewer than batch_size={batch_size}"
        )
    total = cfg.total_train_steps or per_epoch * cfg.total_train_epochs
    engine = TrainEngine(cfg.actor, ctx, total_steps=total, temperature=1.0)
    if run_dir is None:
        run_dir = Path(cfg.cluster.fileroot) / cfg.experiment_name / cfg.trial_name
    tracker = Tracker(cfg, run_dir) if ctx.is_main else None
    metrics = None
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        metrics = (run_dir / "sft_metrics.jsonl").open("a", encoding="utf-8")
    losses: list[float] = []
    step = 0
    try:
        epoch = 0
        while step < total:
            order = list(range(len(examples)))
            random.Random(f"{cfg.seed}-sft-{epoch}").shuffle(order)
            for start in range(0, per_epoch * batch_size, batch_size):
                if step >= total:
                    break
                rows = order[start : start + batch_size][ctx.rank :: ctx.world_size]
                mb = (
                    sft_batch(
                        [examples[i] for i in rows],
                        pad_id,
                        [images[i] for i in rows] if images is not None else None,
                    )
                    if rows
                    else None
                )
                engine.zero_grad()
                lr = engine.lr  # the rate this step uses (clip_and_step advances it)
                token_loss = answer_token_loss(engine, mb, label_smoothing)
                if mb is None:
                    loss = token_loss.sum() * 0.0  # joins the collectives, adds nothing
                    n_local = torch.zeros((), device=ctx.device)
                else:
                    mask = mb.loss_mask.to(token_loss.device)
                    n_local = mask.sum()
                    loss = (token_loss * mask).sum()
                n_tokens = n_local.detach().clone()
                if ctx.world_size > 1:
                    dist.all_reduce(n_tokens)
                # Sum over ranks of each rank's token sum / global tokens = the global mean
                # (FSDP averages gradients over ranks, hence the world_size factor).
                (loss * ctx.world_size / n_tokens.clamp(min=1)).backward()
                grad_norm, _ = engine.clip_and_step()
                step += 1
                mean = (loss.detach() / n_tokens.clamp(min=1)).clone()
                if ctx.world_size > 1:
                    dist.all_reduce(mean)
                losses.append(float(mean))
                record = {
                    "step": step,
                    "epoch": epoch,
                    "loss": float(mean),
                    "lr": lr,
                    "grad_norm": float(grad_norm),
                    "n_tokens": int(n_tokens),
                }
                if metrics is not None:
                    metrics.write(json.dumps(record) + "\n")
                    metrics.flush()
                    if on_step is not None:
                        on_step(record)
                if tracker is not None:
                    tracker.log_named(
                        {f"sft/{k}": v for k, v in record.items() if k not in ("step", "epoch")},
                        step,
                    )
            epoch += 1
        state = engine.full_state_dict()
        summary: dict[str, Any] = {"steps": step, "first_loss": losses[0], "last_loss": losses[-1]}
        if ctx.is_main:
            out = export_hf(state, cfg.actor.path, run_dir / "sft" / "hf")
            summary["model"] = str(out)
            (run_dir / "sft" / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary
    finally:
        if metrics is not None:
            metrics.close()
        if tracker is not None:
            tracker.close()
        if ctx.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    """`flywheel sft --config FILE [overrides] [--dry-run] [--from areal|flywheel]`."""
    from services.common.config import ConfigError, to_yaml
    from services.common.config.loader import load_with_report

    parser = argparse.ArgumentParser(
        prog="flywheel sft", description="supervised fine-tuning of actor on train_dataset"
    )
    parser.add_argument("--config", "-c", help="YAML config file")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config")
    parser.add_argument(
        "--label-smoothing",
        type=float,
        default=0.0,
        help="smooth the answer tokens' targets by this much (Flywheel; AReaL's SFT has none)",
    )
    parser.add_argument(
        "--from",
        dest="source",
        choices=("auto", "areal", "flywheel"),
        default="auto",
        help="read the file as an AReaL config",
    )
    args, overrides = parser.parse_known_args(argv)
    unknown = [a for a in overrides if a.startswith("-")]
    if unknown:
        parser.error(f"unrecognised option(s): {' '.join(unknown)}")
    try:
        cfg, report = load_with_report(
            args.config, overrides, source=args.source, require_data=not args.dry_run
        )
    except ConfigError as exc:
        print(f"flywheel sft: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    lines = [line for line in report.lines() if "train_dataset.type" not in line]
    if args.dry_run:
        sys.stdout.write("".join(f"# {line}\n" for line in lines))
        sys.stdout.write(to_yaml(cfg))
        return 0
    try:
        summary = run_sft(cfg, label_smoothing=args.label_smoothing)
    except ValueError as exc:
        print(f"flywheel sft: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
