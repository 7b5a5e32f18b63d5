"""A 4-layer Llama-shaped model whose 16 heads each have their own W^Q scale (a number
reported under the wrong layer or head shows), the layers named as in the full model
whatever part of it a rank holds, and its FP64 truth over every row: the model of the
pipeline and tensor-parallel tests (tests/parallel/)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

D_MODEL, H, N_LAYERS, VOCAB, T, B = 32, 4, 4, 64, 12, 3
EPS = 0.3  # wide, so that ties are common (≈ 0.1–0.9 of rows) and counted exactly


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads, self.head_dim = H, D_MODEL // H
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(D_MODEL, D_MODEL, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        # -1 heads: the local ones when tensor parallelism splits the projections
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D_MODEL)
        self.attention = Attention()

    def forward(self, x):
        return x + self.attention(self.norm(x))


def full_model() -> nn.ModuleDict:
    """The whole model, the same on every rank: each head's W^Q rows scaled by its own
    factor (0.6 … 3.9 over the 16 heads)."""
    torch.manual_seed(0)
    m = nn.ModuleDict(dict(embed=nn.Embedding(VOCAB, D_MODEL),
                           layers=nn.ModuleDict({str(i): Block() for i in range(N_LAYERS)}),
                           head=nn.Linear(D_MODEL, VOCAB)))
    with torch.no_grad():
        for i, blk in m["layers"].items():
            w = blk.attention.q_proj.weight.view(H, -1, D_MODEL)
            for h in range(H):
                w[h] *= 0.6 + 0.22 * (int(i) * H + h)
    return m


class Stage(nn.Module):
    """One pipeline stage: its layers keep their names from the full model (layers.2)."""

    def __init__(self, full: nn.ModuleDict, layers: list[int], first: bool, last: bool):
        super().__init__()
        self.embed = full["embed"] if first else None
        self.layers = nn.ModuleDict({str(i): full["layers"][str(i)] for i in layers})
        self.head = full["head"] if last else None

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for blk in self.layers.values():
            x = blk(x)
        return self.head(x) if self.head is not None else x


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (B, T + 1), generator=g)


def truth(full: nn.ModuleDict, tokens) -> dict:
    """Per (layer, head), in FP64 over every row: max logit, tied rows / rows, W^Q σ."""
    m = {k: v for k, v in full.items()}
    x = m["embed"].weight.double()[tokens[:, :-1]]
    B = tokens.shape[0]  # noqa: N806 (any number of sequences: DP ranks' batches together)
    out = {}
    for i in range(N_LAYERS):
        blk = m["layers"][str(i)]
        att = blk.attention
        xn = F.layer_norm(x, (D_MODEL,), blk.norm.weight.double(), blk.norm.bias.double())
        q = (xn @ att.q_proj.weight.double().T).view(B, T, H, -1).transpose(1, 2)
        k = (xn @ att.k_proj.weight.double().T).view(B, T, H, -1).transpose(1, 2)
        v = (xn @ att.v_proj.weight.double().T).view(B, T, H, -1).transpose(1, 2)
        s = q @ k.transpose(-1, -2) / (D_MODEL // H) ** 0.5
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -torch.inf)
        rmax = s.amax(-1, keepdim=True)
        tied = ((s >= rmax - EPS).sum(-1) >= 2).double()  # [B, H, T]
        wq = att.q_proj.weight.double().view(H, -1, D_MODEL)
        for h in range(H):
            out[(f"layers.{i}.attention", h)] = dict(
                max_logit=float(s[:, h].amax()), tie=float(tied[:, h].mean()),
                sigma=float(torch.linalg.matrix_norm(wq[h], ord=2)))
        o = torch.softmax(s, -1) @ v
        x = x + o.transpose(1, 2).reshape(B, T, -1) @ att.o_proj.weight.double().T
    return out


def pipeline_step(stage, rank, tokens, opt):
    """Forward stage 0 → 1, backward 1 → 0, by send/recv on the default group."""
    import torch.distributed as dist

    if rank == 0:
        act = stage(tokens[:, :-1])
        dist.send(act.detach(), 1)
        grad = torch.empty_like(act)
        dist.recv(grad, 1)
        act.backward(grad)
    else:
        act = torch.empty(B, T, D_MODEL)
        dist.recv(act, 0)
        act.requires_grad_(True)
        logits = stage(act)
        F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        dist.send(act.grad, 0)
    opt.step()
    opt.zero_grad()


def tp_model(mesh) -> Stage:
    """The whole model with each layer's heads split over `mesh` (torchtitan's plan:
    ColwiseParallel q/k/v, RowwiseParallel o), the module's head count left global."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = Stage(full_model(), list(range(N_LAYERS)), first=True, last=True)
    for blk in model.layers.values():
        parallelize_module(blk.attention, mesh, {
            "q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
            "v_proj": ColwiseParallel(), "o_proj": RowwiseParallel()})
    return model
