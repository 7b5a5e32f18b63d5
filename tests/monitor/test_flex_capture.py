"""Head modes on FlexAttention and varlen calls (flashwatch/monitor/flex_capture.py):
which calls flashwatch's kernel runs, the log-sum-exp it hands back in each op's units,
and what happens when a gradient reaches that log-sum-exp (attention sinks)."""

from __future__ import annotations

import contextlib
import math

import torch
from attention_standins import cpu_varlen, differentiable_flex
from torch import nn
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

import flashwatch as fw

B, N, D, H = 2, 24, 32, 2


def _doc_mask():
    doc = torch.tensor([[0] * 10 + [1] * 14, [0] * 17 + [1] * 7])
    return create_block_mask(lambda b, h, q, k: (q >= k) & (doc[b, q] == doc[b, k]),
                             B, None, N, N, device="cpu")


class Flex(nn.Module):
    """One attention layer over flex_attention; `sinks` adds the log-sum-exp to the
    output as gpt-oss's attention sinks do (so a gradient reaches it)."""

    def __init__(self, sinks=False, mask=None, lse=True, score_mod=None):
        super().__init__()
        torch.manual_seed(0)
        self.num_heads, self.sinks, self.want_lse, self.score_mod = H, sinks, lse, score_mod
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.mask = _doc_mask() if mask is None else mask

    def forward(self, x):
        q, k, v = (p(x).view(B, N, H, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        o, aux = flex_attention(q, k, v, block_mask=self.mask, score_mod=self.score_mod,
                                return_aux=AuxRequest(lse=self.want_lse))
        self.lse = aux.lse.detach() if self.want_lse else None
        if self.sinks:
            o = o * torch.sigmoid(aux.lse)[..., None]
        return o.transpose(1, 2).reshape(B, N, D)


def _run(model, modes, grad=False, steps=1, x=None):
    """`steps` monitored steps of `model` (its layer "0" with FP32_O on every head if
    `modes`): the last output, layer 0's lse, the reports, routed calls per step."""
    if x is None:
        x = torch.randn(B, N, D, generator=torch.Generator().manual_seed(1))
    with fw.watch(model, config=fw.WatchConfig(every_n_steps=1)) as w:
        if modes:
            w.set_head_modes("0", [fw.Mode.FP32_O] * H)
        reports, routed = [], []
        for _ in range(steps):
            with torch.set_grad_enabled(grad):
                y = model(x)
                if grad:
                    y.square().mean().backward()
            routed.append(w._states[0].routed_calls)
            reports.append(w.step())
    return y.detach(), model[0].lse, reports, routed


def test_flex_routed_output_and_lse_match_flex():
    """A document-masked flex call with the identity score mod runs flashwatch's kernel;
    its output and the log-sum-exp the caller asked for equal flex's own."""
    plain, lse, _, _ = _run(nn.Sequential(Flex()), modes=False)
    routed, lse_r, reports, routed_calls = _run(nn.Sequential(Flex()), modes=True)
    assert routed_calls == [1] and reports[0].unmitigable == {}
    assert (routed - plain).abs().max() < 1e-5
    assert (lse_r - lse).abs().max() < 1e-5


def test_a_softcap_score_mod_is_routed_as_the_kernel_s_softcap():
    """c·tanh(s / c) in either order (Gemma2's closure writes c first) runs flashwatch's
    kernel with softcap=c; a bias does not (reported unmitigable)."""
    for mod in (lambda s, b, h, q, k: torch.tanh(s / 0.5) * 0.5,
                lambda s, b, h, q, k: 0.5 * torch.tanh(s / 0.5)):
        plain, lse, _, _ = _run(nn.Sequential(Flex(score_mod=mod)), modes=False)
        routed, lse_r, reports, calls = _run(nn.Sequential(Flex(score_mod=mod)), modes=True)
        assert calls == [1] and reports[0].unmitigable == {}
        assert (routed - plain).abs().max() < 1e-5 and (lse_r - lse).abs().max() < 1e-5
    biased = nn.Sequential(Flex(score_mod=lambda s, b, h, q, k: torch.tanh(s / 0.5) + q * 0.1))
    _, _, reports, calls = _run(biased, modes=True)
    assert calls == [0] and "neither the identity nor a softcap" in reports[0].unmitigable["0"]


def test_a_mask_that_differs_by_head_is_routed_per_head():
    """Head 0 causal, head 1 a 4-key sliding window: the dense mask keeps both."""
    mask = create_block_mask(lambda b, h, q, k: (q >= k) & ((h == 0) | (q - k < 4)),
                             None, H, N, N, device="cpu")
    plain, lse, _, _ = _run(nn.Sequential(Flex(mask=mask)), modes=False)
    routed, lse_r, reports, calls = _run(nn.Sequential(Flex(mask=mask)), modes=True)
    assert calls == [1] and reports[0].unmitigable == {}
    assert (routed - plain).abs().max() < 1e-5 and (lse_r - lse).abs().max() < 1e-5


def test_a_gradient_through_the_lse_is_counted_and_stops_routing():
    """Attention sinks read the lse with a gradient: the first backward counts a monitor
    error naming it, and the layer runs flex's own kernel from the next call on, listed
    unmitigable with the reason."""
    with differentiable_flex():
        _, _, reports, routed = _run(nn.Sequential(Flex(sinks=True)), modes=True, grad=True,
                                     steps=2)
    assert routed == [1, 0]
    assert reports[0].monitor_errors_total == 1
    assert "log-sum-exp" in reports[1].unmitigable["0"]


def test_no_error_when_the_lse_gets_no_gradient():
    """Training through a routed call whose lse is only read, not differentiated: no
    error, the modes run every step."""
    with differentiable_flex():
        _, _, reports, routed = _run(nn.Sequential(Flex()), modes=True, grad=True, steps=2)
    assert routed == [1, 1]
    assert reports[-1].monitor_errors_total == 0 and reports[-1].unmitigable == {}


class Varlen(nn.Module):
    def __init__(self, sinks=False):
        super().__init__()
        torch.manual_seed(0)
        self.num_heads, self.sinks = H, sinks
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.cu = torch.tensor([0, 9, 30, 48], dtype=torch.int32)

    def forward(self, x):  # x [1, T, D]
        from torch.nn.attention.varlen import AuxRequest as VarlenAux
        from torch.nn.attention.varlen import varlen_attn

        t = x.shape[1]
        q, k, v = (p(x).view(t, H, -1) for p in (self.q_proj, self.k_proj, self.v_proj))
        o, lse = varlen_attn(q, k, v, self.cu, self.cu, 21, 21, window_size=(-1, 0),
                             return_aux=VarlenAux(lse=True))
        self.lse = lse.detach()
        if self.sinks:
            o = o * torch.sigmoid(lse).transpose(0, 1)[..., None]
        return o.reshape(1, t, D)


def _run_varlen(model, modes, grad=False, steps=1):
    with cpu_varlen():
        return _run(model, modes, grad, steps,
                    x=torch.randn(1, 48, D, generator=torch.Generator().manual_seed(1)))


def test_varlen_routed_output_and_lse_match_the_kernel():
    """The packed documents through flashwatch's kernel as one block-causal mask: the
    output and the [H, T] natural-log lse equal the per-document kernel's."""
    plain, lse, _, _ = _run_varlen(nn.Sequential(Varlen()), modes=False)
    routed, lse_r, reports, calls = _run_varlen(nn.Sequential(Varlen()), modes=True)
    assert calls == [1] and reports[0].unmitigable == {}
    assert (routed - plain).abs().max() < 1e-5
    assert lse_r.shape == lse.shape == (H, 48) and (lse_r - lse).abs().max() < 1e-5


def test_varlen_sinks_stay_routed():
    """torch's own varlen backward gives the lse no gradient: reading it with one
    (attention sinks) changes nothing when routed, so no error and routing goes on."""
    _, _, reports, routed = _run_varlen(nn.Sequential(Varlen(sinks=True)), modes=True,
                                        grad=True, steps=2)
    assert routed == [1, 1]
    assert reports[-1].monitor_errors_total == 0 and reports[-1].unmitigable == {}
    assert all(math.isfinite(h.attention_max_logit) for h in reports[-1].heads)


def test_sinks_seen_before_routing_are_never_routed():
    """An unrouted step whose backward reaches flex's lse marks the layer: modes set
    after it are refused with the reason, and no gradient is ever dropped (the only
    error is the hand-set modes that did not run)."""
    model = nn.Sequential(Flex(sinks=True))
    x = torch.randn(B, N, D, generator=torch.Generator().manual_seed(1))
    with differentiable_flex(), fw.watch(model, config=fw.WatchConfig(every_n_steps=1)) as w:
        model(x).square().mean().backward()
        assert w.step().monitor_errors_total == 0
        w.set_head_modes("0", [fw.Mode.FP32_O] * H)
        model(x).square().mean().backward()
        assert w._states[0].routed_calls == 0
        report = w.step()
    assert "log-sum-exp" in report.unmitigable["0"] and report.monitor_errors_total == 1


def test_a_block_mask_without_mask_mod_that_hides_blocks_is_not_measured():
    """BlockMask.from_kv_blocks without a mask_mod: the kernel skips the missing key
    blocks, which no mask_mod tells; the layer is left unmeasured with the reason (an
    error), not measured over keys the kernel never read."""
    from torch.nn.attention.flex_attention import BlockMask

    n = 256  # two 128-key blocks; every query block reads only the first
    kv_num = torch.ones(1, 1, 2, dtype=torch.int32)
    kv_idx = torch.zeros(1, 1, 2, 2, dtype=torch.int32)
    mask = BlockMask.from_kv_blocks(kv_num, kv_idx)

    class Sparse(Flex):
        def forward(self, x):
            q, k, v = (p(x).view(1, n, H, -1).transpose(1, 2)
                       for p in (self.q_proj, self.k_proj, self.v_proj))
            return flex_attention(q, k, v, block_mask=mask).transpose(1, 2).reshape(1, n, D)

    model = nn.Sequential(Sparse())
    with fw.watch(model, config=fw.WatchConfig(every_n_steps=1)) as w, torch.no_grad():
        model(torch.randn(1, n, D))
        report = w.step()
    assert report.monitor_errors_total == 1
    assert all(math.isnan(h.attention_max_logit) for h in report.heads)


def test_an_unroutable_flex_layer_does_not_hold_compiled_code_eager():
    """Modes on an ALiBi flex layer (refused): unmeasured steps leave the process's
    compiled code compiled (the stance is forced on measured steps only)."""
    from flashwatch.monitor.attach import forcing_eager

    alibi = nn.Sequential(Flex(score_mod=lambda s, b, h, q, k: s + 0.1 * (k - q)))
    x = torch.randn(B, N, D, generator=torch.Generator().manual_seed(1))
    forced = []
    with fw.watch(alibi, config=fw.WatchConfig(every_n_steps=2)) as w, torch.no_grad():
        w.set_head_modes("0", [fw.Mode.FP32_O] * H)
        for _ in range(4):
            alibi(x)
            forced.append(forcing_eager())
            w.step()
    assert forced == [True, False, True, False]


def test_measured_steps_run_a_compiled_flex_compiled(monkeypatch):
    """On a measured step the force_eager stance makes a model's compiled flex_attention
    call the op eagerly (torch's unfused math: [B, H, N, N] scores); on FUSED_DEVICES
    (CUDA; here the CPU, patched) flashwatch runs that call through
    torch.compile(flex_attention) instead: the output the caller gets is flex's own, and
    the layer is measured. Inductor's CPU flex: one compile, ≈ 20 s, and no lse there
    (the lse's units are checked on a GPU: benchmarks/gpu_flex.py's max_scores)."""
    from flashwatch.monitor import flex_capture

    monkeypatch.setattr(flex_capture, "FUSED_DEVICES", ("cpu",))
    calls = []
    fused = flex_capture.fused_flex
    monkeypatch.setattr(flex_capture, "fused_flex",
                        lambda args, kwargs: calls.append(1) or fused(args, kwargs))
    model = nn.Sequential(Flex(lse=False))
    x = torch.randn(B, N, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(x)
    compiled = torch.compile(model, backend="aot_eager")
    with fw.watch(model, config=fw.WatchConfig(every_n_steps=1)) as w, torch.no_grad():
        y = compiled(x)
        assert calls == [1] and not w._states[0].fused_failed  # it ran compiled
        report = w.step()
    assert (y - plain).abs().max() < 1e-5
    assert report.monitor_errors_total == 0
    assert all(math.isfinite(h.attention_max_logit) for h in report.heads)


def test_a_failure_at_any_torch_call_of_ours_leaves_the_model_as_it_was():
    """A failure raised at each torch call flashwatch makes in a monitored step of a flex
    layer and a varlen layer (forward probe, backward hooks, step(); head modes on, so
    the routing code runs too), one at a time (tests/fault_sweep.py's Inject): nothing
    reaches the training loop, the outputs are the model's (routed or not, within the
    kernels' FP32 difference), and the error is counted. Found two paths that raised into
    the model (the lse conversion after routing, the routing checks' tensor reads)."""
    from fault_sweep import Inject

    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.flex, self.varlen = Flex(lse=False), Varlen()

        def forward(self, x):  # x [1, 48, D] for varlen; [B, N, D] for flex from it
            return self.flex(x[0, :B * N].view(B, N, D)), self.varlen(x)

    torch.manual_seed(0)
    model = Both()
    x = torch.randn(1, 48, D)
    cfg = fw.WatchConfig(every_n_steps=1, rows_per_head=8)
    with differentiable_flex(), cpu_varlen():
        plain = [y.detach() for y in model(x)]
        w = fw.watch(model, config=cfg)
        w.set_head_modes("flex", [fw.Mode.FP32_O] * H)

        def step(inject=None):
            with inject or contextlib.nullcontext():
                ys = model(x)
                sum(y.square().mean() for y in ys).backward()
                report = w.step()
            return [y.detach() for y in ys], report

        try:
            step()  # the first monitored step's one-time work
            counter = Inject()
            step(counter)
            assert counter.count > 100
            for n in range(counter.count):
                before = w.monitor_errors_total
                ys, report = step(Inject(n))
                for y, p in zip(ys, plain, strict=True):
                    assert (y - p).abs().max() < 1e-5, n
                # counted (a failure inside step() may leave this step without a report)
                assert w.monitor_errors_total > before, n
        finally:
            w.remove()
