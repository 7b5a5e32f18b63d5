"""flashwatch/diagnosis/measure.py against the watcher: on the same model, batch and BF16
autocast, `fw.diagnose` and `fw.watch(rows_per_head="all", every_n_steps=1)` measure the
same arithmetic: q, k, v rounded as SDPA receives them (monitor/traced.py autocast_qkv).
A Llama's rotary q, k reach SDPA in FP32 and are rounded by autocast there; measuring
them unrounded changed tie counts on 80 of 270 heads of a 135M model (issue 38)."""

from __future__ import annotations

import pytest
import torch
from _helpers import tiny_gpt, tiny_llama

import flashwatch as fw


def _watched(model, batch, loss_fn):
    cfg = fw.WatchConfig(rows_per_head="all", every_n_steps=1)
    watcher = fw.watch(model, config=cfg)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model, batch)
        loss.backward()
        report = watcher.step()
    finally:
        watcher.remove()
    model.zero_grad(set_to_none=True)
    return {(h.layer, h.head): h for h in report.heads}


def _llama_loss(model, batch):
    logits = model(input_ids=batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                             batch[:, 1:].flatten())


def _gpt_loss(model, batch):
    return model(batch[:, :-1], batch[:, 1:])[1]


@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_diagnose_measures_what_the_watcher_measures(kind, one_thread):
    if kind == "llama":
        model, loss_fn, vocab = tiny_llama(), _llama_loss, 64
        with torch.no_grad():  # larger logits: ties and rounding that matter
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight *= 6.0
    else:
        model, loss_fn, vocab = tiny_gpt(), _gpt_loss, 16
    model.train()  # no dropout in either: eval (diagnose) and train give the same forward
    batch = torch.randint(vocab, (2, 33), generator=torch.Generator().manual_seed(3))
    result = fw.diagnose(model, [batch], loss_fn=loss_fn, dtype=torch.bfloat16,
                         progress=False)
    watched = _watched(model, batch, loss_fn)
    heads = {(h["layer"], h["head"]): h for h in result["heads"]}
    assert sorted(heads) == sorted(watched)
    tied_rows = 0
    for key, h in heads.items():
        w = watched[key]
        assert w.delta_error_all_rows
        assert h["tied_ratio"] * h["rows"] == pytest.approx(w.tied_rowmax_ratio * h["rows"],
                                                            abs=1e-9), key
        assert h["max_logit"] == pytest.approx(w.attention_max_logit, rel=1e-6), key
        # δ against an FP64 O here, an FP32 O in the watcher: the same sum to ~1e-4
        assert h["delta_sum"] == pytest.approx(w.delta_error_sum, rel=2e-3, abs=1e-7), key
        tied_rows += h["tied_ratio"] * h["rows"]
    if kind == "llama":
        assert tied_rows > 0  # the comparison saw ties
