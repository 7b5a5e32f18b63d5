"""delta_error_share against the exact Eq. 3 on checkpoints of a reproduction run.

    python -m reproduction.run --config nope-grammar-hotter --arm unmitigated --seed 0 \
        --save-every 50 --stop-after 250 --out /tmp/ckpt
    OMP_NUM_THREADS=1 python -m benchmarks.share_validation --run /tmp/ckpt \
        --weights model_step100.pt model_step200.pt model.pt --batches 4

For each checkpoint and batch (the run's own data, batches unlike training's), in the
paper arithmetic as the run trained (reproduction.fp32_delta, a foreign kernel to the
watcher):
  exact      ‖dW^Q_h(FP32 δ) - dW^Q_h(BF16 δ)‖_F / ‖dW^Q_h(BF16 δ)‖_F: two backwards
             through one forward (reproduction.grad_error's measurement)
  estimated  the watcher's delta_error_share on a forward/backward of the same batch,
             rows_per_head=64 (default) and "all" (the model's attention a foreign
             kernel to the watcher, c from an FP32 recomputation), and "own": SDPA routed
             to the watcher's backend="paper" (the same arithmetic), c on every row from
             the kernel's BF16 δ and FP32 O
Per head it averages over batches (the squares, as the estimator is unbiased for ‖E‖²)
and prints the median over heads of estimated / exact.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from pathlib import Path

import torch

import flashwatch as fw
from examples.gpt import GPT, GPTConfig
from reproduction.fp32_delta import Fp32DeltaAttention, RouteSDPA
from reproduction.grad_error import wq_grad_pair
from reproduction.run import get_batch, make_data


def exact_share(model, x, y):
    """‖dW^Q(FP32 δ) - dW^Q(BF16 δ)‖² and ‖dW^Q(BF16 δ)‖² per layer and head [L, H]."""
    g_lp, g_hp = wq_grad_pair(model, x, y)
    return (g_hp - g_lp).flatten(2).square().sum(-1), g_lp.flatten(2).square().sum(-1)


def eq3_share(model, x, y):
    """‖E_h‖² and ‖dW^Q_h‖² per layer and head [L, H], E_h = α Σ_T c[T] PK[T] X[T]ᵀ summed
    in FP64 over every row: the paper's Eq. 3 term of the layer itself, with c[T] = the
    BF16 δ the backward used − rowsum(dO ∘ O_fp32) and P exact. This is what
    delta_error_share estimates; the two-backward `exact_share` also holds the BF16
    rounding of dS = P·α·(dP − δ), which the paper backward forms in BF16."""
    C, H = model.config.n_embd, model.config.n_head
    D = C // H
    layers = [blk.attn for blk in model.transformer.h]
    xs: list = []
    hooks = [a.c_attn.register_forward_pre_hook(lambda m, args: xs.append(args[0].detach()))
             for a in layers]
    model.zero_grad(set_to_none=True)
    Fp32DeltaAttention.rows, Fp32DeltaAttention.record_rows = [], True
    try:
        with RouteSDPA(), torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
    finally:
        Fp32DeltaAttention.record_rows = False
        for h in hooks:
            h.remove()
    e2, g2 = [], []
    for li, (a, (q, k, do, o, o32)) in enumerate(zip(layers, reversed(Fp32DeltaAttention.rows),
                                                      strict=True)):
        scale = D ** -0.5
        T = q.shape[2]
        s = (q.double() @ k.double().transpose(-1, -2)) * scale
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        pk = torch.softmax(s, -1) @ k.double()  # [B, H, T, D]
        c = (do * o).sum(-1).double() - (do.double() * o32.double()).sum(-1)  # [B, H, T]
        E = scale * torch.einsum("bht,bhtd,btc->hdc", c, pk, xs[li].double())
        g = a.c_attn.weight.grad[:C].view(H, D, C).double()
        e2.append(E.flatten(1).square().sum(-1))
        g2.append(g.flatten(1).square().sum(-1))
    model.zero_grad(set_to_none=True)
    return torch.stack(e2), torch.stack(g2)


def estimated_share(model, x, y, rows):
    own = rows == "own"
    w = fw.watch(model, every_n_steps=1, rows_per_head=64 if own else rows,
                 mitigation="off", backend="paper", route_all=own)
    model.zero_grad(set_to_none=True)
    with RouteSDPA() if not own else contextlib.nullcontext(), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(x, y)
    loss.backward()
    report = w.step()
    w.remove()
    model.zero_grad(set_to_none=True)
    L, H = model.config.n_layer, model.config.n_head
    return torch.tensor([h.delta_error_share for h in report.heads],
                        dtype=torch.float64).view(L, H)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.share_validation",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--weights", nargs="+", default=["model.pt"])
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    summ = json.loads((a.run / "summary.json").read_text())
    s = summ["settings"]
    data = make_data(s, summ["seed"])
    cfg = GPTConfig(block_size=s["block"], vocab_size=s["vocab"], n_layer=s["n_layer"],
                    n_head=s["n_head"], n_embd=s["n_embd"],
                    position_embedding=s["position_embedding"])
    H = cfg.n_head
    out = []
    for weights in a.weights:
        model = GPT(cfg)
        model.load_state_dict(torch.load(a.run / weights))
        gen = torch.Generator().manual_seed(summ["seed"] + 12345)
        e2 = g2 = q2 = 0.0
        est = {64: 0.0, "all": 0.0, "own": 0.0}
        for _ in range(a.batches):
            x, y = get_batch(data, s, gen)
            err2, grad2 = exact_share(model, x, y)
            e2, g2 = e2 + err2 / grad2, g2 + 1
            eq2, gq2 = eq3_share(model, x, y)
            q2 = q2 + eq2 / gq2
            for rows in est:
                est[rows] = est[rows] + estimated_share(model, x, y, rows).square()
        exact = (e2 / g2).sqrt()
        eq3 = (q2 / a.batches).sqrt()
        line = {"weights": weights}
        for rows, sq in est.items():
            ratio = ((sq / a.batches).sqrt() / eq3).flatten().tolist()
            line[f"median_ratio_{rows}"] = statistics.median(ratio)
            line[f"ratio_{rows}"] = ratio
        line["exact"] = exact.flatten().tolist()
        line["eq3"] = eq3.flatten().tolist()
        line["median_eq3_over_two_backwards"] = statistics.median(
            (eq3 / exact).flatten().tolist())
        line["estimated_64"] = (est[64] / a.batches).sqrt().flatten().tolist()
        line["estimated_all"] = (est["all"] / a.batches).sqrt().flatten().tolist()
        out.append(line)
        print(f"{weights}: two-backward share median {statistics.median(line['exact']):.3g} "
              f"(max {max(line['exact']):.3g}), Eq. 3 share median "
              f"{statistics.median(line['eq3']):.3g} (Eq. 3 / two-backward median "
              f"{line['median_eq3_over_two_backwards']:.2f}); estimated / Eq. 3 median: "
              f"rows 64 {line['median_ratio_64']:.2f}, all rows "
              f"{line['median_ratio_all']:.2f}, own paper kernel "
              f"{line['median_ratio_own']:.2f}", flush=True)
        print("  layer/head  exact  est64  est_all: " + "  ".join(
            f"{i // H}/{i % H} {ex:.3g} {e64:.3g} {ea:.3g}" for i, (ex, e64, ea) in
            enumerate(zip(line["exact"], line["estimated_64"], line["estimated_all"],
                          strict=True))), flush=True)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
