"""reproduction/score.py's outcome and detectors on synthetic run directories whose alarms
and events follow from their construction: the event a run gets (a spike, a degradation
against its fused twin, none, unlabelled), each detector's score and the alarms it raises,
how alarms are judged against the event, and which runs are found. The statistics over
runs and the command line: tests/test_score_stats.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _helpers import FLAT, N, logit_above, spike_at, write_run

from flashwatch.report.runreport import load_run
from flashwatch.report.sinks import read_jsonl
from reproduction import score as S

TH = S.THRESHOLDS


def test_a_crossing_at_400_before_a_spike_at_600_is_a_hit_with_lead_200(tmp_path):
    run = S.load(write_run(tmp_path, "c", "unmitigated", 0, spike_at(600),
                           head=logit_above((400, N))))
    assert (run.event_step, run.event_kind) == (600, "spike")
    assert S.alarms(run.scores["max_logit"], TH["max_logit"]) == [400]
    m = S.detector_metrics([run], "max_logit", TH)
    assert (m["hits"], m["median_lead"], m["false_alarms_per_run"], m["late"]) == (1, 200, 0, 0)


def test_every_alarm_of_a_negative_run_is_false(tmp_path):
    write_run(tmp_path, "c", "fused", 0, [FLAT] * N)
    run = S.load(write_run(tmp_path, "c", "unmitigated", 0, [FLAT] * N,
                           head=logit_above((500, 520))))
    assert (run.event_step, run.event_kind, run.final_gap) == (None, None, 0.0)
    m = S.detector_metrics([run], "max_logit", TH)
    assert (m["n_pos"], m["n_neg"], m["hits"], m["false_alarms_per_run"]) == (0, 1, 0, 1.0)


def test_alarms_too_early_are_false_and_too_close_are_late(tmp_path):
    # event 600: 250 is before 600 − 300 (false), 590 within 20 steps of it (late)
    run = S.load(write_run(tmp_path, "c", "unmitigated", 0, spike_at(600),
                           head=logit_above((250, 260), (590, N))))
    assert S.alarms(run.scores["max_logit"], TH["max_logit"]) == [250, 590]
    assert S.judge([250, 590], 600) == dict(lead=None, false=1, late=1)
    m = S.detector_metrics([run], "max_logit", TH)
    assert (m["hits"], m["false_alarms_per_run"], m["late"]) == (0, 1.0, 1)
    # the window's edges are inclusive: event − 300 and event − 20 are hits
    assert S.judge([300], 600)["lead"] == 300 and S.judge([580], 600)["lead"] == 20


def test_refractory_period_merges_an_alarm_within_100_steps():
    steps = np.arange(0, N, 5)
    on = [(400, 415), (450, 465), (520, 530)]
    values = np.array([150.0 if any(a <= t < b for a, b in on) else 10.0 for t in steps])
    # 450 is 50 steps after 400: not counted; 520 is 120 after: counted
    assert S.alarms((steps, values), 100.0) == [400, 520]
    # a condition that stays true is one alarm, however long it lasts
    assert S.alarms((steps, np.where(steps >= 100, 150.0, 10.0)), 100.0) == [100]


def _ema_gap_crossing(start, jump):
    """First step at which the EMA of a loss that jumps by `jump` at `start` is GAP_NATS
    above the unchanged twin's: the gap after k steps is jump·(1 − 0.95^(k+1))."""
    k = 0
    while jump * (1 - 0.95 ** (k + 1)) <= S.GAP_NATS:
        k += 1
    return start + k


def test_a_gap_to_the_fused_twin_that_stays_is_a_degradation(tmp_path):
    write_run(tmp_path, "c", "fused", 0, [FLAT] * N)
    run = S.load(write_run(tmp_path, "c", "unmitigated", 0, [FLAT] * 300 + [FLAT + 0.5] * 700))
    assert run.event_kind == "degradation"
    assert run.event_step == _ema_gap_crossing(300, 0.5) == 309
    assert run.final_gap == pytest.approx(0.5)
    # the legacy layout's twin (ROOT/CONFIG-fused/unmitigated-sSEED) gives the same label
    write_run(tmp_path / "old", "c-fused", "unmitigated", 0, [FLAT] * N)
    old = S.load(write_run(tmp_path / "old", "c", "unmitigated", 0,
                           [FLAT] * 300 + [FLAT + 0.5] * 700))
    assert (old.event_step, old.event_kind) == (309, "degradation")
    # ... and its twin directory is not scored as a run of configuration c-fused
    assert [r.config for r in S.find_runs(tmp_path / "old")] == ["c"]


def test_a_gap_that_dips_below_after_50_steps_is_not_an_event(tmp_path):
    write_run(tmp_path, "c", "fused", 0, [FLAT] * N)
    losses = [FLAT] * 300 + [FLAT + 0.5] * 40 + [FLAT] * 660
    ema = S.loss_ema(losses)
    above = [t for t in range(N) if ema[t] - FLAT > S.GAP_NATS]
    assert 40 <= len(above) <= 60 and above == list(range(above[0], above[-1] + 1))
    run = S.load(write_run(tmp_path, "c", "unmitigated", 0, losses))
    assert (run.event_step, run.event_kind) == (None, None)


def test_a_run_without_a_twin_is_unlabelled_unless_it_spiked(tmp_path):
    quiet = S.load(write_run(tmp_path, "c", "unmitigated", 0, [FLAT] * N,
                             head=logit_above((500, N))))
    spiked = S.load(write_run(tmp_path, "c", "unmitigated", 1, spike_at(600)))
    assert (quiet.event_kind, quiet.final_gap) == ("unlabelled", None)
    assert (spiked.event_step, spiked.event_kind) == (600, "spike")
    m = S.detector_metrics([quiet, spiked], "max_logit", TH)
    assert (m["n_pos"], m["n_neg"], m["false_alarms_per_run"]) == (1, 0, 0.0)


def test_rule_scores_follow_their_definitions(tmp_path):
    def head(t):
        return dict(
            wq_spectral_norm=0.5 if t < 50 else 1.3 if t >= 300 else 1.0,  # baseline 1.0
            tied_rowmax_ratio=0.2 if t >= 300 else 0.1,
            delta_error_share=0.5, delta_error_share_mean=0.01)  # the mean is preferred
    run = S.load(write_run(tmp_path, "c", "unmitigated", 0, [FLAT] * N, head=head))
    # the W^Q baseline is the first monitored step ≥ warmup, not step 0 (0.5: growth 1)
    assert S.alarms(run.scores["wq_growth"], TH["wq_growth"]) == [300]
    assert S.score_at(run.scores["wq_growth"], 600) == pytest.approx(0.3)
    # tie_trend: +0.1 against 100 steps earlier from 300 to 395, 0 again from 400
    steps, tie = run.scores["tie_trend"]
    assert tie[steps == 395][0] == pytest.approx(0.1) and tie[steps == 400][0] == 0.0
    assert np.isnan(tie[steps == 145][0])  # 100 steps back is before warmup
    assert S.alarms(run.scores["tie_trend"], TH["tie_trend"]) == [300]
    assert S.alarms(run.scores["delta_share"], TH["delta_share"]) == []
    # two rules at once: combined alarms
    assert S.alarms(S.series(run, "combined", TH), TH["combined"]) == [300]
    assert S.alarms(S.series(run, "combined", {**TH, "tie_trend": 1.0}), 2) == []


def test_logit_growth_drift_and_share_take_the_largest_head(tmp_path):
    def head(t):
        return [dict(attention_max_logit=10.0, delta_drift_z=5.0 if t >= 700 else 0.0),
                dict(attention_max_logit=25.0 if t >= 300 else 10.0, delta_error_share=0.5,
                     delta_error_share_mean=None)]  # an old log: the per-step value
    run = S.load(write_run(tmp_path, "c", "unmitigated", 0, [FLAT] * N, head=head))
    assert S.score_at(run.scores["logit_growth"], 300) == pytest.approx(math.log2(2.5))
    assert S.alarms(run.scores["logit_growth"], TH["logit_growth"]) == [300]
    assert S.alarms(run.scores["drift_z"], TH["drift_z"]) == [700]
    assert S.alarms(run.scores["delta_share"], TH["delta_share"]) == [50]


def test_sign_z_takes_the_largest_magnitude_of_either_sign(tmp_path):
    def head(t):
        return [dict(delta_sign_z=-6.0 if t >= 400 else 1.0),
                dict(delta_sign_z=3.0 if t >= 200 else -2.0)]
    run = S.load(write_run(tmp_path, "c", "unmitigated", 0, [FLAT] * N, head=head))
    assert S.score_at(run.scores["sign_z"], 300) == 3.0
    assert S.score_at(run.scores["sign_z"], 400) == 6.0
    assert S.alarms(run.scores["sign_z"], TH["sign_z"]) == [400]


def test_policy_is_the_first_advice_not_set_by_user_and_latches(tmp_path):
    def event(t, reason):
        return [dict(step=t, layer="transformer.h.0.attn", head=0, from_mode="STANDARD",
                     to_mode="BETA", reason=reason, applied=False)]
    run = S.load(write_run(tmp_path, "c", "unmitigated", 0, [FLAT] * N, events={
        100: event(100, "set by user"), 300: event(300, "tie ratio 0.3 ≥ 0.02, ..."),
        600: event(600, "drift z 5 ≥ 4, ...")}))
    assert S.alarms(run.scores["policy"], TH["policy"]) == [300]
    assert S.score_at(run.scores["policy"], 295) == 0.0
    assert S.score_at(run.scores["policy"], 450) == 1.0


def test_train_log_baselines(tmp_path):
    grad = {120: 50.0, 400: 20.0}  # 120: fewer than 100 steps of history after warmup
    losses = [FLAT] * 500 + [FLAT + 0.5] * 500  # +0.5 nat: below the spike's 1 nat
    run = S.load(write_run(tmp_path, "c", "unmitigated", 0, losses,
                           grad=lambda t: grad.get(t, 1.0)))
    assert run.event_kind == "unlabelled"
    assert S.alarms(run.scores["grad_jump"], TH["grad_jump"]) == [400]
    assert run.scores["grad_jump"][0][0] == 50 + S.GRAD_HISTORY
    # loss EMA: 0.5·(1 − 0.95^(k+1)) reaches 0.3 at k = 17
    k = next(k for k in range(100) if 0.5 * (1 - 0.95 ** (k + 1)) >= 0.3)
    assert S.alarms(run.scores["loss_ema"], TH["loss_ema"]) == [500 + k] == [517]


def test_scores_never_look_ahead(tmp_path):
    def head(t):  # every detector's input varies, so a look-ahead changes its score
        return dict(attention_max_logit=10.0 + t / 10, wq_spectral_norm=1.0 + t / 500,
                    tied_rowmax_ratio=(t % 70) / 100, delta_drift_z=math.sin(t),
                    delta_sign_z=math.cos(t), delta_error_share_mean=(t % 30) / 100)
    advice = dict(step=300, layer="transformer.h.0.attn", head=0, from_mode="STANDARD",
                  to_mode="BETA", reason="drift z 5 ≥ 4", applied=False)
    d = write_run(tmp_path, "c", "unmitigated", 0, [FLAT + math.sin(t) for t in range(N)],
                  head=head, grad=lambda t: 1.0 + (t % 13), events={300: [advice]})
    reports = load_run(d)["reports"]
    train = read_jsonl(d / "train.jsonl")
    full = S.detector_scores(reports, train, 50)
    cut = S.detector_scores([r for r in reports if r["step"] <= 600], train[:601], 50)
    assert set(cut) == set(full) == {"drift_z", "sign_z", "delta_share", "wq_growth",
                                     "tie_trend", "logit_growth", "max_logit", "policy",
                                     "loss_ema", "grad_jump"}
    for name, (steps, values) in cut.items():
        assert len(set(values[np.isfinite(values)])) > 1, name  # not constant, not all NaN
        assert np.array_equal(steps, full[name][0][:len(steps)]), name
        np.testing.assert_array_equal(values, full[name][1][:len(values)], err_msg=name)
        assert steps[-1] >= 595, name


def test_seed_filters(tmp_path):
    for seed in range(8):
        write_run(tmp_path, "c", "unmitigated", seed, [FLAT] * 200)
    assert [r.seed for r in S.find_runs(tmp_path, seeds_mod=(4, 3))] == [3, 7]
    assert [r.seed for r in S.find_runs(tmp_path, exclude_mod=(4, 3))] == [0, 1, 2, 4, 5, 6]
