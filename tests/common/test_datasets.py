"""Reading data set files (services/common/datasets.py `read_rows`): every format a data
set may come in gives the same rows, and a bad file is named with its line.

Parquet files are written with pyarrow and JSON with the standard library, so the expected
rows are what those writers were given.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.common.datasets import DatasetError, read_rows

ROWS = [
    {"question": "2 + 3?", "answer": "5", "level": 1},
    {"question": "7 * 6?", "answer": "42", "level": 2},
]


def test_jsonl_json_parquet_and_a_directory_give_the_same_rows(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n\n" for r in ROWS))
    (tmp_path / "b.json").write_text(json.dumps(ROWS))
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "c.parquet")
    for name in ("a.jsonl", "b.json", "c.parquet"):
        assert read_rows(tmp_path / name) == ROWS, name
    (tmp_path / "notes.txt").write_text("not data")  # other files in the folder are skipped
    assert read_rows(tmp_path) == ROWS * 3  # a.jsonl, b.json, c.parquet: sorted by name


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("bad.jsonl", '{"q": 1}\n{"q": \n', r"bad.jsonl:2: not valid JSON"),
        ("list.jsonl", '{"q": 1}\n[1, 2]\n', r"list.jsonl:2: a row must be a JSON object"),
        ("data.csv", "q,a\n1,2\n", r"unsupported file type '.csv'"),
    ],
)
def test_a_bad_file_is_named_with_its_line(
    tmp_path: Path, name: str, text: str, message: str
) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(DatasetError, match=message):
        read_rows(tmp_path / name)


def test_missing_and_empty_sources_say_so(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        read_rows(tmp_path / "nope.jsonl")
    with pytest.raises(DatasetError, match="holds no .jsonl/.json/.parquet files"):
        read_rows(tmp_path)
