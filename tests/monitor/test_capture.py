"""flashwatch/monitor/capture.py: what a watched layer's calls record, on the models people
train: KV-cached generation inside a monitored step, layers without an attention call
flashwatch sees, counters that count only what ran, routed calls (masks, autocast dtypes,
the WatchConfig's β and eps) and activation checkpointing (each forward counted once)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from _helpers import SMALL, SmallAttention, batch, checkpointed, comparable, train
from torch import nn

import flashwatch as fw
from examples.gpt import GPT, GPTConfig
from flashwatch.kernels import dispatch as fw_dispatch
from flashwatch.kernels.common import Mode


class Attention(nn.Module):
    """nanoGPT-style, C = 32, 2 heads; `kind` picks how it attends."""

    def __init__(self, kind="sdpa"):
        super().__init__()
        self.c_attn = nn.Linear(32, 96)
        self.n_head = 2
        self.kind = kind
        if kind == "bias":  # a learned additive bias, as T5's relative positions
            self.bias = nn.Parameter(0.5 * torch.randn(1, 2, 8, 8))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, 2, -1).transpose(1, 2) for t in (q, k, v))
        if self.kind == "softmax":  # hand-written: no SDPA call
            p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
            return (p @ v).sum()
        if self.kind == "dropout":  # never routable while training (random O)
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True).sum()
        mask = None
        if self.kind == "mask":  # causal with the first 2 keys padded out, as a bool mask
            mask = torch.ones(T, T, dtype=torch.bool).tril()
            mask[:, :2] = False
        elif self.kind == "bias":
            mask = self.bias
        elif self.kind == "float_mask":  # the same as an additive float mask, per batch
            hidden = torch.ones(T, T, dtype=torch.bool).triu(1)
            hidden[:, :2] = True
            mask = torch.zeros(B, 1, T, T).masked_fill(hidden, -math.inf)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                              is_causal=mask is None).sum()


class Two(nn.Module):
    """Two attention layers named "0" and "1", each on the same input."""

    def __init__(self, a, b):
        super().__init__()
        self.layers = nn.ModuleDict({"0": a, "1": b})

    def forward(self, x):
        return sum(layer(x) for layer in self.layers.values())


def test_generation_inside_a_monitored_step_loses_no_numbers():
    """A padded batch through generate() on a grouped-query model (an eval callback, RL
    fine-tuning): its decode steps fold query heads into SDPA's length axis. Such calls
    are skipped; the training step's numbers survive (before: the whole report lost to
    an index_add_ size error)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, attn_implementation="sdpa", pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    w = fw.watch(model, every_n_steps=1)
    x = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    model(x, labels=x).loss.backward()
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    with torch.no_grad():
        model.generate(x, attention_mask=mask, max_new_tokens=3, do_sample=False)
    report = w.step()
    assert w.monitor_errors_total == 0
    assert len(report.heads) == 8
    assert all(math.isfinite(h.attention_max_logit) and h.delta_error_rows > 0
               for h in report.heads)
    w.remove()


def test_a_layer_without_a_visible_attention_call_is_said_once_and_counted(caplog):
    model = Two(Attention("softmax"), Attention("sdpa"))
    w = fw.watch(model, every_n_steps=1)
    x = torch.randn(2, 8, 32)
    with caplog.at_level(logging.ERROR, logger="flashwatch"):
        for _ in range(3):
            model(x)
            report = w.step()
    said = [r for r in caplog.records if "without an attention call" in r.getMessage()]
    assert len(said) == 1 and "layers.0 ran 1 forward(s)" in said[0].getMessage()
    assert w.monitor_errors_total == 1
    silent = [h for h in report.heads if h.layer == "layers.0"]
    assert all(math.isnan(h.attention_max_logit) for h in silent)
    assert all(math.isfinite(h.attention_max_logit) for h in report.heads if h.layer == "layers.1")
    w.remove()


def test_confirmed_holds_a_mode_once_it_ran_and_never_one_that_could_not():
    """report.confirmed (what counters count): a hand-set FP32_O on a layer whose SDPA
    call uses dropout cannot run and is never confirmed; on a routable layer it is
    confirmed exactly once, at the first report that saw it run."""
    model = Two(Attention("dropout"), Attention("sdpa"))
    w = fw.watch(model, every_n_steps=1)
    x = torch.randn(2, 8, 32)
    for layer in ("layers.0", "layers.1"):
        w.set_head_modes(layer, [Mode.FP32_O, Mode.STANDARD])
    confirmed = []
    for _ in range(3):
        model(x).backward()
        confirmed.append([(e.layer, e.head, e.to_mode) for e in w.step().confirmed])
    assert confirmed == [[("layers.1", 0, Mode.FP32_O)], [], []]
    w.remove()


def test_a_masked_sdpa_call_is_routed_with_its_mask():
    """A padding mask (bool or additive) no longer keeps a layer on the original kernel
    (issue 28 item 6): FP32_O runs, is confirmed, and the output is SDPA's to FP32 rounding
    (rows 0 and 1 see no key: O = 0 there, as SDPA)."""
    for kind in ("mask", "float_mask"):
        torch.manual_seed(0)
        model = Two(Attention(kind), Attention("sdpa"))
        x = torch.randn(2, 8, 32)
        expected = model(x).item()
        w = fw.watch(model, every_n_steps=1)
        w.set_head_modes("layers.0", [Mode.FP32_O, Mode.STANDARD])
        out = model(x)
        out.backward()
        report = w.step()
        assert report.unmitigable == {}, (kind, report.unmitigable)
        assert [(e.layer, e.head, e.to_mode) for e in report.confirmed] == [
            ("layers.0", 0, Mode.FP32_O)], kind
        assert abs(out.item() - expected) <= 1e-4 * max(1.0, abs(expected)), kind
        w.remove()


def test_a_learned_bias_passed_as_attn_mask_is_routed_and_gets_its_gradient():
    torch.manual_seed(0)
    model = Two(Attention("bias"), Attention("sdpa"))
    x = torch.randn(2, 8, 32)
    model(x).backward()
    want = model.layers["0"].bias.grad.clone()
    model.zero_grad()
    w = fw.watch(model, every_n_steps=1)
    w.set_head_modes("layers.0", [Mode.FP32_O, Mode.STANDARD])
    model(x).backward()
    report = w.step()
    assert report.unmitigable == {}
    got = model.layers["0"].bias.grad
    assert (got - want).abs().max() <= 1e-5 * want.abs().max() and want.abs().max() > 0
    w.remove()


def test_a_masked_call_the_triton_kernels_cannot_run_stays_on_sdpa_without_an_error():
    """On CUDA ("auto" → Triton) a mask that requires grad is not routable (the kernels
    give it no gradient; docs/limits.md): the layer is reported unmitigable with why
    (counted once, as any unmitigable layer), the output is SDPA's, and no routing
    failure is logged. backend="triton" shows it on CPU: the mask is refused before
    Triton is touched."""
    torch.manual_seed(0)
    model = Two(Attention("bias"), Attention("sdpa"))
    x = torch.randn(2, 8, 32)
    expected = model(x)
    w = fw.watch(model, every_n_steps=1, backend="triton")
    w.set_head_modes("layers.0", [Mode.FP32_O, Mode.STANDARD])
    out = model(x)
    report = w.step()
    assert torch.equal(out, expected)
    assert "gives attn_mask no gradient" in report.unmitigable["layers.0"]
    assert report.monitor_errors_total == 1  # the unmitigable layer's, no routing error
    w.remove()


def test_autocast_rotary_style_mixed_dtypes_are_routed_in_the_autocast_dtype():
    def rotaryish(q, k, v):  # like HF Llama under autocast: FP32 q, k (rotary), BF16 v
        return F.scaled_dot_product_attention(q.float(), k.float(), v, is_causal=True)

    torch.manual_seed(0)
    model = nn.Sequential(SmallAttention(rotaryish))
    w = fw.watch(model, every_n_steps=1)
    w.set_head_modes("0", [Mode.BETA, Mode.FP32_O])
    x = torch.randn(2, 8, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
        q, k, v = (t.view(2, 8, 2, -1).transpose(1, 2) for t in model[0].c_attn(x).split(32, 2))
    want = fw.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True,
                        head_modes=[Mode.BETA, Mode.FP32_O])
    out.float().sum().backward()
    r = w.step()
    assert w.monitor_errors_total == 0 and r.unmitigable == {}
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    assert all(math.isfinite(h.delta_error_sum) for h in r.heads)


def test_watchconfig_beta_and_eps_win_over_the_callers_inside_a_watched_layer(
        monkeypatch, caplog):
    def calls_with_beta(q, k, v, beta):  # a model that passes its own β and eps
        return fw.attention(q, k, v, causal=True, head_modes=[Mode.BETA] * 2, beta=beta,
                            eps=1e-2)

    seen = []
    real = fw_dispatch.call_kernel
    monkeypatch.setattr(fw_dispatch, "call_kernel", lambda *a, **kw: (
        seen.append((kw["beta"], kw["eps"])), real(*a, **kw))[1])
    model = nn.Sequential(SmallAttention(calls_with_beta))
    x = torch.randn(2, 8, 32)
    model[0](x, beta=8.0)
    assert seen == [(8.0, 1e-2)]  # unwatched: the caller's values
    w = fw.watch(model, every_n_steps=1, beta=3.0, eps=2e-3)
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        for _ in range(2):
            model[0](x, beta=8.0)
    assert seen[1:] == [(3.0, 2e-3)] * 2
    warnings = [r.message for r in caplog.records if "beta=8.0" in r.message]
    assert len(warnings) == 1 and "beta=3.0" in warnings[0]
    w.remove()
    model[0](x, beta=8.0)
    assert seen[-1] == (8.0, 1e-2)


def _counts(w):
    """Rows counted so far in the step being accumulated, per layer: exact (routed
    kernel), probed and with a gradient. Reports show only ratios of these, in which a
    doubled count would hide, so they are read where they accumulate."""
    return [(int(st.buf.stats.rows[0]), st.buf.probe_rows, st.buf.grad_rows)  # head 0
            for st in w.layer_states]


@pytest.mark.parametrize("rows", [8, 4 * 32])
@pytest.mark.parametrize("route_all", [False, True])
@pytest.mark.parametrize("how", ["non_reentrant", "reentrant", "wrapper", "selective"])
def test_activation_checkpointing_counts_each_forward_once(how, route_all, rows):
    """The checkpointed run reports exactly what the plain run reports, step after step:
    a recompute that sampled again would move the sampling generator (other rows on the
    next steps), a reentrant recompute's δ would come from another sample, and every
    count would double. 4·32 rows: every row sampled."""
    cfg = dict(every_n_steps=1, rows_per_head=rows, route_all=route_all)
    runs, counts = [], []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**SMALL))
        if ckpt:
            model = checkpointed(model, how)
        w = fw.watch(model, **cfg)
        reports, _ = train(model, w, 3)
        x, y = batch(torch.Generator().manual_seed(9))
        _, loss = model(x, y)
        loss.backward()
        counts.append(_counts(w))
        assert w.monitor_errors_total == 0
        runs.append([comparable(r) for r in reports])
    assert counts[0] == counts[1]
    assert counts[0][0] == (4 * 32 if route_all else 0, rows, rows)
    plain, ckpt = runs
    assert len(plain) == len(ckpt) == 3
    for a, b in zip(plain, ckpt, strict=True):
        for ha, hb in zip(a["heads"], b["heads"], strict=True):
            assert ha["layer"] == hb["layer"]  # canonical names through the wrapper
            for key, va in ha.items():
                if isinstance(va, float):
                    assert va == pytest.approx(hb[key], rel=1e-6, abs=1e-12, nan_ok=True), key
                else:
                    assert va == hb[key], key
            assert math.isfinite(ha["delta_error_sum"])


@pytest.mark.parametrize("how", ["non_reentrant", "reentrant", "wrapper", "selective"])
def test_modes_under_activation_checkpointing_run_and_their_events_stand(how):
    torch.manual_seed(0)
    model = checkpointed(GPT(GPTConfig(**SMALL)), how)
    w = fw.watch(model, every_n_steps=1)
    layer = w.sites[0].name
    w.set_head_modes(layer, [Mode.BETA] * SMALL["n_head"])
    reports, _ = train(model, w, 2)
    assert [r.unmitigable for r in reports] == [{}, {}] and w.monitor_errors_total == 0
    assert len(w.events) == SMALL["n_head"] and all(e.applied for e in w.events)
    assert [h.head_mode for h in reports[-1].heads if h.layer == layer] == [Mode.BETA] * 4
    assert all(st.module_calls == 0 for st in w.layer_states)  # reset by each report


def test_hugging_face_gradient_checkpointing_counts_each_forward_once():
    transformers = pytest.importorskip("transformers")

    def run(ckpt):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
        if ckpt:
            model.gradient_checkpointing_enable()
        model.train()
        w = fw.watch(model, every_n_steps=1, rows_per_head=8, route_all=True)
        g = torch.Generator().manual_seed(0)
        reports = []
        for _ in range(3):
            ids = torch.randint(0, 64, (2, 16), generator=g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            counts = _counts(w)
            reports.append(comparable(w.step())["heads"])
        assert w.monitor_errors_total == 0
        return reports, counts

    (plain, n_plain), (ckpt, n_ckpt) = run(False), run(True)
    assert n_plain == n_ckpt == [(2 * 16, 8, 8)] * 2
    for a, b in zip(plain, ckpt, strict=True):
        for ha, hb in zip(a, b, strict=True):
            for key in ("tied_rowmax_ratio", "attention_max_logit", "delta_error_sum"):
                assert ha[key] == pytest.approx(hb[key], rel=1e-6, abs=1e-12), key
            assert math.isfinite(ha["delta_error_sum"])
