"""attn_mask and softcap in the Triton kernels, forward and backward.

Each case runs the Triton kernels and the reference backend through the same op on the
same inputs and compares both with an FP64 oracle (plain torch math, tests/_triton.py):

  2× rule   |triton - fp64|max ≤ 2·|reference - fp64|max + floor, for O, LSE, dq, dk, dv
  counters  tied_rows, guarded_rows and max_logit equal to the reference backend's

Three heads (STANDARD, BETA, FP32_O), Nq != Nk, lengths that are not multiples of the
interpreter's 16-row blocks, D 16/32/64, bf16 and fp16 (the kernels take no fp32).
q and k are multiples of 1/8 (tests/_triton.py `quantized`): scores are exact in FP32,
so ties are exact and the counters can be compared bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashwatch as fw
from flashwatch.kernels.dispatch import NotInKernel
from tests._triton import ALL_MODES, DEVICE, B, H, check, count_dots, inputs, run, ta

# numpy inside the interpreter: 0/0 and log(0) in rows with no visible key (selected away)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# ---------------------------------------------------------------------------------
# attn_mask
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 16), (torch.float16, 32)],
                         ids=["bf16-d16", "fp16-d32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_key_padding_bool_mask(dtype, d, causal):
    # [B, 1, 1, Nk] as a padded HF batch passes it: batch 0 padded at the end, batch 1 at
    # the start and in the middle. Causal: batch 1's first 6 rows see no key at all.
    nq, nk = (70, 37) if causal else (37, 70)
    q, k, v, do = inputs(nq, nk, d, dtype, seed=d + causal)
    mask = torch.ones(B, 1, 1, nk, dtype=torch.bool)
    mask[0, ..., 30:] = False
    mask[1, ..., :6] = False
    mask[1, ..., 20:24] = False
    tri = check(q, k, v, do, causal=causal, scale=0.25, attn_mask=mask.to(DEVICE))
    assert tri["tied"].sum() > 0, "test data should contain tied rows"
    if causal:
        assert (tri["o"][1, :, :6] == 0).all() and torch.isinf(tri["lse"][1, :, :6]).all()


@pytest.mark.parametrize("layout", ["b1qk-fp32", "qk-bf16-transposed"])
def test_additive_float_mask(layout):
    # A finite bias (multiples of 1/4: exact), -inf and Hugging Face's finfo.min hiding
    # keys; as [B, 1, Nq, Nk] fp32, or as an [Nq, Nk] bf16 view of a transposed tensor
    # (stride 1 along the queries, broadcast over B and H).
    nq, nk = 37, 70
    q, k, v, do = inputs(nq, nk, 64, torch.bfloat16, seed=3)
    gen = torch.Generator().manual_seed(4)
    bias = torch.randint(-8, 9, (B, 1, nq, nk), generator=gen) / 4
    bias = bias.masked_fill(torch.rand(B, 1, nq, nk, generator=gen) < 0.3, -math.inf)
    bias[:, :, :, 5:9] = torch.finfo(torch.float32).min
    if layout == "qk-bf16-transposed":
        bias = bias[0, 0].to(torch.bfloat16).t().contiguous().t()
        assert bias.stride() == (1, nq)
    check(q, k, v, do, causal=False, scale=0.25, attn_mask=bias.to(DEVICE))


def test_materialised_mask_hiding_whole_rows():
    # [B, H, Nq, Nk], different per head; rows 0, 17 and 36 (in the ragged last block)
    # see no key in some heads: O = 0, LSE = +inf, their dq = 0, and no NaN anywhere.
    nq, nk = 37, 45
    q, k, v, do = inputs(nq, nk, 16, torch.bfloat16, seed=5)
    gen = torch.Generator().manual_seed(6)
    mask = torch.rand(B, H, nq, nk, generator=gen) < 0.6
    mask[0, 1, [0, 17, 36]] = False  # the BETA head
    mask[1, :, 17] = False
    tri = check(q, k, v, do, causal=True, scale=0.25, attn_mask=mask.to(DEVICE))
    for b, h, r in [(0, 1, 0), (0, 1, 17), (0, 1, 36), (1, 0, 17), (1, 2, 17)]:
        assert (tri["o"][b, h, r] == 0).all() and (tri["dq"][b, h, r] == 0).all()
        assert tri["lse"][b, h, r] == math.inf


def test_hf_padding_rows_with_every_key_at_finfo_min():
    # A padded query row under Hugging Face's float mask has every key at finfo.min: no
    # NaN (naive exp2(s·log2e - m·log2e) is -inf - -inf there). Its O is the mean of V, as
    # in SDPA; its gradients are the reference's (LSE = finfo.min absorbs log Nk, so P = 1
    # per key in the backward of both: these rows' dO is 0 in training).
    nq, nk = 21, 21
    q, k, v, do = inputs(nq, nk, 16, torch.bfloat16, seed=7)
    bias = torch.zeros(B, 1, nq, nk)
    bias[1, :, :5] = torch.finfo(torch.float32).min
    bias = bias.to(DEVICE)
    tri = run("triton", q, k, v, do, causal=False, scale=0.25, attn_mask=bias)
    ref = run("reference", q, k, v, do, causal=False, scale=0.25, attn_mask=bias)
    for name in ("o", "lse", "dq", "dk", "dv"):
        assert torch.isfinite(tri[name]).all(), name
        torch.testing.assert_close(tri[name].float(), ref[name].float(), rtol=2e-2, atol=2e-2)
    mean_v = v[1].float().mean(1, keepdim=True).expand(H, 5, 16).cpu()
    torch.testing.assert_close(tri["o"][1, :, :5].float(), mean_v, rtol=0, atol=2e-2)


# ---------------------------------------------------------------------------------
# softcap
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("cap", [50.0, 5.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_softcap_with_causal_and_key_padding(cap, dtype):
    # scale 0.5 on D = 32: raw scores reach ~±20, so cap 5 bends them hard (tanh(4) =
    # 0.9993) and cap 50 a little; the backward goes through 1 - tanh².
    nq, nk = 45, 37
    q, k, v, do = inputs(nq, nk, 32, dtype, seed=int(cap))
    raw = (torch.matmul(q.float(), k.float().transpose(-1, -2)) * 0.5).abs().max()
    assert raw > 2 * 5.0
    mask = torch.ones(B, 1, 1, nk, dtype=torch.bool)
    mask[1, ..., 33:] = False
    check(q, k, v, do, causal=True, scale=0.5, softcap=cap, attn_mask=mask.to(DEVICE),
          exact_max=False)


def test_softcap_then_additive_mask_non_causal():
    # The mask is added after the cap (Gemma2's order): a bias may push scores past ±cap.
    nq, nk = 37, 70
    q, k, v, do = inputs(nq, nk, 16, torch.float16, seed=8)
    gen = torch.Generator().manual_seed(9)
    bias = (torch.randint(-16, 17, (nq, nk), generator=gen) / 2).masked_fill(
        torch.rand(nq, nk, generator=gen) < 0.2, -math.inf)
    check(q, k, v, do, causal=False, scale=0.5, softcap=5.0, attn_mask=bias.to(DEVICE),
          exact_max=False)


# ---------------------------------------------------------------------------------
# the public call and the backward's work
# ---------------------------------------------------------------------------------


def test_flashwatch_attention_routes_masks_and_softcap_to_triton():
    q, k, v, do = inputs(37, 45, 16, torch.bfloat16, seed=10)
    mask = torch.ones(B, 1, 1, 45, dtype=torch.bool, device=DEVICE)
    mask[0, ..., 40:] = False
    stats = fw.AttentionStats.zeros(H)
    o = fw.attention(q, k, v, causal=True, head_modes=ALL_MODES, stats=stats,
                     backend="triton", attn_mask=mask, softcap=5.0)
    want = run("triton", q, k, v, do, causal=True, scale=0.25, attn_mask=mask, softcap=5.0)
    assert torch.equal(o.cpu(), want["o"])
    assert torch.equal(stats.tied_rows.cpu(), want["tied"])
    bias = torch.zeros(1, H, 37, 45, device=DEVICE, requires_grad=True)
    with pytest.raises(NotInKernel, match=r"attn_mask.*backend='reference'.*detach"):
        fw.attention(q, k, v, backend="triton", attn_mask=bias)


@pytest.mark.skipif(not ta.INTERPRET, reason="counts dots executed by the interpreter")
def test_backward_keeps_five_matmuls_per_block_pair_with_mask_and_softcap(monkeypatch):
    # 16×16 blocks, Nq = 40 (3 query blocks), Nk = 32 (2 key blocks), not causal: 6 pairs.
    q, k, v, do = inputs(40, 32, 16, torch.bfloat16, seed=11)
    q, k, v, do = (t[:1, :1].contiguous() for t in (q, k, v, do))
    mask = (torch.rand(1, 1, 40, 32, generator=torch.Generator().manual_seed(0)) < 0.7)
    modes = torch.zeros(1, dtype=torch.int32)
    kw = dict(attn_mask=mask.to(DEVICE), softcap=5.0)
    o, lse, o32, *_ = torch.ops.flashwatch.attention_fwd(q, k, v, modes, False, 0.25, 2.0,
                                                          1e-3, False, "triton", **kw)
    calls = count_dots(monkeypatch)
    torch.ops.flashwatch.attention_bwd(do, q, k, v, o, o32, lse, modes, False, 0.25,
                                       "triton", **kw)
    assert len(calls) == 5 * 6
