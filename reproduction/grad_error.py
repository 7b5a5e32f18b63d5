"""The paper's Eq. 3 measured exactly: dW^Q_hp - dW^Q_lp per head, on real batches.

    python -m reproduction.grad_error --run runs/repro/uniform-v16/unmitigated-s0
    python -m reproduction.grad_error --config uniform-v16     # the freshly initialised model
    python -m reproduction.grad_error --run DIR --weights model_step250.pt   # (--save-every)

Loads a run's final weights (model.pt) and settings, or initialises the configuration's
model, then for `--batches` batches of its data runs one forward in the paper
arithmetic and two backwards through it: one with δ = rowsum(dO ∘ O_bf16) (what
training used), one with δ from O kept in FP32 (the forward is the same; only δ
differs). Δ = dW^Q(FP32 δ) - dW^Q(BF16 δ) per head (d_head × d_model) is the error the
paper says piles up. Per head it reports:
  rel_error    mean ‖Δ‖ / mean ‖dW^Q‖: how large the error is next to the gradient
  coherence    ‖Σ Δ‖ / Σ ‖Δ‖ over the batches: 1 if Δ points the same way every time,
               ≈ 1/sqrt(batches) if its direction is random
  bias_noise   ‖mean Δ‖ / rms ‖g - mean g‖ with g the gradient training used (BF16 δ):
               the error's mean against the batch-to-batch noise Adam divides by. With
               no persistent part it is ≈ ‖Δ‖/(‖g‖·sqrt(batches)) from sampling alone
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

from examples.gpt import GPT, GPTConfig
from reproduction.fp32_delta import Fp32DeltaAttention, RouteSDPA
from reproduction.run import get_batch, make_data, settings_for


def wq_grad_pair(model: GPT, x, y) -> tuple[torch.Tensor, torch.Tensor]:
    """dW^Q per layer and head [L, H, D, C] (float64) with BF16 δ and with FP32 δ, from
    one forward in the paper arithmetic and two backwards; leaves the grads zeroed."""
    C, H = model.config.n_embd, model.config.n_head
    D = C // H
    layers = [blk.attn for blk in model.transformer.h]

    def wq_grads():
        return torch.stack([a.c_attn.weight.grad[:C].view(H, D, C).double() for a in layers])

    model.zero_grad(set_to_none=True)
    with RouteSDPA(), torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(x, y)
    Fp32DeltaAttention.fp32_delta = False
    loss.backward(retain_graph=True)
    g_lp = wq_grads()
    model.zero_grad(set_to_none=True)
    Fp32DeltaAttention.fp32_delta = True
    loss.backward()
    Fp32DeltaAttention.fp32_delta = False
    g_hp = wq_grads()
    model.zero_grad(set_to_none=True)
    return g_lp, g_hp


def measure(model: GPT, data: torch.Tensor, s: dict, batches: int, seed: int) -> list[dict]:
    C, H = model.config.n_embd, model.config.n_head
    D = C // H
    layers = [blk.attn for blk in model.transformer.h]
    gen = torch.Generator().manual_seed(seed + 12345)  # batches unlike training's
    g_hp_all, g_lp_all = [], []  # per batch: [L, H, D, C]
    Fp32DeltaAttention.tied, Fp32DeltaAttention.record_ties = [], True
    for _ in range(batches):
        x, y = get_batch(data, s, gen)
        g_lp, g_hp = wq_grad_pair(model, x, y)
        g_lp_all.append(g_lp)
        g_hp_all.append(g_hp)
    G, Glp = torch.stack(g_hp_all), torch.stack(g_lp_all)  # [T, L, H, D, C]
    Dl = G - Glp
    Fp32DeltaAttention.fp32_delta = Fp32DeltaAttention.record_ties = False
    tied = torch.stack(Fp32DeltaAttention.tied).view(batches, len(layers), H).mean(0)
    out = []
    for li, attn in enumerate(layers):
        wq = attn.c_attn.weight.detach()[:C].view(H, D, C).double()
        for h in range(H):
            d, g, glp = Dl[:, li, h], G[:, li, h], Glp[:, li, h]
            mean_d = d.mean(0)
            noise = (glp - glp.mean(0)).flatten(1).norm(dim=1).square().mean().sqrt()
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
    p.add_argument("--weights", default="model.pt",
                   help="weights file in the run directory (e.g. model_step250.pt)")
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
        model.load_state_dict(torch.load(a.run / a.weights))
    rows = measure(model, make_data(s, seed), s, a.batches, seed)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")
    print("| layer/head | tied | W^Q σ | rel_error | coherence | bias_noise | align_sigma |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layer']}/{r['head']} | {r['tied']:.2f} | {r['wq_sigma']:.2f} | "
              f"{r['rel_error']:.2e} | {r['coherence']:.3f} | {r['bias_noise']:.2e} | "
              f"{r['align_sigma']:+.2f} |")
    rand = 1 / math.sqrt(a.batches)
    med = sorted(r["rel_error"] for r in rows)[len(rows) // 2]
    coh = sorted(r["coherence"] for r in rows)[len(rows) // 2]
    high = sum(r["coherence"] > 2 * rand for r in rows)
    print(f"random-direction coherence for {a.batches} batches ≈ {rand:.3f}; median "
          f"rel_error {med:.2e}, median coherence {coh:.3f}, heads with coherence > "
          f"{2 * rand:.3f}: {high}/{len(rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
