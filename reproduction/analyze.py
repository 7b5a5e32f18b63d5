"""Tables and plots of docs/REPRODUCTION.md from the run directories of reproduction.run.

    python -m reproduction.analyze search  --root runs/repro --img docs/img
    python -m reproduction.analyze compare --root runs/repro --config CONFIG --img docs/img

`search` summarises the unmitigated seed-0 run of every configuration under ROOT (table 1,
repro_search_loss.png, repro_search_drift.png); `compare` the arms × seeds of one
configuration (table 2, repro_compare_loss.png, repro_compare_growth.png,
repro_compare_heads.png). Tables are
printed as Markdown.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from flashwatch.report.runreport import load_run
from reproduction.run import ARMS, CONFIGS, loss_ema

DRIFT_Z = 4.0  # WatchConfig.drift_z_threshold
LOGIT = 100.0  # a QK-clip style signal, not part of flashwatch's policy: for comparison


def run_stats(run_dir: Path) -> dict:
    """The numbers a table row needs, from one run directory."""
    run = load_run(run_dir)
    summ = json.loads((run_dir / "summary.json").read_text())
    ser = run["series"]
    n = len(run["steps"])
    tenth = max(1, n // 10)

    def mean(rows):
        vals = [v for r in rows for v in r if math.isfinite(v)]
        return sum(vals) / len(vals) if vals else math.nan

    z = [abs(v) for r in ser["delta_drift_z"] for v in r if math.isfinite(v)]
    # Coherence is not scale-free: one large early G dominates a window and pushes it to
    # ≈ 1. Report it where training has settled: the last monitored step.
    coh = [v for v in ser["delta_coherence"][-1] if math.isfinite(v)]
    # growth up to the last report with every norm finite (a diverged run ends in NaN)
    sn = [row for row in ser["wq_spectral_norm"] if all(math.isfinite(v) for v in row)]
    growth = [b / a for a, b in zip(sn[0], sn[-1], strict=True) if a > 0]
    logit_step = next((st for st, row in zip(run["steps"], ser["attention_max_logit"],
                                             strict=True)
                       if any(v > LOGIT for v in row if math.isfinite(v))), None)
    return dict(
        dir=str(run_dir), logit_step=logit_step,
        rise=largest_rise([v for _, v in run["loss"]]), config=summ["config"], arm=summ["arm"],
        seed=summ["seed"],
        settings=summ["settings"], steps=summ["steps_done"], seconds=summ["seconds"],
        ties_start=mean(ser["tied_rowmax_ratio"][:tenth]),
        ties_end=mean(ser["tied_rowmax_ratio"][-tenth:]),
        max_logit_end=max((v for v in ser["attention_max_logit"][-1] if math.isfinite(v)),
                          default=math.nan),
        max_abs_z=max(z) if z else math.nan,
        frac_z_over=(sum(v >= DRIFT_Z for v in z) / len(z)) if z else math.nan,
        max_coherence=max(coh) if coh else math.nan,
        wq_growth_max=max(growth, default=math.nan),
        wq_growth_median=sorted(growth)[len(growth) // 2] if growth else math.nan,
        best_loss=summ["best_loss_ema"], final_loss=summ["final_loss_mean_last100"],
        spike_step=summ["spike_step"],
        first_alert=(summ["first_alert"] or {}).get("step"),
        alert_reason=_kind((summ["first_alert"] or {}).get("reason")),
        flagged=summ["flagged_heads"], top_growth=list(summ["wq_growth_top"]),
        lead=summ["lead_steps"], overhead=summ["monitored_over_plain"],
        events=summ["events"], errors=summ["monitor_errors_total"], run=run,
    )


def largest_rise(losses: list[float]) -> float:
    """Largest rise of the loss EMA above its best value so far, in nats (inf if the
    loss became non-finite): how big the worst spike was, below the spike threshold too."""
    ema = loss_ema(losses)
    if len(ema) < len(losses):
        return math.inf
    rise, best = 0.0, math.inf
    for e in ema:
        rise, best = max(rise, e - best), min(best, e)
    return rise


def _kind(reason: str | None) -> str | None:
    """Which rule of the policy raised an alert: the δ drift or the W^Q growth."""
    if reason is None:
        return None
    return "drift" if "drift" in reason else "W^Q growth" if "spectral" in reason else reason


def _f(v, digits=2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def search(root: Path, img: Path) -> str:
    order = {name: i for i, name in enumerate(CONFIGS)}  # the order they were tried
    rows = [run_stats(d) for d in root.glob("*/unmitigated-s0")
            if (d / "summary.json").is_file()]
    rows.sort(key=lambda r: (order.get(r["config"], len(order)), r["config"]))
    if not rows:
        raise SystemExit(f"no {root}/*/unmitigated-s0/summary.json yet")
    lines = ["| configuration | backend | data | rows × batch | lr, wd, clip | steps | "
             "ties start→end | max logit | "
             "max abs drift z | share z ≥ 4 | coherence at the end (max head) | "
             "W^Q growth max / median | best → final loss | spike | first alert (rule) |",
             "|" + "---|" * 15]
    for r in rows:
        s = r["settings"]
        clip = "none" if s["clip"] >= 1e6 else f"{s['clip']:g}"
        lines.append(
            f"| {r['config']} | {s['backend']} | {s['data']} (V={s['vocab']}) | "
            f"{s['block']} × {s['batch']} | {s['lr']:g}, {s['weight_decay']:g}, {clip} | "
            f"{r['steps']} | {_f(r['ties_start'])}→{_f(r['ties_end'])} | "
            f"{_f(r['max_logit_end'], 1)} | {_f(r['max_abs_z'])} | {_f(r['frac_z_over'], 3)} | "
            f"{_f(r['max_coherence'])} | {_f(r['wq_growth_max'])} / "
            f"{_f(r['wq_growth_median'])} | {_f(r['best_loss'])} → {_f(r['final_loss'])} | "
            f"{_f(r['spike_step'])} | {_f(r['first_alert'])} ({r['alert_reason'] or '–'}) |")
    _plot_search(rows, img)
    return "\n".join(lines)


def _plot_search(rows, img: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in rows:
        loss = r["run"]["loss"]
        ema = loss_ema([v for _, v in loss])
        ax.plot([s for s, _ in loss][:len(ema)], ema, label=r["config"], lw=1)
    ax.set(xlabel="step", ylabel="training loss (EMA 0.95)", title="Search: unmitigated, seed 0")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(img / "repro_search_loss.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in rows:
        z = r["run"]["series"]["delta_drift_z"]
        ax.plot(r["run"]["steps"], [max((abs(v) for v in row if math.isfinite(v)),
                                        default=math.nan) for row in z],
                label=r["config"], lw=1)
    ax.axhline(DRIFT_Z, color="k", ls="--", lw=0.8, label="alert threshold 4")
    ax.set(xlabel="step", ylabel="largest |drift z| over heads",
           title="Search: does any head's δ error keep one sign?")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(img / "repro_search_drift.png", dpi=110)
    plt.close(fig)


def compare(root: Path, config: str, img: Path) -> str:
    dirs = sorted(d for d in (root / config).glob("*-s*") if (d / "summary.json").is_file())
    if not dirs:
        raise SystemExit(f"no runs under {root / config}")
    rows = [run_stats(d) for d in dirs]
    order = {arm: i for i, arm in enumerate(ARMS)}
    rows.sort(key=lambda r: (order[r["arm"]], r["seed"]))
    lines = ["| arm | seed | best → final loss | spike step | first alert (reason) | lead | "
             "heads flagged | top W^Q growth heads | flagged ∩ top growth | max abs z | "
             "W^Q growth max | max logit | first logit > 100 | monitored / plain step |",
             "|" + "---|" * 14]
    for r in rows:
        flagged = ", ".join(_short(h) for h in r["flagged"]) or "none"
        top = ", ".join(_short(h) for h in r["top_growth"][:2])
        both = len(set(r["flagged"]) & set(r["top_growth"]))
        lines.append(
            f"| {r['arm']} | {r['seed']} | {_f(r['best_loss'])} → {_f(r['final_loss'])} | "
            f"{_f(r['spike_step'])} | {_f(r['first_alert'])} ({r['alert_reason'] or '–'}) | "
            f"{_f(r['lead'])} | {flagged} | {top} | {both} | {_f(r['max_abs_z'])} | "
            f"{_f(r['wq_growth_max'])} | {_f(r['max_logit_end'], 0)} | {_f(r['logit_step'])} | "
            f"{_f(r['overhead'])} |")
    _plot_compare(rows, config, img)
    return _arm_summary(rows) + "\n\n" + "\n".join(lines)


def twins(root: Path, config: str) -> str:
    """The paper arithmetic against its twins, seed by seed: `config` (arms unmitigated
    and fp32_delta: same forward, δ from an FP32 O) and `config`-fused (flashwatch's fused
    kernel arithmetic). Final loss = mean of the last 100 steps; gap = against the fused
    twin of the same seed (same data and initialisation)."""
    arms = {"paper": root / config / "unmitigated-s{}", "fp32_delta": root / config /
            "fp32_delta-s{}", "fused": root / f"{config}-fused" / "unmitigated-s{}"}
    seeds = sorted({int(d.name.rsplit("-s", 1)[1]) for d in (root / config).glob("*-s*")
                    if (d / "summary.json").is_file()})
    runs: dict[str, dict[int, dict]] = {a: {} for a in arms}
    for arm, pattern in arms.items():
        for seed in seeds:
            d = Path(str(pattern).format(seed))
            if (d / "summary.json").is_file():
                summ = json.loads((d / "summary.json").read_text())
                train = [json.loads(x) for x in (d / "train.jsonl").read_text().splitlines()]
                runs[arm][seed] = dict(final=summ["final_loss_mean_last100"],
                                       spike=summ["spike_step"],
                                       rise=largest_rise([r["loss"] for r in train]),
                                       gmax=max(r["grad_norm"] for r in train))
    lines = ["| seed | " + " | ".join(f"{a} final (rise)" for a in arms) +
             " | paper − fused | fp32_delta − fused |", "|" + "---|" * (len(arms) + 3)]
    gaps: dict[str, list[float]] = {"paper": [], "fp32_delta": []}
    for seed in seeds:
        cells = []
        for arm in arms:
            r = runs[arm].get(seed)
            cells.append("–" if r is None else f"{_f(r['final'])} ({_f(r['rise'])})")
        gap = []
        for arm in gaps:
            a, b = runs[arm].get(seed), runs["fused"].get(seed)
            if a and b and math.isfinite(a["final"]) and math.isfinite(b["final"]):
                gaps[arm].append(a["final"] - b["final"])
                gap.append(f"{a['final'] - b['final']:+.2f}")
            else:
                gap.append("–")
        lines.append(f"| {seed} | " + " | ".join(cells + gap) + " |")
    out = ["| arm | runs | spiked | median final loss | median gap to fused | "
           "largest gradient norm, median |", "|---|---|---|---|---|---|"]
    for arm in arms:
        rs = list(runs[arm].values())
        if not rs:
            continue
        finals = sorted(r["final"] for r in rs)
        g = sorted(gaps.get(arm, []))
        gm = sorted(r["gmax"] for r in rs)
        out.append(f"| {arm} | {len(rs)} | {sum(r['spike'] is not None for r in rs)} | "
                   f"{finals[len(finals) // 2]:.2f} | "
                   f"{(f'{g[len(g) // 2]:+.2f}' if g else '–')} | {gm[len(gm) // 2]:.3g} |")
    return "\n".join(out) + "\n\n" + "\n".join(lines)


def deltas(files: list[Path], batches: int = 16) -> str:
    """Pool reproduction.checkpoints JSON files (one or more runs each): does the δ error
    keep its sign or direction across batches, and how large is it, by training step?
    Under a random sign z ~ N(0, 1) (sd 1, |z| > 3 in 0.27 % of heads); a random
    direction gives coherence ≈ 1/sqrt(batches). Step 0 (initialisation) is left out."""
    rows = [r for f in files for rs in json.loads(Path(f).read_text()).values() for r in rs
            if r["step"] > 0]
    if not rows:
        raise SystemExit("no checkpoint rows in the given files")
    z = [r["sign_z"] for r in rows]
    sd = math.sqrt(sum(v * v for v in z) / len(z))
    out = [f"{len(rows)} head-checkpoints; sign z: mean {sum(z) / len(z):+.3f}, rms {sd:.2f}, "
           f"|z| > 3 in {sum(abs(v) > 3 for v in z) / len(z):.2%}, max |z| "
           f"{max(abs(v) for v in z):.2f}; coherence (null ≈ {1 / math.sqrt(batches):.2f}): "
           f"median {_median([r['coherence'] for r in rows]):.2f}, > 0.5 in "
           f"{sum(r['coherence'] > 0.5 for r in rows) / len(rows):.1%}", "",
           "| layer | rms z | coherence median | rel_error median |", "|---|---|---|---|"]
    for layer in sorted({r["layer"] for r in rows}):
        at = [r for r in rows if r["layer"] == layer]
        zl = [r["sign_z"] for r in at]
        out.append(f"| {layer} | {math.sqrt(sum(v * v for v in zl) / len(zl)):.2f} | "
                   f"{_median([r['coherence'] for r in at]):.2f} | "
                   f"{_median([r['rel_error'] for r in at]):.2f} |")
    out += ["", "| steps | rel_error median | rel_error 90th percentile |", "|---|---|---|"]
    for lo in range(0, max(r["step"] for r in rows) + 1, 500):
        at = sorted(r["rel_error"] for r in rows if lo <= r["step"] < lo + 500)
        if at:
            out.append(f"| {lo}–{lo + 499} | {at[len(at) // 2]:.2f} | "
                       f"{at[int(0.9 * len(at))]:.2f} |")
    return "\n".join(out)


def summaries(root: Path) -> str:
    """One compact JSON record per run under root/CONFIG/ARM-sSEED, for committing
    (reproduction/results_v2.json, results_v3.json) in place of the run logs, with the
    detection benchmark's outcome (reproduction/score.py: event step and kind, final gap
    to the fused twin)."""
    from reproduction.score import load  # the detection benchmark's outcome

    out = []
    for d in sorted(root.glob("*/*/summary.json")):
        summ = json.loads(d.read_text())
        run = load(d.parent, scores=False)
        train = [json.loads(x) for x in (d.parent / "train.jsonl").read_text().splitlines()]
        last = json.loads((d.parent / "flashwatch.jsonl").read_text().splitlines()[-1])
        logits = [h["attention_max_logit"] for h in last["heads"]
                  if h["attention_max_logit"] is not None]
        out.append(dict(
            config=summ["config"], arm=summ["arm"], seed=summ["seed"],
            steps=summ["steps_done"], final_loss=round(summ["final_loss_mean_last100"], 4),
            best_loss_ema=round(summ["best_loss_ema"], 4), spike_step=summ["spike_step"],
            max_grad_norm=round(max(r["grad_norm"] for r in train), 3),
            max_logit_end=max(logits, default=None), qk_clips=summ.get("qk_clips_total"),
            first_alert=summ["first_alert"], flagged_heads=len(summ["flagged_heads"]),
            final_modes={k: sorted(set(v)) for k, v in summ["final_modes"].items()},
            event_step=run.event_step, event_kind=run.event_kind,
            final_gap=None if run.final_gap is None else round(run.final_gap, 4)))
    return json.dumps(out, indent=0)


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _arm_summary(rows) -> str:
    """One line per arm: how many runs spiked, diverged, were warned in time."""
    out = ["| arm | runs | spiked | not finite | alert before the spike | final loss "
           "(each seed) | largest loss rise, nats (each seed) |", "|---|---|---|---|---|---|---|"]
    for arm in dict.fromkeys(r["arm"] for r in rows):
        rs = [r for r in rows if r["arm"] == arm]
        spiked = [r for r in rs if r["spike_step"] is not None]
        nan = sum(not math.isfinite(r["final_loss"]) for r in rs)
        warned = sum(r["first_alert"] is not None and r["first_alert"] < r["spike_step"]
                     for r in spiked)
        finals = ", ".join(_f(r["final_loss"]) if math.isfinite(r["final_loss"]) else "NaN"
                           for r in rs)
        rises = ", ".join("∞" if math.isinf(r["rise"]) else f"{r['rise']:.2f}" for r in rs)
        out.append(f"| {arm} | {len(rs)} | {len(spiked)} | {nan} | {warned} of {len(spiked)} "
                   f"| {finals} | {rises} |")
    return "\n".join(out)


def _short(head: str) -> str:
    return head.replace("transformer.", "").replace(".attn", "")


def _plot_compare(rows, config: str, img: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    colors = {"unmitigated": "tab:red", "auto": "tab:blue", "fp32_o": "tab:green",
              "beta": "tab:purple", "fp32_delta": "tab:orange", "qk_clip": "tab:brown",
              "fused": "tab:gray"}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    seen = set()
    for r in rows:
        loss = r["run"]["loss"]
        ema = loss_ema([v for _, v in loss])
        ax.plot([s for s, _ in loss][:len(ema)], ema, color=colors[r["arm"]],
                lw=1, alpha=0.8, label=None if r["arm"] in seen else r["arm"])
        seen.add(r["arm"])
    ax.set(xlabel="step", ylabel="training loss (EMA 0.95)",
           title=f"{config}: four arms × seeds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(img / "repro_compare_loss.png", dpi=110)
    plt.close(fig)
    # Largest W^Q spectral norm over heads, per run: does removing the δ error (FP32_O)
    # or the ties (BETA) change the growth?
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    seen = set()
    for r in rows:
        run = r["run"]
        label = None if r["arm"] in seen else r["arm"]
        seen.add(r["arm"])
        a1.plot(run["steps"], [max(row) for row in run["series"]["wq_spectral_norm"]],
                color=colors[r["arm"]], lw=1, alpha=0.8, label=label)
        a2.plot(run["steps"], [max((v for v in row if math.isfinite(v)), default=math.nan)
                               for row in run["series"]["attention_max_logit"]],
                color=colors[r["arm"]], lw=1, alpha=0.8)
    a1.set(xlabel="step", ylabel="largest W^Q spectral norm over heads")
    a2.set(xlabel="step", ylabel="largest attention logit over heads", yscale="log")
    a1.legend()
    fig.suptitle(f"{config}: W^Q and logit growth per arm")
    fig.tight_layout()
    fig.savefig(img / "repro_compare_growth.png", dpi=110)
    plt.close(fig)
    # Unmitigated seed 0: W^Q norm and drift z per head; flagged heads in colour.
    r = next((x for x in rows if x["arm"] == "unmitigated"), rows[0])
    run, flagged = r["run"], set(r["flagged"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (layer, h) in enumerate(run["heads"]):
        name = f"{layer}/{h}"
        kw = dict(lw=1.4, label=_short(name)) if name in flagged else dict(color="0.7", lw=0.7)
        a1.plot(run["steps"], [row[i] for row in run["series"]["wq_spectral_norm"]], **kw)
        a2.plot(run["steps"], [row[i] for row in run["series"]["delta_drift_z"]], **kw)
    a1.set(xlabel="step", ylabel="W^Q spectral norm", title="W^Q spectral norm per head")
    a2.axhline(DRIFT_Z, color="k", ls="--", lw=0.8)
    a2.axhline(-DRIFT_Z, color="k", ls="--", lw=0.8)
    a2.set(xlabel="step", ylabel="drift z", title="δ drift z per head (flagged in colour)")
    if flagged:
        a1.legend(fontsize=7)
    fig.suptitle(f"{config}, unmitigated seed {r['seed']}")
    fig.tight_layout()
    fig.savefig(img / "repro_compare_heads.png", dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m reproduction.analyze", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("search", "compare", "twins", "deltas", "summaries"))
    p.add_argument("--json", type=Path, nargs="*", default=[],
                   help="deltas: reproduction.checkpoints JSON files")
    p.add_argument("--root", type=Path, default=Path("runs/repro"))
    p.add_argument("--config")
    p.add_argument("--img", type=Path, default=Path("docs/img"))
    a = p.parse_args(argv)
    if a.what in ("compare", "twins") and not a.config:
        p.error(f"{a.what} needs --config")
    if a.what == "deltas":
        print(deltas(a.json))
    elif a.what == "summaries":
        print(summaries(a.root))
    elif a.what == "twins":
        print(twins(a.root, a.config))
    else:
        print(search(a.root, a.img) if a.what == "search" else compare(a.root, a.config, a.img))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
