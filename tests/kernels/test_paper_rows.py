"""flashwatch/kernels/paper.py (backend="paper"), rows checked by hand: a fully masked block under
the tie rule rescales to a maximum of 0, the tie rule is unguarded and collapses tied
rows, two tied maxima at 896 give a row sum of 2."""

from __future__ import annotations

import math

import torch

from flashwatch.kernels import paper
from flashwatch.kernels.common import Mode

BF16 = torch.bfloat16


def _planted(n, D, diag, *, v0=None):
    """q_i = diag·e_(i mod D), k_j = e_(j mod D): query i scores `diag` on keys j ≡ i
    (mod D) and 0 elsewhere."""
    q = torch.zeros(1, 1, n, D)
    k = torch.zeros(1, 1, n, D)
    idx = torch.arange(n) % D
    q[0, 0, torch.arange(n), idx] = diag
    k[0, 0, torch.arange(n), idx] = 1.0
    v = torch.zeros(1, 1, n, D)
    v[0, 0, :, 0] = 1.0 if v0 is None else v0
    return q.to(BF16), k.to(BF16), v.to(BF16)


def _fwd(q, k, v, mode, causal=True, beta=2.0):
    modes = torch.tensor([int(mode)], dtype=torch.int32)
    return paper.forward(q, k, v, causal=causal, scale=1.0, modes=modes, beta=beta,
                         eps=1e-3, debug=True)


def _row1(n):
    """Causal rows; query 1 sees keys 0 and 1 with scores -2 and -1.5 and the seed's
    V values -2.40625 and -2.296875; every other score is 0."""
    q, k = torch.zeros(1, 1, n, 16), torch.zeros(1, 1, n, 16)
    q[0, 0, 1, :2] = torch.tensor([-2.0, -1.5])
    k[0, 0, torch.arange(n), torch.arange(n) % 16] = 1.0
    v = torch.zeros(1, 1, n, 16)
    v[0, 0, :2, 0] = torch.tensor([-2.40625, -2.296875])
    return q.to(BF16), k.to(BF16), v.to(BF16)


def test_a_fully_masked_block_under_the_tie_rule_rescales_to_max_zero():
    # Block 0 for query 1: m = -1.5, P̄ = [bf16(e^-0.5), 1] = [0.60546875, 1],
    # l = bf16(1.60546875) = 1.609375, acc = bf16(0.60546875·-2.40625 - 2.296875)
    # = bf16(-3.7537) = -3.75. STANDARD ends there: O = bf16(-3.75/1.609375) = -2.328125,
    # LSE = bf16(bf16(log 1.609375) - 1.5) = -1.0234375.
    # Causal N = 1024: keys 512..1023 are all hidden from query 1; their 512 scores all
    # equal -finfo(bf16).max, so the tie rule sees 512 maxima < 0 and sets the block max
    # to 0. The shift becomes max(0, -1.5) = 0: α = bf16(e^-1.5) = 0.22265625,
    # l = bf16(α·1.609375) = 0.357421875 (+ the 1e-10 floor, lost), acc = bf16(α·-3.75)
    # = -0.8359375, O = bf16(acc/l) = -2.34375, LSE = bf16(log l) = -1.03125.
    # (FP64 truth: O = -2.3382, LSE = -1.0259.)
    cases = [(Mode.STANDARD, 1024, -2.328125, -1.0234375),
             (Mode.BETA, 1024, -2.34375, -1.03125),
             (Mode.BETA, 512, -2.328125, -1.0234375),  # no hidden block
             (Mode.BETA, 513, -2.328125, -1.0234375)]  # hidden block of 1 key: no tie
    for mode, n, o, lse in cases:
        res = _fwd(*_row1(n), mode)
        assert res.o[0, 0, 1, 0].item() == o, (mode.name, n)
        assert res.lse[0, 0, 1].item() == lse, (mode.name, n)


def test_the_tie_rule_is_unguarded_and_collapses_tied_rows():
    # Non-causal N = 32, D = 16: query i scores c on keys i and i+16 (two maxima) and 0
    # elsewhere; v's column 0 is 1, so the true O is 1. The rule shifts by 2c: P̄ at the
    # max is p = bf16(e^-c), the block sum 2p is floored at bf16(1e-10), O = 2p / l.
    floor = torch.tensor(1e-10).to(BF16).item()
    for c, want_o, want_lse in (
        # 2p = 2.3e-7 > floor: O exact; LSE = bf16(bf16(log 2p) + 32) = bf16(-15.3125 + 32)
        # = 16.75 (16.6875 is a tie between 16.625 and 16.75; even mantissa wins)
        (16.0, 1.0, 16.75),
        # 2p = 1.9e-13 < floor: l = 1e-10, O = 2p/1e-10 = 0.0019, LSE = bf16(-23 + 60)
        (30.0, torch.tensor(2 * math.exp(-30.0)).to(BF16).double().item() / floor, 37.0),
        (96.0, 0.0, 169.0),  # p = 2.0e-42 is below BF16's smallest subnormal 9.2e-41: 0
    ):
        res = _fwd(*_planted(32, 16, c), Mode.BETA, causal=False)
        want = torch.tensor(want_o).to(BF16)
        assert torch.equal(res.o[..., 0], want.expand_as(res.o[..., 0])), c
        assert torch.equal(res.lse, torch.full_like(res.lse, want_lse)), c
        std = _fwd(*_planted(32, 16, c), Mode.STANDARD, causal=False)
        assert torch.equal(std.o[..., 0], torch.ones_like(std.o[..., 0]))


def test_two_tied_maxima_at_896_give_a_row_sum_of_2():
    # Hand-checked: query 0 scores 896 on keys 0 and 16 (non-causal, all others 0).
    # l = 1 + 1 (+ e^-896 = 0), LSE = bf16(896 + bf16(log 2)) = 896 (grid of 4), so the
    # backward's P is exactly 1 at both maxima: the row sums to 2, not 1.
    q, k, v = _planted(32, 16, 896.0)
    res = _fwd(q, k, v, Mode.STANDARD, causal=False)
    assert res.lse[0, 0, 0].item() == 896.0
    s = (q[0, 0, :1] @ k[0, 0].T).float()
    p = torch.exp(s.to(BF16) - res.lse[0, 0, :1, None])
    assert p.float().sum().item() == 2.0
