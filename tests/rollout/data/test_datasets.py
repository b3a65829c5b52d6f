"""Prompt data sets from JSONL/parquet, GSM8K columns, chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import PreTrainedTokenizerFast

from services.rollout.data.datasets import DatasetError, PromptDataset, read_rows, render_prompt

GSM8K_ROWS = [
    {"question": "1+2=", "answer": "#### 3"},
    {"question": "10+20=", "answer": "#### 30"},
    {"question": "5+5=", "answer": "#### 10"},
]


@pytest.fixture
def tok(tiny_model_dir: Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(tiny_model_dir)


def test_gsm8k_columns_work_from_jsonl_and_parquet(
    tmp_path: Path, tok: PreTrainedTokenizerFast
) -> None:
    jl = tmp_path / "gsm8k.jsonl"
    jl.write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
    pqf = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.Table.from_pylist(GSM8K_ROWS), pqf)
    assert read_rows(jl) == read_rows(pqf) == GSM8K_ROWS
    ds = PromptDataset(read_rows(pqf), tok, shuffle=False, source="gsm8k")
    row = ds.next()
    assert row.prompt == "1+2=" and row.answer == "#### 3" and row.prompt_id == "gsm8k:0"
    assert row.prompt_ids == tok("1+2=")["input_ids"] and row.prompt_text == "1+2="
    assert row.as_data()["answer"] == "#### 3"


def test_epochs_cycle_with_a_seeded_shuffle(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    ds = PromptDataset(GSM8K_ROWS, tok, seed=3)
    first = [ds.next().prompt_id for _ in range(3)]
    second = [ds.next().prompt_id for _ in range(3)]
    assert sorted(first) == sorted(second) == ["data:0", "data:1", "data:2"] and ds.epoch == 1
    again = PromptDataset(GSM8K_ROWS, tok, seed=3)
    assert [again.next().prompt_id for _ in range(3)] == first


def test_max_length_and_bad_rows(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    ds = PromptDataset(GSM8K_ROWS, tok, max_length=5)  # "10+20=" has 6 tokens
    assert len(ds) == 2 and ds.skipped_too_long == 1
    with pytest.raises(DatasetError, match="no 'prompt' column"):
        PromptDataset([{"text": "1+1="}], tok)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1"}\nnot json\n')
    with pytest.raises(DatasetError, match="bad.jsonl:2"):
        read_rows(bad)
    with pytest.raises(DatasetError, match="does not exist"):
        read_rows(tmp_path / "missing.jsonl")


def test_chat_template_is_applied_when_present(tok: PreTrainedTokenizerFast) -> None:
    text, ids = render_prompt(tok, "1+2")
    assert text == "1+2"  # no template: the text as it is
    tok.chat_template = "{% for m in messages %}({{ m['content'] }}){% endfor %}{% if add_generation_prompt %}={% endif %}"
    text, ids = render_prompt(tok, "1+2")
    assert text == "(1+2)=" and ids == tok("(1+2)=")["input_ids"]
    text, _ = render_prompt(
        tok, [{"role": "user", "content": "3"}, {"role": "user", "content": "4"}]
    )
    assert text == "(3)(4)="
