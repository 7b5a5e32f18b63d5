"""flashwatch/sites/eager_attention.py: layers that make no SDPA call are refused at attach,
by name, with the fix (before: NaN max logits, no δ rows and no word, issue 28 item 2)."""

from __future__ import annotations

import pytest
import torch

import flashwatch as fw
from flashwatch.sites import find_sites
from flashwatch.sites.eager_attention import no_sdpa_reason
from standins import TinyLlama, hf_tiny


def test_an_eager_llama_is_refused_with_the_fix():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, attn_implementation="eager")
    model = LlamaForCausalLM(cfg)
    with pytest.raises(ValueError) as err:
        fw.watch(model)
    msg = str(err.value)
    for words in ("model.layers.0.self_attn", "model.layers.1.self_attn",
                  'attn_implementation="eager"', 'attn_implementation="sdpa"'):
        assert words in msg, (words, msg)
    assert 'model.set_attn_implementation("sdpa")' in msg
    model.set_attn_implementation("sdpa")  # the fix the message names
    w = fw.watch(model, every_n_steps=1)
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    report = w.step()
    w.remove()
    assert len(report.heads) == 8 and all(h.attention_max_logit == h.attention_max_logit
                                          for h in report.heads)  # measured, not NaN


def test_gemma2_softcapping_is_refused_with_the_fw_attention_fix():
    model, _ = hf_tiny("gemma2")
    assert model.config._attn_implementation == "eager"  # transformers: no SDPA for Gemma2
    with pytest.raises(ValueError, match=r"Gemma2Attention.*softcapped.*register\(\).*"
                                         r'attn_implementation="fw_attention"'):
        find_sites(model)


def test_sdpa_and_plain_modules_are_not_refused():
    for arch in ("llama", "llama_flex"):  # SDPA, and torch's flex_attention
        model, _ = hf_tiny(arch)
        assert all(no_sdpa_reason(s.module) is None for s in find_sites(model))
    torch.manual_seed(0)
    assert all(no_sdpa_reason(s.module) is None for s in find_sites(TinyLlama()))
    # a watched module is a subclass of its class: still refused by class name
    bloom, _ = hf_tiny("bloom")
    attn = bloom.transformer.h[0].self_attention
    attn.__class__ = type("BloomAttention", (type(attn),), {})
    assert "never SDPA" in no_sdpa_reason(attn)
