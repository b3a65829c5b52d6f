"""Tensors and a comparison shared by the weight-format tests of every transport."""

from __future__ import annotations

import torch


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "b.weight": torch.randn(3, 4, generator=g),
        "a.bias": torch.randn(5, generator=g).to(torch.bfloat16),
        "c.count": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "d.empty": torch.empty(0, 2),
    }


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(
            a[k].view(-1).view(torch.uint8), b[k].reshape(-1).contiguous().view(torch.uint8)
        ), k
