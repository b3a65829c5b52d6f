"""The parity probe's reference model (services/trainer/parity.py `HFReference`) on the tiny
model, float32 on CPU: what it computes after `load` is what the plain HF model computes
with the published weights, also when many threads run forwards on it at once (the probe
runs one per probed replica)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.trainer.parity import hf_reference
from tests.trainer.helpers import trainer_config
from tests.trainer.test_parity import _updated_weights


def _plain_logits(model_dir: Path, sd: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """The outside reference: a fresh HF model holding `sd`, one forward, nothing shared."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(sd, strict=False)
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture
def frequent_thread_switches() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def test_reference_computes_what_the_hf_model_computes_under_the_published_weights(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = trainer_config(tiny_model_dir, tmp_path)
    ref = hf_reference(cfg)
    own = {n: id(p) for n, p in ref.model.named_parameters()}
    ids = torch.randint(0, ref.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    for seed in (1, 2):
        sd = _updated_weights(cfg, seed)
        ref.load(sd)
        torch.testing.assert_close(
            ref.logits(ids), _plain_logits(tiny_model_dir, sd, ids), rtol=0, atol=1e-5
        )
    # the weights were copied into the model's own float32 parameters, not swapped in
    assert {n: id(p) for n, p in ref.model.named_parameters()} == own
    assert all(p.dtype == torch.float32 for p in ref.model.parameters())

    # bfloat16 as published with trainer.weight_dtype=bfloat16: the reference computes in
    # float32 from the rounded weights
    sd16 = {k: v.to(torch.bfloat16) for k, v in _updated_weights(cfg, 3).items()}
    ref.load(sd16)
    rounded = {k: v.float() for k, v in sd16.items()}
    torch.testing.assert_close(
        ref.logits(ids), _plain_logits(tiny_model_dir, rounded, ids), rtol=0, atol=1e-5
    )

    with pytest.raises(ValueError, match="not have: \\['model.layers.9.mlp.up_proj.weight'\\]"):
        ref.load({**sd16, "model.layers.9.mlp.up_proj.weight": torch.zeros(2)})


def test_concurrent_forwards_all_compute_under_the_loaded_weights(
    tiny_model_dir: Path, tmp_path: Path, frequent_thread_switches: None
) -> None:
    """400 forwards from 8 threads at once, each compared with the same forward run alone:
    a reference that changed the shared model per forward (`torch.func.functional_call`)
    got a few of them wrong by tenths of a nat here."""
    cfg = trainer_config(tiny_model_dir, tmp_path)
    ref = hf_reference(cfg)
    sd = _updated_weights(cfg, 1)
    ref.load(sd)
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randint(0, ref.vocab_size, (1, 12 + i % 9), generator=g) for i in range(8)]
    alone = [ref.logits(ids) for ids in inputs]
    start = threading.Barrier(8)

    def call(i: int) -> float:
        if i < 8:
            start.wait()  # the first forward of every thread begins together
        return float((ref.logits(inputs[i % 8]) - alone[i % 8]).abs().max())

    with ThreadPoolExecutor(8) as pool:
        diffs = list(pool.map(call, range(400)))
    assert max(diffs) == 0.0, sum(d > 0 for d in diffs)
