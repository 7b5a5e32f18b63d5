"""flashwatch/diagnosis/rank.py: verdicts and their order, growth across checkpoints."""

from __future__ import annotations

import pytest


def _record(head, **kw):
    base = dict(layer="h.0", head=head, num_heads=4, tied_ratio=0.0, sign_z=0.0,
                wq_sigma=1.0, wq_ratio=1.0, delta_share=0.01, max_logit=5.0, qk_clip_eta=1.0)
    return base | kw


def test_verdicts_and_their_order():
    from flashwatch.diagnosis.rank import rank

    heads = [_record(0),  # ok
             _record(1, max_logit=400.0, qk_clip_eta=0.25),  # logit growth
             _record(2, delta_share=0.3),  # δ error without a persistent sign
             _record(3, tied_ratio=0.2, sign_z=-4.5, wq_ratio=2.5, delta_share=0.05)]
    out = rank(heads, batches=25, tau=100.0)
    assert [(h["head"], h["verdict"]) for h in out] == [
        (3, "paper-failure"), (2, "delta-error"), (1, "logit-growth"), (0, "ok")]
    assert [h["rank"] for h in out] == [1, 2, 3, 4]
    modes = out[0]["recommendation"].split("[")[1].split("]")[0]
    assert [int(m) for m in modes.split(",")] == [0, 0, 0, 2]  # head 3 → Mode.FP32_O
    assert "qk_clip_threshold=100" in out[2]["recommendation"] and "0.25" in out[2][
        "recommendation"]
    assert out[3]["recommendation"] == "nothing"
    # Without the sign (|z| < 3) the same head is only a δ-error or growth case; with
    # 4 batches the evidence says why the sign cannot show.
    (h,) = rank([_record(3, tied_ratio=0.2, sign_z=-1.9, wq_ratio=2.5)], 4, 100.0)
    assert h["verdict"] == "logit-growth" and "≥ 9 batches to show it" in h["evidence"]


def test_growth_across_checkpoints_counts_as_a_large_wq():
    from flashwatch.diagnosis.rank import growth, rank

    old = dict(heads=[_record(h) for h in range(4)])
    new = dict(heads=[_record(h, wq_sigma=6.0 if h == 1 else 1.5, tied_ratio=0.1,
                              sign_z=3.5) for h in range(4)])
    g = growth([old, new])
    assert g[("h.0", 1)]["wq_sigma"] == 6.0 and g[("h.0", 0)]["wq_sigma"] == 1.5
    assert g[("h.0", 1)]["series"]["wq_sigma"] == [1.0, 6.0]
    out = rank(new["heads"], 16, 100.0, g)  # wq_ratio 1 everywhere: growth decides
    assert out[0]["head"] == 1 and out[0]["verdict"] == "paper-failure"
    assert out[0]["wq_growth_vs_layer"] == pytest.approx(4.0)  # 6 / median 1.5
    assert all(h["verdict"] == "ok" for h in out[1:])


def test_share_of_a_negligible_gradient_cannot_rank_first():
    """Issue 37, a pretrained 135M model: a head whose ‖dW^Q‖ is 1e-4 of its layer's others
    ranked first at a share of 20.5 %. Under GRAD_MIN (0.1 × the layer median) its share
    decides neither the verdict nor the order; the raw share and why stay in the record."""
    from flashwatch.diagnosis.rank import rank

    heads = [_record(0, delta_share=0.205, wq_grad_ratio=1e-4),
             _record(1, delta_share=0.12, wq_grad_ratio=1.0),
             _record(2, delta_share=0.02, wq_grad_ratio=1.0),
             _record(3, delta_share=0.3, wq_grad_ratio=0.1)]  # at the floor: counts
    out = rank(heads, batches=25, tau=100.0)
    assert [(h["head"], h["verdict"]) for h in out] == [
        (3, "delta-error"), (1, "delta-error"), (2, "ok"), (0, "ok")]
    (h0,) = [h for h in out if h["head"] == 0]
    assert h0["delta_share"] == 0.205
    assert "δ error 20.5% of dW^Q (not a signal: ‖dW^Q‖ 0.0001× the layer median < 0.1)" in \
        h0["evidence"]


def _pair(h, first: dict, last: dict):
    return _record(h, **first), _record(h, **last)


def test_a_tied_head_growing_fastest_outranks_a_large_static_one():
    """Issue 38's planted pair: head 1 with 97 % tied rows whose W^Q grew 4× (max logit
    7.5 → 30), head 2 a distractor with a static W^Q 16× its layer median (max logit 39,
    ties 1 %). Ordered by δ share then max logit (before), the distractor came first."""
    from flashwatch.diagnosis.rank import growth, rank

    pairs = [_pair(0, {}, {}),
             _pair(1, dict(tied_ratio=0.97, max_logit=7.5),
                   dict(tied_ratio=0.97, wq_sigma=4.0, wq_ratio=4.0, max_logit=30.0)),
             _pair(2, dict(wq_sigma=16.0, wq_ratio=16.0, max_logit=39.0, tied_ratio=0.01),
                   dict(wq_sigma=16.0, wq_ratio=16.0, max_logit=39.0, tied_ratio=0.01)),
             _pair(3, {}, {})]
    old, new = dict(heads=[p[0] for p in pairs]), dict(heads=[p[1] for p in pairs])
    out = rank(new["heads"], 16, 100.0, growth([old, new]))
    assert [h["head"] for h in out[:2]] == [1, 2]
    assert out[0]["verdict"] == out[1]["verdict"] == "logit-growth"
    assert out[0]["wq_growth_vs_layer"] == pytest.approx(4.0)  # 4 / median 1
    assert out[0]["logit_growth_vs_layer"] == pytest.approx(4.0)  # 30 / 7.5 over median 1
    assert "ordered by tied and growing (ties ≥ 2%, W^Q σ growth 4.00× the layer median's)" \
        in out[0]["evidence"]
    assert out[1]["order_rule"] == "δ share, then max logit"
    # Without ties it is still growth that orders it, by its own rule
    for h in (old, new):
        h["heads"][1]["tied_ratio"] = 0.0
    out = rank(new["heads"], 16, 100.0, growth([old, new]))
    assert out[0]["head"] == 1 and out[0]["order_rule"] == "growth (4.00× the layer median's)"


def test_growth_from_a_negligible_start_never_ranks_first():
    """A head whose W^Q σ (or max logit) started at 1e-4 of its layer's grows 1000× by
    noise: as a share of a negligible gradient, the ratio is no signal."""
    from flashwatch.diagnosis.rank import growth, rank

    pairs = [_pair(0, dict(wq_sigma=1e-4, max_logit=1e-3, tied_ratio=0.5),
                   dict(wq_sigma=0.1, max_logit=1.0, tied_ratio=0.5)),
             _pair(1, dict(tied_ratio=0.05), dict(tied_ratio=0.05, wq_sigma=2.5,
                                                  max_logit=12.5)),
             _pair(2, {}, {}), _pair(3, {}, {})]
    old, new = dict(heads=[p[0] for p in pairs]), dict(heads=[p[1] for p in pairs])
    out = rank(new["heads"], 16, 100.0, growth([old, new]))
    assert out[0]["head"] == 1 and out[0]["order_rule"].startswith("tied and growing")
    (h0,) = [h for h in out if h["head"] == 0]
    assert h0["wq_growth_vs_layer"] is None and h0["logit_growth_vs_layer"] is None
    assert h0["verdict"] == "ok"
