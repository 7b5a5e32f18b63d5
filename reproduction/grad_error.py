"""The paper's Eq. 3 measured exactly: dW^Q_hp - dW^Q_lp per head, on real batches.

    python -m reproduction.grad_error --run runs/repro/uniform-v16/unmitigated-s0
    python -m reproduction.grad_error --config uniform-v16     # the freshly initialised model

Loads a run's final weights (model.pt) and settings, or initialises the configuration's
model, then for `--batches` batches of its data runs one forward in the paper
arithmetic and two backwards through it: one with δ = rowsum(dO ∘ O_bf16) (what
training used), one with δ from O kept in FP32 (the forward is the same; only δ
differs). Δ = dW^Q(FP32 δ) - dW^Q(BF16 δ) per head (d_head × d_model) is the error the
paper says piles up. Per head it reports:
  rel_error    mean ‖Δ‖ / mean ‖dW^Q‖: how large the error is next to the gradient
  coherence    ‖Σ Δ‖ / Σ ‖Δ‖ over the batches: 1 if Δ points the same way every time,
               ≈ 1/sqrt(batches) if its direction is random
  bias_noise   ‖mean Δ‖ / rms ‖dW^Q - mean dW^Q‖: the persistent part of the error
               against the batch-to-batch noise of the gradient (what Adam divides by)
  align_sigma  ⟨mean Δ, u₁v₁ᵀ⟩ / ‖mean Δ‖ with (u₁, v₁) W^Q's top singular pair: > 0
               means the error, applied by training, grows the spectral norm
  tied         tied-rowmax ratio of the head on these batches
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from examples.gpt import GPT, GPTConfig
from flashwatch.kernels import reference
from flashwatch.kernels.common import Mode
from reproduction.run import make_data, settings_for


class _PaperAttention(torch.autograd.Function):
    """Causal attention in the paper arithmetic whose backward takes δ from the BF16 O
    or, when `fp32_delta` is set at backward time, from an FP32 recomputation."""

    fp32_delta = False
    tied: list = []

    @staticmethod
    def forward(ctx, q, k, v):
        H, scale = q.shape[1], 1.0 / math.sqrt(q.shape[-1])
        std = torch.zeros(H, dtype=torch.int32)
        res = reference.forward(q, k, v, causal=True, scale=scale, modes=std, beta=2.0,
                                eps=1e-3, arithmetic="paper")
        hp = reference.forward(q.float(), k.float(), v.float(), causal=True, scale=scale,
                               modes=std, beta=2.0, eps=1e-3, want_ties=False)
        _PaperAttention.tied.append(res.tied_rows.double() / res.rows)
        ctx.save_for_backward(q, k, v, res.o, res.lse, hp.o)
        ctx.scale = scale
        return res.o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, o32 = ctx.saved_tensors
        H = q.shape[1]
        if _PaperAttention.fp32_delta:
            modes, o32_arg = torch.full((H,), int(Mode.FP32_O), dtype=torch.int32), o32
        else:
            modes, o32_arg = torch.zeros(H, dtype=torch.int32), None
        dq, dk, dv, _ = reference.backward(do, q, k, v, o, o32_arg, lse, causal=True,
                                           scale=ctx.scale, modes=modes,
                                           block_n=reference.PAPER_BLOCK_N)
        return dq, dk, dv


class _Route(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            return _PaperAttention.apply(*args[:3])
        return func(*args, **(kwargs or {}))


def measure(model: GPT, data: torch.Tensor, s: dict, batches: int, seed: int) -> list[dict]:
    C, H = model.config.n_embd, model.config.n_head
    D = C // H
    layers = [blk.attn for blk in model.transformer.h]
    gen = torch.Generator().manual_seed(seed + 12345)  # batches unlike training's
    deltas, grads = [], []  # per batch: [L, H, D, C]
    _PaperAttention.tied = []

    def wq_grads():
        return torch.stack([a.c_attn.weight.grad[:C].view(H, D, C).clone() for a in layers])

    for _ in range(batches):
        ix = torch.randint(len(data) - s["block"] - 1, (s["batch"],), generator=gen)
        x = torch.stack([data[i:i + s["block"]] for i in ix])
        y = torch.stack([data[i + 1:i + s["block"] + 1] for i in ix])
        model.zero_grad(set_to_none=True)
        with _Route(), torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(x, y)
        _PaperAttention.fp32_delta = False
        loss.backward(retain_graph=True)
        g_lp = wq_grads()
        model.zero_grad(set_to_none=True)
        _PaperAttention.fp32_delta = True
        loss.backward()
        g_hp = wq_grads()
        deltas.append((g_hp - g_lp).double())
        grads.append(g_hp.double())
    Dl, G = torch.stack(deltas), torch.stack(grads)  # [T, L, H, D, C]
    tied = torch.stack(_PaperAttention.tied).view(batches, len(layers), H).mean(0)
    out = []
    for li, attn in enumerate(layers):
        wq = attn.c_attn.weight.detach()[:C].view(H, D, C).double()
        for h in range(H):
            d, g = Dl[:, li, h], G[:, li, h]
            mean_d = d.mean(0)
            noise = (g - g.mean(0)).flatten(1).norm(dim=1).square().mean().sqrt()
            u, _, vh = torch.linalg.svd(wq[h])
            top = torch.outer(u[:, 0], vh[0])
            out.append(dict(
                layer=li, head=h,
                rel_error=float(d.flatten(1).norm(dim=1).mean() / g.flatten(1).norm(dim=1).mean()),
                coherence=float(d.sum(0).norm() / d.flatten(1).norm(dim=1).sum()),
                bias_noise=float(mean_d.norm() / noise),
                align_sigma=float((mean_d * top).sum() / mean_d.norm()),
                tied=float(tied[li, h]),
                wq_sigma=float(torch.linalg.matrix_norm(wq[h], ord=2)),
            ))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m reproduction.grad_error", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", type=Path, help="a run directory of reproduction.run")
    src.add_argument("--config", help="a configuration, measured at initialisation")
    p.add_argument("--batches", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the per-head numbers here")
    a = p.parse_args(argv)
    torch.manual_seed(a.seed)
    if a.run:
        summ = json.loads((a.run / "summary.json").read_text())
        s, seed = summ["settings"], summ["seed"]
    else:
        s, seed = settings_for(a.config), a.seed
    model = GPT(GPTConfig(block_size=s["block"], vocab_size=s["vocab"], n_layer=s["n_layer"],
                          n_head=s["n_head"], n_embd=s["n_embd"],
                          position_embedding=s["position_embedding"]))
    if a.run:
        model.load_state_dict(torch.load(a.run / "model.pt"))
    rows = measure(model, make_data(s, seed), s, a.batches, seed)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")
    print("| layer/head | tied | W^Q σ | rel_error | coherence | bias_noise | align_sigma |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layer']}/{r['head']} | {r['tied']:.2f} | {r['wq_sigma']:.2f} | "
              f"{r['rel_error']:.2e} | {r['coherence']:.3f} | {r['bias_noise']:.2e} | "
              f"{r['align_sigma']:+.2f} |")
    print(f"random-direction coherence for {a.batches} batches ≈ "
          f"{1 / math.sqrt(a.batches):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
