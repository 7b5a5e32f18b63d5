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
Within a verdict, across checkpoints, growth and ties order first (`order_key`):
  1. "tied and growing": ties ≥ TIE_MIN and W^Q σ growing ≥ WQ_RATIO_MIN × as fast as the
     layer's median head: the paper's precondition forming; by that growth
  2. "growing": W^Q σ or max logit growing ≥ WQ_RATIO_MIN × the layer median's growth;
     by the larger of the two
  3. then delta_share (0 where the gradient is under GRAD_MIN: a head whose ‖dW^Q‖ is
     1e-4 of its layer's others ranked first on a pretrained 135M model at a share of
     20.5 %, issue 37), then max_logit.
A growth ratio whose denominator is negligible (the head's first W^Q σ or max logit under
GRAD_MIN × its layer's median head) is not a signal, as a share of a negligible gradient
is not: a head grown from almost nothing never ranks first by growth. The evidence line
says which rule ordered the head; the raw numbers stay in the record.
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
    """Set verdict, evidence, recommendation, order rule and rank (1 = worst) on each head
    record; returns them worst first. growth: {(layer, head): {"wq_sigma": ratio,
    "max_logit": ratio, "series": {...}}} from `growth`."""
    rel = relative_growth(heads, growth or {})
    for h in heads:
        wq_rel, logit_rel = rel.get((h["layer"], h["head"]), (None, None))
        verdict, evidence = classify(h, batches, tau, wq_rel)
        h.update(verdict=verdict, recommendation=recommend(h, verdict, tau),
                 wq_growth_vs_layer=wq_rel, logit_growth_vs_layer=logit_rel)
        h["order_rule"], _ = order_key(h)
        h["evidence"] = evidence + _growth_evidence(h) + f"; ordered by {h['order_rule']}"
    out = sorted(heads, key=lambda h: (VERDICTS.index(h["verdict"]), *order_key(h)[1]))
    for i, h in enumerate(out):
        h["rank"] = i + 1
    return out


def order_key(h: dict) -> tuple[str, tuple]:
    """(the rule that orders the head within its verdict, its sort key: smaller first)."""
    wq, logit = h.get("wq_growth_vs_layer"), h.get("logit_growth_vs_layer")
    grow = max(wq or 0.0, logit or 0.0)
    rest = (-_signal_share(h), -_num(h["max_logit"]))
    if h["tied_ratio"] >= TIE_MIN and (wq or 0.0) >= WQ_RATIO_MIN:
        return (f"tied and growing (ties ≥ {TIE_MIN:.0%}, W^Q σ growth {wq:.2f}× the layer "
                "median's)", (0, -wq, *rest))
    if grow >= WQ_RATIO_MIN:
        return (f"growth ({grow:.2f}× the layer median's)", (1, -grow, *rest))
    if _signal_share(h) > 0:
        return "δ share, then max logit", (2, 0.0, *rest)
    return "max logit", (2, 0.0, *rest)


def relative_growth(heads: list[dict], growth: dict) -> dict:
    """{(layer, head): (W^Q σ growth, max logit growth)}, each over its layer's median head,
    None where the head's first value is under GRAD_MIN × the layer's median first value
    (a ratio of a negligible denominator) or there is no growth."""
    out: dict = {}
    for key in ("wq_sigma", "max_logit"):
        by_layer: dict = {}
        for h in heads:
            g = growth.get((h["layer"], h["head"]))
            if g is not None:
                by_layer.setdefault(h["layer"], []).append((h["head"], g))
        for layer, gs in by_layer.items():
            med_first = _median([g["series"][key][0] for _, g in gs])
            ok = {head: med_first > 0 and math.isfinite(g[key])
                  and g["series"][key][0] >= GRAD_MIN * med_first for head, g in gs}
            med = _median([g[key] for head, g in gs if ok[head]])  # signals only
            for head, g in gs:
                out.setdefault((layer, head), [None, None])[key == "max_logit"] = \
                    g[key] / med if ok[head] and med > 0 else None
    return {k: tuple(v) for k, v in out.items()}


def _median(v: list[float]) -> float:
    return sorted(v)[len(v) // 2] if v else 0.0


def _growth_evidence(h: dict) -> str:
    logit = h.get("logit_growth_vs_layer")
    return "" if logit is None else f"; max logit grew {logit:.2f}× the median head"


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
