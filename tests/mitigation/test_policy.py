"""flashwatch/mitigation/policy.py: flag rule, patience, min_history, off/advise/auto, escalation,
no flapping, events and their reasons, NaN safety, state round trip. The rules on max
logits and the δ-error share: tests/mitigation/test_policy_rules.py."""

from __future__ import annotations

import math

import pytest
import torch
from _helpers import HEADS, mvec, policy, svals, tvec

from flashwatch.config import WatchConfig
from flashwatch.kernels.common import Mode
from flashwatch.mitigation.policy import Policy, _flags
from flashwatch.signals.drift import HeadSignals

F64 = torch.float64
pytestmark = pytest.mark.usefixtures("one_thread")
DRIFT_HEAD0 = dict(z=[5.3, 0.5, 0.5], coh=[0.62, 0.1, 0.1])  # only head 0 drifts


def test_flag_rule():
    p = policy("off")
    flagged = lambda **kw: p.decide(0, tvec(kw.pop("tie", 0.05)), svals(**kw),  # noqa: E731
                                    mvec()).flagged.tolist()
    assert flagged(**DRIFT_HEAD0) == [True, False, False]
    assert flagged(tie=0.019, **DRIFT_HEAD0) == [False] * 3  # ties not elevated
    assert flagged(z=3.9, coh=0.9) == [False] * 3  # z under 4
    assert flagged(z=9.0, coh=0.14) == [False] * 3  # coherence under 0.15
    assert flagged(z=4.0, coh=0.15) == [True] * 3  # thresholds are inclusive
    # Spectral path: growth ≥ 0.2 and ≥ 3 × median growth of all heads.
    assert flagged(growth=[0.5, 0.01, 0.02]) == [True, False, False]
    assert flagged(growth=[0.5, 0.3, 0.3]) == [False] * 3  # all grow alike: 0.5 < 3 × 0.3
    assert flagged(growth=[0.15, 0.0, 0.0]) == [False] * 3  # under 0.2
    assert flagged(fill=15, z=9.0, coh=0.9) == [False] * 3  # min_history 16 not reached


def test_median_rule_uses_the_median():
    # Two of three heads grow by 0.5: the median is 0.5 and 0.5 < 3 × 0.5, so a layer-wide
    # growth (a learning-rate warmup, say) flags nobody.
    p = policy("off")
    d = p.decide(0, tvec(), svals(growth=[0.5, 0.5, 0.02]), mvec())
    assert d.flagged.tolist() == [False, False, False]


def test_off_reports_flags_but_never_recommends():
    p = policy("off")
    for t in range(100):
        d = p.decide(t, tvec(), svals(**DRIFT_HEAD0), mvec())
        assert d.flagged.tolist() == [True, False, False]
        assert d.events == [] and d.modes.tolist() == [0, 0, 0]
        assert d.recommended.tolist() == [0, 0, 0] and not d.reset_window.any()


def test_auto_switches_after_patience_and_resets_the_window():
    p = policy("auto")
    modes = mvec()
    for t in range(2):
        d = p.decide(t, tvec(), svals(**DRIFT_HEAD0), modes)
        assert d.events == [] and d.modes.tolist() == [0, 0, 0]
    d = p.decide(2, tvec(), svals(**DRIFT_HEAD0), modes)  # 3rd flagged step = patience
    assert d.modes.tolist() == [1, 0, 0] and d.recommended.tolist() == [1, 0, 0]
    assert d.reset_window.tolist() == [True, False, False]
    (e,) = d.events
    assert (e.step, e.layer, e.head, e.from_mode, e.to_mode, e.applied) == (
        2, "h.0.attn", 0, Mode.STANDARD, Mode.BETA, True)
    assert "tie ratio 0.05 ≥ 0.02" in e.reason
    assert "drift z 5.3 ≥ 4" in e.reason and "coherence 0.62 ≥ 0.15" in e.reason
    assert "3 monitored steps" in e.reason


def test_advise_recommends_without_applying():
    p = policy("advise")
    modes = mvec()
    events = []
    for t in range(3):
        d = p.decide(t, tvec(), svals(**DRIFT_HEAD0), modes)
        events += d.events
        assert d.modes.tolist() == [0, 0, 0] and not d.reset_window.any()
    assert d.recommended.tolist() == [1, 0, 0]
    assert [(e.to_mode, e.applied) for e in events] == [(Mode.BETA, False)]


def test_patience_needs_consecutive_flags():
    p = policy("auto", patience=3)
    pattern = [True, True, False, True, True, False, True, True, True]
    for t, on in enumerate(pattern):
        d = p.decide(t, tvec(), svals(**(DRIFT_HEAD0 if on else {})), mvec())
        assert (len(d.events) == 1) == (t == len(pattern) - 1), t


def test_min_history_blocks_decisions():
    p = policy("auto", min_history=16)
    for t in range(16):  # window_fill 0..15: no decision even with huge drift
        d = p.decide(t, tvec(), svals(z=50.0, coh=1.0, growth=5.0, fill=t), mvec())
        assert not d.flagged.any() and not d.events


def _run_after_switch(p, z_after, steps):
    """Switch head 0 to BETA (auto), then feed `steps` post-switch steps whose window
    refills from 1 (the watcher reset it), with drift z_after on head 0."""
    modes = mvec()
    for t in range(3):
        modes = p.decide(t, tvec(), svals(**DRIFT_HEAD0), modes).modes
    assert modes.tolist() == [1, 0, 0]
    events = []
    for i in range(1, steps + 1):
        v = svals(z=[z_after, 0.5, 0.5], coh=[0.62, 0.1, 0.1], fill=min(i, 64))
        d = p.decide(2 + i, tvec(), v, modes)
        modes = d.modes
        events += [(i, e) for e in d.events]
    return modes, events


def test_escalates_to_fp32_o_when_drift_persists():
    p = policy("auto", verify_steps=32)
    modes, events = _run_after_switch(p, z_after=6.0, steps=100)
    assert modes.tolist() == [2, 0, 0]
    ((i, e),) = events  # exactly one escalation, then FP32_O is final
    assert i == 32, "escalation comes exactly verify_steps monitored steps after the switch"
    assert (e.from_mode, e.to_mode, e.applied) == (Mode.BETA, Mode.FP32_O, True)
    assert "drift persists 32 monitored steps after the switch to BETA" in e.reason
    assert "drift z 6 ≥ 4" in e.reason


def test_no_escalation_when_drift_decays():
    p = policy("auto", verify_steps=32)
    modes, events = _run_after_switch(p, z_after=1.0, steps=300)
    assert modes.tolist() == [1, 0, 0] and events == []


def test_no_flapping():
    # Once switched, a head stays up whatever the signals do, and never goes down.
    p = policy("auto")
    g = torch.Generator().manual_seed(0)
    modes = mvec()
    history = []
    for t in range(300):
        z = torch.randn(3, generator=g, dtype=F64) * 4
        coh = torch.rand(3, generator=g, dtype=F64)
        d = p.decide(t, tvec(), svals(z=z, coh=coh), modes)
        assert (d.modes >= modes).all()
        modes = d.modes
        history += d.events
    for e in history:
        assert e.to_mode == e.from_mode + 1
    per_head = {}
    for e in history:
        per_head.setdefault((e.layer, e.head), []).append(e.to_mode)
    assert all(v in ([Mode.BETA], [Mode.BETA, Mode.FP32_O]) for v in per_head.values())


def test_nan_inputs_never_flag():
    p = policy("auto", min_history=0)
    nan = math.nan
    cases = [
        (tvec(nan), svals(**DRIFT_HEAD0)),
        (tvec(), svals(z=[nan, nan, nan], coh=0.9)),
        (tvec(), svals(z=9.0, coh=[nan, nan, nan])),
        (tvec(), svals(growth=[nan, nan, nan])),
        (tvec(), svals(growth=[5.0, nan, nan])),  # median of the finite ones: 5 → not 3×
    ]
    for tie, v in cases:
        for t in range(5):
            d = p.decide(t, tie, v, mvec())
            assert not d.flagged.any() and not d.events and d.modes.tolist() == [0, 0, 0]
    # NaN in other heads does not stop a real spectral outlier from being flagged.
    d = p.decide(9, tvec(), svals(growth=[0.5, 0.01, nan]), mvec())
    assert d.flagged.tolist() == [True, False, False]
    x = p._inputs(tvec(), svals(growth=[0.5, 0.01, nan]), mvec(), None, None)
    assert "W^Q spectral growth 0.5 ≥ 0.2 and ≥ 3 × median" in p._reason(
        0, Mode.STANDARD, x, _flags(p.config, x), [0] * 3)


def test_state_round_trip_gives_identical_decisions():
    g = torch.Generator().manual_seed(1)
    inputs = [(tvec(torch.rand(3, generator=g, dtype=F64).mul(0.05).tolist()),
               svals(z=(torch.randn(3, generator=g, dtype=F64) * 3 + 3),
                       coh=torch.rand(3, generator=g, dtype=F64)))
              for _ in range(200)]
    a = policy("auto")
    modes = mvec()
    for t, (tie, v) in enumerate(inputs[:60]):
        modes = a.decide(t, tie, v, modes).modes
    b = policy("auto")
    b.load_state_dict(a.state_dict())
    ma, mb = modes.clone(), modes.clone()
    saw_events = 0
    for t, (tie, v) in enumerate(inputs[60:], start=60):
        da, db = a.decide(t, tie, v, ma), b.decide(t, tie, v, mb)
        assert torch.equal(da.modes, db.modes) and torch.equal(da.flagged, db.flagged)
        assert [e.to_dict() for e in da.events] == [e.to_dict() for e in db.events]
        ma, mb = da.modes, db.modes
        saw_events += len(da.events)
    assert saw_events > 0  # the compared stretch did exercise decisions


def test_external_mode_change_restarts_verification():
    p = policy("auto", verify_steps=10)
    modes = mvec(1, 0, 0)  # e.g. a user started head 0 in BETA
    events = []
    for t in range(30):
        d = p.decide(t, tvec(), svals(z=[6.0, 0.5, 0.5], coh=0.62), modes)
        modes = d.modes
        events += [(t, e) for e in d.events]
    assert [(t, e.to_mode) for t, e in events] == [(9, Mode.FP32_O)]


def test_signals_and_policy_end_to_end():
    """HeadSignals + Policy in auto with the watcher's reset: a planted bias (s = 2 per-entry
    noise std) is switched to BETA; if BETA removes the bias the head stays there, if the
    bias persists it escalates to FP32_O verify_steps (32) monitored steps later."""
    for bias_after in (0.0, 2.0):
        cfg = WatchConfig(mitigation="auto")
        n, k = 8, cfg.sketch_dim
        g = torch.Generator().manual_seed(2)
        R = torch.zeros(n, k, k, dtype=F64)
        R[0, 0, 0] = 1.0  # only head 0 is biased
        sig = HeadSignals(n, k, cfg.window)
        pol = Policy(cfg, [("l", i) for i in range(n)])
        modes = torch.zeros(n, dtype=torch.int64)
        ties = torch.full((n,), 0.05, dtype=F64)
        switched = None
        log = []
        for t in range(400):
            s = 2.0 if modes[0] == Mode.STANDARD else bias_after
            G = s * R + torch.randn(n, k, k, generator=g, dtype=F64)
            d = pol.decide(t, ties, sig.update(G, torch.ones(n, dtype=F64)), modes)
            sig.reset_window(d.reset_window)
            modes = d.modes
            for e in d.events:
                log.append((t, e.head, e.to_mode))
                if e.to_mode == Mode.BETA:
                    switched = t
        assert switched is not None and switched < 60
        if bias_after == 0.0:
            assert log == [(switched, 0, Mode.BETA)]
        else:
            assert log == [(switched, 0, Mode.BETA), (switched + 32, 0, Mode.FP32_O)]


@pytest.mark.parametrize("call, exc, words", [
    (lambda: Policy({"mitigation": "auto"}, HEADS), TypeError, ["config", "WatchConfig"]),
    (lambda: Policy(WatchConfig(), [("a", "0")]), TypeError, ["heads", "(layer name"]),
    (lambda: Policy(WatchConfig(), []), TypeError, ["heads"]),
    (lambda: Policy(WatchConfig(window=8, min_history=16), HEADS), ValueError,
     ["min_history=16", "window=8"]),
    (lambda: policy().decide(0, tvec(n=2), svals(), mvec()), ValueError,
     ["tie_ratio", "[3]"]),
    (lambda: policy().decide(0, [0.1] * 3, svals(), mvec()), TypeError, ["tie_ratio"]),
    (lambda: policy().decide(0, tvec(), svals(), mvec().double()), TypeError, ["modes"]),
    (lambda: policy().decide(0, tvec(), svals(), mvec(0, 3, 0)), ValueError,
     ["modes", "0..2"]),
    (lambda: policy().load_state_dict({"heads": [("x", 0)]}), ValueError, ["heads"]),
    (lambda: policy().decide(1.0, tvec(), svals(), mvec()), TypeError, ["step"]),
])
def test_bad_arguments_are_named(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    for w in words:
        assert w in str(info.value)


def test_advise_never_recommends_below_the_applied_mode():
    p = policy("advise")
    d = p.decide(0, tvec(), svals(), mvec(0, 1, 2))
    assert d.recommended.tolist() == [0, 1, 2] and d.modes.tolist() == [0, 1, 2]
    # Advice followed by hand: the recommendation continues from there, verification
    # counts from when the policy first saw the BETA (step 0 = 1st step, step 31 = 32nd).
    events = []
    for t in range(1, 40):
        d = p.decide(t, tvec(), svals(z=[0.5, 6.0, 6.0], coh=0.62), mvec(0, 1, 2))
        events += [(t, e.head, e.to_mode, e.applied) for e in d.events]
    assert events == [(31, 1, Mode.FP32_O, False)]
