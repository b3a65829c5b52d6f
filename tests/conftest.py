"""Shared fixtures: a real redis-server per test, and tier markers that skip honestly."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

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


# The files `make test-compat` runs on the pinned SGLang's torch, transformers and tokenizers
# (tools/compat_requirements.py): every place Flywheel calls into them on the CPU path, i.e.
# building and loading models (the tiny model, the GGUF SmolLM2 source), tokenizers and chat
# templates, the torch engine's generation, log-probabilities, the FSDP2 trainer step on gloo,
# supervised fine-tuning, weight transport and checkpoints. Paths are relative to this folder.
COMPAT_FILES = (
    "common/test_tiny_model.py",
    "common/test_model_source.py",
    "common/weights/test_manifest.py",
    "common/weights/test_disk.py",
    "common/weights/test_distributed.py",
    "common/weights/test_grpc_stream.py",
    "rollout/engine/test_torch_engine.py",
    "rollout/engine/test_torch_engine_smollm2.py",
    "rollout/engine/test_native_runner.py",
    "rollout/engine/test_sampling.py",
    "rollout/data/test_datasets.py",
    "rollout/test_weight_transports.py",
    "trainer/test_logprobs.py",
    "trainer/test_fsdp_equivalence.py",
    "trainer/test_checkpoint.py",
    "trainer/test_sft.py",
    "trainer/test_weight_sync.py",
)


def _mark_compat(items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    files = {here / f for f in COMPAT_FILES}
    missing = sorted(str(f.relative_to(here)) for f in files if not f.is_file())
    if missing:
        raise pytest.UsageError(f"tests/conftest.py COMPAT_FILES names missing files: {missing}")
    for item in items:
        if item.path in files:
            item.add_marker(pytest.mark.compat)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _mark_compat(items)
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
