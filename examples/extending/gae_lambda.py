"""GAE λ function: λ = 1 for short trajectories, a smaller λ for long ones."""

from collections.abc import Mapping

import torch
from torch import Tensor


def by_length(
    context: Mapping[str, Tensor], threshold: int = 256, long_lambda: float = 0.95
) -> Tensor:
    lengths = context["timestep_lengths"]
    ones = torch.ones(lengths.shape, dtype=torch.float32, device=lengths.device)
    return torch.where(lengths > threshold, ones * long_lambda, ones)
