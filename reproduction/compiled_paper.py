"""Does torch.compile change the paper arithmetic's rounding? (The authors trained compiled.)

    python -m reproduction.compiled_paper [--batch 8 --heads 4 --seq 64 --dim 16]

flashwatch/kernels/paper.py is the authors' attention run eagerly: every op in BF16, each result
rounded. Inductor may fuse ops and keep intermediates in FP32, which would change the
rounding the study measures. This compiles the same forward and backward functions with
inductor (CPU) and compares them with eager on identical BF16 inputs, at typical
(max logit ≈ 10) and large (≈ 200) scores: the share of bit-identical elements of O, LSE,
dq, dk, dv, and the δ error c = δ_used − rowsum(dO ∘ O_exact) (O_exact in FP64) as an RMS
and a mean per row, each arithmetic against its own O. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from flashwatch.kernels import paper
from flashwatch.kernels.common import Mode


def _inputs(B, H, N, D, logit, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, N, D, generator=g) for _ in range(4))
    # scores ≈ logit · (q̂·k̂): q scaled so that the largest ones reach ≈ `logit`
    q = q * (logit / (math.sqrt(D) * 3.0)) * math.sqrt(D)
    return [t.bfloat16() for t in (q, k, v, do)]


def _run(fwd, bwd, q, k, v, do, scale, modes):
    o, lse = fwd(q, k, v, scale, modes)
    dq, dk, dv, delta = bwd(do, q, k, v, o, lse, scale, modes)
    return dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv, delta=delta)


def _fwd(q, k, v, scale, modes):
    r = paper._forward(q, k, v, True, scale, modes, 2.0, 1e-3, False, False)
    return r.o, r.lse


def _bwd(do, q, k, v, o, lse, scale, modes):
    return paper._backward(do, q, k, v, o, lse, None, True, scale, modes)


def _delta_error(out, q, k, v, do, scale):
    """c per row against the FP64 attention output of the same BF16 inputs."""
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    n = q.shape[2]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    o_exact = torch.softmax(s, -1) @ v.double()
    c = out["delta"].double().squeeze(-1) - (do.double() * o_exact).sum(-1)
    return dict(rms=float(c.square().mean().sqrt()), mean=float(c.mean()))


def compare(B=8, H=4, N=64, D=16, seeds=(0, 1, 2)) -> dict:
    scale = 1.0 / math.sqrt(D)
    modes = torch.full((H,), int(Mode.STANDARD), dtype=torch.int32)
    cfwd = torch.compile(_fwd, backend="inductor", dynamic=False)
    cbwd = torch.compile(_bwd, backend="inductor", dynamic=False)
    result = {}
    for logit in (10.0, 200.0):
        equal = {name: [] for name in ("o", "lse", "dq", "dk", "dv")}
        err = {"eager": [], "compiled": []}
        for seed in seeds:
            q, k, v, do = _inputs(B, H, N, D, logit, seed)
            eager = _run(_fwd, _bwd, q, k, v, do, scale, modes)
            comp = _run(cfwd, cbwd, q, k, v, do, scale, modes)
            for name in equal:
                equal[name].append(float((eager[name] == comp[name]).double().mean()))
            err["eager"].append(_delta_error(eager, q, k, v, do, scale))
            err["compiled"].append(_delta_error(comp, q, k, v, do, scale))
        result[f"logit≈{logit:g}"] = {
            "bit_equal_share": {n: sum(x) / len(x) for n, x in equal.items()},
            "delta_error_rms": {a: sum(e["rms"] for e in es) / len(es)
                                for a, es in err.items()},
            "delta_error_mean": {a: sum(e["mean"] for e in es) / len(es)
                                 for a, es in err.items()},
        }
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m reproduction.compiled_paper",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dim", type=int, default=16)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    print(json.dumps(compare(a.batch, a.heads, a.seq, a.dim), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
