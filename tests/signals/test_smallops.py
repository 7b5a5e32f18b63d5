"""flashwatch/signals/smallops.py: numpy products on the CPU equal torch's (to rounding), on the
layouts the probe and the Gram powers pass; the switch and the dtype/device guard."""

from __future__ import annotations

import pytest
import torch

from flashwatch.signals import smallops


def _cases(g):
    q = torch.randn(8, 4, 8, 32, generator=g)
    k = torch.randn(8, 4, 128, 32, generator=g)
    p = torch.softmax(torch.randn(8, 4, 8, 128, generator=g), -1)
    kv = torch.randn(8, 128, 3, 4, 32, generator=g)[:, :, 1].transpose(1, 2)  # strided
    yield q, k.transpose(-1, -2)  # the scores: a transposed view
    yield p, k  # O and PK
    yield p, kv  # a strided view of a packed projection
    yield torch.randn(5, 7, 7, generator=g, dtype=torch.float64), torch.randn(
        5, 7, 7, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("case", range(4))
def test_matmul_matches_torch_to_rounding(case):
    a, b = list(_cases(torch.Generator().manual_seed(case)))[case]
    want = (a.double() @ b.double())
    got = smallops.matmul(a, b)
    assert got.dtype == a.dtype and got.shape == want.shape
    tol = 1e-12 if a.dtype == torch.float64 else 1e-5
    assert torch.allclose(got.double(), want, rtol=tol, atol=tol * want.abs().max())


def test_numpy_only_for_cpu_float_tensors(monkeypatch):
    f32 = torch.ones(2, 2)
    assert smallops.on_numpy(f32)
    assert not smallops.on_numpy(f32.bfloat16())  # numpy has no bfloat16
    assert not smallops.on_numpy(f32.to(torch.int64))
    monkeypatch.setattr(smallops, "NUMPY_CPU", False)
    assert not smallops.on_numpy(f32)
    assert torch.equal(smallops.matmul(f32, f32), torch.full((2, 2), 2.0))


def test_matmul_of_bfloat16_takes_torch():
    a = torch.randn(3, 4, 5).bfloat16()
    assert torch.equal(smallops.matmul(a, a.mT), torch.matmul(a, a.mT))
