"""`flashwatch.diagnose(model, batches)`: which attention heads look like the BF16
flash-attention failure, measured exactly on a saved model (docs/diagnose.md).

For each batch, one forward in the model's own arithmetic (autocast to `dtype`, its
own SDPA) and one backward; every attention call is measured on every row in FP64
(flashwatch/diagnosis/measure.py), one batch and one layer at a time. Per layer and head:

  tied_ratio        rows whose max score is tied (≥ 2 scores within eps) / rows
  max_logit         largest scaled score α q·k over every row
  delta_share       mean_b ‖E_b‖ / mean_b ‖dW^Q_b‖: the δ error's part of the head's W^Q
                    gradient (Eq. 3; dW^Q with the exact δ), as reproduction/grad_error.py
  delta_coherence   ‖Σ_b E_b‖ / Σ_b ‖E_b‖: 1 if the error points one way in every batch
  sign_z            Σ_b S_b / sqrt(Σ_b S_b²), S_b = Σ_T c[T] of batch b: ≈ N(0, 1) if the
                    sign of the error is random, sqrt(batches) if it never changes
  sign_agreement    share of batches whose S_b has the majority sign
  delta_abs_mean    mean |c[T]| per row; delta_sum: Σ_b S_b (the watcher's delta_error_sum
                    summed over steps)
  wq_sigma          W^Q_h's largest singular value (FP64); wq_ratio: over the layer median
  wq_grad_ratio     mean_b ‖dW^Q_b‖ over the layer's median head: below GRAD_MIN
                    (rank.py) the share is not a signal
  qk_clip_eta       η = τ / max_logit where max_logit > τ (QK-clip's factor), else 1
then a verdict, its evidence and a recommendation (flashwatch/diagnosis/rank.py).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import sys
import time
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from flashwatch._checks import check_float
from flashwatch.diagnosis.measure import Capture, LayerBatch, wq_rows
from flashwatch.diagnosis.rank import rank
from flashwatch.mitigation.qkclip import clip_factors
from flashwatch.sites import AttentionSite, find_sites


def diagnose(model: nn.Module, batches: Iterable, *, loss_fn: Callable | None = None,
             dtype: torch.dtype | None = torch.bfloat16, sites=None, tau: float = 100.0,
             eps: float = 1e-3, scores_dtype: torch.dtype | None = None,
             reference: Callable | None = None, progress: bool = True,
             name: str = "model", layers: Iterable[int] | None = None) -> dict:
    """Measure every attention head of `model` on `batches` (module docstring).

    batches: token ids [B, T + 1] (inputs [:, :-1], targets [:, 1:]) or (x, y) pairs, or
      whatever `loss_fn(model, batch)` takes; moved to the model's device.
    loss_fn: (model, batch) -> scalar loss. Default: nanoGPT-style `model(x, y)` returning
      (logits, loss), or Hugging Face `model(input_ids=x).logits` and cross-entropy.
    dtype: autocast dtype of the forward (the arithmetic the model trains in); None: no
      autocast, the model's own parameter dtype.
    sites: as `find_sites` (None: discover). tau: the QK-clip threshold to evaluate.
    eps: tie tolerance in scaled-score units. scores_dtype: round the scores to this
      dtype before counting ties (torch.bfloat16 for an unfused BF16 kernel; None: a
      fused kernel's FP32 scores, taken as exact).
    reference: optional (q, k, v, *, attn_mask, is_causal, scale) -> O_ref to measure the
      δ error against instead of FP64 attention (a kernel's own FP32 O, say).
    layers: indices of the sites to measure, in discovery order (None: all); the
      backward then stops at the first of them.
    Returns a JSON-ready dict: settings and "heads", one record per head, ranked.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_float("tau", tau, above=0, hint="a max logit, e.g. 100")
    check_float("eps", eps, min=0, finite=False, hint="e.g. 1e-3")  # inf: every row tied
    found = list(enumerate(find_sites(model, sites)))
    if layers is not None:
        layers = sorted(set(layers))
        bad = [i for i in layers if not (isinstance(i, int) and 0 <= i < len(found))]
        if bad or not layers:
            raise ValueError(f"layers={bad or layers}: the model has {len(found)} attention "
                             f"layers; pass indices 0..{len(found) - 1}")
        found = [found[i] for i in layers]
    index = [i for i, _ in found]
    found = [s for _, s in found]
    for s in found:
        if s.q_module is None or getattr(s.q_module, "weight", None) is None:
            raise ValueError(f"site {s.name!r} has no Q projection with a weight; diagnose "
                             "needs X and dW^Q: give the site a q_module (find_sites docs)")
    loss_fn = default_loss if loss_fn is None else loss_fn
    device = next(model.parameters()).device
    sums = [Sums(s, i) for i, s in zip(index, found, strict=True)]
    start, n = time.perf_counter(), 0
    total = len(batches) if hasattr(batches, "__len__") else None
    shown = Progress(name, total, len(found)) if progress else None
    with _prepared(model, found):
        for batch in batches:
            def layer_done(done, n=n):  # the progress line, as each layer is measured
                if shown is not None:
                    shown.layer(n, done)
            one_batch(model, found, sums, _to(batch, device), loss_fn, dtype, device,
                      dict(eps=eps, scores_dtype=scores_dtype, reference=reference,
                           on_layer=layer_done))
            n += 1
            if shown is not None:
                shown.batch(n)
    if shown is not None and n:
        shown.end(n)
    if n == 0:
        raise ValueError("batches is empty: pass at least one batch of token ids")
    heads = [h for s in sums for h in s.heads(tau)]
    return dict(name=name, batches=n, dtype=str(dtype).replace("torch.", ""),
                device=str(device), tau=float(tau), eps=float(eps),
                seconds=time.perf_counter() - start, heads=rank(heads, n, tau))


def one_batch(model, sites, sums, batch, loss_fn, dtype, device, opts) -> None:
    """One forward and backward, measured (flashwatch/diagnosis/measure.py)."""
    cap = Capture(sites, **opts)
    try:
        with cap, _autocast(device, dtype):
            loss = loss_fn(model, batch)
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad):
            raise TypeError(f"loss_fn must return a scalar tensor with a gradient, got "
                            f"{_describe(loss)}")
        loss.backward()
    finally:
        cap.close()
    silent = [s.name for s, lb in zip(sites, cap.layers, strict=True) if lb.calls == 0]
    if silent:
        raise RuntimeError(
            f"no F.scaled_dot_product_attention call was measured in {silent}: diagnose "
            "measures SDPA calls (Hugging Face: load with attn_implementation='sdpa'; "
            "eager and flash_attention_2 are not intercepted)")
    for site, s, lb in zip(sites, sums, cap.layers, strict=True):
        w = site.q_module.weight
        s.add(lb, wq_rows(site, w.grad).double().cpu())
        w.grad = None


class Sums:
    """One layer's per-head sums over the batches."""

    def __init__(self, site: AttentionSite, index: int):
        H = site.num_heads
        self.site, self.index = site, index
        f64 = dict(dtype=torch.float64)
        self.rows, self.tied = torch.zeros(H, **f64), torch.zeros(H, **f64)
        self.max_logit = torch.full((H,), -math.inf, **f64)
        self.c_abs = torch.zeros(H, **f64)
        self.S, self.e_norm, self.g_norm = [], [], []  # per batch, [H] each
        self.E_sum = torch.zeros(H, site.head_dim, site.d_model, **f64)
        self.linear = True

    def add(self, lb: LayerBatch, g_used: torch.Tensor) -> None:
        self.rows += lb.rows
        self.tied += lb.tied
        self.max_logit = torch.maximum(self.max_logit, lb.max_logit)
        self.c_abs += lb.c_abs
        self.S.append(lb.c_sum)
        self.e_norm.append(lb.E.flatten(1).norm(dim=1))
        self.g_norm.append((g_used + lb.E).flatten(1).norm(dim=1))  # dW^Q with exact δ
        self.E_sum += lb.E
        self.linear &= lb.linear

    def heads(self, tau: float) -> list[dict]:
        site = self.site
        S = torch.stack(self.S)  # [batches, H]
        e, g = torch.stack(self.e_norm), torch.stack(self.g_norm)
        z = S.sum(0) / S.square().sum(0).sqrt().clamp_min(1e-300)
        agree = torch.maximum((S > 0).double().mean(0), (S < 0).double().mean(0))
        coh = self.E_sum.flatten(1).norm(dim=1) / e.sum(0).clamp_min(1e-300)
        sigma = torch.linalg.matrix_norm(site.wq().double().cpu(), ord=2)
        # the true median: the mean of the two middle heads when H is even (torch.median
        # takes the lower one: 2.095 vs 2.041 on a 12-head layer)
        med = sigma.quantile(0.5)
        grad = g.mean(0)  # mean_b ‖dW^Q_b‖ per head
        grad_med = grad.quantile(0.5)
        eta = clip_factors(self.max_logit, tau)
        out = []
        for h in range(site.num_heads):
            out.append(dict(
                layer=site.name, layer_index=self.index, head=h, num_heads=site.num_heads,
                rows=int(self.rows[h]),
                tied_ratio=_f(self.tied[h] / max(1.0, float(self.rows[h]))),
                max_logit=_f(self.max_logit[h]),
                delta_share=_f(e[:, h].mean() / g[:, h].mean()) if g[:, h].mean() > 0
                else (math.inf if e[:, h].mean() > 0 else 0.0),
                delta_coherence=_f(coh[h]), sign_z=_f(z[h]), sign_agreement=_f(agree[h]),
                delta_abs_mean=_f(self.c_abs[h] / max(1.0, float(self.rows[h]))),
                delta_sum=_f(S[:, h].sum()),
                wq_sigma=_f(sigma[h]), wq_ratio=_f(sigma[h] / med) if med > 0 else 1.0,
                wq_grad_ratio=_f(grad[h] / grad_med) if grad_med > 0 else 1.0,
                qk_clip_eta=_f(eta[h]), grad_path="exact" if self.linear else "autograd"))
        return out


def default_loss(model: nn.Module, batch) -> torch.Tensor:
    """Next-token cross-entropy of a causal LM on one batch (see `diagnose`)."""
    x, y = split_batch(batch)
    params = inspect.signature(model.forward).parameters
    if "input_ids" in params:  # Hugging Face; no KV cache: nothing generates here
        logits = model(input_ids=x, **({"use_cache": False} if "use_cache" in params
                                       else {})).logits
    else:
        out = model(x, y)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.Tensor) \
                and out[1].dim() == 0:
            return out[1]  # nanoGPT: (logits, loss)
        logits = out[0] if isinstance(out, tuple) else out
    if not isinstance(logits, torch.Tensor) or logits.shape[:2] != y.shape:
        raise TypeError(f"the model returned {_describe(logits)} for input {list(x.shape)}; "
                        "pass loss_fn=lambda model, batch: <scalar loss>")
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def split_batch(batch) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        if batch.dim() != 2 or batch.shape[1] < 2 or batch.dtype.is_floating_point:
            raise ValueError(f"a batch tensor must hold token ids [B, T + 1] (T ≥ 1), got "
                             f"{batch.dtype} {list(batch.shape)}")
        return batch[:, :-1], batch[:, 1:]
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(f"a batch must be token ids [B, T + 1] or a pair (x, y), got "
                    f"{_describe(batch)}; for other batches pass loss_fn=")


@contextlib.contextmanager
def _prepared(model: nn.Module, sites: list[AttentionSite]):
    """Eval mode; only the W^Q weights need gradients (the others are not computed); the
    user's .grad and requires_grad are given back afterwards."""
    params = list(model.parameters())
    saved = [(p, p.requires_grad, p.grad) for p in params]
    training = model.training
    model.eval()
    try:
        for p in params:
            p.requires_grad_(False)
            p.grad = None
        for s in sites:
            s.q_module.weight.requires_grad_(True)
        yield
    finally:
        for p, flag, grad in saved:
            p.requires_grad_(flag)
            p.grad = grad
        model.train(training)


def _autocast(device: torch.device, dtype):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _to(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch


class Progress:
    """Batches measured, on stderr. A terminal gets one line rewritten in place (`\\r`) as
    each layer is measured; a log file or pipe (not a TTY) gets whole lines, one when a
    batch ends at least `interval` s after the last line and one at the end, so a log
    holds no carriage returns and a few lines an hour, plus a line within a batch that
    runs past `layer_interval`. Counts are whole batches; a terminal also shows the layer
    within the next one."""

    interval = 60.0  # s between log-file lines
    layer_interval = 300.0  # s without a line before one within a batch

    def __init__(self, name: str, total: int | None, layers: int, stream=None):
        self.stream = sys.stderr if stream is None else stream
        try:
            self.tty = bool(self.stream.isatty())
        except (AttributeError, ValueError):  # no isatty, or a closed stream
            self.tty = False
        self.name, self.of, self.layers = name, f"/{total}" if total else "", layers
        self.start = self.last = time.perf_counter()
        self.printed = 0  # batches the last log-file line counted

    def _text(self, batches: int) -> str:
        return (f"diagnose {self.name}: {batches}{self.of} batches done, "
                f"{time.perf_counter() - self.start:.1f} s")

    def layer(self, batches: int, layers: int) -> None:
        """`layers` of the batch after `batches` are measured: rewritten on a terminal; in
        a log, a whole line when a batch runs `layer_interval` s past the last line (a 1B
        model's batch of 1,024 tokens takes minutes on CPU)."""
        line = f"{self._text(batches)}, layer {layers}/{self.layers} of batch {batches + 1}"
        now = time.perf_counter()
        if self.tty:
            print(f"\r{line}", end="", file=self.stream, flush=True)
        elif now - self.last >= self.layer_interval:
            print(line, file=self.stream, flush=True)
            self.last = now

    def batch(self, batches: int) -> None:
        now = time.perf_counter()
        if not self.tty and now - self.last >= self.interval:
            print(self._text(batches), file=self.stream, flush=True)
            self.last, self.printed = now, batches

    def end(self, batches: int) -> None:
        # spaces over the ", layer L/N of batch B" (< 32 characters) the last line ended with
        line = self._text(batches)
        if self.tty:
            print(f"\r{line:<{len(line) + 32}}", file=self.stream, flush=True)
        elif self.printed != batches:
            print(line, file=self.stream, flush=True)


def _f(x) -> float:
    return float(x)


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor {list(x.shape)}"
    return f"a {type(x).__name__}"
