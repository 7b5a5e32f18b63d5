"""`flashwatch report RUN_DIR`: plots and a Markdown summary of a watched run.

Reads RUN_DIR/flashwatch.jsonl (JsonlSink) and, when present, RUN_DIR/train.jsonl
(lines with "step" and "loss") and RUN_DIR/summary.json. Writes into RUN_DIR (or --out):
  ties_heatmap.png   tied-rowmax ratio, one row per (layer, head), over monitored steps
  drift.png          drift z and coherence of the flagged heads (else the 4 worst), with
                     the metrics table's limits as dashed lines
  spectral.png       W^Q spectral norm of every head, the flagged ones bold
  loss.png           training loss with the mitigation events marked
A head is "flagged" when the run has a mode change for it (the policy acted or advised);
each head keeps one colour in every plot.
  report.md          flagged heads, when, what fix, what happened after
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from flashwatch._checks import missing_extra
from flashwatch.report.metrics import BY_NAME
from flashwatch.report.sinks import read_jsonl

PLOTS = ("ties_heatmap.png", "drift.png", "spectral.png", "loss.png")


def _nan(v) -> float:
    if v is None:
        return math.nan
    if isinstance(v, str):  # "inf" / "-inf" as JsonlSink writes them
        return float(v)
    return float(v)


def load_run(run_dir: Path) -> dict:
    run_dir = Path(run_dir)
    path = run_dir / "flashwatch.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: RUN_DIR must hold the flashwatch.jsonl "
                                f"written by JsonlSink (as `flashwatch demo` does)")
    # compact lines (JsonlSink on large models) have no per-head record: skip them
    reports = [r for r in read_jsonl(path) if "heads" in r]
    if not reports:
        raise ValueError(f"{path} holds no complete report yet")
    heads = [(h["layer"], h["head"]) for h in reports[0]["heads"]]
    steps = [r["step"] for r in reports]
    series: dict[str, list[list[float]]] = {}
    for key in ("tied_rowmax_ratio", "delta_drift_z", "delta_coherence", "wq_spectral_norm",
                "attention_max_logit"):
        series[key] = [[_nan(h[key]) for h in r["heads"]] for r in reports]
    events = [e for r in reports for e in r["events"] if e.get("kind", "mode") == "mode"]
    clips = [e for r in reports for e in r["events"] if e.get("kind") == "qk_clip"]
    loss = []
    train = run_dir / "train.jsonl"
    if train.is_file():
        loss = [(d["step"], d["loss"]) for d in read_jsonl(train)]
    summary = {}
    if (run_dir / "summary.json").is_file():
        summary = json.loads((run_dir / "summary.json").read_text())
    return dict(heads=heads, steps=steps, series=series, events=events, loss=loss,
                summary=summary, reports=reports, clips=clips)


def _label(head) -> str:
    layer, h = head
    return f"{layer.replace('transformer.', '')}/{h}"


def make_report(run_dir: Path, out: Path | None = None) -> list[Path]:
    try:
        import matplotlib
    except ImportError as e:  # an extra: the core install has no plotting library
        raise missing_extra("matplotlib", "report", "flashwatch report") from e

    matplotlib.use("Agg")
    run = load_run(run_dir)
    out = Path(out or run_dir)
    out.mkdir(parents=True, exist_ok=True)
    shown = _shown_heads(run)
    written = [_plot_ties(run, out / "ties_heatmap.png"),
               _plot_drift(run, shown, out / "drift.png"),
               _plot_spectral(run, _flagged(run), out / "spectral.png"),
               _plot_loss(run, out / "loss.png")]
    md = out / "report.md"
    md.write_text(_markdown(run))
    written.append(md)
    return written


def _subplots(*args, **kwargs):
    import matplotlib.pyplot as plt  # after make_report's matplotlib.use("Agg")

    return plt.subplots(*args, **kwargs)


def _flagged(run: dict) -> list[int]:
    """Indices of the heads with a mode change in the run, in (layer, head) order."""
    heads = run["heads"]
    return [heads.index(h) for h in sorted({(e["layer"], e["head"]) for e in run["events"]})
            if h in heads]


def _colour(i: int):
    """Head i's colour, the same in every plot (tab20 repeats after 20 heads)."""
    import matplotlib

    return matplotlib.colormaps["tab20"](i % 20)


def _limit_line(ax, metric: str, name: str) -> None:
    """The metrics table's limit for `metric` as a dotted line, named on the y axis."""
    limit = BY_NAME[metric].limit
    if limit is None:
        ax.set_ylabel(name)
        return
    ax.axhline(limit, color="black", ls=":", lw=0.8)
    ax.set_ylabel(f"{name} (dotted: limit {limit:g})")


def _shown_heads(run: dict) -> list[int]:
    """Indices of the heads the drift plot shows: the flagged ones, or the 4 of largest
    final drift z when no head was flagged."""
    flagged = _flagged(run)
    if flagged:
        return flagged
    final_z = np.nan_to_num(np.array(run["series"]["delta_drift_z"])[-1], nan=-np.inf)
    return [int(i) for i in np.argsort(-final_z)[:4]]


def _plot_ties(run: dict, path: Path) -> Path:
    """Tie ratio heatmap: rows = heads grouped by layer, columns = monitored steps."""
    heads, steps = run["heads"], run["steps"]
    ties = np.array(run["series"]["tied_rowmax_ratio"]).T  # [heads, steps]
    fig, ax = _subplots(figsize=(10, 0.25 * len(heads) + 2))
    im = ax.imshow(np.ma.masked_invalid(ties), aspect="auto", cmap="magma", vmin=0,
                   interpolation="nearest",
                   extent=(steps[0] - 0.5, steps[-1] + 0.5, len(heads) - 0.5, -0.5))
    ax.set_yticks(range(len(heads)), [_label(h) for h in heads], fontsize=7)
    ax.set_xlabel("optimizer step")
    ax.set_title("tied-rowmax ratio per layer/head")
    fig.colorbar(im, ax=ax, label="tied rows / rows")
    return _save(fig, path)


def _plot_drift(run: dict, shown: list[int], path: Path) -> Path:
    """Drift z and coherence of the heads `shown`, mode events marked."""
    steps, series, events = run["steps"], run["series"], run["events"]
    fig, (a1, a2) = _subplots(2, 1, figsize=(10, 6), sharex=True)
    for i in shown:
        label = _label(run["heads"][i])
        a1.plot(steps, [row[i] for row in series["delta_drift_z"]], label=label,
                color=_colour(i))
        a2.plot(steps, [row[i] for row in series["delta_coherence"]], label=label,
                color=_colour(i))
    _mark_events(a1, events)
    _mark_events(a2, events)
    _limit_line(a1, "delta_drift_z", "drift z")
    _limit_line(a2, "delta_coherence", "coherence")
    a2.set_xlabel("optimizer step")
    a1.set_title("δ-error drift of " + (
        "the heads with a mode change" if events
        else "the 4 heads of largest final drift z (no head flagged)")
        + _caption_events(events))
    a1.legend(fontsize=7, ncol=5)
    return _save(fig, path)


def _plot_spectral(run: dict, shown: list[int], path: Path) -> Path:
    """W^Q spectral norm of every head, the flagged heads (`shown`) bold and labelled."""
    fig, ax = _subplots(figsize=(10, 4))
    sig = np.array(run["series"]["wq_spectral_norm"])
    for i, head in enumerate(run["heads"]):
        ax.plot(run["steps"], sig[:, i], lw=2.0 if i in shown else 0.6, color=_colour(i),
                label=_label(head) if i in shown else None)
    _mark_events(ax, run["events"])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("‖W^Q_h‖₂")
    ax.set_title("W^Q spectral norm per head " + (
        "(bold: heads with a mode change)" if shown else "(no head flagged)")
        + _caption_events(run["events"]))
    if shown:
        ax.legend(fontsize=7)
    return _save(fig, path)


def _plot_loss(run: dict, path: Path) -> Path:
    """Training loss (train.jsonl) with the mode events marked."""
    fig, ax = _subplots(figsize=(10, 4))
    if run["loss"]:
        s, l = zip(*run["loss"], strict=True)
        ax.plot(s, l, lw=0.8)
    else:
        ax.text(0.5, 0.5, "no train.jsonl in this run", ha="center", transform=ax.transAxes)
    _mark_events(ax, run["events"])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title("training loss" + _caption_events(run["events"]))
    return _save(fig, path)


def _caption_events(events) -> str:
    return "; dashed verticals: mode changes" if events else ""


def _mark_events(ax, events) -> None:
    colors = {"BETA": "tab:orange", "FP32_O": "tab:red"}
    for e in events:
        ax.axvline(e["step"], color=colors.get(e["to_mode"], "gray"), ls="--", lw=0.8)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _markdown(run: dict) -> str:
    heads, steps, series, events = run["heads"], run["steps"], run["series"], run["events"]
    s = run["summary"]
    lines = ["# flashwatch run report", ""]
    if s:
        lines += [f"- ended: **{s.get('ended', '?')}** after {s.get('steps_done', '?')} "
                  f"steps ({s.get('seconds', math.nan):.0f} s)",
                  f"- settings: `{json.dumps(s.get('settings', {}))}`",
                  f"- monitor errors: {s.get('monitor_errors_total', 0)}"]
    lines += [f"- monitored steps: {len(steps)} (steps {steps[0]} to {steps[-1]}), "
              f"{len(heads)} heads", ""]
    if run["loss"]:
        first, last = run["loss"][0][1], run["loss"][-1][1]
        lines += [f"Loss went from {first:.3f} to {last:.3f}.", ""]
    ties_last = series["tied_rowmax_ratio"][-1]
    finite = [t for t in ties_last if not math.isnan(t)]
    if finite:
        lines += [f"Tied-rowmax ratio at the last monitored step: median "
                  f"{sorted(finite)[len(finite) // 2]:.3f}, max {max(finite):.3f}.", ""]
    lines += ["## Mode changes", ""]
    if not events:
        lines += ["None: no head was flagged (drift z stayed under its threshold, or ties "
                  "were not elevated).", ""]
    else:
        lines += ["| step | layer | head | from | to | applied | reason |",
                  "|---|---|---|---|---|---|---|"]
        for e in events:
            lines.append(f"| {e['step']} | {e['layer']} | {e['head']} | {e['from_mode']} | "
                         f"{e['to_mode']} | {e['applied']} | {e['reason']} |")
        lines += ["", "## What happened after", ""]
        for layer, head in sorted({(e["layer"], e["head"]) for e in events}):
            i = heads.index((layer, head))
            first = min(e["step"] for e in events if (e["layer"], e["head"]) == (layer, head))
            before = [row[i] for st, row in zip(steps, series["delta_drift_z"], strict=True)
                      if st <= first]
            after = [row[i] for st, row in zip(steps, series["delta_drift_z"], strict=True)
                     if st > first]
            sig = [row[i] for row in series["wq_spectral_norm"]]
            lines.append(
                f"- {layer} head {head}: drift z {_fmt(before[-1] if before else None)} at "
                f"the first change (step {first}), {_fmt(after[-1] if after else None)} at "
                f"the end; W^Q spectral norm {_fmt(sig[0])} → {_fmt(sig[-1])}.")
        lines.append("")
    if run["clips"]:
        lines += ["## QK-clips", "", "| layer | head | clips | first step | last reason |",
                  "|---|---|---|---|---|"]
        for layer, head in sorted({(e["layer"], e["head"]) for e in run["clips"]}):
            mine = [e for e in run["clips"] if (e["layer"], e["head"]) == (layer, head)]
            lines.append(f"| {layer} | {head} | {len(mine)} | {mine[0]['step']} | "
                         f"{mine[-1]['reason']} |")
        lines.append("")
    lines += ["## Plots", ""] + [f"![{p}]({p})" for p in PLOTS] + [""]
    return "\n".join(lines)


def _fmt(v) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f}"
