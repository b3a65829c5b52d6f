"""The torch.distributed transport's bucket plan: grouping and the byte round trip."""

from __future__ import annotations

import pytest
import torch

from services.common.weights.distributed import flatten_bucket, make_buckets, unflatten_bucket
from services.common.weights.manifest import TensorSpec, WeightsError, tensor_specs
from tests.common.weights.samples import assert_bit_identical, sample_tensors


def test_make_buckets_groups_consecutive_specs() -> None:
    specs = [
        TensorSpec("a", "float32", (10,)),  # 40 B
        TensorSpec("b", "float32", (10,)),  # 40 B
        TensorSpec("c", "float32", (25,)),  # 100 B > bucket: alone
        TensorSpec("d", "int64", (1,)),  # 8 B
    ]
    buckets = make_buckets(specs, 96)
    assert [[s.name for s in b.specs] for b in buckets] == [["a", "b"], ["c"], ["d"]]
    assert [b.nbytes for b in buckets] == [80, 100, 8]
    with pytest.raises(WeightsError):
        make_buckets(specs, 0)


def test_flatten_unflatten_round_trip_keeps_every_dtype() -> None:
    ts = sample_tensors()
    out: dict[str, torch.Tensor] = {}
    for bucket in make_buckets(tensor_specs(ts), 50):
        flat = flatten_bucket(bucket, ts)
        assert flat.dtype == torch.uint8 and flat.numel() == bucket.nbytes
        out.update(unflatten_bucket(bucket, flat))
    assert_bit_identical(ts, out)


def test_a_tensor_at_an_offset_its_dtype_cannot_view_is_unpacked_whole() -> None:
    # 5 bf16 values (10 B) then float32: the float32 starts at byte 10, not a multiple of 4.
    ts = {"a": torch.arange(5, dtype=torch.bfloat16), "b": torch.randn(3)}
    (bucket,) = make_buckets(tensor_specs(ts), 1 << 10)
    assert [s.name for s in bucket.specs] == ["a", "b"]
    assert_bit_identical(ts, unflatten_bucket(bucket, flatten_bucket(bucket, ts)))
