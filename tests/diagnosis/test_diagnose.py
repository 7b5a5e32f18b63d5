"""flashwatch/diagnosis/diagnose.py and diagnose_measure.py: the exact per-head measurement against
an FP64 oracle and against the research scripts, the planted head ranked first, the
model given back as it was, bad inputs named. Ranking, loading, the report and the CLI
have their own files (test_diagnose_rank, _load, _report, _cli)."""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.nn.functional as F
from _helpers import id_batches, tiny_gpt, tiny_llama
from torch.overrides import TorchFunctionMode

from examples.gpt import GPT, GPTConfig
from flashwatch import diagnose
from flashwatch.diagnosis.measure import wq_rows
from flashwatch.sites import find_sites


class RoundedFlash(torch.autograd.Function):
    """FP64 attention whose output is rounded to BF16 (the kernel's O) and whose
    backward is FlashAttention's, δ = rowsum(dO ∘ O), in FP64, except in call number
    `exact_at` of the forward, whose δ comes from the unrounded O: two backwards then
    differ by that layer's Eq. 3 error alone (a switch in every layer at once would add
    the upper layers' errors carried down through dX)."""

    exact_at = -1
    calls = 0  # calls in this forward so far
    c_sums: list = []  # Σ_T dO·(O − O_64) per head, per call, in backward order

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        ctx.index = RoundedFlash.calls
        RoundedFlash.calls += 1
        s = q @ k.mT * scale
        if causal:
            T, S = s.shape[-2:]
            s = s.masked_fill(torch.ones(T, S, dtype=torch.bool).tril().logical_not(),
                              -math.inf)
        p = torch.softmax(s, -1)
        o64 = p @ v
        o = o64.to(torch.bfloat16).double()
        ctx.save_for_backward(q, k, v, p, o, o64)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, p, o, o64 = ctx.saved_tensors
        exact = ctx.index == RoundedFlash.exact_at
        if RoundedFlash.exact_at < 0:
            RoundedFlash.c_sums.append((do * (o - o64)).sum(-1).sum((0, 2)))
        delta = (do * (o64 if exact else o)).sum(-1, keepdim=True)
        ds = p * (do @ v.mT - delta)
        return ds @ k * ctx.scale, ds.mT @ q * ctx.scale, p.mT @ do, None, None


class Route(TorchFunctionMode):
    """SDPA calls (no mask; grouped-query K/V expanded) run RoundedFlash."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            assert kwargs.get("attn_mask") is None and len(args) == 3
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            scale = kwargs.get("scale") or 1 / math.sqrt(q.shape[-1])
            return RoundedFlash.apply(q, k, v, bool(kwargs.get("is_causal")), scale)
        return func(*args, **kwargs)


def oracle(model, batches, loss_fn):
    """Per head: delta_share, coherence, sign_z from two FP64 backwards per batch."""
    sites = find_sites(model)
    ws = [s.q_module.weight for s in sites]
    E, G, S = [], [], []
    for batch in batches:
        RoundedFlash.c_sums, RoundedFlash.calls = [], 0
        with Route():
            loss = loss_fn(model, batch)
        used = torch.autograd.grad(loss, ws, retain_graph=True)
        g_used = torch.cat([wq_rows(s, g) for s, g in zip(sites, used, strict=True)])
        g_exact = g_used.clone()
        for i, site in enumerate(sites):  # one forward call per layer, in layer order
            RoundedFlash.exact_at = i
            g = torch.autograd.grad(loss, site.q_module.weight, retain_graph=True)[0]
            rows = slice(i * site.num_heads, (i + 1) * site.num_heads)
            g_exact[rows] = wq_rows(site, g)
        RoundedFlash.exact_at = -1
        E.append(g_exact - g_used)
        G.append(g_exact)
        S.append(torch.cat(RoundedFlash.c_sums[::-1]))  # backward order -> layer order
    E, G, S = torch.stack(E), torch.stack(G), torch.stack(S)  # [batches, heads, ...]
    e, g = E.flatten(2).norm(dim=2), G.flatten(2).norm(dim=2)
    return dict(delta_share=e.mean(0) / g.mean(0),
                delta_coherence=E.sum(0).flatten(1).norm(dim=1) / e.sum(0),
                sign_z=S.sum(0) / S.square().sum(0).sqrt())


def by_position(result):
    """Head records in model order (layer by layer, head by head)."""
    return sorted(result["heads"], key=lambda h: (h["layer_index"], h["head"]))


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_eq3_equals_two_fp64_backwards(kind):
    # GPT: q is X·W^Qᵀ, Eq. 3 from X in FP64; Llama (RoPE, grouped-query): the dq error
    # goes back through q's graph by autograd. Both against the oracle's two backwards.
    model = (tiny_gpt() if kind == "gpt" else tiny_llama()).double()
    batches = id_batches(16 if kind == "gpt" else 64)
    with Route():
        got = diagnose(model, batches, dtype=None, progress=False)
    want = oracle(model, batches, diagnose_default_loss())
    heads = by_position(got)
    assert {h["grad_path"] for h in heads} == {"exact" if kind == "gpt" else "autograd"}
    for key, ref in want.items():
        mine = torch.tensor([h[key] for h in heads], dtype=torch.float64)
        assert torch.allclose(mine, ref, rtol=1e-8, atol=1e-12), (key, (mine / ref - 1).abs().max())
    assert all(0 < h["delta_share"] < 0.05 for h in heads)  # BF16 O rounding: small


def diagnose_default_loss():
    from flashwatch.diagnosis.diagnose import default_loss
    return default_loss


def test_ties_and_max_logit_count_every_row():
    # Plant exact ties: 4 symbols and no position embedding, so equal tokens at layer 0
    # give equal keys. Count them by brute force on q, k captured from the model.
    model = tiny_gpt(vocab_size=4)
    batches = id_batches(4, n=2)
    got = {h["head"]: h for h in diagnose(model, batches, dtype=None, progress=False)["heads"]
           if h["layer"] == "transformer.h.0.attn"}
    attn = model.transformer.h[0]
    tied, rows, mx = torch.zeros(4), 0, torch.full((4,), -math.inf)
    for b in batches:
        with torch.no_grad():
            x = attn.ln_1(model.transformer.wte(b[:, :-1])).double()
            w, bias = attn.attn.c_attn.weight.double(), attn.attn.c_attn.bias.double()
        q, k, _ = (x @ w.T + bias).split(32, -1)
        q, k = (t.unflatten(-1, (4, 8)).transpose(1, 2) for t in (q, k))
        s = (q @ k.mT / math.sqrt(8)).masked_fill(
            ~torch.ones(24, 24, dtype=torch.bool).tril(), -math.inf)
        near = (s >= s.amax(-1, keepdim=True) - 1e-3).sum(-1)  # [B, H, T]
        tied += (near >= 2).sum((0, 2))
        rows += b.shape[0] * 24
        mx = torch.maximum(mx, s.amax((0, 2, 3)).float())
    for h in range(4):
        assert got[h]["tied_ratio"] == pytest.approx(float(tied[h]) / rows, abs=1e-12)
        assert got[h]["rows"] == rows
        assert got[h]["max_logit"] == pytest.approx(float(mx[h]), rel=1e-5)
    assert min(float(tied[h]) for h in range(4)) > 0  # the plant worked


def test_planted_head_ranks_first():
    # Layer 0 head 2: W^Q = 5000·W^K, so q·k ∝ k_t·k_j peaks, in the hundreds, at the
    # keys of the query's own token; a NoPE model over 4 symbols repeats tokens, whose
    # keys are identical: tied maxima. Real SDPA, BF16 autocast.
    model = tiny_gpt(seed=3, vocab_size=4)
    with torch.no_grad():
        w = model.transformer.h[0].attn.c_attn.weight
        w[16:24] = 5000.0 * w[32 + 16:32 + 24]
    res = diagnose(model, id_batches(4, n=3, B=2, T=32), progress=False)
    top = res["heads"][0]
    assert (top["layer"], top["head"]) == ("transformer.h.0.attn", 2)
    assert top["verdict"] != "ok" and top["rank"] == 1
    assert top["wq_ratio"] > 20 and top["tied_ratio"] > 0.1 and top["max_logit"] > 100
    assert top["qk_clip_eta"] == pytest.approx(100.0 / top["max_logit"])
    # logits over τ: whatever the verdict, QK-clip with this head's own η is recommended
    assert f"η = {top['qk_clip_eta']:.3g}" in top["recommendation"], top["recommendation"]
    others = res["heads"][1:]
    assert all(h["max_logit"] < 10 for h in others)


def test_research_scripts_give_the_same_numbers_on_the_same_rows(tmp_path):
    # A paper-arithmetic run regenerated in seconds (tests/test_reproduction.py's TINY),
    # measured by reproduction.grad_error/checkpoints and by diagnose on the same batches,
    # with the δ error taken against the paper kernel's own FP32 O as the scripts do.
    from flashwatch.kernels import paper
    from flashwatch.kernels.common import Mode
    from reproduction import run as R
    from reproduction.checkpoints import measure_run
    from reproduction.fp32_delta import RouteSDPA

    tiny = dict(n_layer=1, n_head=2, n_embd=32, block=32, batch=2, steps=40, every=2,
                warmup=2)
    run = tmp_path / "run"
    summ = R.run("nope-grammar-hotter", "unmitigated", 0, run, tiny, stream=io.StringIO())
    s, n = summ["settings"], 6
    research = measure_run(run, n)

    def fp32_o(q, k, v, *, attn_mask, is_causal, scale):
        modes = torch.full((q.shape[1],), int(Mode.FP32_O), dtype=torch.int32)
        return paper.forward(q, k, v, causal=is_causal, scale=scale, modes=modes, beta=2.0,
                             eps=1e-3).o32

    model = GPT(GPTConfig(block_size=32, vocab_size=s["vocab"], n_layer=1, n_head=2,
                          n_embd=32, position_embedding=False))
    model.load_state_dict(torch.load(run / "model.pt"))
    gen = torch.Generator().manual_seed(summ["seed"] + 12345)  # grad_error's batches
    data = R.make_data(s, summ["seed"])
    batches = [R.get_batch(data, s, gen) for _ in range(n)]
    with RouteSDPA():
        got = diagnose(model, batches, scores_dtype=torch.bfloat16, reference=fp32_o,
                       progress=False)
    mine = {h["head"]: h for h in got["heads"]}
    for r in research:
        h = mine[r["head"]]
        assert h["tied_ratio"] == r["tied"]  # BF16 scores, eps 1e-3: the same count
        assert h["wq_sigma"] == pytest.approx(r["wq_sigma"], rel=1e-12)
        assert h["sign_z"] == pytest.approx(r["sign_z"], rel=1e-9, abs=1e-12)
        assert h["delta_share"] > 0


def test_model_is_given_back_as_it_was():
    model = tiny_gpt()
    model.train()
    model.lm_head.weight.grad = torch.ones_like(model.lm_head.weight)
    model.transformer.ln_f.weight.requires_grad_(False)
    before = {n: p.clone() for n, p in model.named_parameters()}
    diagnose(model, id_batches(16, n=1), progress=False)
    assert model.training
    assert torch.equal(model.lm_head.weight.grad, torch.ones_like(model.lm_head.weight))
    assert not model.transformer.ln_f.weight.requires_grad
    assert model.transformer.h[0].attn.c_attn.weight.grad is None
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_bad_inputs_are_named():
    model = tiny_gpt()
    with pytest.raises(ValueError, match="batches is empty"):
        diagnose(model, [], progress=False)
    with pytest.raises(ValueError, match="tau"):
        diagnose(model, id_batches(16, n=1), tau=-1.0, progress=False)
    with pytest.raises(ValueError, match=r"tau must be .*finite.*got inf; a max logit"):
        diagnose(model, id_batches(16, n=1), tau=float("inf"), progress=False)
    with pytest.raises(TypeError, match=r"tau must be .* got '100' \(str\)"):
        diagnose(model, id_batches(16, n=1), tau="100", progress=False)
    with pytest.raises(ValueError, match=r"eps must be a number \(≥ 0\), got nan"):
        diagnose(model, id_batches(16, n=1), eps=float("nan"), progress=False)
    with pytest.raises(ValueError, match="token ids"):
        diagnose(model, [torch.randn(2, 5)], progress=False)
    with pytest.raises(TypeError, match="loss_fn"):
        diagnose(model, id_batches(16, n=1), loss_fn=lambda m, b: 1.0, progress=False)


def test_eager_attention_is_refused_with_the_fix():
    model = tiny_llama()
    model.config._attn_implementation = "eager"
    with pytest.raises((RuntimeError, ValueError), match="attn_implementation=.sdpa."):
        diagnose(model, id_batches(64, n=1), progress=False)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_in_a_log_file_has_whole_lines_and_whole_batches(monkeypatch):
    from flashwatch.diagnosis import diagnose as module

    model = tiny_gpt(seed=0)
    log = io.StringIO()  # not a TTY, as a log file
    monkeypatch.setattr(module.sys, "stderr", log)
    monkeypatch.setattr(module.Progress, "interval", 0.0)  # a line after every batch
    diagnose(model, id_batches(16, n=3), name="m")
    text = log.getvalue()
    assert "\r" not in text, repr(text)
    lines = text.splitlines()
    # one per batch (interval 0); the closing line would repeat the last one: left out
    assert [ln.split(": ")[1].split(" batches")[0] for ln in lines] == \
        ["1/3", "2/3", "3/3"], lines

    log.seek(0)
    log.truncate()
    monkeypatch.setattr(module.Progress, "interval", 3600.0)
    diagnose(model, id_batches(16, n=3), name="m")
    assert log.getvalue().count("\n") == 1 and "3/3 batches done" in log.getvalue()

    log.seek(0)
    log.truncate()  # a long batch: whole lines within it too (issue 38: 1B models on CPU)
    monkeypatch.setattr(module.Progress, "layer_interval", 0.0)
    diagnose(model, id_batches(16, n=1), name="m")
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and lines == [
        "diagnose m: 0/1 batches done, " + ln.split(", ")[1] + f", layer {i + 1}/2 of batch 1"
        for i, ln in enumerate(lines[:2])] + lines[2:] and len(lines) == 3, lines


def test_progress_on_a_terminal_rewrites_one_line(monkeypatch):
    from flashwatch.diagnosis import diagnose as module

    model = tiny_gpt(seed=0)
    term = _Terminal()
    monkeypatch.setattr(module.sys, "stderr", term)
    diagnose(model, id_batches(16, n=2), name="m")
    text = term.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    updates = text.split("\r")[1:]
    n_layers = len(model.transformer.h)
    assert len(updates) == 2 * n_layers + 1, updates  # each layer of each batch, the end
    assert "0/2 batches done" in updates[0] and f"layer 1/{n_layers} of batch 1" in updates[0]
    assert "2/2 batches done" in updates[-1] and "layer" not in updates[-1]
    assert not any(c in "".join(updates) for c in (".25", ".50", ".75")), updates


def test_wq_ratio_divides_by_the_true_median_of_an_even_head_count():
    """4 heads: the median is the mean of the two middle W^Q σ (torch.median would take
    the lower one). Head σ set to 1, 2, 4, 8 × layer 0's: median 3, not 2."""
    model = tiny_gpt(seed=5)
    with torch.no_grad():
        w = model.transformer.h[0].attn.c_attn.weight
        for h, f in enumerate((1.0, 2.0, 4.0, 8.0)):
            w[8 * h:8 * (h + 1)] *= f
    res = diagnose(model, id_batches(16, n=1, B=2, T=16), progress=False)
    heads = [h for h in res["heads"] if h["layer"] == "transformer.h.0.attn"]
    sigma = torch.linalg.matrix_norm(
        model.transformer.h[0].attn.c_attn.weight[:32].double().view(4, 8, 32), ord=2)
    median = float(sigma.sort().values[1:3].mean())
    for h in heads:
        assert h["wq_ratio"] == pytest.approx(float(sigma[h["head"]]) / median, rel=1e-6)
