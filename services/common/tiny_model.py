"""A tiny Qwen2-architecture causal LM and a character-level tokenizer, written in HF format.

The embedded demo (`make run`) and every test need a real Hugging Face checkpoint without
downloading one. This module writes one: a `Qwen2ForCausalLM` with tied embeddings and a
tokenizer trained offline with `tokenizers` over a small character alphabet (digits,
arithmetic symbols, `#`, space, newline) plus `<pad>`, `<eos>` and `<unk>`.

Load it with `transformers.AutoModelForCausalLM.from_pretrained(path)` and
`transformers.PreTrainedTokenizerFast.from_pretrained(path)`. Do not use `AutoTokenizer`:
for a Qwen2 config it may build Qwen's own tokenizer class, whose pre-tokenizer differs, and
the ids would change.

Writing is idempotent: a directory that already holds a model written with the same
settings is left as it is, so several processes (launcher, rollout, trainer) can call
`write_tiny_model` on the same path at start-up.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)
# 3 special tokens + 21 characters = 24 symbols: enough for "12+34=" prompts and
# GSM8K-style "#### 46" answers, small enough that the output layer is negligible.
ALPHABET: tuple[str, ...] = tuple("0123456789") + tuple("+-*/=# \n().")
MARKER_FILE = "flywheel_tiny_model.json"
_FORMAT_VERSION = 1


def vocab_size() -> int:
    """Number of token ids of the tiny tokenizer (specials + alphabet)."""
    return len(SPECIAL_TOKENS) + len(ALPHABET)


def build_char_tokenizer(
    specials: tuple[str, ...] | list[str], alphabet: tuple[str, ...] | list[str], unk: str | None
):  # -> tokenizers.Tokenizer
    """Train a character-level BPE tokenizer with no merges (one id per character).

    BPE with a vocabulary equal to specials + alphabet learns no merges, so every character
    is its own token and the ids are fixed by the trainer's deterministic ordering (specials
    first, then the alphabet). `Fuse` joins decoded tokens without spaces. The tiny text
    model and the tiny VLM both use it, with their own specials and alphabets.
    """
    from tokenizers import Tokenizer, decoders, models, trainers

    size = len(specials) + len(alphabet)
    tok = Tokenizer(models.BPE(unk_token=unk))
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        special_tokens=list(specials),
        initial_alphabet=list(alphabet),
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    # The corpus only needs to show the alphabet; vocab_size leaves no room for merges.
    tok.train_from_iterator(["".join(alphabet)], trainer=trainer)
    tok.decoder = decoders.Fuse()
    got = tok.get_vocab_size()
    if got != size:
        raise RuntimeError(f"character tokenizer has {got} ids, expected {size}")
    return tok


def build_tokenizer():  # -> tokenizers.Tokenizer
    """The tiny text model's tokenizer: `build_char_tokenizer` over its specials and alphabet."""
    return build_char_tokenizer(SPECIAL_TOKENS, ALPHABET, UNK_TOKEN)


def _settings(
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    seed: int,
    intermediate_size: int | None,
    num_kv_heads: int | None,
    max_position_embeddings: int,
) -> dict[str, int]:
    return {
        "format_version": _FORMAT_VERSION,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads or num_heads,
        "intermediate_size": intermediate_size or 4 * hidden_size,
        "max_position_embeddings": max_position_embeddings,
        "seed": seed,
        "vocab_size": vocab_size(),
    }


def _already_written(
    path: Path, settings: Mapping[str, int], marker_name: str = MARKER_FILE
) -> bool:
    marker = path / marker_name
    if not marker.is_file():
        return False
    try:
        return bool(json.loads(marker.read_text()) == settings)
    except (OSError, ValueError):
        return False


def write_tiny_model(
    path: str | os.PathLike[str],
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
    intermediate_size: int | None = None,
    num_kv_heads: int | None = None,
    max_position_embeddings: int = 512,
) -> Path:
    """Write model + tokenizer into `path` (HF format) unless the same model is already there.

    Parameters are drawn from `seed` without touching the caller's global RNG state.
    `intermediate_size` defaults to 4 x hidden; `num_kv_heads` to `num_heads` (no GQA).
    A directory holding a different tiny model, or anything else, is an error rather than
    being overwritten. Returns the directory.
    """
    if hidden_size % num_heads != 0:
        raise ValueError(
            f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}; "
            "pick num_heads dividing hidden_size"
        )
    kv = num_kv_heads or num_heads
    if num_heads % kv != 0:
        raise ValueError(f"num_kv_heads={kv} must divide num_heads={num_heads}")
    path = Path(path)
    settings = _settings(
        hidden_size,
        num_layers,
        num_heads,
        seed,
        intermediate_size,
        num_kv_heads,
        max_position_embeddings,
    )
    if _already_written(path, settings):
        return path
    refuse_foreign_dir(path, settings)

    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer()
    pad_id = tok.token_to_id(PAD_TOKEN)
    eos_id = tok.token_to_id(EOS_TOKEN)
    config = Qwen2Config(
        vocab_size=settings["vocab_size"],
        hidden_size=hidden_size,
        intermediate_size=settings["intermediate_size"],
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=kv,
        max_position_embeddings=max_position_embeddings,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
        torch_dtype="float32",
        use_cache=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    generation = model.generation_config
    assert generation is not None  # a model that can generate is built with one
    generation.pad_token_id = pad_id
    generation.eos_token_id = eos_id
    generation.bos_token_id = eos_id
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )

    return publish_dir(path, settings, (model, hf_tok))


def refuse_foreign_dir(path: Path, settings: Mapping[str, int]) -> None:
    """Raise unless `path` is absent or empty (never overwrite another model or files)."""
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(
            f"{path} exists and does not hold a tiny model with settings {dict(settings)}; "
            "choose an empty or new directory"
        )


def publish_dir(
    path: Path, settings: Mapping[str, int], parts: Iterable[Any], marker: str = MARKER_FILE
) -> Path:
    """Save every part (`save_pretrained`) and the settings marker into a temporary sibling
    and move it to `path` in one rename, so readers see no directory or a complete one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        for part in parts:
            part.save_pretrained(tmp)
        (tmp / marker).write_text(json.dumps(settings, indent=1, sort_keys=True))
        if path.exists():
            path.rmdir()  # empty (checked by the caller)
        try:
            os.replace(tmp, path)
        except OSError:
            # Another process won the race; accept its copy if it is the same model.
            if not _already_written(path, settings, marker):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
