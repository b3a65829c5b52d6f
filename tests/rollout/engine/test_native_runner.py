"""The native decoder against a fresh HF forward, on each architecture it claims to run.

Every case runs a ragged batch through the runner the way the engine does (one prefill of
uneven prompts, decode steps at different positions, a sequence finishing and its slot being
refilled, a mid-sequence extend) and compares the logits of every step with the HF model's
own forward over the whole sequence so far. Float tolerance: the two compute the same float32
sums in a different order (and, with paired q/k rows, RoPE as a complex product); on these
2-layer models they agree to ~1e-6, so logits are compared with atol=1e-4 (rtol=0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
)

from services.rollout.engine.native_runner import NativeDecoderRunner

ATOL = 1e-4
COMMON = {
    "vocab_size": 32,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
}

CONFIGS = {
    # q/k/v biases (Qwen2's default), no GQA
    "qwen2": Qwen2Config(**COMMON, num_key_value_heads=4),
    # GQA, every projection with a bias: the residual adds cannot ride in the GEMM
    "llama-gqa-bias": LlamaConfig(
        **COMMON, num_key_value_heads=2, attention_bias=True, mlp_bias=True
    ),
    # per-head q/k norms: no paired rows, the scale is applied to the scores
    "qwen3": Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=16),
    # position-dependent frequencies (static per position, so the tables still apply)
    "llama3-rope": LlamaConfig(
        **COMMON,
        num_key_value_heads=4,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
}


@dataclass
class Seq:
    tokens: list[int]
    cache_len: int = 0
    slot: object = None
    ref: list[torch.Tensor] = field(default_factory=list)


def make_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name], attn_implementation="eager")
    with torch.no_grad():  # biases are zero at init: make them matter
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0.0, 0.5)
    return model.eval()


def reference(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


def check(model: torch.nn.Module, runner: NativeDecoderRunner, seqs: list[Seq]) -> None:
    logits = runner.forward(seqs)
    for row, s in zip(logits, seqs, strict=True):
        torch.testing.assert_close(row, reference(model, s.tokens), atol=ATOL, rtol=0)
        s.tokens.append(int(row.argmax()))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_native_runner_matches_the_hf_forward(name: str) -> None:
    model = make_model(name)
    ok, why = NativeDecoderRunner.supports(model)
    assert ok, why
    runner = NativeDecoderRunner(model, max_slots=4, initial_capacity=8)
    gen = torch.Generator().manual_seed(1)
    prompt = lambda n: torch.randint(2, 32, (n,), generator=gen).tolist()  # noqa: E731
    a, b, c = Seq(prompt(5)), Seq(prompt(9)), Seq(prompt(3))
    check(model, runner, [a, b, c])  # ragged prefill
    for _ in range(4):  # decode at three different positions (masked attention)
        check(model, runner, [a, b, c])
    runner.remove(b)  # c moves into b's slot
    d = Seq(prompt(6))
    check(model, runner, [d])  # prefill into the freed slot while the others wait
    for _ in range(3):  # rows out of slot order
        check(model, runner, [c, d, a])
    a.tokens += prompt(4)  # an extend mid-sequence (e.g. a multi-turn feedback message)
    check(model, runner, [a])
    for _ in range(12):  # grow the cache past its initial capacity
        check(model, runner, [a, c, d])
    assert runner.capacity > 8


def test_uniform_rows_take_the_unmasked_contiguous_path_and_agree() -> None:
    model = make_model("qwen2")
    runner = NativeDecoderRunner(model, max_slots=3)
    seqs = [Seq([3, 4, 5, 6]), Seq([7, 8, 9, 10]), Seq([11, 12, 13, 14])]
    for _ in range(6):
        check(model, runner, seqs)


def test_pairing_is_used_only_where_it_is_exact() -> None:
    """Paired q/k rows (complex RoPE, folded scale) need float32/64, no q/k norms and equal
    RoPE table halves; everything else keeps HF's rotate_half order."""
    assert NativeDecoderRunner(make_model("qwen2"), max_slots=1)._paired
    assert NativeDecoderRunner(make_model("llama3-rope"), max_slots=1)._paired
    assert not NativeDecoderRunner(make_model("qwen3"), max_slots=1)._paired
    half = make_model("qwen2").to(torch.bfloat16)
    assert not NativeDecoderRunner(half, max_slots=1)._paired


def test_refreshed_weights_are_served() -> None:
    """The fused (and permuted) copies are rebuilt from the parameters on refresh."""
    model = make_model("qwen2")
    runner = NativeDecoderRunner(model, max_slots=1)
    s = Seq([3, 4, 5])
    check(model, runner, [s])
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    runner.refresh_weights()
    runner.invalidate([s])
    check(model, runner, [s])
