"""flashwatch/parallel/sharding.py without processes: which rank counts a gradient that
is gathered whole (a DTensor not sharded on dim 0 over a 1-D mesh: HSDP, or FSDP2 on a
sub-mesh of a DP × PP job)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from scaled_heads import D_MODEL, H, Stage, full_model

from flashwatch.parallel import sharding
from flashwatch.sites import find_sites


class _Mesh:
    """The parts of a 2-D DeviceMesh the gathered path reads: its ranks."""

    ndim = 2

    def __init__(self, ranks):
        self.mesh = torch.tensor(ranks)


class _Gathered:
    """A DTensor-like gradient on a 2-D mesh: `full_tensor()` gives every rank the same
    whole gradient."""

    placements = ("replicate", "shard")

    def __init__(self, full, ranks):
        self.full, self.device_mesh, self.shape = full, _Mesh(ranks), full.shape

    def full_tensor(self):
        return self.full


@pytest.mark.parametrize("me, counts", [(2, True), (3, False), (0, False)])
def test_a_gathered_gradient_counts_once_on_the_first_rank_of_its_mesh(monkeypatch, me,
                                                                       counts):
    """The stage held by global ranks 2 and 3 (its mesh [[2, 3]]): rank 2 counts each
    head's ‖dW^Q_h‖², rank 3 adds 0, and global rank 0 (another stage) holds none of it.
    It used to count on global rank 0, so this stage's norms summed to 0."""
    site = find_sites(Stage(full_model(), [0], first=True, last=False))[0]
    grad = torch.randn(D_MODEL, D_MODEL, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: me)
    got, averaged = sharding.wq_grad_sq(site, _Gathered(grad, [[2, 3]]))
    want = grad.double().view(H, -1).square().sum(1)  # q_proj's rows are head-major
    assert averaged
    if counts:
        assert torch.allclose(got, want, rtol=1e-12)
    else:
        assert torch.equal(got, torch.zeros(H, dtype=torch.float64))
