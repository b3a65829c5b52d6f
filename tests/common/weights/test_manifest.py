"""The manifest every transport carries: the checksum encoding, counts, the size bound."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch

from services.common.weights.manifest import (
    WeightManifest,
    WeightsError,
    check_update_size,
    make_manifest,
    state_dict_checksum,
    tensor_specs,
)
from tests.common.weights.samples import sample_tensors


def test_checksum_matches_the_documented_encoding() -> None:
    t = torch.tensor([1.0, -2.0], dtype=torch.float32)
    # name \0 dtype \0 shape \0 then little-endian float32 bytes of 1.0 and -2.0
    expected = hashlib.sha256(b"w\x00float32\x002\x00" + struct.pack("<ff", 1.0, -2.0)).hexdigest()
    assert state_dict_checksum({"w": t}) == expected


def test_checksum_ignores_order_and_layout_but_not_dtype_name_or_values() -> None:
    ts = sample_tensors()
    ref = state_dict_checksum(ts)
    assert state_dict_checksum(dict(reversed(list(ts.items())))) == ref
    transposed = dict(ts, **{"b.weight": ts["b.weight"].t().contiguous().t()})  # non-contiguous
    assert state_dict_checksum(transposed) == ref
    assert state_dict_checksum(dict(ts, **{"b.weight": ts["b.weight"].double()})) != ref
    assert state_dict_checksum({("z" + k): v for k, v in ts.items()}) != ref
    bumped = dict(ts, **{"b.weight": ts["b.weight"].clone()})
    bumped["b.weight"][0, 0] += 1e-6
    assert state_dict_checksum(bumped) != ref
    with pytest.raises(WeightsError, match="appears twice"):
        state_dict_checksum([("x", ts["a.bias"]), ("x", ts["a.bias"])])


def test_manifest_counts() -> None:
    m = make_manifest(sample_tensors(), 7)
    # bytes: 3*4*4=48, 5*2=10 (bf16), 6*8=48, 0 -> 106
    assert (m.version, m.num_tensors, m.total_bytes) == (7, 4, 106)
    assert WeightManifest.from_proto(m.to_proto()) == m
    assert WeightManifest.from_json(m.to_json()) == m


def test_check_update_size_for_transports_that_send_specs_first() -> None:
    ts = sample_tensors()
    m = make_manifest(ts, 3)  # 106 bytes (see test_manifest_counts)
    specs = tensor_specs(ts)
    check_update_size(m, specs, 106)
    with pytest.raises(WeightsError, match="exceeds the limit"):
        check_update_size(m, specs, 105)
    with pytest.raises(WeightsError, match="tensor specs hold 48 bytes"):
        check_update_size(m, [s for s in specs if s.name == "b.weight"], 1000)
    with pytest.raises(WeightsError, match="announce its size"):
        check_update_size(WeightManifest(3, m.checksum, 4, 0), specs, 1000)
