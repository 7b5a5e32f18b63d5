"""Verdicts, evidence and recommendations for `flashwatch.diagnosis.diagnose`, and growth across
checkpoints.

Verdicts, in rank order (the first that applies):
  paper-failure  the paper's chain: tied row maxima (tied_ratio ≥ TIE_MIN), a δ error
                 whose sign persists across batches (|sign_z| ≥ Z_MIN), and a large or
                 growing W^Q (σ ≥ WQ_RATIO_MIN × the layer median, or growing that much
                 faster than the layer median between checkpoints)
  delta-error    the δ error is a large part of the head's W^Q gradient (delta_share ≥
                 SHARE_MIN), its sign not shown to persist, and that gradient is a signal
                 (wq_grad_ratio ≥ GRAD_MIN; a share of a negligible gradient is noise)
  logit-growth   max logit above τ, or W^Q large/growing as above, with a small δ error:
                 plain logit growth, QK-clip's case
  ok             none of these
Within a verdict heads are ordered by delta_share (0 where the gradient is under GRAD_MIN:
a head whose ‖dW^Q‖ is 1e-4 of its layer's others ranked first on a pretrained 135M model
at a share of 20.5 %, issue 37), then max_logit. The raw share stays in the record.
"""

from __future__ import annotations

import math

TIE_MIN = 0.02  # WatchConfig.tie_ratio_threshold's default
Z_MIN = 3.0  # |z| of a random sign: N(0, 1), so 3 is p ≈ 0.003; needs ≥ 9 batches
WQ_RATIO_MIN = 2.0
SHARE_MIN = 0.1  # δ error ≥ 10 % of the W^Q gradient
GRAD_MIN = 0.1  # WatchConfig.delta_share_min_grad_layer's default
VERDICTS = ("paper-failure", "delta-error", "logit-growth", "ok")


def rank(heads: list[dict], batches: int, tau: float, growth: dict | None = None) -> list[dict]:
    """Set verdict, evidence, recommendation and rank (1 = worst) on each head record;
    returns them worst first. growth: {(layer, head): {"wq_sigma": ratio, ...}}."""
    med_growth = _layer_medians(heads, growth)
    for h in heads:
        g = (growth or {}).get((h["layer"], h["head"]))
        rel = g["wq_sigma"] / med_growth[h["layer"]] if g and med_growth[h["layer"]] > 0 \
            else None
        verdict, evidence = classify(h, batches, tau, rel)
        h.update(verdict=verdict, evidence=evidence, recommendation=recommend(h, verdict, tau),
                 wq_growth_vs_layer=rel)
    out = sorted(heads, key=lambda h: (VERDICTS.index(h["verdict"]), -_signal_share(h),
                                       -_num(h["max_logit"])))
    for i, h in enumerate(out):
        h["rank"] = i + 1
    return out


def _grad_signal(h: dict) -> bool:
    """The head's W^Q gradient is ≥ GRAD_MIN × its layer's median head (records without
    wq_grad_ratio, from before issue 37: True)."""
    return not (h.get("wq_grad_ratio", 1.0) < GRAD_MIN)


def _signal_share(h: dict) -> float:
    return _num(h["delta_share"]) if _grad_signal(h) else 0.0


def classify(h: dict, batches: int, tau: float, wq_growth_rel: float | None):
    """(verdict, evidence text) of one head record."""
    ties = h["tied_ratio"] >= TIE_MIN
    sign = abs(h["sign_z"]) >= Z_MIN
    big = h["wq_ratio"] >= WQ_RATIO_MIN or (wq_growth_rel or 0) >= WQ_RATIO_MIN
    share = h["delta_share"] >= SHARE_MIN and _grad_signal(h)
    logits = h["max_logit"] > tau
    ev = [f"ties {h['tied_ratio']:.1%}" + (" ≥ " if ties else " < ") + f"{TIE_MIN:.0%}",
          f"sign z {h['sign_z']:+.1f} over {batches} batches"
          + ("" if sign else f" (|z| < {Z_MIN:g}"
             + ("" if batches >= Z_MIN ** 2 else f"; ≥ {int(Z_MIN ** 2)} batches to show it")
             + ")"),
          f"W^Q σ {h['wq_sigma']:.3g} = {h['wq_ratio']:.2f}× layer median"
          + ("" if wq_growth_rel is None else f", grew {wq_growth_rel:.2f}× the median head"),
          f"δ error {_pct(h['delta_share'])} of dW^Q" + ("" if _grad_signal(h) else
              f" (not a signal: ‖dW^Q‖ {h['wq_grad_ratio']:.2g}× the layer median "
              f"< {GRAD_MIN:g})"),
          f"max logit {h['max_logit']:.3g}" + (" > " if logits else " ≤ ") + f"τ {tau:g}"]
    if ties and sign and big:
        verdict = "paper-failure"
    elif share:
        verdict = "delta-error"
    elif logits or big:
        verdict = "logit-growth"
    else:
        verdict = "ok"
    return verdict, "; ".join(ev)


def recommend(h: dict, verdict: str, tau: float) -> str:
    """One line a user can act on."""
    layer, head = h["layer"], h["head"]
    if verdict in ("paper-failure", "delta-error"):
        n = h.get("num_heads") or head + 1
        modes = ["0"] * max(n, head + 1)
        modes[head] = "2"
        line = (f'watcher.set_head_modes("{layer}", [{", ".join(modes)}])  # head {head} → '
                "Mode.FP32_O: δ from an FP32 O")
        if h["max_logit"] > tau:
            line += f"; and QK-clip τ = {tau:g} (η = {h['qk_clip_eta']:.3g})"
        return line
    if verdict == "logit-growth":
        if h["max_logit"] > tau:
            return (f"WatchConfig(qk_clip_threshold={tau:g}, mitigation=\"auto\")  # η = "
                    f"{h['qk_clip_eta']:.3g}: this head's logits × {h['qk_clip_eta']:.3g}")
        return "nothing yet: logits ≤ τ; diagnose the next checkpoint and compare"
    return "nothing"


def growth(results: list[dict]) -> dict:
    """Per head, across checkpoints (oldest first): last / first of W^Q σ, max logit and
    δ share, and every checkpoint's values. {(layer, head): {...}}."""
    if len(results) < 2:
        return {}
    keys = ("wq_sigma", "max_logit", "delta_share", "tied_ratio", "sign_z")
    series: dict = {}
    for r in results:
        for h in r["heads"]:
            s = series.setdefault((h["layer"], h["head"]), {k: [] for k in keys})
            for k in keys:
                s[k].append(h[k])
    out = {}
    for key, s in series.items():
        if len(s["wq_sigma"]) != len(results):
            continue  # a head not in every checkpoint
        out[key] = dict(series=s, **{k: _ratio(s[k][-1], s[k][0])
                                     for k in ("wq_sigma", "max_logit", "delta_share")})
    return out


def _layer_medians(heads: list[dict], growth: dict | None) -> dict:
    by_layer: dict = {}
    for h in heads:
        g = (growth or {}).get((h["layer"], h["head"]))
        if g is not None:
            by_layer.setdefault(h["layer"], []).append(g["wq_sigma"])
    med = {layer: sorted(v)[len(v) // 2] for layer, v in by_layer.items()}
    return {h["layer"]: med.get(h["layer"], 0.0) for h in heads}


def _ratio(a: float, b: float) -> float:
    if b > 0 and math.isfinite(b):
        return a / b
    return math.nan


def _num(x: float) -> float:
    return x if math.isfinite(x) else (1e308 if x > 0 else -1e308)


def _pct(x: float) -> str:
    if not math.isfinite(x):
        return "∞"
    return f"{x:.1%}" if x < 10 else f"{x:.3g}×"
