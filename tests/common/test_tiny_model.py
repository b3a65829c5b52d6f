"""The tiny model writer: loadable HF format, fixed ids, idempotent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from services.common.tiny_model import (
    ALPHABET,
    EOS_TOKEN,
    PAD_TOKEN,
    UNK_TOKEN,
    vocab_size,
    write_tiny_model,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tm") / "m")


def test_vocabulary_has_24_ids_with_fixed_specials(model_dir: Path) -> None:
    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    # 3 specials + 10 digits + 11 symbols ("+-*/=# \n().") = 24
    assert vocab_size() == 24 == len(tok.get_vocab())
    assert (tok.convert_tokens_to_ids([PAD_TOKEN, EOS_TOKEN, UNK_TOKEN])) == [0, 1, 2]
    assert tok.pad_token_id == 0 and tok.eos_token_id == 1
    assert set(tok.get_vocab()) == {PAD_TOKEN, EOS_TOKEN, UNK_TOKEN, *ALPHABET}


def test_encoding_is_one_id_per_character_and_round_trips(model_dir: Path) -> None:
    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    vocab = tok.get_vocab()
    text = "12+34=\n#### 46"
    ids = tok(text)["input_ids"]
    assert ids == [vocab[c] for c in text]  # 14 characters -> 14 ids, no specials added
    assert tok.decode(ids) == text
    # Characters outside the alphabet become <unk> (id 2), they are not dropped.
    assert tok("a1")["input_ids"] == [2, vocab["1"]]


def test_model_is_qwen2_with_tied_embeddings_and_expected_size(model_dir: Path) -> None:
    m = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(m).__name__ == "Qwen2ForCausalLM"
    assert m.config.tie_word_embeddings and m.lm_head.weight is m.model.embed_tokens.weight
    # embed 24*64=1536; per layer q,k,v 3*(64*64+64)=12480, o 64*64=4096, mlp 3*64*256=49152,
    # 2 norms 128 -> 65856; 2 layers 131712; final norm 64: 1536+131712+64 = 133312
    assert sum(p.numel() for p in m.parameters()) == 133_312
    out = m(torch.tensor([[3, 4, 5]])).logits
    assert out.shape == (1, 3, 24)


def test_write_is_idempotent_and_refuses_a_different_model(model_dir: Path, tmp_path: Path) -> None:
    weights = model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert write_tiny_model(model_dir) == model_dir
    assert weights.stat().st_mtime_ns == before  # untouched
    with pytest.raises(FileExistsError, match="does not hold a tiny model"):
        write_tiny_model(model_dir, seed=5)
    other = tmp_path / "not-empty"
    other.mkdir()
    (other / "x.txt").write_text("x")
    with pytest.raises(FileExistsError):
        write_tiny_model(other)


def test_seed_decides_the_weights(tmp_path: Path) -> None:
    a = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / "a", seed=3))
    b = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / "b", seed=3))
    c = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / "c", seed=4))
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    torch.testing.assert_close(wa, wb, rtol=0, atol=0)
    assert not torch.equal(wa, wc)


def test_bad_head_count_names_the_fields(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_heads=5"):
        write_tiny_model(tmp_path / "x", hidden_size=64, num_heads=5)
    assert not os.path.exists(tmp_path / "x")
