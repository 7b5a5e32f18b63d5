"""flashwatch/mitigation/policy.py on a real watched run (issue 37): the README's
plain-PyTorch quickstart trained on random tokens switches nothing, and a planted δ error
that is a true large share of an ordinary gradient still switches."""

from __future__ import annotations

import pytest
import torch
from _helpers import TwoLayers, biased_kernel, drive

import flashwatch as fw
from flashwatch.kernels.common import Mode
from flashwatch.nanogpt import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")
QUICKSTART = dict(block_size=64, n_layer=2, n_head=4, n_embd=64)  # README's model


def quickstart_run(seed: int, steps: int, **watch):
    """The README quickstart (lr 3e-3, batches 8 × 64, BF16 autocast), random tokens;
    returns (reports, watcher)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**QUICKSTART))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    w = fw.watch(model, **{"mitigation": "auto", "every_n_steps": 5, **watch})
    reports = []
    for _ in range(steps):
        b = torch.randint(0, 256, (8, QUICKSTART["block_size"] + 1), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(b[:, :-1], b[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        r = w.step()
        if r is not None:
            reports.append(r)
    w.remove()
    return reports, w


def test_random_tokens_switch_nothing():
    """300 steps (60 monitored; ≈ 5 s on one thread). Without the gradient floors layer 1's
    four heads went to FP32_O here ([delta_share], shares 0.4-5.7 on a ‖dW^Q‖ 0.2-2 % of
    its start); the raw shares are still reported."""
    reports, w = quickstart_run(0, 300)
    assert len(reports) == 60
    assert [e for e in w.events if e.kind == "mode"] == []
    assert all(h.head_mode == Mode.STANDARD for r in reports for h in r.heads)
    # the report hides nothing: layer 1's raw shares, over 1, are there
    assert max(h.delta_error_share for r in reports for h in r.heads) > 1


@pytest.mark.parametrize("bias", [1e-3, 1e-2])
def test_planted_delta_share_still_switches_after_delta_share_steps(monkeypatch, bias):
    """A kernel whose O leans by bias·|O| (tests/standins.py leaning_dispatch) on the
    tied layer, whose gradient is ordinary: shares 0.43-0.77 (1e-3) and 11-13 (1e-2,
    clamped to 1 by the rule). Both heads go to FP32_O on the 8th monitored step
    (delta_share_steps), defaults otherwise."""
    biased_kernel(monkeypatch, bias)
    torch.manual_seed(7)
    model = TwoLayers()
    w = fw.watch(model, every_n_steps=1, mitigation="auto")
    reports = drive(model, w, 12)
    events = [e for e in w.events if e.kind == "mode"]
    assert [(e.step, e.layer, e.head, e.to_mode) for e in events] == [
        (reports[7].step, "tied", h, Mode.FP32_O) for h in (0, 1)]
    assert all(e.reason.startswith("[delta_share]") for e in events)
    if bias == 1e-2:
        assert all("(> 1: the estimated error exceeds the gradient" in e.reason for e in events)
