"""What the Triton kernel tests share (tests/test_triton_*.py): the device, quantized
inputs, the FP64 oracle with the 2× rule, brute-force counters, planted ties, and a dot
counter for the interpreter.

On a CPU machine the kernels run in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports triton); with TRITON_INTERPRET=0 and a GPU
(benchmarks/gpu_check.py) the same tests run the compiled kernels on CUDA.

Accuracy rule (docs/design.md §8): with ref = FP64 math and pt = plain PyTorch math in the
same low dtype, |out - ref|max ≤ 2·|pt - ref|max + floor, for O and each gradient.
Counters are compared exactly, to the reference and to a brute-force count.
`oracle`, `run`, `check` and `inputs`: the masks, softcap and sliding-window tests'
FP64 oracle, one op call, the 2× rule with counters, and their tie-rich inputs.

Inputs for counter tests are multiples of 1/8 in [-2, 2] (q, k): every product is a
multiple of 1/64 and every partial sum of ≤ 128 terms is exact in FP32, so S is
bit-identical whatever order a dot sums in, and ties are exact ties.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see conftest)

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

import flashwatch as fw  # noqa: E402
from flashwatch.kernels import reference  # noqa: E402
from flashwatch.kernels import triton_attention as ta  # noqa: E402
from flashwatch.kernels import triton_tuning as tuning  # noqa: E402,F401 (tests patch it)
from flashwatch.kernels.common import GUARD_NATS, Mode  # noqa: E402

if ta.INTERPRET:
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device",
                allow_module_level=True)

# The interpreter's forward uses 16-row/16-key blocks; these lengths give 3 blocks with
# a ragged end, and Nq != Nk.
NQ, NK = 37, 45
B, H = 2, 3  # the batch and heads of `inputs` (one head per mode)
DTYPES = (torch.bfloat16, torch.float16)
ALL_MODES = [int(Mode.STANDARD), int(Mode.BETA), int(Mode.FP32_O)]


def quantized(*shape, gen, dtype):
    """Multiples of 1/8 in [-2, 2]: exact scores (see module docstring), frequent ties."""
    return (torch.randint(-16, 17, shape, generator=gen) / 8).to(dtype).to(DEVICE)


def causal_mask(nq, nk, device):
    return torch.arange(nk, device=device)[None, :] > torch.arange(nq, device=device)[:, None]


def plain_attention(q, k, v, causal, scale):
    """softmax(scale·QKᵀ)V in whatever dtype q, k, v have (FP64 ref or low-dtype pt)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(causal_mask(q.shape[2], k.shape[2], q.device), -math.inf)
    return torch.matmul(torch.softmax(s, dim=-1), v)


def run_plain(q, k, v, do, causal, scale, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    o = plain_attention(*leaves, causal, scale)
    o.backward(do.to(dtype))
    return [o.detach()] + [t.grad for t in leaves]


def run_triton(q, k, v, do, causal, scale, modes, stats=None, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = fw.attention(*leaves, causal=causal, scale=scale, head_modes=modes, stats=stats,
                     backend="triton", **kw)
    o.backward(do)
    return [o.detach()] + [t.grad for t in leaves]


def assert_accuracy(outs, q, k, v, do, causal, scale, floor=1e-5):
    ref = run_plain(q, k, v, do, causal, scale, torch.float64)
    pt = run_plain(q, k, v, do, causal, scale, q.dtype)
    for name, out, r, p in zip(("o", "dq", "dk", "dv"), outs, ref, pt, strict=True):
        assert torch.isfinite(out).all(), f"{name} has non-finite values"
        err = (out.double() - r).abs().max().item()
        pt_err = (p.double() - r).abs().max().item()
        assert err <= 2 * pt_err + floor, (
            f"{name}: |triton - fp64| = {err:.3g} > 2·|pytorch {q.dtype} - fp64| "
            f"= 2·{pt_err:.3g} (+{floor:g})")


def brute_force_counters(q, k, causal, scale, modes, beta=2.0, eps=1e-3):
    """Tie, guard and max-logit counters from the full score matrix, no blocking."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(causal_mask(q.shape[2], k.shape[2], q.device), -math.inf)
    m = s.amax(-1)
    tied = ((s >= (m - eps).unsqueeze(-1)) & (s != -math.inf)).sum(-1) >= 2
    excess = torch.where(m > 0, (beta - 1.0) * m, -m)
    beta_h = (torch.as_tensor(modes, device=q.device) == int(Mode.BETA)).view(1, -1, 1)
    guarded = tied & beta_h & (excess > GUARD_NATS[q.dtype])
    return tied.sum((0, 2)).cpu(), guarded.sum((0, 2)).cpu(), m.amax((0, 2)).cpu()


def assert_counters(stats, q, k, causal, scale, modes):
    tied, guarded, max_logit = brute_force_counters(q, k, causal, scale, modes)
    assert stats.tied_rows.cpu().tolist() == tied.tolist()
    assert stats.guarded_rows.cpu().tolist() == guarded.tolist()
    assert stats.rows.cpu().tolist() == [q.shape[0] * q.shape[2]] * q.shape[1]
    assert torch.equal(stats.max_logit.cpu(), max_logit)
    # and the reference agrees with both
    ref_stats = fw.AttentionStats.zeros(q.shape[1])
    reference.attention(q.cpu(), k.cpu(), k.cpu(), causal=causal, scale=scale,
                        head_modes=modes, stats=ref_stats)
    for name in ("tied_rows", "guarded_rows", "rows", "max_logit"):
        assert torch.equal(getattr(stats, name).cpu(), getattr(ref_stats, name)), name


def run_plain_reference(q, k, v, do, causal, scale, modes):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = reference.attention(*leaves, causal=causal, scale=scale, head_modes=modes)
    o.backward(do)
    return [o.detach().float()] + [t.grad.float() for t in leaves]


def count_dots(monkeypatch):
    """Patch the interpreter so that every tl.dot executed is counted; returns the list
    the counts go to (one entry per dot)."""
    from triton.runtime.interpreter import InterpreterBuilder

    calls = []
    real = InterpreterBuilder.create_dot

    def counting(self, *args, **kwargs):
        calls.append(args[0].data.shape)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(InterpreterBuilder, "create_dot", counting)
    return calls


def transposed(b, n, h, d, gen, dtype=torch.bfloat16):
    """[B, H, N, D] view of a [B, N, H, D] tensor, as a model that splits heads makes."""
    return torch.randn(b, n, h, d, generator=gen).to(dtype).to(DEVICE).transpose(1, 2)


def planted_ties(dtype, big=False):
    """Rows built to hit every branch of the online tie count. Returns (q, k, scale, tied).

    Query i = e_{i mod 8}, so its scores are `scale · k[:, i mod 8]`: column c of K is the
    score pattern of the 5 rows ≡ c (mod 8). Keys sit in the interpreter's 16-key blocks
    [0,16) [16,32) [32,40). With scale 0.02 and key values near 4 (bf16 spacing 1/32),
    neighbouring values are 0.000625 apart in score, within eps = 1e-3. big=True: values
    near 64 and scale 16, scores ≈ ±1024 (BETA's excess far above the guard); the near
    ties of columns 1 and 3 are then 8 apart and no longer ties.
    """
    nk, nq, d = 40, 40, 16
    gen = torch.Generator().manual_seed(11)
    kk = torch.rand(nk, d, generator=gen) * 2 - 1  # background: scores far below the max
    top, step, scale = (64.0, 0.5, 16.0) if big else (4.0, 1 / 32, 0.02)
    kk[[3, 35], 0] = top  # exact tie split across blocks 0 and 2
    kk[5, 1], kk[20, 1] = top, top + step  # later max, within eps above: tied
    kk[[2, 4], 2], kk[30, 2] = top, top + 2 * step  # tie, then a max > eps higher: not tied
    kk[1, 3], kk[33, 3] = top + step, top  # earlier max, later one within eps below: tied
    kk[7, 4] = top  # unique max
    kk[[0, 17, 39], 5] = top  # three-way tie, one in the ragged last block
    kk[[8, 9], 6] = top  # tie inside one block
    kk[:, 7] = kk[:, 7] - top - 3  # all well below -top ...
    kk[[10, 38], 7] = -top  # ... except a tie at a negative max (BETA excess = -r_m)
    q = torch.zeros(nq, d)
    q[torch.arange(nq), torch.arange(nq) % 8] = 1.0

    def heads(t):
        return t.to(dtype).expand(1, 3, *t.shape).contiguous().to(DEVICE)

    tied_cols = [0, 5, 6, 7] if big else [0, 1, 3, 5, 6, 7]
    return heads(q), heads(kk), scale, 5 * len(tied_cols)


def oracle(q, k, v, do, *, causal, scale, attn_mask=None, softcap=None,
           sliding_window=None):
    """FP64 attention with autograd: scale·QKᵀ, cap·tanh(s/cap), then causal, the sliding
    window (i - j >= window hidden) and attn_mask hide keys (bool False → hidden, float →
    added). A row with no visible key
    gives O = 0, LSE = +inf and zero gradients."""
    q, k, v = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(s.shape[-2])[:, None]
    j = torch.arange(s.shape[-1])[None, :]
    hidden = (j > i) if causal else torch.zeros(s.shape[-2:], dtype=torch.bool)
    if sliding_window is not None:
        hidden = hidden | (i - j >= sliding_window)
    if attn_mask is not None:
        m = attn_mask.cpu()
        if m.dtype == torch.bool:
            hidden = hidden | ~m
        else:
            s = s + m.double()
    s = s.masked_fill(hidden, -math.inf)
    mx = s.amax(-1, keepdim=True).detach()
    mx = torch.where(torch.isfinite(mx), mx, 0.0)
    e = torch.exp(s - mx)
    l = e.sum(-1, keepdim=True)
    o = torch.matmul(e / torch.where(l == 0, 1.0, l), v)
    lse = torch.where(l == 0, math.inf, mx + torch.log(l)).squeeze(-1)
    o.backward(do.cpu().double())
    return dict(o=o.detach(), lse=lse.detach(), dq=q.grad, dk=k.grad, dv=v.grad)


def run(backend, q, k, v, do, *, causal, scale, modes=ALL_MODES, **kw):
    """One forward and backward through the op (LSE and counters included)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    modes = torch.tensor(modes, dtype=torch.int32)
    o, lse, _o32, tied, guarded, max_logit = torch.ops.flashwatch.attention_fwd(
        *leaves, modes, causal, scale, 2.0, 1e-3, True, backend, **kw)
    o.backward(do)
    grads = [t.grad.cpu() for t in leaves]
    return dict(o=o.detach().cpu(), lse=lse.cpu(), dq=grads[0], dk=grads[1], dv=grads[2],
                tied=tied.cpu(), guarded=guarded.cpu(), max_logit=max_logit.cpu())


def check(q, k, v, do, *, causal, scale, exact_max=True, **kw):
    """Triton within 2× the reference's error against FP64; counters as the reference's.
    Returns the Triton results."""
    tri = run("triton", q, k, v, do, causal=causal, scale=scale, **kw)
    ref = run("reference", q, k, v, do, causal=causal, scale=scale, **kw)
    truth = oracle(q, k, v, do, causal=causal, scale=scale, **kw)
    for name, t in truth.items():
        a, r = tri[name].double(), ref[name].double()
        assert not a.isnan().any(), f"{name}: NaN"
        fin = torch.isfinite(t)
        assert torch.equal(torch.isfinite(a), fin), f"{name}: non-finite where FP64 is not"
        err = (a - t)[fin].abs().max().item()
        err_ref = (r - t)[fin].abs().max().item()
        floor = 1e-6 * max(1.0, t[fin].abs().max().item())
        assert err <= 2 * err_ref + floor, (
            f"{name}: |triton - fp64| = {err:.3g} > 2·|reference - fp64| = 2·{err_ref:.3g}")
    assert torch.equal(tri["tied"], ref["tied"]), (tri["tied"], ref["tied"])
    assert torch.equal(tri["guarded"], ref["guarded"])
    if exact_max:
        assert torch.equal(tri["max_logit"], ref["max_logit"])
    else:  # tanh is not correctly rounded (torch's nor the kernel's): a few FP32 ulps
        torch.testing.assert_close(tri["max_logit"], ref["max_logit"], rtol=2e-7, atol=0)
    return tri


def inputs(nq, nk, d, dtype, seed, scale_v=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = quantized(B, H, nq, d, gen=gen, dtype=dtype)
    k = quantized(B, H, nk, d, gen=gen, dtype=dtype)
    third = nk // 3
    k[:, :, nk - third:] = k[:, :, :third]  # ties across blocks: BETA shifts mid-row
    v = (scale_v * torch.randn(B, H, nk, d, generator=gen)).to(dtype).to(DEVICE)
    do = torch.randn(B, H, nq, d, generator=gen).to(dtype).to(DEVICE)
    return q, k, v, do


def assert_compiled_matches_eager(compiled, step, q, k, v, do, *args):
    """`compiled(q, k, v, *args, stats)` and `step` (eager) on fresh leaves and stats:
    the same O, gradients and counters, bit for bit."""
    h = q.shape[1]
    stats, stats_eager = fw.AttentionStats.zeros(h), fw.AttentionStats.zeros(h)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    leaves_e = [t.clone().requires_grad_() for t in (q, k, v)]
    out = compiled(*leaves, *args, stats)
    out.backward(do)
    out_e = step(*leaves_e, *args, stats_eager)
    out_e.backward(do)
    assert torch.equal(out, out_e)
    for a, b in zip(leaves, leaves_e, strict=True):
        assert torch.equal(a.grad, b.grad)
    for name in ("tied_rows", "rows", "guarded_rows", "max_logit"):
        assert torch.equal(getattr(stats, name), getattr(stats_eager, name)), name
