"""flashwatch/integrations/hf_attention.py: attn_implementation="fw_attention" computes
what transformers' own attention computes (Gemma2: softcapping, GQA, padding and sliding
window masks, KV-cached decoding), and makes layers flashwatch refuses watchable.

Oracles are outside flashwatch: Gemma2's `eager_attention_forward` (transformers) in
FP64, and the same model run with attn_implementation="eager".
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import Gemma2Config, Gemma2ForCausalLM  # noqa: E402
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward  # noqa: E402

import flashwatch as fw  # noqa: E402
from flashwatch.integrations import hf_attention  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

CAP = 5.0  # small, so the tanh bends the scores of these inputs (|s| up to ~8)
SHARP = 40.0


class _Layer(torch.nn.Module):
    """What eager_attention_forward reads from a Gemma2 attention module."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.head_dim, self.is_causal = groups, 16, True


def _masks(B, N, window, pad):
    """(bool [B, 1, N, N], True = attend: causal, sliding window, right padding of `pad`
    keys in batch row 0) and the additive float form transformers' eager path takes."""
    i = torch.arange(N)
    keep = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
    keep = keep.expand(B, 1, N, N).clone()
    keep[0, ..., N - pad:] = False
    return keep


def _additive(keep, dtype):
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_attention_forward_within_twice_transformers_eager_error(dtype):
    """GQA (4 query heads on 2 KV heads), softcap, sliding window and padding: the output
    of the padded batch's real rows is within 2× transformers' own eager error in `dtype`
    (both against eager in FP64), plus a floor of one ulp at the output's scale."""
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, N, D, pad = 2, 4, 2, 21, 16, 5
    q = torch.randn(B, H, N, D, generator=g) * 2
    k = torch.randn(B, Hkv, N, D, generator=g) * 2
    v = torch.randn(B, Hkv, N, D, generator=g)
    keep = _masks(B, N, window=8, pad=pad)
    layer = _Layer(H // Hkv)

    def eager(t):
        return eager_attention_forward(layer, *(x.to(t) for x in (q, k, v)),
                                       _additive(keep, t), scaling=D ** -0.5, softcap=CAP)[0]

    truth, pt = eager(torch.float64), eager(dtype).double()
    out, none = hf_attention.attention_forward(layer, q.to(dtype), k.to(dtype), v.to(dtype),
                                               keep, scaling=D ** -0.5, softcap=CAP)
    assert none is None and out.shape == (B, N, H, D) and out.dtype == dtype
    real = torch.ones(B, N, dtype=torch.bool)
    real[0, N - pad:] = False  # padded query rows: no caller reads them
    err = (out.double() - truth)[real].abs().max()
    pt_err = (pt - truth)[real].abs().max()
    floor = torch.finfo(dtype).eps * truth.abs().max()
    assert err <= 2 * pt_err + floor, (float(err), float(pt_err))
    # The cap matters here: without it the output moves far more than the error allowed.
    uncapped = hf_attention.attention_forward(layer, q.to(dtype), k.to(dtype), v.to(dtype),
                                              keep, scaling=D ** -0.5)[0]
    assert (uncapped.double() - truth)[real].abs().max() > 10 * (2 * pt_err + floor)


def _gemma2(impl: str, seed: int = 0) -> Gemma2ForCausalLM:
    if impl == hf_attention.NAME:
        hf_attention.register()
    cfg = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, sliding_window=6, max_position_embeddings=64,
                       attn_logit_softcapping=CAP, attn_implementation=impl)
    torch.manual_seed(seed)
    model = Gemma2ForCausalLM(cfg)
    with torch.no_grad():  # scores up to ~3·CAP (initialised, they are ~1e-3): the cap bends
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(SHARP)
            layer.self_attn.k_proj.weight.mul_(SHARP)
    return model


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0  # right padding
    return ids, mask


def test_gemma2_model_matches_its_eager_attention_forward_and_backward():
    """FP32, same weights: logits on the real tokens and every weight's gradient agree
    with attn_implementation="eager" to FP32 rounding (the only difference is the order
    of the softmax's sums)."""
    ids, mask = _batch()
    grads, logits = {}, {}
    for impl in ("eager", hf_attention.NAME):
        model = _gemma2(impl)
        out = model(input_ids=ids, attention_mask=mask).logits
        (out[mask.bool()].square().mean()).backward()
        logits[impl] = out[mask.bool()].detach()
        grads[impl] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(logits[hf_attention.NAME], logits["eager"], rtol=1e-5,
                               atol=1e-5)
    assert grads["eager"].keys() == grads[hf_attention.NAME].keys()
    assert any("q_proj" in n for n in grads["eager"])
    for n, g in grads["eager"].items():
        torch.testing.assert_close(grads[hf_attention.NAME][n], g, rtol=1e-4, atol=1e-6,
                                   msg=n)


def test_sliding_layers_pass_their_window_to_the_kernels_and_change_nothing(monkeypatch):
    """Gemma2's sliding layers hand flashwatch.attention their window (so the kernels can
    skip key blocks outside it), its global layers none; the mask already held the window,
    so logits and gradients are the same bits as with the mask alone."""
    ids, mask = _batch()
    windows, runs = [], {}
    attention = hf_attention.dispatch.attention

    def recording(*args, **kwargs):
        windows.append(kwargs.get("sliding_window"))
        return attention(*args, **kwargs)
    for passed in (True, False):
        if not passed:
            monkeypatch.setattr(hf_attention, "_window", lambda *a: None)
        monkeypatch.setattr(hf_attention.dispatch, "attention", recording)
        windows.clear()
        model = _gemma2(hf_attention.NAME)
        out = model(input_ids=ids, attention_mask=mask).logits
        out.square().mean().backward()
        runs[passed] = (out.detach(), model.model.layers[0].self_attn.q_proj.weight.grad,
                        list(windows))
    assert runs[True][2] == [6, None] and runs[False][2] == [None, None]  # layer 0 slides
    assert torch.equal(runs[True][0], runs[False][0])
    assert torch.equal(runs[True][1], runs[False][1])


def test_greedy_generation_with_a_kv_cache_is_eager_generation():
    """Decoding: one query per step against every cached key (no causal flag), the
    sliding window in the mask once the cache outgrows it (6 keys < 4 + 8 tokens)."""
    ids = _batch()[0][:, :4]
    seqs = {impl: _gemma2(impl).generate(ids, max_new_tokens=8, do_sample=False)
            for impl in ("eager", hf_attention.NAME)}
    assert seqs["eager"].shape == (2, 12)
    assert torch.equal(seqs[hf_attention.NAME], seqs["eager"])


def test_eager_gemma2_is_refused_with_the_fw_attention_fix():
    with pytest.raises(ValueError, match="fw_attention") as e:
        fw.watch(_gemma2("eager"))
    assert "register()" in str(e.value)


def test_watched_fw_attention_gemma2_reports_every_head():
    """The layers the eager path hides are measured: a finite max logit ≤ the cap, δ rows
    for every head, no monitor error."""
    model = _gemma2(hf_attention.NAME)
    ids, mask = _batch()
    with fw.watch(model, every_n_steps=1, rows_per_head="all") as w:
        model(input_ids=ids, attention_mask=mask).logits.square().mean().backward()
        report = w.step()
    assert report.monitor_errors_total == 0
    assert len(report.heads) == 2 * 4
    for h in report.heads:
        assert 0 < h.attention_max_logit <= CAP, h
        assert h.delta_error_rows > 0, h


def test_dropout_is_refused_by_name():
    layer = _Layer(1)
    q = torch.randn(1, 2, 3, 16)
    with pytest.raises(ValueError, match="dropout=0.1"):
        hf_attention.attention_forward(layer, q, q, q, None, dropout=0.1)


def test_register_is_idempotent_and_its_name_asks_for_no_flash_kernel():
    """transformers loads a flash-attention kernel for any implementation name that
    contains "flash"."""
    from transformers import AttentionInterface

    hf_attention.register()
    hf_attention.register()
    assert AttentionInterface()[hf_attention.NAME] is hf_attention.attention_forward
    assert "flash" not in hf_attention.NAME


def test_t5_position_bias_and_its_gradient_as_sdpa():
    """T5 passes its learned relative bias as position_bias: folded into one float mask
    with the padding (encoder), the causal pattern (decoder) and the cross mask, as
    transformers' SDPA path does; logits and the bias table's gradient equal SDPA's."""
    from transformers import T5Config, T5ForConditionalGeneration

    hf_attention.register()
    ids, mask = _batch()
    logits, grads = {}, {}
    for impl in ("sdpa", hf_attention.NAME):
        torch.manual_seed(0)
        model = T5ForConditionalGeneration(T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            dropout_rate=0.0, attn_implementation=impl))
        out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=ids.flip(1)).logits
        out.square().mean().backward()
        logits[impl] = out.detach()
        grads[impl] = {n: p.grad for n, p in model.named_parameters()
                       if "relative_attention_bias" in n}
    torch.testing.assert_close(logits[hf_attention.NAME], logits["sdpa"], rtol=1e-5, atol=1e-5)
    assert len(grads["sdpa"]) == 2 and all(g.abs().sum() > 0 for g in grads["sdpa"].values())
    for n, g in grads["sdpa"].items():
        torch.testing.assert_close(grads[hf_attention.NAME][n], g, rtol=1e-4, atol=1e-7, msg=n)
