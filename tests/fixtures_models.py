"""Shared model fixtures: a tiny Qwen2 model + character tokenizer written once per session.

Import into `tests/conftest.py` with `from tests.fixtures_models import tiny_model_dir  # noqa: F401`
(or `pytest_plugins = ["tests.fixtures_models"]`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.tiny_model import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny HF-format model directory (hidden 64, 2 layers, 4 heads, 24-symbol vocab, seed 0).

    Session-scoped and read-only by convention: tests that change weights load their own copy
    of the model from it and never write into the directory.
    """
    return write_tiny_model(tmp_path_factory.mktemp("tiny_model") / "model")
