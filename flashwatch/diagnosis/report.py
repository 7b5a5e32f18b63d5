"""`flashwatch diagnose` output: report.md (ranked table, recommendations, evidence,
growth), diagnose.json (every number), heads.png (per-head heatmaps of the last
checkpoint) and, with several checkpoints, growth.png.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from flashwatch.diagnosis.rank import SHARE_MIN, TIE_MIN, VERDICTS, WQ_RATIO_MIN, Z_MIN

TABLE_ROWS = 20  # ranked rows shown besides every flagged head
HEATMAPS = (("tied_ratio", "tied-rowmax ratio"), ("max_logit", "max logit"),
            ("delta_share", "δ error / dW^Q"), ("sign_z", "sign z"),
            ("wq_ratio", "W^Q σ / layer median"))


def write_report(results: list[dict], out: Path, growth: dict | None = None) -> list[Path]:
    """Write the files of the module docstring into `out`; returns their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    growth = growth or {}
    js = out / "diagnose.json"
    everything = dict(checkpoints=results, growth=[dict(layer=k[0], head=k[1], **v)
                                                   for k, v in growth.items()])
    js.write_text(json.dumps(_clean(everything), indent=1, allow_nan=False) + "\n")
    written = [js]
    try:
        written.append(_heatmaps(results[-1], out / "heads.png"))
        if growth:
            written.append(_growth_plot(results, growth, out / "growth.png"))
        note = []
    except ImportError:  # matplotlib is an extra: the numbers do not need it
        note = ["", "No plots: they need matplotlib (pip install 'flashwatch[report]')."]
    md = out / "report.md"
    md.write_text(markdown(results, growth, [p.name for p in written[1:]])
                  + "\n".join(note) + ("\n" if note else ""))
    return [md, *written]


def markdown(results: list[dict], growth: dict, images: list[str]) -> str:
    last = results[-1]
    heads = last["heads"]
    flagged = [h for h in heads if h["verdict"] != "ok"]
    lines = [f"# flashwatch diagnose: {last['name']}", "",
             f"{last['batches']} batches, every row, {last['dtype']} autocast on "
             f"{last['device']}; τ = {last['tau']:g}, tie eps = {last['eps']:g}; "
             f"{last['seconds']:.1f} s. {len(flagged)} of {len(heads)} heads flagged.", "",
             "Verdicts: **paper-failure** = ties ≥ "
             f"{TIE_MIN:.0%} + persistent δ sign (|z| ≥ {Z_MIN:g}) + W^Q ≥ "
             f"{WQ_RATIO_MIN:g}× the layer median (or growing that much faster); "
             f"**delta-error** = δ error ≥ {SHARE_MIN:.0%} of the head's W^Q gradient; "
             "**logit-growth** = max logit > τ or large W^Q with a small δ error.", ""]
    lines += table(heads[:max(TABLE_ROWS, len(flagged))])
    if flagged:
        lines += ["", "## Recommendations", ""]
        lines += [f"- {h['layer']}/{h['head']} ({h['verdict']}): `{h['recommendation']}`"
                  for h in flagged]
        lines += ["", "## Evidence", ""]
        lines += [f"- {h['layer']}/{h['head']}: {h['evidence']}" for h in flagged]
    if growth:
        lines += ["", "## Checkpoints, oldest first", ""] + checkpoint_table(results)
        lines += ["", "## Growth across checkpoints (last / first)", ""]
        lines += growth_table(growth, flagged)
    lines += [""] + [f"![{name}]({name})" for name in images]
    return "\n".join(lines) + "\n"


def table(heads: list[dict]) -> list[str]:
    rows = ["| rank | layer/head | verdict | tied | max logit | δ error / dW^Q | coherence | "
            "sign z | W^Q σ (× median) | QK-clip η |", "|---|---|---|---|---|---|---|---|---|---|"]
    for h in heads:
        rows.append(f"| {h['rank']} | {h['layer']}/{h['head']} | {h['verdict']} | "
                    f"{h['tied_ratio']:.3f} | {h['max_logit']:.4g} | {_g(h['delta_share'])} | "
                    f"{h['delta_coherence']:.2f} | {h['sign_z']:+.2f} | {h['wq_sigma']:.3g} "
                    f"({h['wq_ratio']:.2f}) | {h['qk_clip_eta']:.3g} |")
    return rows


def checkpoint_table(results: list[dict]) -> list[str]:
    """One row per checkpoint: verdict counts, medians and the worst head."""
    rows = ["| checkpoint | paper-failure / delta-error / logit-growth | median δ error / "
            "dW^Q | largest max logit | median tied | rank 1 |", "|---|---|---|---|---|---|"]
    for r in results:
        hs = r["heads"]
        n = [sum(h["verdict"] == v for h in hs) for v in VERDICTS[:3]]
        med = sorted(h["delta_share"] for h in hs)[len(hs) // 2]
        tied = sorted(h["tied_ratio"] for h in hs)[len(hs) // 2]
        top = hs[0]
        rows.append(f"| {r['name']} | {n[0]} / {n[1]} / {n[2]} | {_g(med)} | "
                    f"{max(h['max_logit'] for h in hs):.4g} | {tied:.3f} | "
                    f"{top['layer']}/{top['head']} ({top['verdict']}) |")
    return rows


def growth_table(growth: dict, flagged: list[dict]) -> list[str]:
    """The flagged heads, else the 8 of largest W^Q growth: last / first checkpoint."""
    keys = [(h["layer"], h["head"]) for h in flagged if (h["layer"], h["head"]) in growth]
    if not keys:
        keys = sorted(growth, key=lambda k: -_num(growth[k]["wq_sigma"]))[:8]
    rows = ["| layer/head | W^Q σ growth | max logit growth | δ share growth | W^Q σ per "
            "checkpoint | max logit per checkpoint |", "|---|---|---|---|---|---|"]
    for k in keys:
        g = growth[k]
        rows.append(f"| {k[0]}/{k[1]} | {_g(g['wq_sigma'])} | {_g(g['max_logit'])} | "
                    f"{_g(g['delta_share'])} | "
                    f"{', '.join(f'{x:.3g}' for x in g['series']['wq_sigma'])} | "
                    f"{', '.join(f'{x:.3g}' for x in g['series']['max_logit'])} |")
    return rows


def _grid(heads: list[dict], key: str):
    layers = [h["layer"] for h in sorted(heads, key=lambda h: h["layer_index"])]
    layers = list(dict.fromkeys(layers))  # model order
    n = max(h["head"] for h in heads) + 1
    grid = [[math.nan] * n for _ in layers]
    for h in heads:
        v = h[key]
        grid[layers.index(h["layer"])][h["head"]] = abs(v) if key == "sign_z" else v
    return layers, grid


def _heatmaps(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(HEATMAPS), figsize=(3.2 * len(HEATMAPS), 3.5))
    for ax, (key, title) in zip(axes, HEATMAPS, strict=True):
        layers, grid = _grid(result["heads"], key)
        a = np.array(grid, dtype=float)
        if key in ("max_logit", "delta_share"):
            a = np.log10(np.clip(a, 1e-12, None))
            title = f"log10 {title}"
        im = ax.imshow(np.ma.masked_invalid(a), aspect="auto", cmap="viridis")
        ax.set_title(title if key != "sign_z" else "|sign z|", fontsize=9)
        ax.set_xlabel("head")
        ax.set_yticks(range(len(layers)), [str(i) for i in range(len(layers))])
        fig.colorbar(im, ax=ax, fraction=0.046)
    axes[0].set_ylabel("layer (model order)")
    fig.suptitle(result["name"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _growth_plot(results: list[dict], growth: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    flagged = {(h["layer"], h["head"]) for h in results[-1]["heads"] if h["verdict"] != "ok"}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    x = range(len(results))
    for key, ax, title in (("wq_sigma", axes[0], "W^Q σ"), ("max_logit", axes[1], "max logit")):
        for k, g in growth.items():
            hot = k in flagged
            ax.plot(x, g["series"][key], color="C3" if hot else "0.7", lw=1.6 if hot else 0.7,
                    label=f"{k[0]}/{k[1]}" if hot else None, zorder=3 if hot else 1)
        ax.set_yscale("log")
        ax.set_title(f"{title} per head (flagged in red)", fontsize=9)
        ax.set_xticks(list(x), [r["name"] for r in results], rotation=20, fontsize=7)
    if flagged:
        axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _g(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def _num(x: float) -> float:
    return x if math.isfinite(x) else -1.0


def _clean(x):
    """Non-finite floats as the strings "inf", "-inf", "nan" (as JsonlSink writes them):
    strict JSON has no literal for them."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x
