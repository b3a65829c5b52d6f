"""Input guards shared by the algorithm core: NaN/Inf on the positions that matter.

A NaN in a log-probability or an advantage silently poisons every gradient of the step,
so the core refuses it with an error that names the tensor. Positions outside the mask
(prompt, padding) are never read and may hold anything. The fast path is one fused check
over all tensors; only when it fails are they inspected one by one for the message.
"""

from __future__ import annotations

import torch
from torch import Tensor


def require_finite(mask: Tensor, what: str = "generated tokens", **tensors: Tensor | None) -> None:
    """Raise `ValueError` naming the first tensor with NaN/Inf where `mask` is true."""
    given = [(name, t) for name, t in tensors.items() if t is not None]
    if not given:
        return
    total = given[0][1].detach().to(torch.float32)
    for _, t in given[1:]:
        total = total + t.detach().to(torch.float32)
    if bool(torch.isfinite(torch.where(mask, total, 0.0)).all()):
        return
    for name, t in given:
        bad = mask & ~torch.isfinite(t.detach())
        if bool(bad.any()):
            raise ValueError(f"{name} has {int(bad.sum())} NaN/Inf values on {what}")
    # Finite one by one but not in sum: an overflow of the sum itself (|x| ~ 1e38) is
    # not a bad input.
