"""Fixtures of the trainer tests (the tiny model fixture is shared with other services)."""

from __future__ import annotations

import torch

from tests.fixtures_models import tiny_model_dir  # noqa: F401

torch.set_num_threads(1)
