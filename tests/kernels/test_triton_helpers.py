"""The interpreter-safe rounding helpers of flashwatch/kernels/triton_helpers.py, on every bf16 bit
pattern and on torch's round-to-nearest-even (tests/conftest.py sets TRITON_INTERPRET=1;
with a GPU and TRITON_INTERPRET=0 the native path runs the same checks)."""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see conftest)

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from flashwatch.kernels import triton_attention as ta  # noqa: E402
from flashwatch.kernels import triton_helpers as th  # noqa: E402

if ta.INTERPRET:
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device",
                allow_module_level=True)




@triton.jit
def _rne_probe(X, Y, N: tl.constexpr):
    offs = tl.program_id(0) * N + tl.arange(0, N)
    x = tl.load(X + offs)
    tl.store(Y + offs, th._rne_bf16(x))


@triton.jit
def _store_probe(X, Y, N: tl.constexpr, INTERPRET: tl.constexpr):
    offs = tl.program_id(0) * N + tl.arange(0, N)
    tl.store(Y + offs, th._to_store(tl.load(X + offs), Y.dtype.element_ty, INTERPRET))


PROBE = 1024  # elements per program in the probe kernels


@triton.jit
def _up_probe(X, Y, N: tl.constexpr, INTERPRET: tl.constexpr):
    offs = tl.program_id(0) * N + tl.arange(0, N)
    tl.store(Y + offs, th._up(tl.load(X + offs), INTERPRET))


def test_bf16_widening_exact_for_every_bit_pattern():
    x = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16)
    x = x.view(torch.bfloat16).to(DEVICE)
    y = torch.empty(x.numel(), dtype=torch.float32, device=DEVICE)
    _up_probe[(x.numel() // PROBE,)](x, y, N=PROBE, INTERPRET=ta.INTERPRET)
    want = x.float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(y), nan)
    assert torch.equal(y[~nan].view(torch.int32), want[~nan].view(torch.int32))


def _bf16_bits(t):
    return t.view(torch.int16).to(torch.int32) & 0xFFFF


def test_rne_bf16_matches_torch_rounding():
    one_ulp = 2.0 ** -7  # bf16 spacing in [1, 2)
    specials = [
        1.0 + one_ulp / 2,  # exact midpoint, even neighbour below: stays 1.0
        1.0 + 3 * one_ulp / 2,  # exact midpoint, even neighbour above: rounds up
        -(1.0 + one_ulp / 2), -(1.0 + 3 * one_ulp / 2),  # the same, negative
        1.0 + one_ulp / 2 + 2.0 ** -20,  # just above a midpoint: up
        1.0 + one_ulp / 2 - 2.0 ** -20,  # just below: down
        -2.40625, -0.00087, -2.296875, -4.70399,  # docs/design.md §1 worked example
        math.inf, -math.inf, math.nan, -0.0, 0.0,
        3.3961e38,  # above bf16 max (3.3895e38) past the midpoint: overflows to +Inf
        -3.3961e38,
        1e-40, -1e-40, 2.0 ** -133 * 1.5,  # subnormals, one an exact midpoint
        65504.0, 1e30, -7.1e-9,
    ]
    gen = torch.Generator().manual_seed(0)
    rand_bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (4096,), generator=gen, dtype=torch.int64)
    x = torch.cat([torch.tensor(specials, dtype=torch.float32),
                   rand_bits.to(torch.int32).view(torch.float32)])
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.zeros(n - x.numel())]).to(DEVICE)
    y = torch.empty_like(x)
    _rne_probe[(n // PROBE,)](x, y, N=PROBE)
    want = x.to(torch.bfloat16)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(y), nan), "NaN must stay NaN (never become ±Inf)"
    got = y[~nan].to(torch.bfloat16)  # exact: y already holds a bf16 value
    assert torch.equal(y[~nan], got.float()), "RNE result is not a bf16 value"
    assert torch.equal(_bf16_bits(got), _bf16_bits(want[~nan])), "differs from torch RNE"
    assert torch.signbit(y[x == 0]).tolist() == torch.signbit(x[x == 0]).tolist()  # -0 kept
    # the store path (what O, dQ, dK, dV go through) gives the same bits
    z = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)
    _store_probe[(n // PROBE,)](x, z, N=PROBE, INTERPRET=ta.INTERPRET)
    assert torch.equal(_bf16_bits(z[~nan]), _bf16_bits(want[~nan]))
    assert torch.isnan(z[nan]).all()


@triton.jit
def _offset_probe(OUT, pid_bh, H, stride_b, stride_h, start, stride):
    one = tl.arange(0, 1)
    tl.store(OUT + one, th._bh_offset(pid_bh, H, stride_b, stride_h) + tl.zeros([1], tl.int64))
    tl.store(OUT + 1 + one, th._row_offset(start, stride) + tl.zeros([1], tl.int64))


@pytest.mark.parametrize("pid_bh,H,stride_b,stride_h,start,stride", [
    (7, 4, 2 ** 30, 2 ** 29, 2 ** 20, 4096),  # batch 1 at 2^30, head 3 at 1.5·2^30
    (3, 4, 2 ** 28, 2 ** 30, 2 ** 21 - 1, 2 ** 12),  # head 3 alone is 3·2^30
])
def test_offsets_past_int32_are_exact(pid_bh, H, stride_b, stride_h, start, stride):
    # Every factor fits int32 (Triton passes such ints as i32); the products do not.
    out = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    _offset_probe[(1,)](out, pid_bh, H, stride_b, stride_h, start, stride)
    b, h = divmod(pid_bh, H)
    assert out.tolist() == [b * stride_b + h * stride_h, start * stride]
    assert max(out.tolist()) >= 2 ** 31
