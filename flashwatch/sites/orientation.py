"""The orientation check: a site's W^Q against the module that computes q.

`find_sites` reads W^Q per head as [H, head_dim, d_model] from a weight that nn.Linear
stores [out, in], transformers' Conv1D [in, out], and a fused projection holds next to K
and V. Read the wrong way (transposed, the wrong slice), W^Q is still a tensor of the
right shape, and every number built on it (spectral norms, the δ error's direction,
QK-clip's scaling) would be quietly wrong for days. So every site's W^Q is checked
once, at discovery, against its q_module: q_module(X) − q_module(0) must equal X·W^Qᵀ on
a seeded input, and a mismatch fails loudly, naming the site and how to pass it.

A slice that is consistent with q_module but not the layer's Q (the K rows of an
interleaved projection) passes this check; flashwatch.sites.layouts.QCheck compares it with
the q the layer hands SDPA on its first monitored call.

The helpers that run q_module as the check needs it (autocast off, sharded weights
gathered) serve QCheck and the reading of interleaved W^Q rows (flashwatch/sites/site.py) too.
"""

from __future__ import annotations

import torch

from flashwatch.sites.site import AttentionSite
from flashwatch.sites.weights import autocast_off, gathered, plain_call

# Tolerance, relative Frobenius error of X·W^Qᵀ. A transposed weight or a wrong slice
# gives two unrelated random maps: error ≈ sqrt(2) ≈ 1.4. BF16 rounding of the output
# gives ≈ 2^-9 ≈ 0.002 and TF32 matmuls ≈ 5e-4, so 0.05 is far from both.
ORIENTATION_RTOL = 0.05


def check_orientation(site: AttentionSite) -> None:
    """Check once that q_module(X)[..., q_slice] == X @ W^Qᵀ (+ bias), per head.

    Uses a seeded 1×2×d_model input in W^Q's dtype and device, under no_grad with
    autocast off, and compares q_module(X) − q_module(0) (the bias cancels) with
    einsum(X, wq()). Raises RuntimeError naming the site when they differ. Sites without
    a q_module, or with weights on the meta device, cannot be checked and pass.
    Sharded weights (DTensor: FSDP2 after `fully_shard`, tensor parallel) are gathered
    for this one check, and q_module runs on the gathered copies (a collective: every
    rank discovers its sites together, as it builds its model).
    """
    if site.q_module is None:
        return
    w = gathered(site.wq())
    if w.device.type == "meta":
        return
    if not w.dtype.is_floating_point:
        raise RuntimeError(f"site {site.name!r}: W^Q has dtype {w.dtype}; flashwatch needs "
                           "floating-point Q weights (quantized layers are not supported)")
    # Own generator: discovery must not move the global RNG, or watching a run would
    # change its data order and dropout masks.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, site.d_model, generator=gen).to(device=w.device, dtype=w.dtype)
    index = site.q_index
    with torch.no_grad(), autocast_off(w.device.type):
        try:
            call = plain_call(site.q_module)
            out, zero = call(x), call(torch.zeros_like(x))
        except Exception as e:
            raise RuntimeError(
                f"site {site.name!r}: calling q_module ({type(site.q_module).__name__}) on a "
                f"[1, 2, {site.d_model}] {w.dtype} input failed ({e}); q_module must take X "
                "of width d_model (the last dim of W^Q)"
            ) from e
        if not isinstance(out, torch.Tensor) or out.shape[:-1] != x.shape[:-1]:
            got = (f"a tensor {list(out.shape)}" if isinstance(out, torch.Tensor)
                   else f"a {type(out).__name__}")
            raise RuntimeError(
                f"site {site.name!r}: q_module ({type(site.q_module).__name__}) returned "
                f"{got} for an input [1, 2, {site.d_model}]; it must return one "
                "tensor [..., channels] whose channels q_slice_of_output selects"
            )
        if int(index.max()) >= out.shape[-1]:
            raise RuntimeError(f"site {site.name!r}: its Q channels ({site.layout} layout) go "
                               f"past the {out.shape[-1]} output channels of q_module")
        out, zero = (t.index_select(-1, index.to(t.device)) for t in (out, zero))
        got = (out.float() - zero.float()).unflatten(-1, (site.num_heads, site.head_dim))
        want = torch.einsum("btc,hdc->bthd", x.float(), w.float())
        err = (got - want).norm().item()
        # Rounding of q_module's output in its own dtype: at most eps/2 per element for each
        # of up to two roundings (matmul, then + bias), so eps·(‖f(X)‖ + ‖f(0)‖) bounds it.
        rounding = torch.finfo(out.dtype).eps * (out.float().norm() + zero.float().norm())
        allowed = ORIENTATION_RTOL * want.norm().item() + rounding.item()
    if not err <= allowed:  # `not <=` so that NaN fails too
        raise RuntimeError(
            f"site {site.name!r} ({site.kind}): W^Q does not match its q_module "
            f"({type(site.q_module).__name__}): |q_module(X) - X W^Qᵀ| = {err:.3g} > "
            f"{allowed:.3g} allowed (relative {err / max(want.norm().item(), 1e-30):.3g}). "
            "The weight is transposed (nn.Linear stores [out, in], Conv1D [in, out]) or "
            "q_slice_of_output selects the wrong channels; pass this site explicitly with "
            "sites={name: dict(num_heads=..., q_module=..., wq=...)} or q_layout=..."
        )


