"""Fixtures of the algorithm-core tests: one CPU thread, seeded generators."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread_seeded() -> None:
    # The machine is shared; these tests are tiny and must not fight for cores.
    torch.set_num_threads(1)
    torch.manual_seed(0)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)
