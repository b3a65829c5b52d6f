"""Shared fixtures: a real redis-server per test, and tier markers that skip honestly."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from services.common.redis_server import RedisServer
from tests.fixtures_models import tiny_model_dir  # noqa: F401  (session-wide tiny HF model)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine); CPU path tested")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A fresh real redis-server (AOF on) in its own directory, stopped after the test."""
    server = RedisServer(dir=tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url
