"""flashwatch/diagnosis/report.py: report.md keeps the numbers without matplotlib; the
heatmap's rows are the layers in model order."""

from __future__ import annotations

import json

from _helpers import id_batches, tiny_gpt

from flashwatch import diagnose


def test_report_without_matplotlib_keeps_the_numbers(tmp_path, monkeypatch):
    from flashwatch.diagnosis.report import write_report

    res = diagnose(tiny_gpt(), id_batches(16, n=1), progress=False)
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # import fails
    written = write_report([res], tmp_path)
    assert [p.name for p in written] == ["report.md", "diagnose.json"]
    assert "pip install 'flashwatch[report]'" in (tmp_path / "report.md").read_text()
    assert len(json.loads((tmp_path / "diagnose.json").read_text())["checkpoints"][0]
               ["heads"]) == 8


def test_heatmap_rows_are_layers_in_model_order():
    from flashwatch.diagnosis.report import _grid

    heads = [dict(layer="b", layer_index=1, head=0, tied_ratio=0.5),  # ranked first
             dict(layer="a", layer_index=0, head=1, tied_ratio=0.25),
             dict(layer="a", layer_index=0, head=0, tied_ratio=0.0),
             dict(layer="b", layer_index=1, head=1, tied_ratio=1.0)]
    layers, grid = _grid(heads, "tied_ratio")
    assert layers == ["a", "b"] and grid == [[0.0, 0.25], [0.5, 1.0]]
