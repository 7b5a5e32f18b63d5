"""FlexAttention and varlen calls (flashwatch/monitor/flex.py, flex_capture.py) against an
FP64 truth built here with the same masks and score mods, written by hand (broadcasting,
no vmap): every head's max logit within 1e-4, ties exact, masked and padded rows out.

torch 2.13 runs flex_attention's forward on the CPU (its math implementation), not its
backward, and has no CPU kernel for varlen. The backward signals and varlen are tested
through stand-ins (tests/attention_standins.py) for the ops flashwatch intercepts, each
for its test only: torch's own math flex implementation as the flex op's autograd kernel
(differentiable), and a per-document FP32 attention as varlen's CPU kernels.
benchmarks/gpu_check.py runs the real kernels.
"""

from __future__ import annotations

import math

import attention_standins
import pytest
import torch
from attention_standins import band
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import flashwatch as fw
from flashwatch.monitor import probe

B, N, D_MODEL, H = 2, 40, 64, 4  # N: not a multiple of flex's 128-row blocks
EPS = 1e-3
PAD = -1


def _docs(seed=0):
    """Document ids [B, N] of packed sequences, the second element padded at its end."""
    doc = torch.zeros(B, N, dtype=torch.long)
    doc[0, 15:], doc[0, 31:] = 1, 2
    doc[1, 9:], doc[1, 33:] = 1, PAD
    return doc


# name -> (score_mod, mask_mod, score64(s, b, h, q, k), keep64(b, h, q, k)) with the
# FP64 versions broadcasting over [B, H, N, N] index grids
def spec(name, doc=None):
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(H)])

    def causal(b, h, q, k):
        return q >= k

    if name == "causal":
        return None, causal, lambda s, b, h, q, k: s, causal
    if name == "document":
        def same_doc(b, h, q, k):
            return (q >= k) & (doc[b, q] == doc[b, k]) & (doc[b, q] != PAD)
        # evaluated by broadcasting over index grids for the truth, vmapped by the kernel
        return None, same_doc, lambda s, b, h, q, k: s, same_doc
    if name == "softcap":
        return (lambda s, b, h, q, k: torch.tanh(s / 3.0) * 3.0, causal,
                lambda s, b, h, q, k: torch.tanh(s / 3.0) * 3.0, causal)
    if name == "alibi":
        return (lambda s, b, h, q, k: s + slopes[h] * (k - q), causal,
                lambda s, b, h, q, k: s + slopes.double()[h] * (k - q), causal)
    raise ValueError(name)


class FlexAttention(nn.Module):
    def __init__(self, kv_heads=H):
        super().__init__()
        self.num_heads, self.kv_heads, self.head_dim = H, kv_heads, D_MODEL // H
        self.q_proj = nn.Linear(D_MODEL, D_MODEL, bias=False)
        self.k_proj = nn.Linear(D_MODEL, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(D_MODEL, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(D_MODEL, D_MODEL, bias=False)
        self.mods = (None, None)  # score_mod, block mask: set by the test
        self.seen = []  # (q, k, out) of each call, for the truth

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, H, -1).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.kv_heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, -1).transpose(1, 2)
        score_mod, block_mask = self.mods
        o = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                           enable_gqa=self.kv_heads != H)
        self.seen.append((q.detach(), k.detach(), o))
        return self.o_proj(o.transpose(1, 2).reshape(b, n, -1))


class Model(nn.Module):
    def __init__(self, kv_heads=H, seed=0, checkpoint=None):
        torch.manual_seed(seed)
        super().__init__()
        self.layers = nn.ModuleList([FlexAttention(kv_heads) for _ in range(2)])
        self.checkpoint = checkpoint  # None, or how each layer is recomputed
        with torch.no_grad():  # large logits, so max logits and ties mean something
            for layer in self.layers:
                layer.q_proj.weight.mul_(4.0)

    def forward(self, x):
        from _helpers import sac_policy
        from torch.utils.checkpoint import checkpoint

        for layer in self.layers:
            if self.checkpoint is None:
                x = x + layer(x)
            else:
                kw = {"context_fn": sac_policy()} if self.checkpoint == "selective" else {}
                x = x + checkpoint(layer, x, use_reentrant=self.checkpoint == "reentrant",
                                   **kw)
        return x


def _set(model, name, doc=None):
    score_mod, mask_mod, *_ = spec(name, doc)
    bm = create_block_mask(mask_mod, B if doc is not None else None, None, N, N,
                           device="cpu")
    for layer in model.layers:
        layer.mods = (score_mod, bm)
        layer.seen.clear()


def _grids():
    """b, h, q_idx, kv_idx as index grids broadcasting to [B, H, N, N]."""
    return (torch.arange(B)[:, None, None, None], torch.arange(H)[None, :, None, None],
            torch.arange(N)[None, None, :, None], torch.arange(N)[None, None, None, :])


def _truth(model, name, doc=None):
    """{(layer, head): (max logit, tied rows, visible rows)} in FP64."""
    _, _, score64, keep64 = spec(name, doc)
    b, h, qi, ki = _grids()
    out = {}
    for li, layer in enumerate(model.layers):
        q, k, _ = layer.seen[-1]
        k = k.double().repeat_interleave(H // k.shape[1], 1)
        s = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        s = score64(s, b, h, qi, ki)
        keep = keep64(b, h, qi, ki)
        s = s.masked_fill(~keep.expand(s.shape), -math.inf)
        top = s.topk(2, -1).values
        visible = torch.isfinite(top[..., 0])
        tied = visible & (top[..., 1] >= top[..., 0] - EPS)
        for hd in range(H):
            out[(f"layers.{li}", hd)] = (top[:, hd, :, 0][visible[:, hd]].max().item(),
                                         int(tied[:, hd].sum()), int(visible[:, hd].sum()))
    return out


def _check(report, truth, errors=0):
    assert report.monitor_errors_total == errors
    assert len(report.heads) == len(truth)
    for rec in report.heads:
        mx, tied, rows = truth[(rec.layer, rec.head)]
        assert rec.attention_max_logit == pytest.approx(mx, rel=1e-4), (rec.layer, rec.head)
        assert rec.tied_rowmax_ratio * rows == pytest.approx(tied, abs=1e-9), \
            (rec.layer, rec.head, rec.tied_rowmax_ratio, tied, rows)


def _input(seed=1):
    return torch.randn(B, N, D_MODEL, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["causal", "document", "softcap", "alibi"])
@pytest.mark.parametrize("kv_heads", [H, 2])
def test_flex_calls_measured_exactly(name, kv_heads):
    """Each mask and score mod, multi-head and grouped-query (enable_gqa), eager."""
    model, doc = Model(kv_heads), _docs() if name == "document" else None
    _set(model, name, doc)
    with fw.watch(model, config=fw.WatchConfig(every_n_steps=1)) as w:
        with torch.no_grad():
            model(_input())
        report = w.step()
    _check(report, _truth(model, name, doc))


def test_padded_rows_left_out():
    """The document mask's padded rows see no key: counting them as rows (or their
    scores) would change the second element's head statistics; here the visible-row
    count is checked against the truth's, which leaves the 7 padded rows out."""
    model, doc = Model(), _docs()
    _set(model, "document", doc)
    with fw.watch(model, config=fw.WatchConfig(every_n_steps=1)) as w:
        with torch.no_grad():
            model(_input())
        report = w.step()
    truth = _truth(model, "document", doc)
    assert all(rows == B * N - 7 for _, _, rows in truth.values())
    _check(report, truth)


def test_chunked_over_query_rows(monkeypatch):
    """Chunks of a few query rows (large calls): the score mod and mask see the right
    q_idx in every chunk."""
    monkeypatch.setattr(probe, "CHUNK_BYTES", 4 * H * N * 6)  # 6 rows per chunk
    model, doc = Model(2), _docs()
    _set(model, "document", doc)
    with fw.watch(model, config=fw.WatchConfig(every_n_steps=1)) as w:
        with torch.no_grad():
            model(_input())
        report = w.step()
    _check(report, _truth(model, "document", doc))


def test_compiled_model_measured_on_monitored_steps():
    """torch.compile'd model (flex compiled with it): monitored steps run eagerly
    (force_eager), so the call is measured; the unmonitored step between runs compiled.
    aot_eager: inductor's CPU lowering of flex_attention fails on this model's q view
    without flashwatch too (torch 2.13: "not enough values to unpack")."""
    model = Model()
    _set(model, "softcap")
    compiled = torch.compile(model, backend="aot_eager")
    with fw.watch(model, config=fw.WatchConfig(every_n_steps=2)) as w:
        for step in range(3):
            with torch.no_grad():
                compiled(_input(step))
            report = w.step()
            if step == 2:
                _check(report, _truth(model, "softcap"))


# ------------------------------------------------------------------ backward (stand-in)

@pytest.fixture
def differentiable_flex():
    """torch's math flex implementation as the flex op's autograd kernel
    (tests/attention_standins.py): a backward runs on the CPU."""
    with attention_standins.differentiable_flex():
        yield


def _delta_truth(model, name, doc=None):
    """Σ_T rowsum(dO ∘ (O_used - O_fp64)) per (layer, head), real rows only."""
    _, _, score64, keep64 = spec(name, doc)
    b, h, qi, ki = _grids()
    out = {}
    for li, layer in enumerate(model.layers):
        q, k, o = layer.seen[-1]
        v = layer.v_proj(layer.last_x).view(B, N, layer.kv_heads, -1).transpose(1, 2)
        k = k.double().repeat_interleave(H // k.shape[1], 1)
        v = v.detach().to(o.dtype).double().repeat_interleave(H // v.shape[1], 1)
        s = score64(q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), b, h, qi, ki)
        s = s.masked_fill(~keep64(b, h, qi, ki).expand(s.shape), -math.inf)
        p = torch.softmax(s, -1).nan_to_num(0.0)
        o64 = p @ v
        c = (layer.grad.double() * (o.detach().double() - o64)).sum(-1)  # [B, H, N]
        for hd in range(H):
            out[(f"layers.{li}", hd)] = (c[:, hd].sum().item(), c[:, hd].abs().sum().item())
    return out


@pytest.mark.parametrize("how", [None, "non_reentrant", "reentrant", "selective"])
def test_backward_signals_through_a_differentiable_flex(differentiable_flex, how):
    """δ error from the gradient the flex call's output receives, on every row, against
    FP64 (bf16 weights: the kernel's O is BF16), also with each layer recomputed by
    activation checkpointing (selective: torchtitan's SelectiveAC-shaped policy)."""
    model = Model(checkpoint=how).to(torch.bfloat16)
    _set(model, "softcap")
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda m, a: setattr(m, "last_x", a[0]))

        def keep_grad(m, a, o):
            if m.seen[-1][2].requires_grad:  # a reentrant checkpoint's first forward: not
                m.seen[-1][2].register_hook(lambda g, m=m: setattr(m, "grad", g))
        layer.register_forward_hook(keep_grad)
    cfg = fw.WatchConfig(every_n_steps=1, rows_per_head="all")
    with fw.watch(model, config=cfg) as w:
        # a reentrant checkpoint passes gradients only to inputs that require one
        y = model(_input().bfloat16().requires_grad_(how == "reentrant"))
        y.float().square().mean().backward()
        report = w.step()
    truth = _delta_truth(model, "softcap")
    assert report.monitor_errors_total == 0
    for rec in report.heads:
        total, size = truth[(rec.layer, rec.head)]
        assert size > 0
        # FP32 recomputation against FP64: far below the BF16 rounding c measures
        assert rec.delta_error_sum == pytest.approx(total, abs=1e-3 * size), \
            (rec.layer, rec.head, rec.delta_error_sum, total, size)
        assert math.isfinite(rec.delta_error_share) and rec.delta_error_share >= 0
        assert rec.delta_error_rows == B * N


# ----------------------------------------------------------------------- routing

def test_identity_score_flex_is_routed_with_its_mask(differentiable_flex):
    """FP32_O on a document-masked flex layer: flashwatch's kernel runs it with the
    mask_mod as a dense mask; its output matches the FP64 attention by the 2× rule."""
    model, doc = Model(), _docs()
    _set(model, "document", doc)
    x = _input()
    with torch.no_grad():
        plain = model(x)
    with fw.watch(model, config=fw.WatchConfig(every_n_steps=1)) as w:
        w.set_head_modes("layers.0", [fw.Mode.FP32_O] * H)
        with torch.no_grad():
            routed = model(x)
        st = next(s for s in w._states if s.site.name == "layers.0")
        assert st.routed_calls == 1 and st.fallback_calls == 0
        report = w.step()
    assert "layers.0" not in report.unmitigable
    assert report.monitor_errors_total == 0
    assert (routed - plain).abs().max() < 1e-4  # the same attention, FP32 both


def test_score_mod_flex_is_unmitigable_with_the_reason():
    """ALiBi: a position bias flashwatch's kernel cannot apply (softcap it can:
    tests/monitor/test_flex_capture.py)."""
    model = Model()
    _set(model, "alibi")
    with fw.watch(model, config=fw.WatchConfig(every_n_steps=1)) as w:
        w.set_head_modes("layers.1", [fw.Mode.FP32_O] * H)
        with torch.no_grad():
            model(_input())
        report = w.step()
    assert "score_mod" in report.unmitigable["layers.1"]
    # hand-set modes that did not run are a monitor error (head_modes.judge), and the
    # layer is still measured
    _check(report, _truth(model, "alibi"), errors=1)


def test_qk_clip_acts_on_a_flex_layer():
    """QK-clip scales W^Q and W^K of heads whose max logit passes the threshold, whatever
    the kernel: the next measured max logit is below it."""
    model = Model()
    _set(model, "causal")
    x = _input()
    with fw.watch(model, config=fw.WatchConfig(every_n_steps=1)) as w:
        with torch.no_grad():
            model(x)
        first = w.step()
    tau = min(h.attention_max_logit for h in first.heads) / 2
    model = Model()
    _set(model, "causal")
    before = [layer.q_proj.weight.detach().clone() for layer in model.layers]
    with fw.watch(model, config=fw.WatchConfig(every_n_steps=1, mitigation="auto",
                                              qk_clip_threshold=tau)) as w:
        for _ in range(3):  # a clip counts once the next measurement confirms it
            with torch.no_grad():
                model(x)
            report = w.step()
    assert report.qk_clips_total > 0
    assert any(not torch.equal(b, layer.q_proj.weight)
               for b, layer in zip(before, model.layers, strict=True))
    assert max(h.attention_max_logit for h in report.heads) < max(
        h.attention_max_logit for h in first.heads)


# ------------------------------------------------------------------ varlen (stand-in)

DOCS = [13, 20, 7]  # packed document lengths, T = 40


@pytest.fixture
def cpu_varlen():
    """CPU kernels for torch_attn::_varlen_attn and its backward (torch has none):
    attention per document in FP32 (tests/attention_standins.py)."""
    with attention_standins.cpu_varlen() as seen:
        yield seen


class VarlenAttention(nn.Module):
    def __init__(self, window):
        super().__init__()
        self.num_heads, self.head_dim, self.window = H, D_MODEL // H, window
        self.q_proj = nn.Linear(D_MODEL, D_MODEL, bias=False)
        self.k_proj = nn.Linear(D_MODEL, D_MODEL // 2, bias=False)  # 2 KV heads
        self.v_proj = nn.Linear(D_MODEL, D_MODEL // 2, bias=False)
        self.o_proj = nn.Linear(D_MODEL, D_MODEL, bias=False)
        self.cu = torch.tensor([0] + DOCS, dtype=torch.int32).cumsum(0).int()

    def forward(self, x):  # x [1, T, d]: packed documents
        from torch.nn.attention.varlen import varlen_attn

        t = x.shape[1]
        q = self.q_proj(x).view(t, H, -1)
        k = self.k_proj(x).view(t, H // 2, -1)
        v = self.v_proj(x).view(t, H // 2, -1)
        o = varlen_attn(q, k, v, self.cu, self.cu, max(DOCS), max(DOCS),
                        window_size=self.window, enable_gqa=True)
        self.seen = (q.detach(), k.detach(), v.detach(), o)
        if o.requires_grad:
            o.register_hook(lambda g: setattr(self, "grad", g))
        return self.o_proj(o.reshape(1, t, -1))


def _varlen_truth(layer):
    """Per head: (max logit, tied rows, Σ c over rows, Σ |c|) in FP64, document by document."""
    q, k, v, o = layer.seen
    rep = H // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    mx, tied, c_sum, c_abs = torch.full((H,), -math.inf, dtype=torch.float64), \
        torch.zeros(H), torch.zeros(H, dtype=torch.float64), torch.zeros(H, dtype=torch.float64)
    a = 0
    for n in DOCS:
        qi = q[a:a + n].double().transpose(0, 1)
        ki = k[a:a + n].double().repeat_interleave(rep, 1).transpose(0, 1)
        vi = v[a:a + n].double().repeat_interleave(rep, 1).transpose(0, 1)
        s = (qi @ ki.transpose(-1, -2) * scale).masked_fill(
            ~band(n, n, layer.window), -math.inf)
        top = s.topk(min(2, n), -1).values
        mx = torch.maximum(mx, top[..., 0].amax(-1))
        if n > 1:
            tied += (top[..., 1] >= top[..., 0] - EPS).sum(-1)
        if getattr(layer, "grad", None) is not None:
            o64 = torch.softmax(s, -1) @ vi  # [H, n, D]
            g = layer.grad[a:a + n].double().transpose(0, 1)
            c = (g * (o[a:a + n].detach().double().transpose(0, 1) - o64)).sum(-1)
            c_sum += c.sum(-1)
            c_abs += c.abs().sum(-1)
        a += n
    return mx, tied, c_sum, c_abs


@pytest.mark.parametrize("window", [(-1, 0), (5, 0)], ids=["causal", "window5"])
def test_varlen_measured_per_document(cpu_varlen, window):
    """Packed documents through varlen_attn: each row against its own document's keys
    (causal, or a 5-key window), max logit and ties exact; a BF16 backward gives δ error
    on every row against FP64."""
    torch.manual_seed(0)
    model = nn.Sequential(VarlenAttention(window), VarlenAttention(window)).to(torch.bfloat16)
    for layer in model:
        with torch.no_grad():
            layer.q_proj.weight.mul_(4.0)
    x = torch.randn(1, sum(DOCS), D_MODEL).bfloat16()
    cfg = fw.WatchConfig(every_n_steps=1, rows_per_head="all")
    with fw.watch(model, config=cfg) as w:
        model(x).float().square().mean().backward()
        report = w.step()
    assert report.monitor_errors_total == 0
    for li, layer in enumerate(model):
        mx, tied, c_sum, c_abs = _varlen_truth(layer)
        recs = [r for r in report.heads if r.layer == str(li)]
        assert len(recs) == H
        for r in recs:
            assert r.attention_max_logit == pytest.approx(mx[r.head].item(), rel=1e-4)
            assert r.tied_rowmax_ratio * sum(DOCS) == pytest.approx(tied[r.head].item(),
                                                                    abs=1e-9)
            assert r.delta_error_sum == pytest.approx(c_sum[r.head].item(),
                                                      abs=1e-3 * c_abs[r.head].item())
            assert r.delta_error_rows == sum(DOCS)


def test_the_stand_ins_leave_torch_as_it_was():
    """After each stand-in, torch refuses a CPU flex backward again and has no varlen
    kernel on the CPU (the stand-ins' own exit checks say the same of what they set)."""
    from torch.nn.attention.varlen import varlen_attn

    q = torch.randn(1, H, N, D_MODEL // H, requires_grad=True)
    cu = torch.tensor([0, N], dtype=torch.int32)
    packed = torch.randn(N, H, D_MODEL // H).bfloat16()
    with attention_standins.differentiable_flex():
        flex_attention(q, q, q).sum().backward()
        assert q.grad is not None
    with attention_standins.cpu_varlen() as seen:
        varlen_attn(packed, packed, packed, cu, cu, N, N)
        assert len(seen) == 1
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        flex_attention(q, q, q)
    with pytest.raises(NotImplementedError):
        varlen_attn(packed, packed, packed, cu, cu, N, N)
