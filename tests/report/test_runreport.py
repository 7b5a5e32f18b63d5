"""flashwatch/report/runreport.py (`flashwatch report RUN_DIR`): report.md and the plots of a
run written by hand through JsonlSink; every expected number is read back from the JSONL
here, not taken from runreport.py."""

from __future__ import annotations

import json
import math
import re
import sys

import matplotlib.figure
import matplotlib.pyplot as plt
import numpy as np
import pytest

from flashwatch import Event, Mode
from flashwatch.report.records import HeadRecord, StepReport
from flashwatch.report.runreport import PLOTS, make_report
from flashwatch.report.sinks import JsonlSink

LAYERS = ("transformer.h.0.attn", "transformer.h.1.attn")
HEADS = [(layer, h) for layer in LAYERS for h in range(3)]
STEPS = list(range(10, 90, 10))  # 8 monitored steps
NAN_HEAD = 5  # drift z NaN at the last step, the largest z (9) before it
# Out of step and head order on purpose: the table keeps the run's order, the
# "What happened after" list sorts by (layer, head). QK-clips have their own table.
EVENTS = [
    Event(40, LAYERS[1], 0, Mode.STANDARD, Mode.BETA, "drift z 4.1 > 3", True),
    Event(50, LAYERS[0], 1, Mode.STANDARD, Mode.STANDARD, "max logit 120 > 100", True,
          kind="qk_clip"),
    Event(60, LAYERS[0], 2, Mode.STANDARD, Mode.FP32_O, "ties 0.41", False),
    Event(70, LAYERS[0], 1, Mode.STANDARD, Mode.STANDARD, "max logit 130 > 100", True,
          kind="qk_clip"),
]


def _write_run(run, *, events=True, full_every=None):
    """A 6-head run of 8 monitored steps through the real JsonlSink, with train.jsonl
    and summary.json as `flashwatch demo` writes them."""
    g = np.random.default_rng(0)
    z = g.permutation(np.linspace(-3.0, 4.0, len(STEPS) * len(HEADS)))  # no two equal
    z = z.reshape(len(STEPS), len(HEADS))
    z[:-1, NAN_HEAD], z[-1, NAN_HEAD] = 9.0, math.nan
    ties = g.uniform(0.0, 0.5, z.shape)
    ties[-1, 4] = math.nan  # 5 finite ratios left at the last step: one middle value
    sigma = 1.0 + np.cumsum(g.uniform(0.0, 0.1, z.shape), axis=0)
    sink = JsonlSink(run / "flashwatch.jsonl", full_every=full_every)
    for t, step in enumerate(STEPS):
        heads = [HeadRecord(layer=layer, head=h, delta_drift_z=float(z[t, i]),
                            tied_rowmax_ratio=float(ties[t, i]),
                            delta_coherence=float(g.uniform()),
                            wq_spectral_norm=float(sigma[t, i]),
                            attention_max_logit=float(g.uniform(1, 50)))
                 for i, (layer, h) in enumerate(HEADS)]
        sink.write(StepReport(step=step, heads=heads,
                              events=[e for e in EVENTS if events and e.step == step]))
    sink.close()
    losses = [{"step": s, "loss": 4.0 - 0.01 * s + float(g.uniform())} for s in range(1, 81)]
    (run / "train.jsonl").write_text("".join(json.dumps(d) + "\n" for d in losses))
    (run / "summary.json").write_text(json.dumps(dict(
        ended="completed", steps_done=80, seconds=12.3, settings={"mitigation": "auto"},
        monitor_errors_total=0)))
    return run


def _lines(run, name="flashwatch.jsonl"):
    return [json.loads(line) for line in (run / name).read_text().splitlines()]


def _num(v):
    return math.nan if v is None else float(v)  # JsonlSink writes NaN as null


def _column(lines, key, head):
    """{step: value} of one head's `key` over the JSONL lines with per-head records."""
    layer, h = head
    return {d["step"]: _num(next(r[key] for r in d["heads"]
                                 if (r["layer"], r["head"]) == (layer, h)))
            for d in lines if "heads" in d}


def _section(md, title):
    return md.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def _legends(monkeypatch):
    """{file name: legend labels of its first axes}, recorded as each figure is saved."""
    seen, save = {}, matplotlib.figure.Figure.savefig

    def savefig(fig, path, *args, **kwargs):
        legend = fig.axes[0].get_legend()
        seen[path.name] = [t.get_text() for t in legend.get_texts()] if legend else []
        return save(fig, path, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    return seen


def _label(head):
    return f"{head[0].removeprefix('transformer.')}/{head[1]}"


def test_report_md_numbers_are_the_runs(tmp_path):
    run = _write_run(tmp_path)
    make_report(run)
    md, lines = (run / "report.md").read_text(), _lines(run)
    assert "- ended: **completed** after 80 steps (12 s)" in md
    assert f"- monitored steps: {len(lines)} (steps {lines[0]['step']} to " \
           f"{lines[-1]['step']}), {len(lines[0]['heads'])} heads" in md
    loss = _lines(run, "train.jsonl")
    assert f"Loss went from {loss[0]['loss']:.3f} to {loss[-1]['loss']:.3f}." in md
    last = [_num(r["tied_rowmax_ratio"]) for r in lines[-1]["heads"]]
    finite = [t for t in last if not math.isnan(t)]
    assert f"median {np.median(finite):.3f}, max {max(finite):.3f}." in md
    # Each switched head: drift z at the last report up to its first change, at the end,
    # and its W^Q norm first -> last; in (layer, head) order, not the events' order.
    want = []
    for head in sorted({(e["layer"], e["head"]) for d in lines for e in d["events"]
                        if e["kind"] == "mode"}):
        first = min(e["step"] for d in lines for e in d["events"]
                    if (e["layer"], e["head"]) == head and e["kind"] == "mode")
        z, sigma = _column(lines, "delta_drift_z", head), _column(lines, "wq_spectral_norm", head)
        at_change = z[max(s for s in z if s <= first)]
        want.append(f"- {head[0]} head {head[1]}: drift z {at_change:.2f} at the first change "
                    f"(step {first}), {z[max(z)]:.2f} at the end; W^Q spectral norm "
                    f"{sigma[min(sigma)]:.2f} → {sigma[max(sigma)]:.2f}.")
    got = [line for line in _section(md, "What happened after").splitlines() if line]
    assert got == want and len(want) == 2


def test_mode_events_are_listed_in_run_order_and_qk_clips_apart(tmp_path):
    run = _write_run(tmp_path)
    make_report(run)
    md, lines = (run / "report.md").read_text(), _lines(run)
    mode = [e for d in lines for e in d["events"] if e["kind"] == "mode"]
    rows = [line for line in _section(md, "Mode changes").splitlines()
            if re.match(r"\| \d", line)]
    assert rows == [f"| {e['step']} | {e['layer']} | {e['head']} | {e['from_mode']} | "
                    f"{e['to_mode']} | {e['applied']} | {e['reason']} |" for e in mode]
    assert [r.split(" | ")[4] for r in rows] == ["BETA", "FP32_O"]
    clips = [line for line in _section(md, "QK-clips").splitlines() if re.match(r"\| t", line)]
    assert clips == ["| transformer.h.0.attn | 1 | 2 | 50 | max logit 130 > 100 |"]

    quiet = tmp_path / "quiet"
    quiet.mkdir()
    make_report(_write_run(quiet, events=False))
    md = (quiet / "report.md").read_text()
    assert "None: no head was flagged" in _section(md, "Mode changes")
    assert "## QK-clips" not in md and "## What happened after" not in md


def test_the_drift_plot_names_the_worst_heads_by_final_drift_z(tmp_path, monkeypatch):
    legends = _legends(monkeypatch)
    run = _write_run(tmp_path, events=False)
    make_report(run)
    final = _lines(run)[-1]["heads"]
    # Largest final drift z first; the NaN head (the largest before the end) is not one.
    worst = sorted((r for r in final if r["delta_drift_z"] is not None),
                   key=lambda r: -r["delta_drift_z"])[:4]
    assert legends["drift.png"] == [_label((r["layer"], r["head"])) for r in worst]
    assert _label(HEADS[NAN_HEAD]) not in legends["drift.png"]
    assert legends["spectral.png"] == []  # nothing flagged: no head bold or labelled

    # With mode changes, the switched heads instead, in (layer, head) order.
    flagged = tmp_path / "flagged"
    flagged.mkdir()
    make_report(_write_run(flagged))
    assert legends["drift.png"] == ["h.0.attn/2", "h.1.attn/0"]
    assert legends["spectral.png"] == ["h.0.attn/2", "h.1.attn/0"]


def _figures(monkeypatch):
    """{file name: the figure}, kept as each is saved."""
    seen, save = {}, matplotlib.figure.Figure.savefig

    def savefig(fig, path, *args, **kwargs):
        seen[path.name] = fig
        return save(fig, path, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    return seen


def _colours(ax):
    return {ln.get_label(): ln.get_color() for ln in ax.get_lines()
            if not ln.get_label().startswith("_")}


@pytest.mark.parametrize("events", [False, True])
def test_plots_say_what_they_show(tmp_path, monkeypatch, events):
    figs = _figures(monkeypatch)
    make_report(_write_run(tmp_path, events=events))
    drift, spectral, loss = (figs[n].axes[0] for n in ("drift.png", "spectral.png",
                                                         "loss.png"))
    titles = drift.get_title() + spectral.get_title() + loss.get_title()
    assert ("mode changes" in titles) == events, titles
    assert ("no head flagged" in spectral.get_title()) == (not events)
    bold = [ln.get_label() for ln in spectral.get_lines() if ln.get_linewidth() > 1]
    assert bold == (["h.0.attn/2", "h.1.attn/0"] if events else [])
    # one colour per head: every head drawn in drift.png has its spectral.png colour
    spectral_colour = {_label(h): c for h, c in zip(
        HEADS, [ln.get_color() for ln in spectral.get_lines()][:len(HEADS)], strict=True)}
    drawn = _colours(drift)
    assert drawn and all(spectral_colour[k] == c for k, c in drawn.items()), drawn
    # the metrics table's limits as horizontal lines: drift z 4, coherence 0.15
    flat = {ln.get_ydata()[0] for ax in figs["drift.png"].axes for ln in ax.get_lines()
            if len(set(ln.get_ydata())) == 1 and len(ln.get_ydata()) == 2}
    assert {4.0, 0.15} <= flat, flat


def _png_shapes(heads):
    """[height, width] of each plot: runreport.py's figure sizes in inches at dpi 100,
    (10, 0.25 · heads + 2), (10, 6), (10, 4), (10, 4)."""
    return {"ties_heatmap.png": (round(25 * heads + 200), 1000), "drift.png": (600, 1000),
            "spectral.png": (400, 1000), "loss.png": (400, 1000)}


def _check_png(path, shape):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path.name
    pixels = plt.imread(path)  # decodes the whole file: a truncated one raises
    assert pixels.shape[:2] == shape, path.name
    assert pixels[..., :3].std() > 0.05, path.name  # something drawn, not a blank canvas


def test_plots_are_written_as_pngs_where_asked(tmp_path):
    run = _write_run(tmp_path)
    out = tmp_path / "out" / "report"
    written = make_report(run, out)
    assert written == [out / name for name in PLOTS] + [out / "report.md"]
    assert list(_png_shapes(6)) == list(PLOTS)
    for name, shape in _png_shapes(6).items():
        _check_png(out / name, shape)
        assert f"![{name}]({name})" in (out / "report.md").read_text()
    assert not (run / "report.md").exists()


@pytest.mark.parametrize("make", [lambda d: d / "missing", lambda d: d],
                         ids=["missing_dir", "empty_dir"])
def test_a_dir_without_a_run_names_the_file_it_needs(tmp_path, make):
    run = make(tmp_path)
    with pytest.raises(FileNotFoundError, match=re.escape(str(run / "flashwatch.jsonl"))):
        make_report(run)
    assert list(tmp_path.iterdir()) == []  # nothing written, no directory made


def test_a_run_without_a_complete_report_names_the_file(tmp_path):
    (tmp_path / "flashwatch.jsonl").write_text("")
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "flashwatch.jsonl"))):
        make_report(tmp_path)


def test_compact_lines_are_skipped(tmp_path):
    run = _write_run(tmp_path, events=False, full_every=3)
    full = [d["step"] for d in _lines(run) if "heads" in d]
    assert full == [10, 40, 70] and len(_lines(run)) == 8
    make_report(run)
    assert "- monitored steps: 3 (steps 10 to 70), 6 heads" in (run / "report.md").read_text()


def test_a_run_of_nan_values_is_reported_not_a_crash(tmp_path):
    sink = JsonlSink(tmp_path / "flashwatch.jsonl")
    for step in (1, 2, 3):  # every number NaN (null in the JSONL) but an infinite W^Q norm
        heads = [HeadRecord(layer=LAYERS[0], head=h,
                            wq_spectral_norm=math.inf if step == 3 else math.nan)
                 for h in range(2)]
        events = [Event(2, LAYERS[0], 1, Mode.STANDARD, Mode.BETA, "test", True)] * (step == 2)
        sink.write(StepReport(step=step, heads=heads, events=events))
    sink.close()
    (tmp_path / "train.jsonl").write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": NaN}\n')
    make_report(tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "- transformer.h.0.attn head 1: drift z n/a at the first change (step 2), n/a at " \
           "the end; W^Q spectral norm n/a → inf." in md
    assert "Loss went from 3.000 to nan." in md and "Tied-rowmax" not in md
    for name, shape in _png_shapes(2).items():
        _check_png(tmp_path / name, shape)


def test_without_matplotlib_it_says_which_extra_to_install(tmp_path, monkeypatch):
    _write_run(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    with pytest.raises(ImportError, match=re.escape("pip install 'flashwatch[report]'")):
        make_report(tmp_path)
    assert not (tmp_path / "report.md").exists()
