"""Trainer tests: one torch thread per process (the machine's cores are shared); the tiny
model fixture comes from the root conftest."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
