"""flashwatch/kernels/paper.py (backend="paper"): bitwise against an independent statement of the
authors' arithmetic, and masks; rows checked by hand: tests/kernels/test_paper_rows.py.

The oracle below restates that arithmetic one head at a time ([N, D] tensors), with
every elementwise step computed in FP32 and rounded to the input dtype explicitly by
`_r`, so each rounding point is visible. Only the matmuls stay input-dtype matmuls:
their internal FP32 accumulation cannot be restated (an FP32 matmul rounded once to BF16
differs in about 10 of 1.5M entries).
"""

from __future__ import annotations

import math

import pytest
import torch

import flashwatch as fw
from flashwatch.kernels import paper
from flashwatch.kernels.common import Mode
from oracle import duplicate_keys

BF16 = torch.bfloat16
BLOCK = 512  # the authors' query chunk and key block


def _r(x: torch.Tensor, dt) -> torch.Tensor:
    """Round an FP32 result to the input dtype (one rounding)."""
    return x.to(dt)


def _f(x: torch.Tensor) -> torch.Tensor:
    return x.float()


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b as a [1, 1, n, m] batched matmul: the call shape of one head in the op (in
    FP32 a 2-D matmul can round 1×1 blocks differently in the last bit)."""
    return torch.matmul(a[None, None], b[None, None])[0, 0]


def _hidden(rows: torch.Tensor, cols: torch.Tensor, causal: bool) -> torch.Tensor:
    return (cols[None, :] > rows[:, None]) if causal else torch.zeros(len(rows), len(cols),
                                                                      dtype=torch.bool)


def oracle_forward(q, k, v, *, causal, scale, mode, beta=2.0, eps=1e-3):
    """One head: (O, LSE, O32 in FP64) as the authors' forward computes them."""
    dt = q.dtype
    big = torch.finfo(dt).max
    floor = torch.tensor(1e-10).to(dt)
    outs, lses, o64s = [], [], []
    for r0 in range(0, q.shape[0], BLOCK):
        rows = torch.arange(r0, min(r0 + BLOCK, q.shape[0]))
        n = len(rows)
        m = torch.full((n,), -big, dtype=dt)
        l = torch.zeros(n, dtype=dt)
        acc = torch.zeros(n, q.shape[1], dtype=dt)
        l64 = torch.zeros(n, dtype=torch.float64)
        acc64 = torch.zeros(n, q.shape[1], dtype=torch.float64)
        for c0 in range(0, k.shape[0], BLOCK):
            cols = torch.arange(c0, min(c0 + BLOCK, k.shape[0]))
            s = _r(_f(_mm(q[rows], k[cols].T)) * scale, dt)
            s[_hidden(rows, cols, causal)] = -big
            mb = s.max(dim=1).values
            if mode == Mode.BETA:
                near = (s >= _r(_f(mb) - eps, dt)[:, None]).sum(dim=1)
                tied = near >= 2
                mb = torch.where(tied & (mb > 0), _r(_f(mb) * beta, dt),
                                 torch.where(tied & (mb < 0), torch.zeros_like(mb), mb))
            mn = torch.maximum(m, mb)
            p = _r(torch.exp(_f(_r(_f(s) - _f(mn)[:, None], dt))), dt)
            lb = torch.maximum(_r(_f(p).sum(dim=1), dt), floor)
            a = _r(torch.exp(_f(_r(_f(m) - _f(mn), dt))), dt)
            l = _r(_f(_r(_f(a) * _f(l), dt)) + _f(lb), dt)
            acc = _r(_f(_r(_f(acc) * _f(a)[:, None], dt)) + _f(_mm(p, v[cols])), dt)
            l64 = l64 * a.double() + p.double().sum(dim=1).clamp(min=1e-10)
            acc64 = acc64 * a.double()[:, None] + p.double() @ v[cols].double()
            m = mn
        outs.append(_r(_f(acc) / _f(l)[:, None], dt))
        lses.append(_r(_f(_r(torch.log(_f(l)), dt)) + _f(m), dt))
        o64s.append(acc64 / l64[:, None])
    return torch.cat(outs), torch.cat(lses), torch.cat(o64s)


def oracle_backward(q, k, v, o, lse, do, *, causal, scale, o32=None):
    """One head: (dq, dk, dv) as the authors' backward computes them; with o32 given,
    δ = rowsum(dO ∘ o32) in FP32 and dS is formed in FP32 (Mode.FP32_O)."""
    dt = q.dtype
    if o32 is None:
        delta = _f(_r(_f(_r(_f(do) * _f(o), dt)).sum(dim=1), dt))
    else:
        delta = (_f(do) * o32).sum(dim=1)
    dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
    for r0 in range(0, q.shape[0], BLOCK):
        rows = torch.arange(r0, min(r0 + BLOCK, q.shape[0]))
        for c0 in range(0, k.shape[0], BLOCK):
            cols = torch.arange(c0, min(c0 + BLOCK, k.shape[0]))
            s = _r(_f(_mm(q[rows], k[cols].T)) * scale, dt)
            s[_hidden(rows, cols, causal)] = -math.inf
            p = _r(torch.exp(_f(_r(_f(s) - _f(lse[rows])[:, None], dt))), dt)
            dv[cols] = _r(_f(dv[cols]) + _f(_mm(p.T, do[rows])), dt)
            dp = _mm(do[rows], v[cols].T)
            ps = _r(_f(p) * scale, dt)
            diff = _f(dp) - delta[rows][:, None]
            if o32 is None:
                diff = _f(_r(diff, dt))
            ds = _r(_f(ps) * diff, dt)
            dq[rows] = _r(_f(dq[rows]) + _f(_mm(ds, k[cols])), dt)
            dk[cols] = _r(_f(dk[cols]) + _f(_mm(ds.T, q[rows])), dt)
    return dq, dk, dv


def brute_ties(s: torch.Tensor, hidden: torch.Tensor, eps: float):
    """(tied rows, max) of one head's input-dtype scores over the visible keys."""
    s = s.float().masked_fill(hidden, -math.inf)
    m = s.amax(dim=1)
    return int(((s >= (m - eps)[:, None]).sum(dim=1) >= 2).sum()), m.max().item()


def _data(N, D, *, logit, seed, dtype=BF16, B=2, H=2):
    """Random q, k with duplicated keys (tied rows) scaled so the largest |score| is
    about `logit`; v and dO standard normal."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, H, N, D, generator=g), torch.randn(B, H, N, D, generator=g)
    k = duplicate_keys(k, g)
    s = (q @ k.transpose(-1, -2)) * D**-0.5
    f = math.sqrt(logit / s.abs().amax().item())
    v, do = torch.randn(B, H, N, D, generator=g), torch.randn(B, H, N, D, generator=g)
    return (q * f).to(dtype), (k * f).to(dtype), v.to(dtype), do.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view: equal bits, so +0 and -0 and NaN payloads count too."""
    t = t.contiguous()
    return t.view({torch.bfloat16: torch.int16, torch.float16: torch.int16,
                   torch.float32: torch.int32}[t.dtype])


def _run(q, k, v, do, *, causal, modes, beta=2.0):
    """backend="paper" through the public op: (o, lse, dq, dk, dv, stats)."""
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    st = fw.AttentionStats.zeros(q.shape[1])
    o = fw.attention(qq, kk, vv, causal=causal, head_modes=modes, beta=beta, stats=st,
                     backend="paper")
    o.backward(do)
    res = paper.forward(q, k, v, causal=causal, scale=q.shape[-1] ** -0.5,
                        modes=torch.tensor([int(m) for m in modes], dtype=torch.int32),
                        beta=beta, eps=1e-3)
    return o.detach(), res.lse, qq.grad, kk.grad, vv.grad, st, res


# (N, D): 1 and 200 fit one block; 513 leaves a 1-key block; 1024 has a fully masked
# block for the first 512 causal rows; 1100 spans three blocks.
SHAPES = [(1, 16), (200, 64), (513, 16), (1024, 64), (1100, 16)]


@pytest.mark.parametrize("logit", [12.0, 250.0])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("N,D", SHAPES)
def test_standard_and_beta_match_the_oracle_bitwise(N, D, causal, logit):
    q, k, v, do = _data(N, D, logit=logit, seed=N + D)
    modes = [Mode.STANDARD, Mode.BETA]
    o, lse, dq, dk, dv, st, _ = _run(q, k, v, do, causal=causal, modes=modes)
    scale = D**-0.5
    for b in range(q.shape[0]):
        for h, mode in enumerate(modes):
            args = (q[b, h], k[b, h], v[b, h])
            o_w, lse_w, _ = oracle_forward(*args, causal=causal, scale=scale, mode=mode)
            grads = oracle_backward(*args, o_w, lse_w, do[b, h], causal=causal, scale=scale)
            got = (o[b, h], lse[b, h], dq[b, h], dk[b, h], dv[b, h])
            for name, x, y in zip(("o", "lse", "dq", "dk", "dv"), got, (o_w, lse_w, *grads),
                                  strict=True):
                assert torch.equal(_bits(x), _bits(y)), (name, b, h, mode.name)
    # Counters: row-wide ties on the BF16 scores, whatever the mode.
    s = (q @ k.transpose(-1, -2)) * scale
    hidden = _hidden(torch.arange(N), torch.arange(N), causal)
    for h in range(2):
        ties = [brute_ties(s[b, h], hidden, 1e-3) for b in range(2)]
        assert st.tied_rows[h].item() == sum(t for t, _ in ties)
        assert st.max_logit[h].item() == max(m for _, m in ties)
    assert st.guarded_rows.sum() == 0
    if N > 1:
        assert st.tied_rows.sum() > 0  # the duplicated keys must plant ties


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes_use_their_own_arithmetic(dtype):
    # The authors' code runs in whatever dtype it is given (mask value -finfo.max of it).
    # One head per call: in FP32 a batch of heads can round a 1×1-block product (row
    # 512, key 512 here) differently from one head's matmul, in the last bit.
    # (Against the authors' code the batched call is bit-identical in FP32 too.)
    for mode in (Mode.STANDARD, Mode.BETA):
        q, k, v, do = _data(513, 16, logit=8.0, seed=1, dtype=dtype, B=1, H=1)
        o, lse, dq, dk, dv, _, _ = _run(q, k, v, do, causal=True, modes=[mode])
        args = (q[0, 0], k[0, 0], v[0, 0])
        o_w, lse_w, _ = oracle_forward(*args, causal=True, scale=0.25, mode=mode)
        grads = oracle_backward(*args, o_w, lse_w, do[0, 0], causal=True, scale=0.25)
        for x, y in zip((o[0, 0], lse[0, 0], dq[0, 0], dk[0, 0], dv[0, 0]),
                        (o_w, lse_w, *grads), strict=True):
            assert torch.equal(_bits(x), _bits(y)), mode.name


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("N,D", [(200, 64), (1100, 16)])
def test_fp32_o_keeps_the_forward_and_changes_only_delta(N, D, causal):
    q, k, v, do = _data(N, D, logit=30.0, seed=7)
    std = _run(q, k, v, do, causal=causal, modes=[Mode.STANDARD] * 2)
    f32 = _run(q, k, v, do, causal=causal, modes=[Mode.STANDARD, Mode.FP32_O])
    o, lse, dq, dk, dv, _, res = f32
    assert torch.equal(_bits(o), _bits(std[0]))  # same BF16 O and LSE for every head
    assert torch.equal(_bits(lse), _bits(std[1]))
    assert torch.equal(_bits(dv), _bits(std[4]))  # dV = Pᵀ dO has no δ
    for x, y in zip((dq, dk), std[2:4], strict=True):
        assert torch.equal(_bits(x[:, 0]), _bits(y[:, 0]))  # the STANDARD head
        assert not torch.equal(x[:, 1], y[:, 1])  # δ moved the FP32_O head
    scale = D**-0.5
    for b in range(q.shape[0]):
        args = (q[b, 1], k[b, 1], v[b, 1])
        o_w, lse_w, o64 = oracle_forward(*args, causal=causal, scale=scale, mode=Mode.STANDARD)
        # O32 is the forward's own accumulation, only without its BF16 roundings: FP32
        # rounding away from an FP64 statement of it (relative to the row's size) ...
        o32 = res.o32[b, 0]
        rel = ((o32.double() - o64).abs().amax(1) / o64.abs().amax(1)).max().item()
        assert rel < 1e-5, rel
        # ... and markedly closer to it than the BF16 O, whose roundings δ used to see.
        rel_bf16 = ((o[b, 1].double() - o64).abs().amax(1) / o64.abs().amax(1)).max().item()
        assert rel_bf16 > 100 * rel
        grads = oracle_backward(*args, o_w, lse_w, do[b, 1], causal=causal, scale=scale,
                                o32=o32)
        for x, y in zip((dq[b, 1], dk[b, 1], dv[b, 1]), grads, strict=True):
            assert torch.equal(_bits(x), _bits(y))


def test_keep_o32_gives_every_heads_fp32_o_and_changes_nothing_else():
    """keep_o32 (the watcher's δ error on every row): each head's FP32 O is the one an
    FP32_O head would get, and O, LSE and the counters are those without it."""
    q, k, v, _ = _data(513, 16, logit=30.0, seed=3)
    modes = torch.tensor([int(Mode.STANDARD), int(Mode.BETA)])
    kw = dict(causal=True, scale=0.25, beta=2.0, eps=1e-3)
    plain = paper.forward(q, k, v, modes=modes, **kw)
    kept = paper.forward(q, k, v, modes=modes, keep_o32=True, **kw)
    assert plain.o32 is None and kept.o32.shape == (q.shape[0], 2, 513, 16)
    assert torch.equal(_bits(kept.o), _bits(plain.o))
    assert torch.equal(_bits(kept.lse), _bits(plain.lse))
    assert torch.equal(kept.tied_rows, plain.tied_rows)
    f32 = paper.forward(q, k, v, modes=torch.tensor([int(Mode.FP32_O)] * 2), **kw)
    assert torch.equal(kept.o32[:, 0], f32.o32[:, 0])  # the STANDARD head: same P̄ and α


def test_fp32_o_backward_needs_o32():
    q, k, v, do = _data(8, 16, logit=4.0, seed=0, B=1, H=1)
    modes = torch.tensor([int(Mode.FP32_O)], dtype=torch.int32)
    res = paper.forward(q, k, v, causal=True, scale=0.25, modes=modes, beta=2.0, eps=1e-3)
    with pytest.raises(ValueError, match="o32 must hold the 1 FP32_O heads"):
        paper.backward(do, q, k, v, res.o, res.lse, None, causal=True, scale=0.25,
                       modes=modes)


def test_backward_p_is_consistent_with_the_forward_at_logits_near_900():
    # BF16 spacing is 4 between 512 and 1024. The backward's P = exp(S - LSE) uses the
    # same BF16 scores as the forward, so within a row P stays proportional to the
    # forward's P̄ = exp(S - m); its row sum is 1 up to LSE's own BF16 rounding, a common
    # factor exp(m + log l - LSE) in [e^-2, e^2] at this size. Recomputing S in FP32
    # against that LSE (the previous backend) moves each entry by its own factor.
    q, k, v, _ = _data(256, 64, logit=900.0, seed=3)
    res = _fwd_std(q, k, v)
    s = (q @ k.transpose(-1, -2)) * 0.125
    hidden = _hidden(torch.arange(256), torch.arange(256), True)
    s = s.masked_fill(hidden, -math.inf)
    p = torch.exp(s - res.lse.unsqueeze(-1))  # BF16, as paper.backward computes it
    pbar = torch.exp(s - s.amax(-1, keepdim=True)).double()
    seen = pbar > 1e-3
    ratio = p.double() / pbar
    spread = ratio.where(seen, 0).amax(-1) / ratio.where(seen, math.inf).amin(-1)
    assert spread.max().item() <= 1 + 2**-7  # two BF16 roundings (P and P̄)
    # The row sums deviate from 1 only by LSE's rounding: LSE holds m + log l rounded to
    # the grid of 4, so |log(row sum)| ≤ 2 (+ the entries' rounding).
    assert (p.double().sum(-1).log().abs() <= 2 + 2**-6).all()
    # The previous backend's P: FP32 scores against an LSE from the BF16 forward.
    s32 = (q.float() @ k.float().transpose(-1, -2) * 0.125).masked_fill(hidden, -math.inf)
    p_old = torch.exp(s32 - res.lse.float().unsqueeze(-1)).double() / pbar
    old_spread = p_old.where(seen, 0).amax(-1) / p_old.where(seen, math.inf).amin(-1)
    assert old_spread.max().item() > 10  # measured 27


def _fwd_std(q, k, v):
    modes = torch.zeros(q.shape[1], dtype=torch.int32)
    return paper.forward(q, k, v, causal=True, scale=q.shape[-1] ** -0.5, modes=modes,
                         beta=2.0, eps=1e-3)


def _masked_run(q, k, v, do, mask, *, causal=False, modes=(Mode.STANDARD, Mode.BETA)):
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    st = fw.AttentionStats.zeros(q.shape[1])
    o = fw.attention(qq, kk, vv, causal=causal, head_modes=list(modes), stats=st,
                     backend="paper", attn_mask=mask)
    o.backward(do)
    return [o.detach(), qq.grad, kk.grad, vv.grad], st


@pytest.mark.parametrize("N", [200, 1100])
def test_a_causal_bool_mask_is_bitwise_causal_and_additive_masks_match_bool(N):
    q, k, v, do = _data(N, 16, logit=30.0, seed=N)
    hidden = torch.ones(N, N, dtype=torch.bool).triu(1)
    want, st_want = _masked_run(q, k, v, do, None, causal=True)
    for mask in (~hidden, torch.zeros(N, N, dtype=BF16).masked_fill(hidden, -math.inf)):
        got, st = _masked_run(q, k, v, do, mask)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(_bits(a), _bits(b))
        assert torch.equal(st.tied_rows, st_want.tied_rows)
        assert torch.equal(st.max_logit, st_want.max_logit)


def test_padding_and_fully_masked_rows_give_zero_and_exact_counters():
    """Batch 1's last 50 keys padded; its first 4 query rows see no key (O = 0, zero
    gradients, no NaN); counters equal the brute force over the visible BF16 scores."""
    N, D = 200, 16
    q, k, v, do = _data(N, D, logit=30.0, seed=3)
    mask = torch.ones(2, 1, N, N, dtype=torch.bool)
    mask[1, :, :, N - 50:] = False
    mask[1, :, :4] = False
    (o, dq, dk, dv), st = _masked_run(q, k, v, do, mask)
    assert o[1, :, :4].abs().max() == 0 and dq[1, :, :4].abs().max() == 0
    assert dk[1, :, N - 50:].abs().max() == 0 and dv[1, :, N - 50:].abs().max() == 0
    assert all(torch.isfinite(t).all() for t in (o, dq, dk, dv))
    s = torch.matmul(q, k.transpose(-1, -2)) * D**-0.5  # one 512-key block: their S
    for h in range(2):
        # (brute_ties would count batch 1's rows without a visible key: -inf ≥ -inf)
        ties = [brute_ties(s[0, h], ~mask[0, 0], 1e-3),
                brute_ties(s[1, h, 4:], ~mask[1, 0, 4:], 1e-3)]
        assert st.tied_rows[h].item() == sum(t for t, _ in ties)
        assert st.max_logit[h].item() == max(m for _, m in ties)
