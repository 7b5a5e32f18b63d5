"""Offline scoring of alarm detectors on the run directories of reproduction.run.

    python -m reproduction.score --root DIR [--config C ...] [--arm unmitigated]
        [--seeds-mod M R] [--exclude-mod M R] [--thresholds NAME=VALUE ...] [--json]
    python -m reproduction.score --root DIR --sweep DETECTOR V1 V2 ... [--seeds-mod M R]
    python -m reproduction.score --root DIR --config C --arms-compare ARM1 ARM2 ...

A run is ROOT/CONFIG/ARM-sSEED (train.jsonl, flashwatch.jsonl, summary.json). By default
every run of arm "unmitigated" under ROOT is scored; --seeds-mod M R keeps the seeds with
seed % M == R and --exclude-mod M R drops them, so thresholds can be tuned on some seeds
(--sweep) and scored on the others. A directory CONFIG-fused next to CONFIG holds the
legacy layout's fused twins and is not scored unless named with --config.

Outcome (the event of a run)
  spike        reproduction.run.first_spike: the first step ≥ warmup at which the loss
               EMA (factor 0.95) is 1 nat above its best value so far, or the loss is not
               finite.
  degradation  the run's loss EMA minus its fused twin's (same configuration and seed,
               arm "fused": ROOT/CONFIG/fused-sSEED; legacy layout
               ROOT/CONFIG-fused/unmitigated-sSEED) is > GAP_NATS = 0.2 at every step of
               a stretch of SUSTAIN = 100 steps starting at t ≥ warmup; event step = the
               first such t.
  event        the earlier of the two. A run is positive if it has an event, negative if
               it has none and has a twin. A run without a twin has no degradation label:
               it is positive at its spike if it spiked (a degradation could only have come
               earlier), otherwise unlabelled and left out of the scores.

Detectors: each is a function of the run's own logs up to step t (never the future, never
the twin), scored at every monitored step (train.jsonl ones: every step); records before
settings.warmup are ignored. Per head, then the maximum over heads:
  drift_z       delta_drift_z
  sign_z        |delta_sign_z|: the δ error's sign over the window, on every row
  delta_share   delta_error_share_mean, else delta_error_share (NaN in logs without either)
  wq_growth     wq_spectral_norm / its value at the first monitored step ≥ warmup − 1
  tie_trend     tied_rowmax_ratio minus its value LAG = 100 steps earlier (the last
                monitored step ≤ t − 100; undefined before warmup + 100)
  logit_growth  log2(attention_max_logit / its value 100 steps earlier)
  max_logit     attention_max_logit (a baseline: QK-clip's signal)
Whole run:
  policy        the watcher's own alarm, latched: 1 from the first monitored step with a
                mode event whose reason is not "set by user" (in "advise" mode: a head whose
                recommended_mode is not STANDARD), 0 before. `flagged` alone is not an
                alarm: the policy advises only after `patience` flagged steps.
  combined      how many of drift_z, sign_z, delta_share, wq_growth, tie_trend,
                logit_growth are at or above their thresholds at the step
  loss_ema      the loss EMA minus its best value since warmup (baseline)
  grad_jump     grad_norm / the median grad_norm of the previous 100 steps since warmup
                (baseline; from warmup + 100 on)
A detector is in alarm where its score ≥ its threshold (NaN: not in alarm): PREREGISTERED,
tuned on tuning seeds before the held-out ones were scored (--defaults: THRESHOLDS). An
alarm is counted where the condition becomes true, unless within REFRACTORY = 100 steps of
the last counted alarm (an episode that flickers is one alarm).

Scores, per detector, over the labelled runs:
  hit           a positive run with an alarm in [event − 300, event − 20]; lead = event −
                the first alarm in that window. hit_rate = hits / n_pos, with the Wilson
                95 % interval.
  false alarms  every alarm of a negative run, and in a positive run every alarm before
                event − 300; false_alarms_per_run divides by n_pos + n_neg.
  late          alarms after event − 20 (total over runs); neither hits nor false.
  auroc         for each positive run p whose e_p − 50 ≥ warmup: its score at the last
                scored step ≤ e_p − 50 against each negative run's score at that step
                (Mann–Whitney: 1 if higher, 1/2 if equal; NaN counts as −inf); the mean
                over all (p, n) pairs.

--json prints one object:
  {"outcome": {"GAP_NATS", "SUSTAIN", "SPIKE_NATS", "EMA", "REFRACTORY", "HIT_WINDOW":
               [300, 20], "AUROC_BEFORE": 50, "LAG": 100, "GRAD_HISTORY": 100},
   "thresholds": {detector: value},
   "runs": [{"config", "arm", "seed", "event_step" (null if none), "event_kind" ("spike",
             "degradation", null: negative, "unlabelled"), "final_gap" (final loss, mean of
             the last 100 steps, minus the twin's; null without a twin), "alarms":
             {detector: [step, ...]}}],
   "detectors": {detector: {"n_pos", "n_neg", "hits", "hit_rate", "wilson_low",
                 "wilson_high", "median_lead", "false_alarms_per_run", "late", "auroc"}}}
Non-finite numbers are written as JsonlSink writes them: NaN as null, ±inf as "inf"/"-inf".
--tune picks each detector's threshold on the selected runs (tune(): most hits with at
most MAX_FALSE_ALARMS = 0.2 false alarms per run) and prints {"tuned": {detector:
{"threshold", "within_bar", ...metrics}}}: run it on tuning seeds only.
--basin CUT (exploratory, not pre-registered) prints, per configuration, how many runs
of each arm end above CUT with McNemar against unmitigated, and the AUROC of each
detector and of the loss EMA's level at steps 100–800 for that outcome: {config: {"cut",
"arms": {arm: {"n", "high", "b", "c", "mcnemar_p"}}, "auroc": {step: {name: auroc}}}}.
--sweep prints {"detector", "sweep": [{"threshold", ...the metrics above}]}; --arms-compare
prints {"arms": {config: [arm_table rows]}}; --control prints {"control": {config: {"n",
"events", "swapped", "paper_worse", "sign_p", "final_gap_median"}}} (control()).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from flashwatch.config import WatchConfig
from flashwatch.report.records import _json_float
from flashwatch.report.runreport import load_run
from flashwatch.report.sinks import read_jsonl
from reproduction.run import EMA, QK_CLIP_TAU, SPIKE_NATS, first_spike, loss_ema

GAP_NATS = 0.2  # degradation: the loss EMA this far above the fused twin's ...
SUSTAIN = 100  # ... at every step of this many steps
REFRACTORY = 100  # no new alarm this many steps after a counted one
HIT_EARLIEST, HIT_LATEST = 300, 20  # a hit: an alarm in [event − 300, event − 20]
AUROC_BEFORE = 50  # AUROC compares scores this many steps before the event
LAG = 100  # tie_trend and logit_growth: against the value this many steps earlier
GRAD_HISTORY = 100  # grad_jump: median over this many previous steps

# Starting points (flashwatch's own defaults where it has one): what tune() starts from,
# and the thresholds of --defaults.
THRESHOLDS = {
    "drift_z": WatchConfig.drift_z_threshold,
    "sign_z": 4.0,  # |z| of a mean-zero sum: ≈ N(0, 1)
    "delta_share": WatchConfig.delta_share_threshold,
    "wq_growth": WatchConfig.spectral_growth_threshold,
    "tie_trend": 0.05,
    "logit_growth": 1.0,  # a doubling
    "policy": 0.5,
    "combined": 2.0,
    "max_logit": QK_CLIP_TAU,
    "loss_ema": 0.3,
    "grad_jump": 10.0,
}

# The pre-registered thresholds the CLI scores with: tune() on the tuning seeds only
# (nope-grammar-warm, seeds 0–39 with seed % 4 != 3; 7 positive, 23 negative), by
#   python -m reproduction.score --root runs/v3 --config nope-grammar-warm \
#       --exclude-mod 4 3 --tune
# committed before any held-out run (seeds ≡ 3 mod 4, and all of pe-grammar-warm) was
# scored (docs/REPRODUCTION.md names the commit). Changing them needs fresh seeds.
PREREGISTERED = {  # tune()'s picks, exactly (a quantile of the scores: rounding moves hits)
    "drift_z": 4.0,  # no alarm at all on the tuning seeds: left at the default
    "sign_z": 4.8379230754885,
    "delta_share": 4.036234282870803,
    "wq_growth": 16.74574995737975,
    "tie_trend": 0.677734375,
    "logit_growth": 12.500767373304727,
    "policy": 0.5,
    "combined": 1.0,
    "max_logit": 5952.0,
    "loss_ema": 0.25628375776808276,
    "grad_jump": 312.44579693516613,
}
RULES = ("drift_z", "sign_z", "delta_share", "wq_growth", "tie_trend",
         "logit_growth")  # combined

Series = tuple[np.ndarray, np.ndarray]  # (steps, scores), steps increasing


@dataclass
class Run:
    dir: Path
    config: str
    arm: str
    seed: int
    warmup: int
    final_loss: float  # summary.json final_loss_mean_last100
    event_step: int | None
    event_kind: str | None  # "spike" | "degradation" | None (negative) | "unlabelled"
    final_gap: float | None  # final_loss − the twin's; None without a twin
    scores: dict[str, Series] = field(default_factory=dict)  # detector → series

    @property
    def labelled(self) -> bool:
        return self.event_kind != "unlabelled"

    @property
    def positive(self) -> bool:
        return self.event_step is not None


# ---- outcome ----

def twin_dir(run_dir: Path, seed: int) -> Path | None:
    """The finished fused twin of a run: ROOT/CONFIG/fused-sSEED, else the legacy
    ROOT/CONFIG-fused/unmitigated-sSEED."""
    root, config = run_dir.parent.parent, run_dir.parent.name
    for d in (root / config / f"fused-s{seed}", root / f"{config}-fused" / f"unmitigated-s{seed}"):
        if (d / "summary.json").is_file():
            return d
    return None


def degradation(ema: list[float], twin_ema: list[float], warmup: int) -> int | None:
    """First t ≥ warmup with ema − twin_ema > GAP_NATS at each of t .. t + SUSTAIN − 1."""
    stretch = 0
    for t in range(warmup, min(len(ema), len(twin_ema))):
        stretch = stretch + 1 if ema[t] - twin_ema[t] > GAP_NATS else 0
        if stretch == SUSTAIN:
            return t - SUSTAIN + 1
    return None


def outcome(losses: list[float], twin_losses: list[float] | None,
            warmup: int) -> tuple[int | None, str | None]:
    """(event step, kind): kind "spike", "degradation", None (negative) or "unlabelled"."""
    spike = first_spike(losses, warmup)
    degr = None if twin_losses is None else degradation(loss_ema(losses),
                                                        loss_ema(twin_losses), warmup)
    if spike is not None and (degr is None or spike <= degr):
        return spike, "spike"
    if degr is not None:
        return degr, "degradation"
    return None, None if twin_losses is not None else "unlabelled"


# ---- detectors ----

def _num(v) -> float:
    """A JsonlSink number: null is NaN, "inf"/"-inf" are strings."""
    return math.nan if v is None else float(v)


def _head_max(m: np.ndarray) -> np.ndarray:
    """Per row, the maximum over heads, NaN heads left out (NaN when all are)."""
    out = np.full(len(m), np.nan)
    ok = ~np.isnan(m).all(axis=1)
    out[ok] = np.nanmax(m[ok], axis=1)
    return out


def _lagged(steps: np.ndarray, m: np.ndarray) -> np.ndarray:
    """m's row at the last step ≤ step − LAG, row by row (NaN where there is none)."""
    j = np.searchsorted(steps, steps - LAG, side="right") - 1
    out = np.full_like(m, np.nan)
    out[j >= 0] = m[j[j >= 0]]
    return out


def _alerted(report: dict) -> bool:
    return (any(e.get("kind", "mode") == "mode" and e["reason"] != "set by user"
                for e in report["events"])
            or any(h["recommended_mode"] != "STANDARD" for h in report["heads"]))


def detector_scores(reports: list[dict], train: list[dict], warmup: int) -> dict[str, Series]:
    """Every detector's series except `combined` (which depends on the thresholds), from
    flashwatch.jsonl's full reports and train.jsonl's rows."""
    reports = [r for r in reports if r["step"] >= warmup]
    steps = np.array([r["step"] for r in reports], dtype=int)
    n_heads = len(reports[0]["heads"]) if reports else 0

    def heads(value) -> np.ndarray:  # [report, head]
        return np.array([[value(h) for h in r["heads"]] for r in reports],
                        dtype=float).reshape(len(reports), n_heads)

    def key(name):
        return heads(lambda h: _num(h.get(name)))

    share = heads(lambda h: _num(h.get("delta_error_share_mean")
                                 if h.get("delta_error_share_mean") is not None
                                 else h.get("delta_error_share")))
    wq, ties, logit = key("wq_spectral_norm"), key("tied_rowmax_ratio"), key("attention_max_logit")
    with np.errstate(divide="ignore", invalid="ignore"):  # zero or NaN norms and logits
        monitored = {
            "drift_z": _head_max(key("delta_drift_z")),
            "sign_z": _head_max(np.abs(key("delta_sign_z"))),
            "delta_share": _head_max(share),
            "wq_growth": _head_max(wq / wq[:1] - 1),
            "tie_trend": _head_max(ties - _lagged(steps, ties)),
            "logit_growth": _head_max(np.log2(logit / _lagged(steps, logit))),
            "max_logit": _head_max(logit),
            # latched: an alert stays raised (as run.py's first_alert)
            "policy": np.maximum.accumulate([float(_alerted(r)) for r in reports])
            if reports else np.zeros(0),
        }
    out = {name: (steps, s) for name, s in monitored.items()}

    rows = [r for r in train if r["step"] >= warmup]
    tsteps = np.array([r["step"] for r in rows], dtype=int)
    ema = np.array(loss_ema([r["loss"] for r in train])[warmup:])  # the outcome's EMA
    out["loss_ema"] = (tsteps[:len(ema)], ema - np.minimum.accumulate(ema))
    g = np.array([r["grad_norm"] for r in rows], dtype=float)
    if len(g) > GRAD_HISTORY:
        windows = np.lib.stride_tricks.sliding_window_view(g, GRAD_HISTORY)[:-1]
        with np.errstate(divide="ignore", invalid="ignore"):
            out["grad_jump"] = (tsteps[GRAD_HISTORY:], g[GRAD_HISTORY:] /
                                np.median(windows, axis=1))
    else:
        out["grad_jump"] = (np.zeros(0, dtype=int), np.zeros(0))
    return out


def series(run: Run, name: str, thresholds: dict) -> Series:
    """A detector's series for `run`; `combined` counts the RULES at their thresholds."""
    if name != "combined":
        return run.scores[name]
    steps = run.scores[RULES[0]][0]
    return steps, sum((run.scores[r][1] >= thresholds[r]).astype(float) for r in RULES)


def alarms(s: Series, threshold: float) -> list[int]:
    """Steps at which an alarm is counted: the score reaches the threshold (it was below,
    or this is the first scored step) at least REFRACTORY steps after the last one."""
    out: list[int] = []
    was_on = False
    for t, v in zip(*s, strict=True):
        on = bool(v >= threshold)  # NaN: off
        if on and not was_on and (not out or t - out[-1] >= REFRACTORY):
            out.append(int(t))
        was_on = on
    return out


def score_at(s: Series, t: int) -> float:
    """The score at the last scored step ≤ t; −inf where there is none or it is NaN."""
    i = int(np.searchsorted(s[0], t, side="right")) - 1
    v = float(s[1][i]) if i >= 0 else math.nan
    return -math.inf if math.isnan(v) else v


# ---- loading ----

def load(run_dir: Path, scores: bool = True) -> Run:
    """One run, its outcome and (scores=True) its detector series."""
    summ = json.loads((run_dir / "summary.json").read_text())
    train = read_jsonl(run_dir / "train.jsonl")
    warmup = summ["settings"]["warmup"]
    twin = twin_dir(run_dir, summ["seed"])
    twin_losses = final_gap = None
    if twin is not None:
        twin_losses = [r["loss"] for r in read_jsonl(twin / "train.jsonl")]
        twin_final = json.loads((twin / "summary.json").read_text())["final_loss_mean_last100"]
        final_gap = summ["final_loss_mean_last100"] - twin_final
    step, kind = outcome([r["loss"] for r in train], twin_losses, warmup)
    run = Run(dir=run_dir, config=summ["config"], arm=summ["arm"], seed=summ["seed"],
              warmup=warmup, final_loss=summ["final_loss_mean_last100"], event_step=step,
              event_kind=kind, final_gap=final_gap)
    if scores:
        run.scores = detector_scores(load_run(run_dir)["reports"], train, warmup)
    return run


def _seed(run_dir: Path) -> int:
    return int(run_dir.name.rsplit("-s", 1)[1])


def find_runs(root: Path, configs: list[str] | None = None, arm: str = "unmitigated",
              seeds_mod: tuple[int, int] | None = None,
              exclude_mod: tuple[int, int] | None = None, scores: bool = True) -> list[Run]:
    """The finished runs ROOT/CONFIG/ARM-sSEED, seeds filtered by seed % M == R."""
    if configs:
        config_dirs = [root / c for c in configs]
    else:  # every configuration but the legacy layout's twin directories
        config_dirs = [d for d in sorted(root.iterdir()) if d.is_dir() and not (
            d.name.endswith("-fused") and (root / d.name.removesuffix("-fused")).is_dir())]
    dirs = [d for c in config_dirs for d in sorted(c.glob(f"{arm}-s*"), key=_seed)
            if (d / "summary.json").is_file()]
    if seeds_mod:
        dirs = [d for d in dirs if _seed(d) % seeds_mod[0] == seeds_mod[1]]
    if exclude_mod:
        dirs = [d for d in dirs if _seed(d) % exclude_mod[0] != exclude_mod[1]]
    return [load(d, scores) for d in dirs]


# ---- metrics ----

def judge(alarm_steps: list[int], event: int | None) -> dict:
    """A run's alarms against its event: lead (None: no hit), false and late counts."""
    if event is None:
        return dict(lead=None, false=len(alarm_steps), late=0)
    window = [a for a in alarm_steps if event - HIT_EARLIEST <= a <= event - HIT_LATEST]
    return dict(lead=event - window[0] if window else None,
                false=sum(a < event - HIT_EARLIEST for a in alarm_steps),
                late=sum(a > event - HIT_LATEST for a in alarm_steps))


def wilson(k: int, n: int, z: float = 1.959963984540054) -> tuple[float | None, float | None]:
    """Wilson score interval (95 % by default) for k successes in n trials."""
    if n == 0:
        return None, None
    p, d = k / n, 1 + z * z / n
    centre = (p + z * z / (2 * n)) / d
    half = z / d * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return centre - half, centre + half


def auroc(runs: list[Run], name: str, thresholds: dict) -> float | None:
    """Mann–Whitney AUROC of the score AUROC_BEFORE steps before each positive's event
    against the negatives' scores at the same step; None without a pair."""
    pos = [r for r in runs if r.labelled and r.positive
           and r.event_step - AUROC_BEFORE >= r.warmup]
    neg = [series(r, name, thresholds) for r in runs if r.labelled and not r.positive]
    wins = []
    for p in pos:
        t = p.event_step - AUROC_BEFORE
        sp = score_at(series(p, name, thresholds), t)
        wins += [1.0 if sp > sn else 0.5 if sp == sn else 0.0
                 for sn in (score_at(n, t) for n in neg)]
    return sum(wins) / len(wins) if wins else None


def detector_metrics(runs: list[Run], name: str, thresholds: dict) -> dict:
    """hits, leads, false and late alarms, AUROC of one detector over the labelled runs."""
    scored = [r for r in runs if r.labelled]
    judged = [judge(alarms(series(r, name, thresholds), thresholds[name]), r.event_step)
              for r in scored]
    n_pos = sum(r.positive for r in scored)
    leads = [j["lead"] for j in judged if j["lead"] is not None]
    low, high = wilson(len(leads), n_pos)
    return dict(n_pos=n_pos, n_neg=len(scored) - n_pos, hits=len(leads),
                hit_rate=len(leads) / n_pos if n_pos else None, wilson_low=low,
                wilson_high=high, median_lead=statistics.median(leads) if leads else None,
                false_alarms_per_run=sum(j["false"] for j in judged) / len(scored)
                if scored else None,
                late=sum(j["late"] for j in judged), auroc=auroc(runs, name, thresholds))


def score(runs: list[Run], thresholds: dict | None = None) -> dict:
    """The --json object (see the module docstring)."""
    th = {**THRESHOLDS, **(thresholds or {})}
    return {
        "outcome": dict(GAP_NATS=GAP_NATS, SUSTAIN=SUSTAIN, SPIKE_NATS=SPIKE_NATS, EMA=EMA,
                        REFRACTORY=REFRACTORY, HIT_WINDOW=[HIT_EARLIEST, HIT_LATEST],
                        AUROC_BEFORE=AUROC_BEFORE, LAG=LAG, GRAD_HISTORY=GRAD_HISTORY),
        "thresholds": th,
        "runs": [dict(config=r.config, arm=r.arm, seed=r.seed, event_step=r.event_step,
                      event_kind=r.event_kind, final_gap=r.final_gap,
                      alarms={n: alarms(series(r, n, th), th[n]) for n in th})
                 for r in runs],
        "detectors": {n: detector_metrics(runs, n, th) for n in th},
    }


# ---- tuning (on tuning seeds only: the pre-registration) ----

MAX_FALSE_ALARMS = 0.2  # per run: the benchmark's bar for a usable detector
TUNE_QUANTILES = np.linspace(0.5, 1.0, 101)  # candidate thresholds: score quantiles


def tune(runs: list[Run], name: str, thresholds: dict) -> dict:
    """The threshold for `name` that catches most events while raising at most
    MAX_FALSE_ALARMS false alarms per run; ties go to fewer false alarms, then the
    longer median lead. Candidates: quantiles of the detector's finite scores over the
    runs (and its current threshold). No candidate within the bar: the one with the
    fewest false alarms. Returns {"threshold", "within_bar", **its metrics}."""
    values = np.concatenate([series(r, name, thresholds)[1] for r in runs if r.labelled]
                            or [np.zeros(0)])
    values = values[np.isfinite(values)]
    cands = sorted({float(thresholds[name]),
                    *(np.quantile(values, TUNE_QUANTILES).tolist() if len(values) else [])})
    best, best_key = None, None
    for v in cands:
        m = detector_metrics(runs, name, {**thresholds, name: v})
        fa = m["false_alarms_per_run"] or 0.0
        within = fa <= MAX_FALSE_ALARMS
        key = (within, m["hits"] if within else 0, -fa, m["median_lead"] or 0.0)
        if best_key is None or key > best_key:
            best, best_key = {"threshold": v, "within_bar": within, **m}, key
    return best


def tune_all(runs: list[Run]) -> dict:
    """Tuned thresholds for every detector: the RULES first, then `combined` (how many
    rules at once, 1..len(RULES)) at the tuned rule thresholds. `policy` is binary."""
    th = dict(THRESHOLDS)
    out = {}
    for name in (*RULES, "max_logit", "loss_ema", "grad_jump"):
        out[name] = tune(runs, name, th)
        th[name] = out[name]["threshold"]
    best = None
    for k in range(1, len(RULES) + 1):
        m = detector_metrics(runs, "combined", {**th, "combined": float(k)})
        fa = m["false_alarms_per_run"] or 0.0
        key = (fa <= MAX_FALSE_ALARMS, m["hits"] if fa <= MAX_FALSE_ALARMS else 0, -fa)
        if best is None or key > best[0]:
            best = (key, {"threshold": float(k), "within_bar": key[0], **m})
    out["combined"] = best[1]
    out["policy"] = {"threshold": THRESHOLDS["policy"], "within_bar": None,
                     **detector_metrics(runs, "policy", th)}
    return out


# ---- plots (docs/REPRODUCTION.md) ----

def plot(runs: list[Run], result: dict, img: Path, tag: str) -> list[Path]:
    """Two figures: every run's loss-EMA gap to its fused twin (the outcome), and each
    detector's alarms relative to the event of each positive run (the hit window
    shaded). Returns the files written (IMG/benchmark_{gap,alarms}_TAG.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for r in runs:
        twin = twin_dir(r.dir, r.seed)
        if twin is None:
            continue
        ema = loss_ema([x["loss"] for x in read_jsonl(r.dir / "train.jsonl")])
        tw = loss_ema([x["loss"] for x in read_jsonl(twin / "train.jsonl")])
        n = min(len(ema), len(tw))
        ax.plot(range(n), np.subtract(ema[:n], tw[:n]), lw=0.7, alpha=0.7,
                color="tab:red" if r.positive else "tab:blue")
    ax.axhline(GAP_NATS, color="k", ls="--", lw=0.8)
    ax.set(xlabel="step", ylabel="loss EMA − fused twin's (nat)",
           title=f"{tag}: red = degradation event, blue = none")
    gap = img / f"benchmark_gap_{tag}.png"
    fig.tight_layout()
    fig.savefig(gap, dpi=110)
    plt.close(fig)

    names = list(result["detectors"])
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.2))
    ax.axvspan(-HIT_EARLIEST, -HIT_LATEST, color="tab:green", alpha=0.15)
    for i, name in enumerate(names):
        for r, rr in zip(runs, result["runs"], strict=True):
            if r.positive and r.labelled:
                x = [t - r.event_step for t in rr["alarms"][name]]
                ax.plot(x, [i] * len(x), "|", color="k", ms=9, alpha=0.6)
    ax.axvline(0, color="tab:red", lw=1)
    ax.set_yticks(range(len(names)), [f"{n} ({result['thresholds'][n]:.3g})" for n in names])
    ax.set(xlabel="alarm step − event step (positive runs); green: the hit window",
           title=f"{tag}: alarms around the event")
    ax.set_xlim(-1500, 1500)
    alarms_png = img / f"benchmark_alarms_{tag}.png"
    fig.tight_layout()
    fig.savefig(alarms_png, dpi=110)
    plt.close(fig)
    return [gap, alarms_png]


# ---- arms ----

def plot_arms(rows: list[dict], img: Path, tag: str) -> Path:
    """Final loss of every run per arm (one dot per seed, the median as a bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, r in enumerate(rows):
        y = [v for v in r["final_losses"].values() if math.isfinite(v)]
        x = i + np.linspace(-0.15, 0.15, len(y)) if len(y) > 1 else [i] * len(y)
        ax.plot(x, y, "o", ms=3, alpha=0.6)
        if y:
            ax.plot([i - 0.3, i + 0.3], [statistics.median(y)] * 2, color="k", lw=2)
    ax.set_xticks(range(len(rows)), [f"{r['arm']}\n{r['events']}/{r['labelled']} events"
                                     for r in rows])
    ax.set(ylabel="final loss (mean of the last 100 steps)", title=tag)
    out = img / f"benchmark_arms_{tag}.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: b and c discordant pairs, Binomial(b + c, 1/2)."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def _median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def arm_table(root: Path, config: str, arms: list[str],
              seeds: set[int] | None = None) -> list[dict]:
    """Per arm of one configuration: runs, event rate (over labelled runs), median final
    loss (NaN counts as +inf: a diverged run is the worst), and against the unmitigated
    run of the same seed: b = pairs where only unmitigated had an event, c = only the arm,
    the exact McNemar p, the median final-loss difference arm − unmitigated (finite pairs).
    seeds: only these seeds (e.g. those every arm has), else all."""
    by_arm = {a: {r.seed: r for r in find_runs(root, [config], a, scores=False)
                  if seeds is None or r.seed in seeds}
              for a in dict.fromkeys(["unmitigated", *arms])}
    base = by_arm["unmitigated"]
    rows = []
    for arm in arms:
        runs = by_arm[arm]
        labelled = [r for r in runs.values() if r.labelled]
        pairs = [(base[s], r) for s, r in runs.items() if s in base]
        both = [(u, a) for u, a in pairs if u.labelled and a.labelled]
        b = sum(u.positive and not a.positive for u, a in both)
        c = sum(a.positive and not u.positive for u, a in both)
        diffs = [a.final_loss - u.final_loss for u, a in pairs
                 if math.isfinite(a.final_loss) and math.isfinite(u.final_loss)]
        finals = [r.final_loss if math.isfinite(r.final_loss) else math.inf
                  for r in runs.values()]
        rows.append(dict(arm=arm, n=len(runs), labelled=len(labelled),
                         final_losses={s: r.final_loss for s, r in sorted(runs.items())},
                         events=sum(r.positive for r in labelled),
                         event_rate=sum(r.positive for r in labelled) / len(labelled)
                         if labelled else None,
                         final_loss_median=_median_or_none(finals), pairs=len(both), b=b, c=c,
                         mcnemar_p=mcnemar_exact(b, c),
                         final_loss_diff_median=_median_or_none(diffs)))
    return rows


def control(root: Path, config: str, seeds: set[int] | None = None) -> dict:
    """The outcome's negative control, per configuration, over the seeds with both an
    unmitigated run and its fused twin: `events` = unmitigated runs with an event;
    `swapped` = seeds where the degradation rule fires with the roles swapped (the fused
    run GAP_NATS worse than the paper one for SUSTAIN steps): how often two arithmetics
    that diverge chaotically part this far with neither harmed; `paper_worse` = seeds
    whose final loss is above the twin's, with the exact two-sided sign test and the
    median final gap."""
    runs = [r for r in find_runs(root, [config], "unmitigated", scores=False)
            if r.final_gap is not None and (seeds is None or r.seed in seeds)]
    swapped, gaps = 0, []
    for r in runs:
        mine = loss_ema([x["loss"] for x in read_jsonl(r.dir / "train.jsonl")])
        twin = loss_ema([x["loss"] for x in read_jsonl(twin_dir(r.dir, r.seed) / "train.jsonl")])
        swapped += degradation(twin, mine, r.warmup) is not None
        gaps.append(r.final_gap)
    worse = sum(g > 0 for g in gaps)
    better = sum(g < 0 for g in gaps)
    return dict(n=len(runs), events=sum(r.positive for r in runs), swapped=swapped,
                paper_worse=worse, sign_p=mcnemar_exact(worse, better),
                final_gap_median=_median_or_none(gaps))


# ---- exploratory: which basin a run ends in (not pre-registered) ----

BASIN_STEPS = (100, 200, 300, 500, 800)


def _auroc_of(pos: list[float], neg: list[float]) -> float | None:
    wins = [1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg]
    return sum(wins) / len(wins) if wins else None


def basin(root: Path, config: str, cut: float, arms: list[str],
          seeds: set[int] | None = None, thresholds: dict | None = None) -> dict:
    """A post-hoc outcome, for what the runs suggest and fresh seeds must confirm: the
    run ends above `cut` (final loss, mean of the last 100 steps). Per arm: how many do,
    and McNemar against unmitigated by seed. For the unmitigated runs: the AUROC of each
    detector's score, and of the loss EMA's level, at BASIN_STEPS for that outcome."""
    th = thresholds or PREREGISTERED
    by_arm = {a: {r.seed: r for r in find_runs(root, [config], a, scores=a == "unmitigated")
                  if seeds is None or r.seed in seeds}
              for a in dict.fromkeys(["unmitigated", *arms])}
    base = by_arm["unmitigated"]
    high = {a: {s: not r.final_loss <= cut for s, r in runs.items()}  # NaN: high
            for a, runs in by_arm.items()}
    out = {"cut": cut, "arms": {}, "auroc": {}}
    for a in by_arm:
        paired = [s for s in high[a] if s in base]
        b = sum(high["unmitigated"][s] and not high[a][s] for s in paired)
        c = sum(high[a][s] and not high["unmitigated"][s] for s in paired)
        out["arms"][a] = dict(n=len(high[a]), high=sum(high[a].values()), b=b, c=c,
                              mcnemar_p=mcnemar_exact(b, c))
    runs = list(base.values())
    label = [high["unmitigated"][r.seed] for r in runs]
    emas = [loss_ema([x["loss"] for x in read_jsonl(r.dir / "train.jsonl")]) for r in runs]
    for t in BASIN_STEPS:
        scores = {n: [score_at(series(r, n, th), t) for r in runs] for n in th}
        scores["loss_level"] = [e[t] if t < len(e) else math.inf for e in emas]
        out["auroc"][t] = {n: _auroc_of([v for v, y in zip(sc, label, strict=True) if y],
                                        [v for v, y in zip(sc, label, strict=True) if not y])
                           for n, sc in scores.items()}
    return out


# ---- output ----

def _clean(x):
    """JSON-ready: NaN → null, ±inf → "inf"/"-inf" (as JsonlSink), numpy scalars → Python."""
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    return _json_float(x)


def _f(v, fmt: str = ".2f") -> str:
    if v is None:
        return "–"
    return format(v, fmt) if isinstance(v, float) else str(v)


def _metric_cells(m: dict) -> str:
    return (f"{m['hits']}/{m['n_pos']} | {_f(m['hit_rate'])} ({_f(m['wilson_low'])}–"
            f"{_f(m['wilson_high'])}) | {_f(m['median_lead'], '.0f')} | "
            f"{_f(m['false_alarms_per_run'])} | {m['late']} | {_f(m['auroc'])} |")


METRIC_HEADER = ("hits | hit rate (95 % CI) | median lead | false alarms / run | late | "
                 "AUROC @ −50 |")


def table(result: dict) -> str:
    runs = ["| config | arm | seed | event | kind | final gap |", "|---|---|---|---|---|---|"]
    runs += [f"| {r['config']} | {r['arm']} | {r['seed']} | {_f(r['event_step'])} | "
             f"{r['event_kind'] or 'negative'} | {_f(r['final_gap'], '+.2f')} |"
             for r in result["runs"]]
    some = next(iter(result["detectors"].values()), None)
    head = (f"{some['n_pos']} positive, {some['n_neg']} negative runs" if some else "no runs")
    dets = [f"| detector | threshold | {METRIC_HEADER}", "|" + "---|" * 8]
    dets += [f"| {n} | {result['thresholds'][n]:g} | {_metric_cells(m)}"
             for n, m in result["detectors"].items()]
    return "\n".join(runs) + f"\n\n{head}\n\n" + "\n".join(dets)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m reproduction.score", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--config", nargs="+", help="configurations (default: all under ROOT)")
    p.add_argument("--arm", default="unmitigated")
    p.add_argument("--seeds-mod", nargs=2, type=int, metavar=("M", "R"),
                   help="keep seeds with seed %% M == R")
    p.add_argument("--exclude-mod", nargs=2, type=int, metavar=("M", "R"),
                   help="drop seeds with seed %% M == R")
    p.add_argument("--thresholds", nargs="+", default=[], metavar="NAME=VALUE")
    p.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    p.add_argument("--sweep", nargs="+", metavar=("DETECTOR", "V"),
                   help="the detector's metrics at each candidate threshold V")
    p.add_argument("--plot", nargs=2, metavar=("DIR", "TAG"),
                   help="also write DIR/benchmark_{gap,alarms}_TAG.png (plot())")
    p.add_argument("--whole", nargs="+", metavar="C",
                   help="also these configurations, every seed (a configuration held out "
                        "whole next to the seed-filtered --config ones)")
    p.add_argument("--defaults", action="store_true",
                   help="score with THRESHOLDS (the starting points), not PREREGISTERED")
    p.add_argument("--tune", action="store_true",
                   help="tune every detector's threshold on the selected runs (tune())")
    p.add_argument("--basin", type=float, metavar="CUT",
                   help="exploratory: runs ending above CUT (basin()); arms from "
                        "--arms-compare")
    p.add_argument("--seeds", nargs="+", type=int,
                   help="--arms-compare: only these seeds, for every arm")
    p.add_argument("--arms-compare", nargs="+", metavar="ARM",
                   help="event rates and final losses of these arms against unmitigated")
    p.add_argument("--control", action="store_true",
                   help="the outcome's negative control and sign test (control())")
    a = p.parse_args(argv)
    overrides = {}
    for kv in a.thresholds:
        name, _, value = kv.partition("=")
        if name not in THRESHOLDS or not value:
            p.error(f"--thresholds {kv!r}: expected NAME=VALUE, NAME one of {list(THRESHOLDS)}")
        overrides[name] = float(value)
    th = {**(THRESHOLDS if a.defaults else PREREGISTERED), **overrides}

    if a.control:
        if not a.config:
            p.error("--control needs --config")
        seeds = set(a.seeds) if a.seeds else None
        res = {c: control(a.root, c, seeds) for c in a.config}
        if a.json:
            print(json.dumps(_clean({"control": res})))
            return 0
        print("| configuration | seeds | events | events with the roles swapped | final "
              "loss above the twin's | sign test p | median final gap |\n|" + "---|" * 7)
        for c, r in res.items():
            print(f"| {c} | {r['n']} | {r['events']} | {r['swapped']} | {r['paper_worse']} | "
                  f"{_f(r['sign_p'], '.3g')} | {_f(r['final_gap_median'], '+.3f')} |")
        return 0
    if a.basin is not None:
        if not a.config:
            p.error("--basin needs --config")
        seeds = set(a.seeds) if a.seeds else None
        res = {c: basin(a.root, c, a.basin, a.arms_compare or [], seeds) for c in a.config}
        if a.json:
            print(json.dumps(_clean(res)))
            return 0
        for c, r in res.items():
            print(f"{c}: final loss above {a.basin}\n\n| arm | runs | above | b | c | "
                  "McNemar p |\n|---|---|---|---|---|---|")
            for arm, m in r["arms"].items():
                print(f"| {arm} | {m['n']} | {m['high']} | {m['b']} | {m['c']} | "
                      f"{m['mcnemar_p']:.2g} |")
            names = list(next(iter(r["auroc"].values())))
            print("\nAUROC for it, unmitigated runs, by step\n\n| step | " + " | ".join(names)
                  + " |\n|" + "---|" * (len(names) + 1))
            for t, row in r["auroc"].items():
                print(f"| {t} | " + " | ".join(_f(row[n]) for n in names) + " |")
            print()
        return 0
    if a.arms_compare:
        if not a.config:
            p.error("--arms-compare needs --config")
        seeds = set(a.seeds) if a.seeds else None
        tables = {c: arm_table(a.root, c, a.arms_compare, seeds) for c in a.config}
        if a.plot:
            for c, rows in tables.items():
                plot_arms(rows, Path(a.plot[0]), f"{a.plot[1]}_{c}")
        if a.json:
            print(json.dumps(_clean({"arms": tables})))
            return 0
        for c, rows in tables.items():
            print(f"{c}\n\n| arm | runs | labelled | events | event rate | median final loss | "
                  "pairs | b (only unmitigated) | c (only arm) | McNemar p | "
                  "median Δ final loss |\n" + "|" + "---|" * 11)
            for r in rows:
                print(f"| {r['arm']} | {r['n']} | {r['labelled']} | {r['events']} | "
                      f"{_f(r['event_rate'])} | {_f(r['final_loss_median'], '.3f')} | "
                      f"{r['pairs']} | {r['b']} | {r['c']} | {_f(r['mcnemar_p'], '.3g')} | "
                      f"{_f(r['final_loss_diff_median'], '+.3f')} |")
            print()
        return 0

    runs = find_runs(a.root, a.config, a.arm, a.seeds_mod, a.exclude_mod)
    if a.whole:  # held out whole: no seed filter
        runs += find_runs(a.root, a.whole, a.arm)
    if not runs:
        p.error(f"no finished {a.arm} runs under {a.root}")
    if a.tune:
        tuned = tune_all(runs)
        if a.json:
            print(json.dumps(_clean({"tuned": tuned})))
        else:
            print(f"| detector | tuned threshold | within bar | {METRIC_HEADER}\n"
                  + "|" + "---|" * 9)
            print("\n".join(f"| {n} | {m['threshold']:.6g} | {m['within_bar']} | "
                            f"{_metric_cells(m)}" for n, m in tuned.items()))
        return 0
    if a.sweep:
        name, values = a.sweep[0], [float(v) for v in a.sweep[1:]]
        if name not in THRESHOLDS or not values:
            p.error(f"--sweep DETECTOR V ...: DETECTOR one of {list(THRESHOLDS)}")
        sweep = [{"threshold": v, **detector_metrics(runs, name, {**th, name: v})}
                 for v in values]
        if a.json:
            print(json.dumps(_clean({"detector": name, "sweep": sweep})))
        else:
            print(f"| {name} threshold | {METRIC_HEADER}\n" + "|" + "---|" * 7)
            print("\n".join(f"| {m['threshold']:g} | {_metric_cells(m)}" for m in sweep))
        return 0
    result = score(runs, th)
    print(json.dumps(_clean(result)) if a.json else table(result))
    if a.plot:
        plot(runs, result, Path(a.plot[0]), a.plot[1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
