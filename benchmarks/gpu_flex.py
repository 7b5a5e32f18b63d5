"""gpu_check stage (f): flashwatch on the real FlexAttention and varlen kernels, which the
CPU cannot run (torch 2.13: no flex backward, no flex max_scores, no varlen kernel there;
tests/monitor/test_flex.py covers those paths through stand-ins).

  flex     a watched 2-layer BF16 model calling torch.compile'd flex_attention (Triton on
           CUDA) with a block-causal document mask and a softcap score_mod, forward and
           backward: every head's max logit (1e-4) and tied rows (exact) against FP64
           scores of the q, k each call received, δ error rows counted, 0 monitor
           errors; flex's own per-row max_scores (AuxRequest(max_scores=True)) beside
           flashwatch's max logit, the number torchtitan's max-logit monitoring reads.
  varlen   the same through varlen_attn on packed documents (causal): per-document FP64
           truth, forward and backward.
--dry-run (CPU): flex forward only (its math implementation), varlen skipped (no kernel).
"""

from __future__ import annotations

import math

import torch
from torch import nn

import flashwatch as fw

H, D_MODEL, EPS = 4, 256, 1e-3


class _Attn(nn.Module):
    def __init__(self, call):
        super().__init__()
        self.num_heads, self.head_dim, self.call = H, D_MODEL // H, call
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(D_MODEL, D_MODEL, bias=False) for _ in range(4))
        with torch.no_grad():
            self.q_proj.weight.mul_(6.0)  # logits of tens: ties and maxima to compare

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, H, -1).transpose(1, 2) for p in
                   (self.q_proj, self.k_proj, self.v_proj))
        o = self.call(q, k, v)
        self.seen = (q.detach(), k.detach())
        return x + self.o_proj(o.transpose(1, 2).reshape(b, n, -1))


def _stats(s):
    """Per head: (max logit, tied rows) of FP64 scores s [B, H, N, N] (-inf hidden)."""
    top = s.topk(2, -1).values
    seen = torch.isfinite(top[..., 0])
    tied = (seen & (top[..., 1] >= top[..., 0] - EPS)).sum((0, 2))
    mx = top[..., 0].masked_fill(~seen, -math.inf).amax((0, 2))
    return mx, tied, seen.sum((0, 2))


def _compare(report, model, truth_of) -> dict:
    worst, tie_errors = 0.0, 0
    for li, layer in enumerate(model):
        mx, tied, rows = truth_of(layer)
        for r in (r for r in report.heads if r.layer == str(li)):
            worst = max(worst, abs(r.attention_max_logit - mx[r.head].item())
                        / abs(mx[r.head].item()))
            tie_errors += abs(round(r.tied_rowmax_ratio * rows[r.head].item())
                              - int(tied[r.head]))
    return {"max_logit_rel_err": worst, "tie_count_errors": tie_errors,
            "monitor_errors": report.monitor_errors_total,
            "delta_error_rows": sum(r.delta_error_rows for r in report.heads),
            "ok": worst < 1e-4 and tie_errors == 0 and report.monitor_errors_total == 0}


def flex(device: str, dry: bool) -> dict:
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    B, N = (2, 96) if dry else (4, 2048)
    doc = (torch.arange(N, device=device) // (N // 3)).expand(B, N).clone()
    doc[1, -N // 8:] = -1  # padding at the end of the second element

    def mask_mod(b, h, q, k):
        return (q >= k) & (doc[b, q] == doc[b, k]) & (doc[b, q] >= 0)

    def softcap(s, b, h, q, k):
        return torch.tanh(s / 20.0) * 20.0

    bm = create_block_mask(mask_mod, B, None, N, N, device=device)
    compiled = flex_attention if dry else torch.compile(flex_attention)
    aux = {}

    def call(q, k, v):
        if dry:
            return compiled(q, k, v, score_mod=softcap, block_mask=bm)
        o, a = compiled(q, k, v, score_mod=softcap, block_mask=bm,
                        return_aux=AuxRequest(max_scores=True))
        aux.setdefault("max_scores", []).append(a.max_scores.detach())
        return o

    torch.manual_seed(0)
    model = nn.Sequential(_Attn(call), _Attn(call)).to(device, torch.bfloat16)
    x = torch.randn(B, N, D_MODEL, device=device, dtype=torch.bfloat16)
    b = torch.arange(B, device=device)[:, None, None, None]
    qi = torch.arange(N, device=device)[None, None, :, None]
    ki = torch.arange(N, device=device)[None, None, None, :]

    def truth(layer):
        q, k = layer.seen
        s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
        s = torch.tanh(s / 20.0) * 20.0
        return _stats(s.masked_fill(~mask_mod(b, None, qi, ki), -math.inf))

    with fw.watch(model, config=fw.WatchConfig(every_n_steps=1)) as w:
        if dry:
            with torch.no_grad():
                model(x)
        else:
            model(x).float().square().mean().backward()
        report = w.step()
        fused_failed = any(st.fused_failed for st in w._states)
    out = _compare(report, model, truth)
    # the measured step ran the model's compiled flex through flashwatch's own compiled
    # call (flex_capture._run_flex), not torch's unfused math: on CUDA it must not fail
    out["fused_failed"] = fused_failed
    out["ok"] = out["ok"] and (dry or not fused_failed)
    if aux:  # flex's own row maxima (the op's log2 units undone by flex), real rows only
        kernel = max(float(m.masked_fill(~torch.isfinite(m), -math.inf).max())
                     for m in aux["max_scores"][-2:])
        ours = max(r.attention_max_logit for r in report.heads)
        out["flex_max_scores_vs_ours_rel"] = abs(kernel - ours) / abs(ours)
        out["ok"] = out["ok"] and out["flex_max_scores_vs_ours_rel"] < 1e-3
    out["backward"] = not dry
    return out


def flex_routed(device: str, dry: bool) -> dict:
    """FP32_O on every head of a compiled flex model (document mask + softcap score_mod):
    flashwatch's kernel (Triton on CUDA) runs each call with the mask made dense and the
    softcap, forward and backward; its output and W^Q gradient against the unrouted
    model's (BF16: within 2e-2 of the largest), 0 errors, nothing unmitigable."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, N = (2, 96) if dry else (4, 1024)
    doc = (torch.arange(N, device=device) // (N // 3)).expand(B, N).clone()

    def mask_mod(b, h, q, k):
        return (q >= k) & (doc[b, q] == doc[b, k])

    bm = create_block_mask(mask_mod, B, None, N, N, device=device)
    compiled = flex_attention if dry else torch.compile(flex_attention)

    def call(q, k, v):
        return compiled(q, k, v, score_mod=lambda s, b, h, q_, k_: 20.0 * torch.tanh(s / 20.0),
                        block_mask=bm)

    x = torch.randn(B, N, D_MODEL, device=device, dtype=torch.bfloat16)
    outs = []
    for modes in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(_Attn(call), _Attn(call)).to(device, torch.bfloat16)
        with fw.watch(model, config=fw.WatchConfig(every_n_steps=1)) as w:
            if modes:
                for name in ("0", "1"):
                    w.set_head_modes(name, [fw.Mode.FP32_O] * H)
            with torch.set_grad_enabled(not dry):
                y = model(x)
                if not dry:
                    y.float().square().mean().backward()
            routed = sum(st.routed_calls for st in w._states)
            report = w.step()
        grad = model[0].q_proj.weight.grad
        outs.append((y.detach().float(), None if grad is None else grad.float(), routed,
                     report))
    (y0, g0, _, _), (y1, g1, routed, report) = outs
    out_err = float((y1 - y0).abs().max() / y0.abs().max())
    grad_err = None if g0 is None else float((g1 - g0).abs().max() / g0.abs().max())
    return {"routed_calls": routed, "out_rel_err": out_err, "grad_rel_err": grad_err,
            "unmitigable": report.unmitigable, "monitor_errors": report.monitor_errors_total,
            "ok": routed == 2 and out_err < 2e-2 and (grad_err is None or grad_err < 2e-2)
            and not report.unmitigable and report.monitor_errors_total == 0}


def varlen(device: str, dry: bool) -> dict:
    if dry:
        return {"ok": True, "skipped": "torch has no CPU varlen kernel (tests use a stand-in)"}
    from torch.nn.attention.varlen import varlen_attn

    docs = [700, 1300, 48]
    T = sum(docs)
    cu = torch.tensor([0] + docs, device=device).cumsum(0).int()

    def call(q, k, v):  # [1, H, T, D] → packed [T, H, D]
        p = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]
        o = varlen_attn(*p, cu, cu, max(docs), max(docs), window_size=(-1, 0))
        return o.transpose(0, 1).unsqueeze(0)

    torch.manual_seed(0)
    model = nn.Sequential(_Attn(call), _Attn(call)).to(device, torch.bfloat16)
    x = torch.randn(1, T, D_MODEL, device=device, dtype=torch.bfloat16)

    def truth(layer):
        q, k = layer.seen
        s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
        d = torch.repeat_interleave(torch.arange(len(docs), device=device),
                                    torch.tensor(docs, device=device))
        i = torch.arange(T, device=device)
        keep = (d[:, None] == d[None, :]) & (i[:, None] >= i[None, :])
        return _stats(s.masked_fill(~keep, -math.inf))

    with fw.watch(model, config=fw.WatchConfig(every_n_steps=1)) as w:
        model(x).float().square().mean().backward()
        report = w.step()
    return _compare(report, model, truth)
