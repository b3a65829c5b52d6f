"""Surrogate: the importance-weighted policy gradient without a trust region, l = -A ρ."""

import torch
from torch import Tensor

from services.api import SurrogateOutput, SurrogateParams


def unclipped(
    ratio: Tensor, advantages: Tensor, logprobs: Tensor, params: SurrogateParams
) -> SurrogateOutput:
    never = torch.zeros_like(ratio, dtype=torch.bool)  # nothing is clipped
    return SurrogateOutput(-advantages.detach() * ratio, never, never.clone())
