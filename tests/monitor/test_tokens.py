"""flashwatch/monitor/tokens.py and the probe's exact statistics: every row by default,
padding query rows left out (set_valid_tokens, a Hugging Face model's attention_mask),
against FP64 truths from the q and k the model handed SDPA (tests/sdpa_calls.py)."""

from __future__ import annotations

import pytest
import torch
from _helpers import batch
from sdpa_calls import SdpaCalls, check_heads, head_truth

import flashwatch as fw
from flashwatch.monitor import probe
from flashwatch.nanogpt import GPT, GPTConfig


def _gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=4, n_embd=32))


def _planted(model):
    """Heads with tied rows: W^K rows of head 0 zeroed, so every score of a row is 0."""
    with torch.no_grad():
        for blk in model.transformer.h:
            blk.attn.c_attn.weight[32:40] = 0.0
    return model


@pytest.mark.parametrize("rows_per_head", [64, 8])
def test_max_logit_and_ties_are_exact_over_every_row_by_default(rows_per_head):
    """B·T = 128 rows, 64 (or 8) sampled: max logit and ties still cover all 128 rows,
    equal to the FP64 truth: not a sampled lower bound."""
    model = _planted(_gpt())
    x, y = batch(torch.Generator().manual_seed(1))
    w = fw.watch(model, rows_per_head=rows_per_head)
    with SdpaCalls() as seen, torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(x, y)
    loss.backward()
    report = w.step()
    w.remove()
    assert w.monitor_errors_total == 0
    layers = [f"transformer.h.{i}.attn" for i in range(2)]
    check_heads(report, seen.calls, layers)
    by = {(h.layer, h.head): h for h in report.heads}
    assert by[(layers[0], 0)].tied_rowmax_ratio > 0.9  # the planted head
    # the sample is the δ probe's only: fewer rows than the batch
    assert all(h.delta_error_rows < 128 for h in report.heads)


def test_set_valid_tokens_leaves_padding_rows_out():
    """Right padding of 13 and 27 tokens in two of four sequences (token 7), scores of
    a few units (W^Q, W^K scaled up), so counting the padded rows would show."""
    model = _planted(_gpt(2))
    x, y = batch(torch.Generator().manual_seed(3))
    real = torch.ones(4, 32, dtype=torch.bool)
    real[1, 19:] = False
    real[3, 5:] = False
    x = x.masked_fill(~real, 7)
    with torch.no_grad():
        for blk in model.transformer.h:
            blk.attn.c_attn.weight[:64] *= 12
    w = fw.watch(model, every_n_steps=1)
    w.set_valid_tokens(real.long())
    with SdpaCalls() as seen, torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(x, y)
    loss.backward()
    report = w.step()
    layers = [f"transformer.h.{i}.attn" for i in range(2)]
    check_heads(report, seen.calls, layers, real)
    # the padded rows change some head's truth: the check above could fail
    assert any(not torch.equal(a, b) for c in seen.calls
               for a, b in zip(head_truth(c)[:2], head_truth(c, real)[:2], strict=True))
    w.set_valid_tokens(None)  # cleared: every row counts again
    with SdpaCalls() as seen, torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(x, y)
    loss.backward()
    report = w.step()
    w.remove()
    check_heads(report, seen.calls, layers)
    assert w.monitor_errors_total == 0


def test_set_valid_tokens_names_a_bad_mask():
    w = fw.watch(_gpt())
    with pytest.raises(TypeError, match="mask must be a"):
        w.set_valid_tokens([[1, 0]])
    with pytest.raises(ValueError, match=r"got shape \(4,\)"):
        w.set_valid_tokens(torch.ones(4))
    w.remove()


def test_a_mask_that_does_not_fit_the_call_counts_every_row_and_says_so(caplog):
    model = _gpt()
    x, y = batch(torch.Generator().manual_seed(1))
    w = fw.watch(model)
    w.set_valid_tokens(torch.ones(4, 31))
    with SdpaCalls() as seen, torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(x, y)
    loss.backward()
    report = w.step()
    w.remove()
    check_heads(report, seen.calls, [f"transformer.h.{i}.attn" for i in range(2)])
    assert "not the valid-token mask's (4, 31)" in caplog.text


def test_a_hugging_face_models_attention_mask_reaches_the_probe():
    """BERT in BF16 autocast with padded sentences: no call by the user, the mask the
    model's forward receives leaves the padding rows out (keys are hidden by the model's
    own SDPA mask, filled with finfo.min, not -inf)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, vocab_size=100,
                                  attention_probs_dropout_prob=0.0,
                                  attn_implementation="sdpa")
    model = transformers.BertModel(cfg)
    with torch.no_grad():  # ties: head 0's keys all equal
        for layer in model.encoder.layer:
            layer.attention.self.key.weight[:16] = 0.0
            layer.attention.self.key.bias[:16] = 0.0
    ids = torch.randint(0, 100, (3, 10), generator=torch.Generator().manual_seed(1))
    am = torch.ones(3, 10, dtype=torch.long)
    am[0, 6:] = 0
    am[1, 3:] = 0
    w = fw.watch(model)
    with SdpaCalls() as seen, torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids, attention_mask=am).last_hidden_state
    out.float().square().mean().backward()
    report = w.step()
    w.remove()
    assert w.monitor_errors_total == 0
    layers = [f"encoder.layer.{i}.attention.self" for i in range(2)]
    check_heads(report, seen.calls, layers, am.bool())
    assert min(h.tied_rowmax_ratio for h in report.heads if h.head == 0) == 1.0  # 19 of 19


def test_score_bias_hides_what_sdpa_hides():
    """bool (True = attend), additive float with finfo.min for hidden keys (Hugging
    Face), causal and a sliding window, combined."""
    n = 5
    boolean = torch.rand(2, 1, n, n, generator=torch.Generator().manual_seed(0)) > 0.4
    additive = torch.zeros(2, 1, n, n).masked_fill(~boolean, torch.finfo(torch.float32).min)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    want = ~boolean | (j > i) | (i - j >= 2)
    for mask in (boolean, additive):
        got = probe.score_bias(n, n, causal=True, attn_mask=mask, sliding_window=2)
        assert torch.equal(torch.isneginf(got), want)
        assert (got[~want] == 0).all()
    assert probe.score_bias(n, n, causal=False) is None
