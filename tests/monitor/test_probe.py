"""flashwatch/monitor/probe.py: every row's max logit and ties, the FP32 recomputation of
sampled rows, c[T] and the sketch G."""

from __future__ import annotations

import math

import pytest
import torch

from flashwatch.monitor import probe, samples
from flashwatch.signals import smallops
from oracle import causal_mask, grads_given_delta, math_attention


@pytest.fixture(autouse=True, params=[True, False], ids=["numpy_matmul", "torch_matmul"])
def matmul_path(request, monkeypatch):
    """Every test on both product paths: numpy (CPU) and torch (every other device)."""
    monkeypatch.setattr(smallops, "NUMPY_CPU", request.param)


def _rows(q, b, t):
    return q[b, :, t]


def _flat(x):
    """[E, H, w, ·] (the probe's grouped rows) -> [E·w, H, ·], rows in probe.flat's order."""
    return x.transpose(1, 2).flatten(0, 1)


def _recompute(q, k, v, elems, t, **kw):
    r = probe.recompute(q, k, v, probe.rows_on(elems, t, q.device), **kw)
    return _flat(r.o32), _flat(r.pk), r.tied, r.row_max


def _every_row(s, eps=1e-3, real=None):
    """FP64 truth per head over every row (real [B, N] bool: those rows only): tied
    rows (≥ 2 scores within eps of a finite row max) and the max score."""
    mx = s.amax(-1, keepdim=True)
    tied = ((s >= mx - eps).sum(-1) >= 2) & torch.isfinite(mx[..., 0])
    if real is not None:
        tied = tied & real[:, None]
        mx = mx.masked_fill(~real[:, None, :, None], -math.inf)
    return tied.sum((0, 2)), mx.amax((0, 2, 3))


@pytest.mark.parametrize("chunk_bytes", [None, 4 * 3 * 37 * 37 * 2, 4 * 3 * 37 * 10])
@pytest.mark.parametrize("mask_kind", [None, "causal", "bool", "float"])
@pytest.mark.parametrize("n_rows", [20, 2])
def test_recompute_matches_fp64_rows(mask_kind, chunk_bytes, n_rows, monkeypatch):
    """Chunks: all elements at once, two elements per chunk, and blocks of 10 query rows
    of one element (the path long sequences take: 37 = 10 + 10 + 10 + 7).
    n_rows=2 < B: a random subset of the batch elements, gathered."""
    if chunk_bytes is not None:
        monkeypatch.setattr(probe, "CHUNK_BYTES", chunk_bytes)
    g = torch.Generator().manual_seed(0)
    B, H, N, D = 3, 3, 37, 16
    q, k, v = (torch.randn(B, H, N, D, generator=g).bfloat16() for _ in range(3))
    k[:, :, 3] = k[:, :, 2]  # rows 20-24 have two equal maxima: tied
    q[:, :, 20:25] = 2 * k[:, :, 2:3]
    scale = D ** -0.5
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, 1, N, N, generator=g) > 0.3
        mask[..., 0] = True  # every row keeps a key
    elif mask_kind == "float":
        mask = torch.randn(1, H, N, N, generator=g)
    elems, tq = probe.sample_rows(g, B, N, n_rows)
    b, t = probe.flat(elems, tq)
    assert len(b) == (21 if n_rows == 20 else 2)  # 3 elements × 7 rows; 2 elements × 1
    o32, pk, tied, row_max = _recompute(q, k, v, elems, tq,
                                             causal=mask_kind == "causal", scale=scale,
                                             attn_mask=mask, eps=1e-3)
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if mask_kind == "causal":
        s = s.masked_fill(causal_mask(N, N), -math.inf)
    elif mask_kind == "bool":
        s = s.masked_fill(~mask, -math.inf)
    elif mask_kind == "float":
        s = s + mask.double()
    p = torch.softmax(s, -1)
    assert torch.allclose(o32.double(), _rows(p @ v.double(), b, t), atol=1e-5)
    assert torch.allclose(pk.double(), _rows(p @ k.double(), b, t), atol=1e-5)
    want_tied, want_max = _every_row(s)
    assert torch.allclose(row_max.double(), want_max, atol=1e-5)
    assert tied.shape == (H,) and torch.equal(tied, want_tied)
    assert want_tied.sum() >= B * H * 5 or mask_kind in ("bool", "float")


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_recompute_of_grouped_query_attention_matches_repeated_kv(kv_heads):
    """k, v with fewer heads (GQA, MQA): query head h reads KV head h // (H / H_kv),
    as SDPA's enable_gqa, without repeating K and V."""
    g = torch.Generator().manual_seed(5)
    B, H, N, D = 2, 4, 29, 8
    q = torch.randn(B, H, N, D, generator=g).bfloat16()
    k, v = (torch.randn(B, kv_heads, N, D, generator=g).bfloat16() for _ in range(2))
    elems, tq = probe.sample_rows(g, B, N, 10)
    b, t = probe.flat(elems, tq)
    o32, pk, _, row_max = _recompute(q, k, v, elems, tq, causal=True, scale=0.3,
                                          eps=1e-3)
    kr, vr = (x.double().repeat_interleave(H // kv_heads, dim=1) for x in (k, v))
    s = ((q.double() @ kr.transpose(-1, -2)) * 0.3).masked_fill(causal_mask(N, N), -math.inf)
    p = torch.softmax(s, -1)
    assert torch.allclose(o32.double(), _rows(p @ vr, b, t), atol=1e-5)
    assert torch.allclose(pk.double(), _rows(p @ kr, b, t), atol=1e-5)
    assert torch.allclose(row_max.double(), s.amax((0, 2, 3)), atol=1e-5)
    with pytest.raises(ValueError, match="dividing"):
        _recompute(q, k[:, :1].expand(B, 3, N, D), v, elems, tq, causal=True,
                        scale=0.3, eps=1e-3)


@pytest.mark.parametrize("cap", [50.0, 2.0])
def test_recompute_applies_softcap_before_the_masks(cap):
    """Gemma2's softcapping, s = cap·tanh(s/cap), then causal and a bool mask: what
    flashwatch.attention(softcap=) computes. cap 2 bends every score (|s| up to ~6)."""
    g = torch.Generator().manual_seed(8)
    B, H, N, D = 2, 2, 23, 16
    q, k, v = (2 * torch.randn(B, H, N, D, generator=g).bfloat16() for _ in range(3))
    mask = torch.rand(B, 1, N, N, generator=g) > 0.2
    mask[..., 0] = True
    elems, tq = probe.sample_rows(g, B, N, 12)
    b, t = probe.flat(elems, tq)
    o32, pk, tied, row_max = _recompute(q, k, v, elems, tq, causal=True, scale=0.25,
                                             attn_mask=mask, eps=1e-3, softcap=cap)
    s = (q.double() @ k.double().transpose(-1, -2)) * 0.25
    s = cap * torch.tanh(s / cap)
    s = s.masked_fill(causal_mask(N, N) | ~mask, -math.inf)
    p = torch.softmax(s, -1)
    assert torch.allclose(o32.double(), _rows(p @ v.double(), b, t), atol=1e-5)
    assert torch.allclose(pk.double(), _rows(p @ k.double(), b, t), atol=1e-5)
    want_tied, want_max = _every_row(s)
    assert torch.allclose(row_max.double(), want_max, atol=1e-5)
    assert row_max.max() < cap
    assert torch.equal(tied, want_tied)


def test_recompute_ignores_the_users_autocast():
    g = torch.Generator().manual_seed(4)
    q, k, v = (3 * torch.randn(2, 2, 30, 16, generator=g).bfloat16() for _ in range(3))
    elems, tq = probe.sample_rows(g, 2, 30, 12)
    want = _recompute(q, k, v, elems, tq, causal=True, scale=0.25, eps=1e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _recompute(q, k, v, elems, tq, causal=True, scale=0.25, eps=1e-3)
    for a, w in zip(got, want, strict=True):
        assert a.dtype == w.dtype and torch.equal(a, w)


def test_a_row_with_no_visible_key_gives_zero_not_nan_and_is_not_a_row():
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    mask[..., 3, :] = False  # left padding: row 3 sees nothing
    whole = probe.recompute(q, k, v, probe.rows_on(None, torch.arange(6)[None], "cpu"),
                            causal=False, scale=1.0, attn_mask=mask, eps=1e-3)
    assert whole.visible.tolist() == [5, 5]  # the tie ratio's denominator per head
    o32, pk, tied, _ = _recompute(q, k, v, torch.tensor([0]), torch.arange(6)[None],
                                       causal=False, scale=1.0, attn_mask=mask, eps=1e-3)
    assert torch.isfinite(o32).all() and torch.isfinite(pk).all()
    assert (o32[3] == 0).all() and tied.tolist() == [0, 0]
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                            scale=1.0)
    assert torch.allclose(o32.transpose(0, 1)[None], sdpa, atol=1e-6)


def test_recompute_counts_planted_ties():
    q = torch.zeros(1, 1, 4, 8)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, 6, 8)
    k[0, 0, :, 0] = torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0 - 2e-3, 0.0])
    v = torch.randn(1, 1, 6, 8)
    _, _, tied, _ = _recompute(q, k, v, torch.tensor([0]), torch.arange(4)[None],
                                    causal=True, scale=1.0, eps=1e-3)
    # row 0 sees [1]; row 1 sees [1, 3]; rows 2 and 3 see two 3.0s
    assert tied.tolist() == [2]


@pytest.mark.parametrize("batch, n_q, n_rows, n_el, width", [
    (3, 10, 25, 3, 9),  # 27 rows: 3 elements × ⌈25/3⌉
    (8, 128, 64, 8, 8),  # the default: exactly 64
    (5, 10, 4, 4, 1),  # fewer rows than elements: 4 elements drawn, 1 row each
    (4, 10, 5, 3, 2),  # ⌈5/4⌉ = 2 rows in ⌈5/2⌉ = 3 elements
    (2, 3, 100, 2, 3),  # never more rows than exist: every row
])
def test_sample_rows_are_distinct_seeded_and_bounded(batch, n_q, n_rows, n_el, width):
    elems, tq = probe.sample_rows(torch.Generator().manual_seed(1), batch, n_q, n_rows)
    assert tq.shape == (n_el, width)
    assert (elems is None) == (n_el == batch)  # None: every element, in order
    b, t = probe.flat(elems, tq)
    pairs = set(zip(b.tolist(), t.tolist(), strict=True))
    assert len(pairs) == n_el * width  # distinct
    assert all(0 <= x < batch and 0 <= y < n_q for x, y in pairs)
    assert len(set(b.tolist())) == n_el
    e2, t2 = probe.sample_rows(torch.Generator().manual_seed(1), batch, n_q, n_rows)
    assert (elems is None and e2 is None or torch.equal(elems, e2)) and torch.equal(tq, t2)


def test_sample_rows_give_every_row_the_same_chance():
    """Sums over the sample scaled by rows / sampled rows are unbiased only if every row
    is equally likely to be drawn: 4,000 draws of 5 rows of a 4 × 6 batch (⌈5/4⌉ = 2
    rows in 3 elements: 6 of 24 rows, p = 1/4)."""
    g = torch.Generator().manual_seed(2)
    hits = torch.zeros(4, 6)
    n = 4000
    for _ in range(n):
        b, t = probe.flat(*probe.sample_rows(g, 4, 6, 5))
        hits[b, t] += 1
    p = hits / n
    # binomial standard error √(¼·¾/4000) = 0.0068: 5 σ
    assert (p - 0.25).abs().max() < 0.035, p


def test_delta_error_equals_an_fp64_computation():
    g = torch.Generator().manual_seed(2)
    B, H, N, D = 2, 2, 50, 32
    q, k, v, do = (torch.randn(B, H, N, D, generator=g).bfloat16() for _ in range(4))
    scale = D ** -0.5
    o_lp = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    o64 = math_attention(q, k, v, causal=True, scale=scale, dtype=torch.float64)
    c64 = (do.double() * o_lp.double()).sum(-1) - (do.double() * o64).sum(-1)
    elems, tq = probe.sample_rows(g, B, N, 40)
    b, t = probe.flat(elems, tq)
    o32, _, _, _ = _recompute(q, k, v, elems, tq, causal=True, scale=scale, eps=1e-3)
    c = samples.delta_error(_rows(do, b, t), _rows(o_lp, b, t).float(), o32)
    want = _rows(c64.unsqueeze(-1), b, t)[..., 0]
    assert c.dtype == torch.float64
    assert want.abs().max() > 1e-3  # the bf16 error is really there
    assert torch.allclose(c, want, atol=2e-5, rtol=0)


def test_sketch_is_the_projected_wq_gradient_error():
    # End to end against autograd-free FP64 calculus: with q = X W_Qᵀ, the W_Q gradient
    # error from using δ_lp instead of δ_hp is ΔW = α Σ_T c[T] PK[T] X[T]ᵀ (the paper's
    # Eq. 2). With every row sampled, α·G must equal (Ω_aᵀ ΔW Ω_x)ᵀ.
    g = torch.Generator().manual_seed(3)
    B, N, C, H, D, kdim = 2, 24, 32, 2, 16, 8
    X = torch.randn(B, N, C, generator=g).bfloat16()
    Wq = torch.randn(H * D, C, generator=g) / C ** 0.5
    q = (X.float() @ Wq.T).view(B, N, H, D).transpose(1, 2).bfloat16()
    k, v, do = (torch.randn(B, H, N, D, generator=g).bfloat16() for _ in range(3))
    alpha = D ** -0.5
    o_lp = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    o64 = math_attention(q, k, v, causal=True, scale=alpha, dtype=torch.float64)
    d_lp = (do.double() * o_lp.double()).sum(-1)
    d_hp = (do.double() * o64).sum(-1)
    dq_lp, _ = grads_given_delta(q, k, v, do, d_lp, causal=True, scale=alpha)
    dq_hp, _ = grads_given_delta(q, k, v, do, d_hp, causal=True, scale=alpha)
    # q[b, h, t] = W_h X[b, t]  ⇒  dW_h = Σ_{b,t} dq[b, h, t] X[b, t]ᵀ
    dW = torch.einsum("bhtd,btc->hdc", dq_hp - dq_lp, X.double())
    om_x = torch.randn(C, kdim, generator=g).double()
    om_a = torch.randn(D, kdim, generator=g).double()
    want = torch.einsum("dk,hdc,cl->hlk", om_a, dW, om_x)  # (Ω_aᵀ ΔW_h Ω_x)ᵀ
    elems, tq = probe.sample_rows(g, B, N, B * N)  # every row
    b, t = probe.flat(elems, tq)
    o32, pk, _, _ = _recompute(q, k, v, elems, tq, causal=True, scale=alpha, eps=1e-3)
    c = samples.delta_error(_rows(do, b, t), _rows(o_lp, b, t).float(), o32)
    z = X[b, t].double() @ om_x
    y = pk.double() @ om_a
    G = samples.sketch(c, z, y)
    assert want.abs().max() > 1e-4
    rel = ((alpha * G - want).abs().max() / want.abs().max()).item()
    assert rel < 1e-3, rel


class _SoftcappedAttention(torch.nn.Module):
    """A layer calling flashwatch.attention(softcap=) as Gemma2 would: cap 1 bends
    every score, so a probe without the softcap would recompute another function."""

    def __init__(self, C=32, H=2, cap=1.0):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(C, C) for _ in range(3))
        self.n_head, self.cap = H, cap

    def heads(self, x):
        B, T, C = x.shape
        return [p(x).view(B, T, self.n_head, -1).transpose(1, 2)
                for p in (self.q_proj, self.k_proj, self.v_proj)]

    def forward(self, x):
        import flashwatch as fw
        q, k, v = self.heads(x)
        o = fw.attention(q, k, v, causal=True, softcap=self.cap)
        return o.transpose(1, 2).reshape(x.shape)


def test_a_watched_softcapped_call_is_probed_with_its_softcap():
    """Every row's δ error and the exact max logit of the capped scores (FP64 here)."""
    import flashwatch as fw
    torch.manual_seed(3)
    B, T, C, H, cap = 2, 12, 32, 2, 1.0
    model = _SoftcappedAttention(C, H, cap).bfloat16()
    x = torch.randn(B, T, C).bfloat16()
    w = fw.watch(model, sites={"": dict(num_heads=H, q_module="q_proj")}, every_n_steps=1,
                 rows_per_head=4)
    model(x).float().sum().backward()
    report = w.step()
    w.remove()
    assert w.monitor_errors_total == 0
    with torch.no_grad():
        q, k, v = (t.double() for t in model.heads(x))
    s = cap * torch.tanh((q @ k.transpose(-1, -2)) * (C // H) ** -0.5 / cap)
    s = s.masked_fill(causal_mask(T, T), -math.inf)
    want_max = s.amax((0, 2, 3))
    for h, rec in enumerate(report.heads):
        assert rec.delta_error_rows == B * T  # 0 when the probe skipped softcapped calls
        assert rec.attention_max_logit == pytest.approx(float(want_max[h]), abs=2e-2)
        assert rec.attention_max_logit < cap


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("window", [1, 4, 100])
def test_recompute_applies_the_sliding_window(causal, window):
    """flashwatch.attention(sliding_window=): query t hides key j when t - j >= window
    (Hugging Face's sliding_window_overlay), with causal or alone (later keys visible).
    Nq = 30 > Nk = 20: with window 4, rows from 23 on see no key (O = 0, never tied)."""
    g = torch.Generator().manual_seed(12)
    B, H, Nq, Nk, D = 2, 2, 30, 20, 16
    q = torch.randn(B, H, Nq, D, generator=g).bfloat16()
    k, v = (torch.randn(B, H, Nk, D, generator=g).bfloat16() for _ in range(2))
    k[:, :, 3] = k[:, :, 5] = k[:, :, 9] = 3 * q[:, :, 6]  # row 6's max: 3-5 tied in
    # every window >= 4; 3 and 9 tie in rows whose window holds both (not window 4)
    elems, tq = probe.sample_rows(g, B, Nq, B * Nq)
    b, t = probe.flat(elems, tq)
    o32, pk, tied, row_max = _recompute(q, k, v, elems, tq, causal=causal, scale=0.25,
                                             eps=1e-3, sliding_window=window)
    s = (q.double() @ k.double().transpose(-1, -2)) * 0.25
    i, j = torch.arange(Nq)[:, None], torch.arange(Nk)[None, :]
    hidden = (i - j >= window) | ((j > i) if causal else torch.zeros(Nq, Nk, dtype=torch.bool))
    s = s.masked_fill(hidden, -math.inf)
    empty = torch.isneginf(s.amax(-1, keepdim=True))
    p = torch.softmax(s, -1).masked_fill(empty, 0.0)
    assert torch.allclose(o32.double(), _rows(p @ v.double(), b, t), atol=1e-5)
    assert torch.allclose(pk.double(), _rows(p @ k.double(), b, t), atol=1e-5)
    want_tied, want_max = _every_row(s)
    assert torch.allclose(row_max.double(), want_max, atol=1e-5)
    assert torch.equal(tied, want_tied)
    if window == 4:
        assert empty.any() and want_tied.sum() > 0


class _WindowedAttention(_SoftcappedAttention):
    """A layer calling flashwatch.attention(sliding_window=) as Mistral would."""

    def __init__(self, C=32, H=2, window=3):
        super().__init__(C, H)
        self.window = window

    def forward(self, x):
        import flashwatch as fw
        q, k, v = self.heads(x)
        o = fw.attention(q, k, v, causal=True, sliding_window=self.window)
        return o.transpose(1, 2).reshape(x.shape)


def test_a_watched_windowed_call_is_probed_with_its_window(monkeypatch):
    """The probe's FP32 rows (from which each row's δ error is measured) are those of
    the windowed attention, not of the full causal one (FP64 here)."""
    import flashwatch as fw
    torch.manual_seed(4)
    B, T, C, H, window = 2, 12, 32, 2, 3
    model = _WindowedAttention(C, H, window).bfloat16()
    x = torch.randn(B, T, C).bfloat16()
    seen = []
    real = probe.recompute

    def spy(q, k, v, rows, **kw):
        out = real(q, k, v, rows, **kw)
        seen.append((probe.flat(rows.elems, rows.t), _flat(out[0])))
        return out

    monkeypatch.setattr(probe, "recompute", spy)
    w = fw.watch(model, sites={"": dict(num_heads=H, q_module="q_proj")}, every_n_steps=1,
                 rows_per_head=4)
    model(x).float().sum().backward()
    report = w.step()
    w.remove()
    assert w.monitor_errors_total == 0 and len(seen) == 1
    assert all(rec.delta_error_rows > 0 for rec in report.heads)
    with torch.no_grad():
        q, k, v = (t.double() for t in model.heads(x))
    s = (q @ k.transpose(-1, -2)) * (C // H) ** -0.5
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    full = torch.softmax(s.masked_fill(j > i, -math.inf), -1) @ v
    windowed = torch.softmax(s.masked_fill((j > i) | (i - j >= window), -math.inf), -1) @ v
    (b, t), o32 = seen[0]
    assert (o32.double() - _rows(windowed, b, t)).abs().max() < 2e-2
    assert (o32.double() - _rows(full, b, t)).abs().max() > 0.1  # the window matters here


def _tf32_matmul(a, b):
    """A GPU's FP32 matmul with TF32 allowed, emulated: each operand rounded to TF32's
    10-bit mantissa (round to nearest), products summed in FP64, the result in FP32."""
    def tf32(x):
        i = x.contiguous().view(torch.int32)
        return ((i + 0x1000) & ~0x1FFF).view(torch.float32)
    return torch.matmul(tf32(a).double(), tf32(b).double()).float()


def test_the_fp32_softmax_product_stays_fp32_exact_where_tf32_is_allowed(monkeypatch):
    """P · [K V] with FP32 softmax weights P and BF16-valued K, V: TF32 rounding of P
    costs ≈ 5e-4 relative (a quarter of the BF16 rounding the δ error measures); the
    split into P's BF16 part and the rest keeps it within 1e-5 of the FP64 product."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(3 * torch.randn(2, 4, 16, 200, generator=g), -1)
    kv = torch.randn(2, 4, 200, 48, generator=g).bfloat16().float()
    truth = p.double() @ kv.double()

    def rel(x):
        return float((x.double() - truth).abs().max() / truth.abs().max())

    assert rel(_tf32_matmul(p, kv)) > 1e-4  # the hazard, unsplit
    monkeypatch.setattr(probe, "tf32_allowed", lambda device: True)
    assert rel(probe.fp32_matmul(p, kv, matmul=_tf32_matmul)) < 1e-5
    assert rel(probe.fp32_matmul(p, kv)) < 1e-6  # FP32 matmuls (the CPU's) as well


@pytest.mark.parametrize("allowed", [True, False])
def test_the_probe_s_fp32_rows_go_through_the_tf32_safe_product(monkeypatch, allowed):
    """The probe's O_fp32 of sampled rows under an emulated TF32 matmul: within 1e-5 of
    FP64 when the split runs (TF32 allowed), ≥ 1e-4 off if it did not."""
    import functools

    g = torch.Generator().manual_seed(1)
    B, H, N, D = 2, 3, 64, 16
    q, k, v = (torch.randn(B, H, N, D, generator=g).bfloat16() for _ in range(3))
    elems, tq = None, torch.arange(N).expand(B, N)
    want = math_attention(q, k, v, causal=True, scale=0.7, dtype=torch.float64)
    monkeypatch.setattr(probe, "tf32_allowed", lambda device: allowed)
    monkeypatch.setattr(probe, "fp32_matmul",
                        functools.partial(probe.fp32_matmul, matmul=_tf32_matmul))
    o32, _, _, _ = _recompute(q, k, v, elems, tq, causal=True, scale=0.7, eps=1e-3)
    err = float((o32.double() - _flat(want)).abs().max() / want.abs().max())
    assert (err < 1e-5) if allowed else (err > 1e-4), err


@pytest.mark.parametrize("how", ["legacy_flag", "precision_high", "precision_medium",
                                 "new_api", "off"])
def test_tf32_allowed_reads_every_way_a_user_allows_tf32(how):
    """Read on a CUDA device (flags only: no GPU needed): the Hugging Face Trainer's
    tf32=True (allow_tf32), Lightning's suggested set_float32_matmul_precision, the
    new fp32_precision API; and never on a CPU device."""
    cuda = torch.backends.cuda.matmul
    before = cuda.fp32_precision
    try:
        if how == "legacy_flag":
            cuda.allow_tf32 = True
        elif how.startswith("precision_"):
            torch.set_float32_matmul_precision(how.split("_")[1])
        elif how == "new_api":
            cuda.fp32_precision = "tf32"
        assert probe.tf32_allowed(torch.device("cuda")) is (how != "off")
        assert probe.tf32_allowed(torch.device("cpu")) is False
    finally:  # back through the same API (mixing the two makes torch's reads raise)
        if how == "new_api":
            cuda.fp32_precision = before
        else:
            torch.set_float32_matmul_precision("highest")
