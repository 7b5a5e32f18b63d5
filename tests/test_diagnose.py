"""flashwatch/diagnose*.py and `flashwatch diagnose`: the exact per-head measurement
against an FP64 oracle and against the research scripts, the ranking, the three
checkpoint kinds end to end through the CLI."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from examples.gpt import GPT, GPTConfig
from flashwatch import diagnose
from flashwatch.cli import main
from flashwatch.diagnose_load import load_tokens, make_batches
from flashwatch.diagnose_measure import wq_rows
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


def tiny_gpt(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(block_size=32, vocab_size=16, n_layer=2, n_head=4, n_embd=32,
               position_embedding=False) | kw
    return GPT(GPTConfig(**cfg))


def tiny_llama(seed=0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg)


def id_batches(vocab, n=4, B=2, T=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (B, T + 1), generator=g) for _ in range(n)]


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
    from flashwatch.diagnose import default_loss
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
    assert "set_head_modes" in top["recommendation"] or "qk_clip" in top["recommendation"]
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
    with pytest.raises(ValueError, match="token ids"):
        diagnose(model, [torch.randn(2, 5)], progress=False)
    with pytest.raises(TypeError, match="loss_fn"):
        diagnose(model, id_batches(16, n=1), loss_fn=lambda m, b: 1.0, progress=False)


def test_eager_attention_is_refused_with_the_fix():
    model = tiny_llama()
    model.config._attn_implementation = "eager"
    with pytest.raises((RuntimeError, ValueError), match="attn_implementation=.sdpa."):
        diagnose(model, id_batches(64, n=1), progress=False)


def test_data_formats_give_the_same_tokens(tmp_path):
    ids = np.arange(300, dtype=np.uint16) % 50
    ids.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", ids.astype(np.int64))
    torch.save(torch.from_numpy(ids.astype(np.int64)), tmp_path / "t.pt")
    want = torch.from_numpy(ids.astype(np.int64))
    for name in ("t.bin", "t.npy", "t.pt"):
        got = load_tokens(tmp_path / name)
        if not isinstance(got, torch.Tensor):  # .bin, .npy: memory-mapped arrays
            got = torch.from_numpy(np.array(got, dtype=np.int64))
        assert torch.equal(got, want)
        assert torch.equal(make_batches(got, 2, 3, 16, seed=5)[1],
                           make_batches(want, 2, 3, 16, seed=5)[1])
    (tmp_path / "t.txt").write_text("héllo")
    model = tiny_gpt(vocab_size=256)
    assert load_tokens(tmp_path / "t.txt", None, model).tolist() == list("héllo".encode())
    batches = make_batches(want, 3, 2, 16, seed=0)
    assert [tuple(b.shape) for b in batches] == [(2, 17)] * 3
    for b in batches:  # windows of the stream: consecutive ids (mod 50)
        assert torch.equal((b[:, 1:] - b[:, :-1]) % 50, torch.ones(2, 16, dtype=torch.long))
    assert all(torch.equal(a, b) for a, b in zip(batches, make_batches(want, 3, 2, 16, 0),
                                                 strict=True))


def _nanogpt_ckpt(path, model, args):
    torch.save({"model_args": args, "iter_num": 7,
                "model": {"_orig_mod." + k: v for k, v in model.state_dict().items()}}, path)


def test_cli_nanogpt_checkpoints_growth(tmp_path, capsys):
    args = dict(n_layer=2, n_head=4, n_embd=32, block_size=32, bias=True, vocab_size=64,
                dropout=0.0)
    model = GPT(GPTConfig(**args))
    _nanogpt_ckpt(tmp_path / "a.pt", model, args)
    with torch.no_grad():  # layer 1, head 3: W^Q × 3 in the later checkpoint
        model.transformer.h[1].attn.c_attn.weight[24:32] *= 3.0
    _nanogpt_ckpt(tmp_path / "b.pt", model, args)
    np.random.default_rng(0).integers(0, 64, 4000).astype(np.uint16).tofile(tmp_path / "d.bin")
    out = tmp_path / "out"
    code = main(["diagnose", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--data",
                 str(tmp_path / "d.bin"), "--batches", "2", "--out", str(out)])
    assert code == 0
    for name in ("report.md", "diagnose.json", "heads.png", "growth.png"):
        assert (out / name).stat().st_size > 200
    js = json.loads((out / "diagnose.json").read_text())
    assert [c["name"] for c in js["checkpoints"]] == ["a.pt", "b.pt"]
    g = {(r["layer"], r["head"]): r for r in js["growth"]}
    assert g[("transformer.h.1.attn", 3)]["wq_sigma"] == pytest.approx(3.0, rel=1e-6)  # FP32 × 3
    assert g[("transformer.h.1.attn", 2)]["wq_sigma"] == pytest.approx(1.0, rel=1e-12)
    assert all(h["rows"] == 2 * 32 for h in js["checkpoints"][1]["heads"])  # every row
    md = (out / "report.md").read_text()
    assert "grew 3.00× the median head" in md
    assert "| a.pt | " in md and "| b.pt | " in md  # the per-checkpoint table
    cap = capsys.readouterr()
    printed = cap.out.splitlines()
    assert printed[0].startswith("a.pt: ") and printed[1].startswith("b.pt: ")
    assert "diagnose b.pt: batch 1.50/2" in cap.err  # progress: one layer of two measured


def test_cli_hugging_face_directory(tmp_path, capsys):
    model = tiny_llama()
    model.save_pretrained(tmp_path / "llama")
    torch.save(torch.randint(64, (3, 20)), tmp_path / "rows.pt")
    out = tmp_path / "out"
    code = main(["diagnose", str(tmp_path / "llama"), "--data", str(tmp_path / "rows.pt"),
                 "--batches", "3", "--out", str(out)])
    assert code == 0
    js = json.loads((out / "diagnose.json").read_text())
    (res,) = js["checkpoints"]
    assert len(res["heads"]) == 8 and res["batches"] == 3 and res["dtype"] == "bfloat16"
    assert {h["grad_path"] for h in res["heads"]} == {"autograd"}  # RoPE
    assert all(h["rows"] == 3 * 19 for h in res["heads"])
    md = (out / "report.md").read_text()
    assert "| rank | layer/head | verdict |" in md and "model.layers.1.self_attn" in md


def test_cli_module_function_and_errors(tmp_path, capsys, monkeypatch):
    (tmp_path / "mymodels.py").write_text(
        "from examples.gpt import GPT, GPTConfig\n"
        "def build():\n    return GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, "
        "block_size=16))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "d.txt").write_text("the quick brown fox jumps over the lazy dog " * 4)
    out = tmp_path / "out"
    assert main(["diagnose", "mymodels:build", "--data", str(tmp_path / "d.txt"),
                 "--batches", "2", "--out", str(out)]) == 0
    assert len(json.loads((out / "diagnose.json").read_text())["checkpoints"][0]["heads"]) == 2
    assert main(["diagnose", str(tmp_path / "nothing-here"), "--data",
                 str(tmp_path / "d.txt")]) == 2
    assert "neither a directory, a file nor module:function" in capsys.readouterr().err
    torch.save({"weights": 1}, tmp_path / "other.pt")
    assert main(["diagnose", str(tmp_path / "other.pt"), "--data",
                 str(tmp_path / "d.txt")]) == 2
    assert "not a nanoGPT checkpoint" in capsys.readouterr().err


def test_report_without_matplotlib_keeps_the_numbers(tmp_path, monkeypatch):
    from flashwatch.diagnose_report import write_report

    res = diagnose(tiny_gpt(), id_batches(16, n=1), progress=False)
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # import fails
    written = write_report([res], tmp_path)
    assert [p.name for p in written] == ["report.md", "diagnose.json"]
    assert "pip install 'flashwatch[report]'" in (tmp_path / "report.md").read_text()
    assert len(json.loads((tmp_path / "diagnose.json").read_text())["checkpoints"][0]
               ["heads"]) == 8


def test_heatmap_rows_are_layers_in_model_order():
    from flashwatch.diagnose_report import _grid

    heads = [dict(layer="b", layer_index=1, head=0, tied_ratio=0.5),  # ranked first
             dict(layer="a", layer_index=0, head=1, tied_ratio=0.25),
             dict(layer="a", layer_index=0, head=0, tied_ratio=0.0),
             dict(layer="b", layer_index=1, head=1, tied_ratio=1.0)]
    layers, grid = _grid(heads, "tied_ratio")
    assert layers == ["a", "b"] and grid == [[0.0, 0.25], [0.5, 1.0]]


def _record(head, **kw):
    base = dict(layer="h.0", head=head, num_heads=4, tied_ratio=0.0, sign_z=0.0,
                wq_sigma=1.0, wq_ratio=1.0, delta_share=0.01, max_logit=5.0, qk_clip_eta=1.0)
    return base | kw


def test_verdicts_and_their_order():
    from flashwatch.diagnose_rank import rank

    heads = [_record(0),  # ok
             _record(1, max_logit=400.0, qk_clip_eta=0.25),  # logit growth
             _record(2, delta_share=0.3),  # δ error without a persistent sign
             _record(3, tied_ratio=0.2, sign_z=-4.5, wq_ratio=2.5, delta_share=0.05)]
    out = rank(heads, batches=25, tau=100.0)
    assert [(h["head"], h["verdict"]) for h in out] == [
        (3, "paper-failure"), (2, "delta-error"), (1, "logit-growth"), (0, "ok")]
    assert [h["rank"] for h in out] == [1, 2, 3, 4]
    modes = out[0]["recommendation"].split("[")[1].split("]")[0]
    assert [int(m) for m in modes.split(",")] == [0, 0, 0, 2]  # head 3 → Mode.FP32_O
    assert "qk_clip_threshold=100" in out[2]["recommendation"] and "0.25" in out[2][
        "recommendation"]
    assert out[3]["recommendation"] == "nothing"
    # Without the sign (|z| < 3) the same head is only a δ-error or growth case; with
    # 4 batches the evidence says why the sign cannot show.
    (h,) = rank([_record(3, tied_ratio=0.2, sign_z=-1.9, wq_ratio=2.5)], 4, 100.0)
    assert h["verdict"] == "logit-growth" and "≥ 9 batches to show it" in h["evidence"]


def test_growth_across_checkpoints_counts_as_a_large_wq():
    from flashwatch.diagnose_rank import growth, rank

    old = dict(heads=[_record(h) for h in range(4)])
    new = dict(heads=[_record(h, wq_sigma=6.0 if h == 1 else 1.5, tied_ratio=0.1,
                              sign_z=3.5) for h in range(4)])
    g = growth([old, new])
    assert g[("h.0", 1)]["wq_sigma"] == 6.0 and g[("h.0", 0)]["wq_sigma"] == 1.5
    assert g[("h.0", 1)]["series"]["wq_sigma"] == [1.0, 6.0]
    out = rank(new["heads"], 16, 100.0, g)  # wq_ratio 1 everywhere: growth decides
    assert out[0]["head"] == 1 and out[0]["verdict"] == "paper-failure"
    assert out[0]["wq_growth_vs_layer"] == pytest.approx(4.0)  # 6 / median 1.5
    assert all(h["verdict"] == "ok" for h in out[1:])
