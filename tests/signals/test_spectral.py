"""flashwatch/signals/spectral.py: the Gram-matrix norm and the batched warm-started power iteration
vs matrix_norm(ord=2)."""

from __future__ import annotations

import math

import pytest
import torch

from flashwatch.signals import smallops
from flashwatch.signals.spectral import gram_norm, power_iteration

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True, params=[True, False], ids=["numpy_matmul", "torch_matmul"])
def matmul_path(request, monkeypatch):
    """Every test on both product paths: numpy (CPU) and torch (every other device)."""
    monkeypatch.setattr(smallops, "NUMPY_CPU", request.param)


def _exact(W):
    return torch.linalg.matrix_norm(W.double(), ord=2)


def _rel(a, b):
    return ((a.double() - b) / b).abs().max().item()


def _low_rank_plus_noise(H, a, b, rank=3, noise=0.05, seed=0):
    # What trained W^Q look like: a few strong directions over a noise floor.
    g = torch.Generator().manual_seed(seed)
    L = torch.randn(H, a, rank, generator=g) @ torch.randn(H, rank, b, generator=g) / math.sqrt(b)
    return L + noise * torch.randn(H, a, b, generator=g)


@pytest.mark.parametrize("shape", [(6, 64, 256), (4, 256, 64), (3, 8, 8), (2, 1, 5)])
def test_cold_start_gaussian_matches_matrix_norm(shape):
    # Gaussian matrices have no spectral gap: the hardest case for power iteration.
    W = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    sigma, v = power_iteration(W, None)
    assert sigma.shape == (shape[0],) and v.shape == (shape[0], shape[2])
    assert _rel(sigma, _exact(W)) < 1e-3
    assert torch.allclose(v.norm(dim=1), torch.ones(shape[0]), atol=1e-5)


def test_cold_start_trained_looking_matches_matrix_norm():
    W = _low_rank_plus_noise(12, 64, 768)
    sigma, _ = power_iteration(W, None)
    assert _rel(sigma, _exact(W)) < 1e-3


def test_warm_start_tracks_a_slowly_changing_matrix():
    # 20 "optimizer steps" of small updates, 4 warm iterations each (the default cadence).
    g = torch.Generator().manual_seed(2)
    W = _low_rank_plus_noise(8, 64, 256, seed=3)
    _, v = power_iteration(W, None)
    for _ in range(20):
        W = W + 0.01 * torch.randn(W.shape, generator=g) / 16
        sigma, v = power_iteration(W, v, iters=4)
        assert _rel(sigma, _exact(W)) < 1e-3


def test_max_iters_caps_a_warm_start():
    W = _low_rank_plus_noise(8, 64, 256, seed=3)
    _, v = power_iteration(W, None)
    turned = W.flip(-1)  # the previous vector is now a poor start
    capped, _ = power_iteration(turned, v, iters=1, max_iters=1)
    free, _ = power_iteration(turned, v, iters=1)
    assert _rel(free, _exact(turned)) < 1e-3 < _rel(capped, _exact(turned))


def test_low_precision_and_float64_inputs():
    W = _low_rank_plus_noise(4, 32, 128, seed=4)
    s16, v16 = power_iteration(W.bfloat16(), None)
    assert s16.dtype == torch.float32 and v16.dtype == torch.float32
    assert _rel(s16, _exact(W.bfloat16())) < 1e-3
    s64, _ = power_iteration(W.double(), None)
    assert s64.dtype == torch.float64
    assert _rel(s64, _exact(W)) < 1e-6


def test_zero_and_non_finite_heads():
    W = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(5))
    W[1] = 0.0
    W[2, 3, 4] = float("nan")
    sigma, v = power_iteration(W, None)
    assert sigma[1] == 0 and math.isnan(sigma[2])
    assert torch.isfinite(v).all(), "a NaN vector would poison every later warm start"
    assert _rel(sigma[[0, 3]], _exact(W[[0, 3]])) < 1e-3
    # Once the weights are finite again, the warm start recovers.
    W[2] = torch.randn(16, 32, generator=torch.Generator().manual_seed(6))
    sigma, _ = power_iteration(W, v, iters=300)
    assert _rel(sigma[2:3], _exact(W[2:3])) < 1e-3


def test_deterministic():
    W = torch.randn(3, 20, 30, generator=torch.Generator().manual_seed(7))
    a, va = power_iteration(W, None)
    b, vb = power_iteration(W, None)
    assert torch.equal(a, b) and torch.equal(va, vb)


# ------------------------------------------------------------------------ gram_norm


@pytest.mark.parametrize("shape", [(6, 64, 256), (4, 256, 64), (3, 8, 8), (2, 1, 5),
                                   (12, 128, 768)])
def test_gram_norm_of_gaussian_matrices_matches_matrix_norm(shape):
    # No spectral gap: the case a few iterations of anything get wrong. a > b (the
    # second shape) takes the Gram of the other side.
    W = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    sigma, v = gram_norm(W)
    assert sigma.shape == (shape[0],) and v.shape == (shape[0], shape[2])
    assert _rel(sigma, _exact(W)) < 1e-5
    assert torch.allclose(v.norm(dim=1), torch.ones(shape[0]), atol=1e-5)
    # v is the right singular vector: ‖W v‖ = σ
    assert _rel((W.double() @ v.double()[..., None])[..., 0].norm(dim=1), _exact(W)) < 1e-5


def test_gram_norm_with_crowded_top_singular_values():
    """128 singular values within 1e-3 of each other and 40 tied at the top: the worst
    case for the power of the Gram matrix (module docstring's bound: 3e-5)."""
    g = torch.Generator().manual_seed(2)
    U = torch.linalg.qr(torch.randn(8, 128, 128, generator=g, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(8, 512, 128, generator=g, dtype=torch.float64))[0]
    S = 1 - 1e-3 * torch.rand(8, 128, generator=g, dtype=torch.float64)
    S[:, :40] = 1.0
    W = U @ torch.diag_embed(S) @ V.mT  # [8, 128, 512]
    sigma, _ = gram_norm(W.float())
    assert _rel(sigma, torch.ones(8, dtype=torch.float64)) < 3e-5
    s64, _ = gram_norm(W)
    # the algorithm's own error, not rounding: the same bound in float64
    assert s64.dtype == torch.float64 and _rel(s64, torch.ones(8, dtype=torch.float64)) < 3e-5


def test_gram_norm_of_trained_looking_low_precision_and_float64_weights():
    W = _low_rank_plus_noise(12, 64, 768)
    assert _rel(gram_norm(W)[0], _exact(W)) < 1e-5
    s16, v16 = gram_norm(W.bfloat16())
    assert s16.dtype == torch.float32 and v16.dtype == torch.float32
    assert _rel(s16, _exact(W.bfloat16())) < 1e-5
    s64, _ = gram_norm(W.double())
    assert s64.dtype == torch.float64 and _rel(s64, _exact(W)) < 1e-10


def test_gram_norm_of_zero_extreme_and_non_finite_heads():
    W = torch.randn(6, 16, 32, generator=torch.Generator().manual_seed(5))
    W[1] = 0.0
    W[2, 3, 4] = float("nan")
    W[3] *= 1e-12
    W[4] *= 1e18  # an exploding weight: its Gram (1e37 per entry, ×32) overflows FP32
    W[5] *= 1e-20  # a vanishing one: its Gram underflows
    sigma, v = gram_norm(W)
    assert sigma[1] == 0 and torch.equal(v[1], torch.zeros(32))
    assert math.isnan(sigma[2])
    assert _rel(sigma[[0, 3, 4, 5]], _exact(W[[0, 3, 4, 5]])) < 1e-5


@pytest.mark.parametrize("call, exc, words", [
    (lambda: gram_norm(torch.randn(4, 5)), ValueError, ["W", "[H, a, b]"]),
    (lambda: gram_norm([[1.0]]), TypeError, ["W", "torch.Tensor"]),
    (lambda: gram_norm(torch.ones(2, 3, 4, dtype=torch.int64)), TypeError, ["W", "float"]),

    (lambda: power_iteration(torch.randn(4, 5)), ValueError, ["W", "[H, a, b]"]),
    (lambda: power_iteration([[1.0]]), TypeError, ["W", "torch.Tensor"]),
    (lambda: power_iteration(torch.ones(2, 3, 4, dtype=torch.int64)), TypeError, ["W", "float"]),
    (lambda: power_iteration(torch.randn(2, 3, 4), torch.randn(2, 3)), ValueError, ["v", "[2, 4]"]),
    (lambda: power_iteration(torch.randn(2, 3, 4), None, iters=0), ValueError, ["iters"]),
    (lambda: power_iteration(torch.randn(2, 3, 4), None, tol=-1.0), ValueError, ["tol"]),
    (lambda: power_iteration(torch.randn(2, 3, 4), None, tol=math.nan), ValueError,
     ["tol", "nan", "1e-7"]),
    (lambda: power_iteration(torch.randn(2, 3, 4), None, tol="1e-7"), TypeError,
     ["tol", "str"]),
    (lambda: power_iteration(torch.randn(2, 3, 4), None, max_iters=0), ValueError,
     ["max_iters"]),
])
def test_bad_arguments_are_named(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    for w in words:
        assert w in str(info.value)
