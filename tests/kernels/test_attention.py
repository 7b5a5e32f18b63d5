"""flashwatch/kernels/dispatch.py: the public op `flashwatch.attention` and its backend dispatch."""

from __future__ import annotations

import pytest
import torch

import flashwatch as fw
from flashwatch.kernels import reference as R
from oracle import FLOOR


def _qkv(shape=(2, 3, 40, 32), dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(3)]


def test_auto_on_cpu_is_the_reference_bit_for_bit():
    q, k, v = _qkv()
    modes = [fw.Mode.STANDARD, fw.Mode.BETA, fw.Mode.FP32_O]
    a = fw.attention(q, k, v, causal=True, head_modes=modes)
    b = R.attention(q, k, v, causal=True, head_modes=modes)
    assert torch.equal(a, b)


def test_triton_backend_rejects_what_it_cannot_run_with_a_clear_error():
    # (CPU without TRITON_INTERPRET=1: tests/kernels/test_triton_attention.py, in a subprocess)
    q, k, v = _qkv(dtype=torch.float32)
    with pytest.raises(TypeError, match="backend='reference'"):
        fw.attention(q, k, v, backend="triton")


def test_matches_sdpa_layout_and_accepts_non_contiguous_inputs():
    # Models often hold [B, N, H, D] and transpose(1, 2) into SDPA: no copy required.
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 40, 3, 32, generator=g).bfloat16().transpose(1, 2)
               for _ in range(3))
    assert not q.is_contiguous()
    out = fw.attention(q, k, v, causal=True)
    want = fw.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert torch.equal(out, want)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=True)
    assert (out.double() - sdpa).abs().max() < 2e-2


def test_gradients_flow_to_every_input_and_stats_fill():
    q, k, v = (t.requires_grad_(True) for t in _qkv())
    stats = fw.AttentionStats.zeros(3)
    o = fw.attention(q, k, v, stats=stats)
    o.float().square().sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.dtype == torch.bfloat16
        assert torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0
    assert stats.rows.tolist() == [80, 80, 80]
    assert torch.isfinite(stats.max_logit).all()


def test_no_grad_and_inference_mode():
    q, k, v = _qkv()
    with torch.inference_mode():
        a = fw.attention(q, k, v)
    assert torch.equal(a, fw.attention(q, k, v))


def test_user_autocast_does_not_change_the_fp32_math():
    # Under CPU autocast an FP32 matmul runs in BF16; the op's FP32 scores and
    # accumulator must not (seen: 0.2 off before the op turned autocast off).
    q, k, v = (t.float() * 3 for t in _qkv())
    want = fw.attention(q, k, v, causal=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fw.attention(q, k, v, causal=True)
    assert torch.equal(got, want)


def test_paper_backend_is_the_reference_in_paper_arithmetic_forward_and_backward():
    # backend="paper" must run exactly reference.attention(arithmetic="paper"), with its
    # 512-key backward blocks, and must differ from the fused arithmetic in BF16.
    modes = [fw.Mode.STANDARD, fw.Mode.BETA, fw.Mode.FP32_O]
    outs, grads, ties = [], [], []
    for which in ("paper-backend", "paper-reference", "fused"):
        q, k, v = (t.requires_grad_() for t in _qkv(shape=(2, 3, 600, 32), seed=3))
        st = fw.AttentionStats.zeros(3)
        if which == "paper-backend":
            o = fw.attention(q, k, v, causal=True, head_modes=modes, stats=st, backend="paper")
        elif which == "paper-reference":
            o = R.attention(q, k, v, causal=True, head_modes=modes, stats=st,
                            arithmetic="paper")
        else:
            o = fw.attention(q, k, v, causal=True, head_modes=modes, stats=st)
        o.float().square().sum().backward()
        outs.append(o)
        grads.append([q.grad, k.grad, v.grad])
        ties.append(st.tied_rows)
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(grads[0], grads[1], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(ties[0], ties[1])
    assert not torch.equal(outs[0][:, 0], outs[2][:, 0])  # STANDARD heads: other arithmetic


def test_watch_config_routes_to_the_paper_backend():
    from examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, position_embedding=False))
    x = torch.randint(0, 256, (2, 64))
    outs = {}
    for backend in ("paper", "reference"):
        with fw.watch(model, backend=backend, route_all=True, mitigation="off"), \
                torch.autocast("cpu", dtype=torch.bfloat16):
            outs[backend] = model(x)[0]
    q, k, v = (torch.randn(2, 4, 64, 16).bfloat16() for _ in range(3))
    direct = R.attention(q, k, v, causal=True, arithmetic="paper")
    assert torch.equal(fw.attention(q, k, v, causal=True, backend="paper"), direct)
    assert not torch.equal(outs["paper"], outs["reference"])  # the watcher used it


# ---------------------------------------------------------------------------------------
# attn_mask and softcap (issue 28 item 6): the 2× rule against FP64 for O, dq, dk, dv,
# and counters equal to a brute-force count over the visible scores.

MODES3 = [fw.Mode.STANDARD, fw.Mode.BETA, fw.Mode.FP32_O]  # one head each


def _mask(pattern, B, H, N, generator):
    """A bool mask (True = attend) and whether causal applies on top. padding: batch 1's
    last third of the keys hidden, [B, 1, N, N], with causal; window: Mistral's sliding
    window of 5 (causal inside), [N, N]; empty: random [B, H, N, N] with batch 1's first 3
    rows seeing no key at all."""
    i = torch.arange(N)
    if pattern == "padding":
        m = torch.ones(B, 1, N, N, dtype=torch.bool)
        m[1, :, :, N - N // 3:] = False
        return m, True
    if pattern == "window":
        return (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 5), False
    m = torch.rand(B, H, N, N, generator=generator) < 0.5
    m[1, :, :3] = False
    return m, False


def _additive(mask, dtype):
    """The same mask as SDPA's additive float mask, plus an ALiBi-like finite bias
    (multiples of 1/4, exact in every dtype): -inf hides, finite values add."""
    i = torch.arange(mask.shape[-1])
    bias = -0.25 * (i[:, None] - i[None, :]).abs().clamp(max=8).float()
    return bias.masked_fill(~mask, -torch.inf).to(dtype)


def _scores(q, k, scale, dtype, *, attn_mask=None, causal=False, softcap=None):
    s = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -torch.inf)
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, -torch.inf) if attn_mask.dtype == torch.bool \
            else s + attn_mask.to(dtype)
    return s


def _math(q, k, v, dtype, **kw):
    """SDPA's math in `dtype` (differentiable): a row with no visible key gives O = 0."""
    s = _scores(q, k, q.shape[-1] ** -0.5, dtype, **kw)
    empty = torch.isneginf(s).all(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
    return torch.matmul(p, v.to(dtype))


def _fwd_bwd(fn, q, k, v, do):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    o = fn(q, k, v)
    o.backward(do.to(o.dtype))
    return [t.detach().double() for t in (o, q.grad, k.grad, v.grad)]


def _within_rule(out, pt, truth, dtype, what):
    """tests/oracle.py's rule with its floor relative to the largest true output or
    gradient (N = 1: pt's dq, dk are exactly 0 while a kernel's δ = rowsum(dO∘O) leaves
    FP32 rounding of the size of dv)."""
    floor = FLOOR[dtype] * max(1.0, *(t.abs().max().item() for t in truth))
    names = ("O", "dq", "dk", "dv", "dmask")[:len(out)]
    for name, a, b, t in zip(names, out, pt, truth, strict=True):
        e, e_pt = (a - t).abs().max().item(), (b - t).abs().max().item()
        assert e <= 2 * e_pt + floor, f"{what} {name}: {e:.3g} > 2×{e_pt:.3g} + {floor:g}"


@pytest.mark.parametrize("N,D", [(1, 16), (7, 32), (200, 64)])
@pytest.mark.parametrize("pattern", ["padding", "window", "empty"])
@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_masked_attention_within_the_rule_every_mode(dtype, kind, pattern, N, D):
    g = torch.Generator().manual_seed(N + D)
    B, H = 2, 3
    q, k, v, do = (torch.randn(B, H, N, D, generator=g).to(dtype) for _ in range(4))
    mask, causal = _mask(pattern, B, H, N, g)
    if kind == "additive":
        mask = _additive(mask, dtype)
    kw = dict(attn_mask=mask, causal=causal)
    out = _fwd_bwd(lambda a, b, c: fw.attention(a, b, c, head_modes=MODES3, **kw), q, k, v, do)
    truth = _fwd_bwd(lambda a, b, c: _math(a, b, c, torch.float64, **kw), q, k, v, do)
    pt = _fwd_bwd(lambda a, b, c: _math(a, b, c, dtype, **kw), q, k, v, do)
    _within_rule(out, pt, truth, dtype, f"{kind} {pattern}")
    if pattern == "empty":  # rows with no visible key: O = 0 and dq = 0 exactly, no NaN
        assert out[0][1, :, :3].abs().max() == 0 and out[1][1, :, :3].abs().max() == 0
    assert all(torch.isfinite(t).all() for t in out)


def _brute(q, k, eps=1e-3, **kw):
    """(tied_rows, max_logit) per head over the visible FP32 scores, by brute force."""
    s = _scores(q.float(), k.float(), q.shape[-1] ** -0.5, torch.float32, **kw)
    m = s.amax(-1)
    count = ((s >= (m - eps).unsqueeze(-1)) & ~torch.isneginf(s)).sum(-1)
    return (count >= 2).sum((0, 2)), m.amax((0, 2))


@pytest.mark.parametrize("N", [1, 7, 300])
@pytest.mark.parametrize("pattern", ["padding", "window", "empty"])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_masked_counters_equal_brute_force(kind, pattern, N):
    """Tie-heavy integer data: many tied rows; a hidden score never ties nor is the max
    (in `empty`, whole rows are hidden and a hidden key's score is the largest)."""
    g = torch.Generator().manual_seed(N)
    B, H, D = 2, 3, 16
    q, k, v = (torch.randint(-2, 3, (B, H, N, D), generator=g).bfloat16() for _ in range(3))
    mask, causal = _mask(pattern, B, H, N, g)
    if kind == "additive":
        mask = _additive(mask, torch.float32)
    stats = fw.AttentionStats.zeros(H)
    fw.attention(q, k, v, attn_mask=mask, causal=causal, head_modes=MODES3, stats=stats)
    tied, max_logit = _brute(q, k, attn_mask=mask, causal=causal)
    assert stats.tied_rows.tolist() == tied.tolist()
    assert torch.equal(stats.max_logit, max_logit)
    assert stats.rows.tolist() == [B * N] * H
    if N == 300:
        assert tied.min() > 0


def test_a_hidden_larger_score_is_not_the_max_logit_nor_a_tie():
    q = torch.ones(1, 1, 1, 16)
    k = torch.stack([torch.full((16,), x) for x in (1.0, 1.0, 9.0)])[None, None]
    stats = fw.AttentionStats.zeros(1)
    mask = torch.tensor([True, False, False])
    fw.attention(q, k, k, attn_mask=mask, scale=1.0, stats=stats)
    assert stats.max_logit.tolist() == [16.0] and stats.tied_rows.tolist() == [0]


@pytest.mark.parametrize("N", [1, 7, 200])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_softcap_as_gemma2_within_the_rule_with_exact_counters(dtype, N):
    """s = cap·tanh(s/cap) on the scaled scores, before the (sliding-window) mask; q
    scaled by 4 puts the scores (≈ ±4) where the cap of 3 bends them."""
    g = torch.Generator().manual_seed(N)
    B, H, D = 2, 3, 64
    q, k, v, do = (torch.randn(B, H, N, D, generator=g).to(dtype) for _ in range(4))
    q = q * 4
    mask, _ = _mask("window", B, H, N, g)
    kw = dict(attn_mask=mask, softcap=3.0)
    out = _fwd_bwd(lambda a, b, c: fw.attention(a, b, c, head_modes=MODES3, **kw), q, k, v, do)
    truth = _fwd_bwd(lambda a, b, c: _math(a, b, c, torch.float64, **kw), q, k, v, do)
    pt = _fwd_bwd(lambda a, b, c: _math(a, b, c, dtype, **kw), q, k, v, do)
    _within_rule(out, pt, truth, dtype, "softcap")
    stats = fw.AttentionStats.zeros(H)
    fw.attention(q, k, v, stats=stats, **kw)
    tied, max_logit = _brute(q, k, **kw)
    assert torch.equal(stats.max_logit, max_logit) and stats.tied_rows.tolist() == tied.tolist()
    assert max_logit.max() < 3.0 and (N == 1 or max_logit.min() > 2.0)


@pytest.mark.parametrize("shape", [(1, 3, 7, 7), (7, 7), (2, 1, 7, 7)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_learned_bias_gets_its_gradient_within_the_rule(dtype, shape):
    """A float attn_mask that requires grad (T5's relative position bias): its gradient
    is dS summed over the broadcast dims, held to the 2× rule like dq, dk, dv; causal and
    softcap on top, since both change dS."""
    g = torch.Generator().manual_seed(len(shape))
    q, k, v, do = (torch.randn(2, 3, 7, 16, generator=g).to(dtype) for _ in range(4))
    bias = torch.randn(shape, generator=g).to(dtype)
    kw = dict(causal=True, softcap=2.0)

    def grads(fn, dt):
        b = bias.detach().to(dt).requires_grad_(True)
        out = _fwd_bwd(lambda x, y, z: fn(x, y, z, b), q, k, v, do)
        return [*out, b.grad.double()]

    out = grads(lambda x, y, z, b: fw.attention(x, y, z, attn_mask=b, head_modes=MODES3,
                                                **kw), dtype)
    truth = grads(lambda x, y, z, b: _math(x, y, z, torch.float64, attn_mask=b, **kw),
                  torch.float64)
    pt = grads(lambda x, y, z, b: _math(x, y, z, dtype, attn_mask=b, **kw), dtype)
    assert out[4].shape == shape and truth[4].abs().max() > 0
    _within_rule(out, pt, truth, dtype, f"bias {shape}")


def test_triton_refuses_a_mask_that_requires_grad_before_running_anything():
    q, k, v = _qkv()
    bias = torch.zeros(40, 40, requires_grad=True)  # a learned bias: no dmask in Triton
    with pytest.raises(RuntimeError, match="attn_mask.*detach"):
        fw.attention(q, k, v, attn_mask=bias, backend="triton")


def test_a_masked_softcapped_call_compiles_fullgraph_and_matches_eager():
    """attn_mask (Optional[Tensor]) and softcap (Optional[float]) go through the
    torch.library op and its fake implementation: no graph break, the same bits."""
    q, k, v = _qkv(shape=(2, 2, 9, 16), dtype=torch.float32)
    mask = torch.rand(2, 1, 9, 9, generator=torch.Generator().manual_seed(0)) < 0.7
    fn = torch.compile(lambda a, b, c: fw.attention(a, b, c, attn_mask=mask, softcap=4.0),
                       fullgraph=True, backend="eager")
    assert torch.equal(fn(q, k, v), fw.attention(q, k, v, attn_mask=mask, softcap=4.0))


def test_the_kernels_level_reference_takes_the_same_mask_and_softcap_bit_for_bit():
    q, k, v = (t.requires_grad_(True) for t in _qkv(shape=(2, 3, 40, 16)))
    bias = torch.randn(1, 3, 40, 40).requires_grad_(True)
    kw = dict(attn_mask=bias, softcap=3.0, causal=True, head_modes=MODES3)
    got = [R.attention(q, k, v, **kw)]
    got += torch.autograd.grad(got[0].float().sum(), (q, k, v, bias))
    want = [fw.attention(q, k, v, **kw)]
    want += torch.autograd.grad(want[0].float().sum(), (q, k, v, bias))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


# ---------------------------------------------------------------------------------------
# sliding_window (issue 28 item 6): Mistral's and Gemma2's window, Hugging Face's
# sliding_window_overlay (query i sees key j iff i - j < window), on the reference and
# the paper backends. The Triton kernels: tests/kernels/test_triton_sliding_window.py.


def _window_mask(nq, nk, window, causal):
    """The window as a materialised bool mask (True = attend): what it must equal."""
    i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
    return (i - j < window) & ((j <= i) if causal else True)


def _hf_window_mask(nq, nk, window, causal):
    """The same mask from transformers' own mask functions (the definition we match)."""
    mu = pytest.importorskip("transformers.masking_utils")
    fn = (mu.sliding_window_causal_mask_function(window) if causal
          else mu.sliding_window_overlay(window))
    zero = torch.tensor(0)
    return fn(zero, zero, torch.arange(nq)[:, None], torch.arange(nk)[None, :])


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("window", [1, 3, 8])
def test_the_window_is_hugging_faces_including_the_off_by_one(window, causal):
    assert torch.equal(_window_mask(9, 12, window, causal),
                       _hf_window_mask(9, 12, window, causal))
    # window 1 with causal: each query sees itself only
    if window == 1 and causal:
        assert torch.equal(_window_mask(9, 12, 1, True), torch.eye(9, 12, dtype=torch.bool))


WINDOW_SHAPES = [  # (Nq, Nk, window, causal)
    (1, 1, 1, True),
    (7, 9, 1, True),  # window 1: the diagonal only
    (200, 200, 5, True),  # two 128-key blocks: the first is skipped for rows >= 132
    (300, 260, 130, False),  # later keys visible; rows past Nk + window - 1 see no key
    (40, 40, 100, True),  # window >= N: causal alone
]


@pytest.mark.parametrize("Nq,Nk,window,causal", WINDOW_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sliding_window_within_the_rule_and_equal_to_its_mask(dtype, Nq, Nk, window, causal):
    """The 2× rule against FP64 for O, dq, dk, dv; bit for bit the same window given as
    a materialised bool attn_mask (outputs, gradients and counters), causal passed as
    such in both (causal stops the reference's key loop at the diagonal: the shorter
    matmuls may sum in another order, so a materialised causal mask is not bit-equal)."""
    g = torch.Generator().manual_seed(Nq + window)
    B, H, D = 2, 3, 32
    q, do = (torch.randn(B, H, Nq, D, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(B, H, Nk, D, generator=g).to(dtype) for _ in range(2))
    mask = _window_mask(Nq, Nk, window, causal)
    runs = {}
    for name, kw in [("window", dict(sliding_window=window, causal=causal)),
                     ("mask", dict(attn_mask=_window_mask(Nq, Nk, window, False),
                                   causal=causal))]:
        stats = fw.AttentionStats.zeros(H)
        runs[name] = _fwd_bwd(lambda a, b, c, kw=kw, st=stats: fw.attention(
            a, b, c, head_modes=MODES3, stats=st, **kw), q, k, v, do)
        runs[name] += [stats.tied_rows, stats.max_logit]
    assert all(torch.equal(a, b) for a, b in zip(runs["window"], runs["mask"], strict=True))
    truth = _fwd_bwd(lambda a, b, c: _math(a, b, c, torch.float64, attn_mask=mask), q, k, v, do)
    pt = _fwd_bwd(lambda a, b, c: _math(a, b, c, dtype, attn_mask=mask), q, k, v, do)
    _within_rule(runs["window"][:4], pt, truth, dtype, f"window {window}")
    empty = ~mask.any(-1)
    if empty.any():  # rows with no visible key: O = 0 and dq = 0, no NaN
        assert runs["window"][0][:, :, empty].abs().max() == 0
        assert runs["window"][1][:, :, empty].abs().max() == 0
    assert all(torch.isfinite(t).all() for t in runs["window"][:4])


@pytest.mark.parametrize("N,window,causal", [(7, 2, True), (300, 5, True), (300, 40, False)])
def test_sliding_window_counters_equal_brute_force(N, window, causal):
    """Tie-heavy integer data; a score outside the window never ties nor is the max
    (a key ahead of the window holds the largest score of every row here)."""
    g = torch.Generator().manual_seed(N + window)
    B, H, D = 2, 3, 16
    q, k, v = (torch.randint(-2, 3, (B, H, N, D), generator=g).bfloat16() for _ in range(3))
    q[..., 0], k[..., 0, :] = 2.0, 2.0  # key 0: the largest score of every row
    stats = fw.AttentionStats.zeros(H)
    fw.attention(q, k, v, sliding_window=window, causal=causal, head_modes=MODES3,
                 stats=stats)
    tied, max_logit = _brute(q, k, attn_mask=_window_mask(N, N, window, causal))
    assert stats.tied_rows.tolist() == tied.tolist()
    assert torch.equal(stats.max_logit, max_logit)
    if N == 300:
        assert tied.min() > 0
        full = fw.AttentionStats.zeros(H)
        fw.attention(q, k, v, causal=causal, head_modes=MODES3, stats=full)
        assert not torch.equal(full.tied_rows, stats.tied_rows)  # the window matters


@pytest.mark.parametrize("Nq,Nk,window,causal", [(7, 9, 1, True), (600, 600, 37, True),
                                                 (520, 700, 300, False)])
def test_the_paper_backend_hides_the_window_as_its_causal_mask(Nq, Nk, window, causal):
    """backend="paper": bit for bit the same window as a materialised bool mask (hidden
    with -finfo.max forward, -inf backward, every 512-key block still computed), with
    the counters; 600 rows: a second 512-query chunk whose first key block is hidden."""
    g = torch.Generator().manual_seed(Nq)
    B, H, D = 1, 3, 16
    q, do = (torch.randn(B, H, Nq, D, generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(B, H, Nk, D, generator=g).bfloat16() for _ in range(2))
    runs = []
    for kw in (dict(sliding_window=window, causal=causal),
               dict(attn_mask=_window_mask(Nq, Nk, window, causal))):
        stats = fw.AttentionStats.zeros(H)
        runs.append(_fwd_bwd(lambda a, b, c, kw=kw, st=stats: fw.attention(
            a, b, c, head_modes=MODES3, stats=st, backend="paper", **kw), q, k, v, do)
                    + [stats.tied_rows, stats.max_logit])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    assert all(torch.isfinite(t).all() for t in runs[0][:4])


@pytest.mark.parametrize("block_n", [16, 48])
def test_reference_blocks_outside_the_window_are_skipped_without_changing_a_bit(block_n):
    """Small key blocks so that most are skipped (window 20, 16 or 48 keys a block): the
    same bits as the materialised mask, which computes every block."""
    q, k, v = _qkv(shape=(1, 3, 150, 16))
    modes = torch.tensor([int(m) for m in MODES3])
    kw = dict(causal=True, scale=0.25, modes=modes, beta=2.0, eps=1e-3, block_n=block_n)
    a = R.forward(q, k, v, window=20, **kw)
    b = R.forward(q, k, v, attn_mask=_window_mask(150, 150, 20, True), **kw)
    for name in ("o", "lse", "tied_rows", "max_logit"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_a_windowed_softcapped_masked_call_compiles_fullgraph_and_matches_eager():
    """sliding_window (Optional[int]) goes through the torch.library op: no graph break,
    the same bits; with softcap and a key-padding mask on top (all three compose)."""
    q, k, v = _qkv(shape=(2, 2, 9, 16), dtype=torch.float32)
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[1, ..., 6:] = False
    kw = dict(attn_mask=mask, softcap=4.0, sliding_window=3, causal=True)
    fn = torch.compile(lambda a, b, c: fw.attention(a, b, c, **kw), fullgraph=True,
                       backend="eager")
    want = fw.attention(q, k, v, **kw)
    assert torch.equal(fn(q, k, v), want)
    both = mask & _window_mask(9, 9, 3, True)
    assert torch.equal(want, fw.attention(q, k, v, attn_mask=both, softcap=4.0))
