"""Activation codecs: raw roundtrips exactly, int8 within its quantization error, bad blobs rejected."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.sessions import TensorBlob
from stratamesh.kernels.codec import decode, encode


def hidden(dtype: torch.dtype, shape=(7, 64)) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 64), (64,), (2, 3, 5), ()])
def test_raw_roundtrip_is_exact(dtype, shape):
    t = hidden(dtype, shape)
    blob = encode(t)
    assert blob.shape == shape and blob.codec == "raw" and len(blob.data) == t.numel() * t.element_size()
    back = decode(blob)
    assert back.dtype == dtype and torch.equal(back, t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_int8_roundtrip_within_half_a_step_per_row(dtype):
    t = hidden(dtype)
    t[3] *= 100   # an outlier token must not cost the others their precision
    blob = encode(t, "int8")
    assert len(blob.data) == t.numel() and blob.scales.shape == (7,)
    back = decode(blob)
    assert back.dtype == dtype
    step = t.float().abs().amax(dim=1, keepdim=True) / 127
    err = (back.float() - t.float()).abs()
    assert bool((err <= step * 0.5 + t.float().abs() * 1e-2).all())
    assert float(err[0].max()) < float(step[3]) / 10


def test_int8_zero_rows():
    t = torch.zeros(2, 8)
    assert torch.equal(decode(encode(t, "int8")), t)


def test_bad_blobs_name_the_field():
    good = encode(hidden(torch.float32))
    bad = [
        (dataclasses.replace(good, data=good.data[:-1]), "blob.data"),
        (dataclasses.replace(good, shape=(7, 65)), "blob.data"),
        (dataclasses.replace(good, dtype="int64"), "blob.dtype"),
        (dataclasses.replace(good, codec="zstd"), "blob.codec"),
        (dataclasses.replace(good, shape=(7, -64)), "blob.shape"),
        (dataclasses.replace(good, codec="int8"), "blob"),
    ]
    q = encode(hidden(torch.float16), "int8")
    bad += [
        (dataclasses.replace(q, scales=None), "blob.scales"),
        (dataclasses.replace(q, scales=TensorBlob("float32", (6,), q.scales.data[:-4])), "blob.scales"),
        (dataclasses.replace(q, scales=dataclasses.replace(q.scales, data=q.scales.data[:-1])), "blob.scales.data"),
        (dataclasses.replace(q, scales=encode(torch.full((7,), float("nan")))), "non-finite"),
    ]
    for blob, field in bad:
        with pytest.raises(InvalidInput, match=field):
            decode(blob)


def test_encode_rejects_what_it_cannot_carry():
    with pytest.raises(InvalidInput, match="dtype"):
        encode(torch.arange(4))
    with pytest.raises(InvalidInput, match="codec"):
        encode(torch.ones(4), "fp8")
