"""reproduction/score.py on synthetic run directories whose alarms and events follow from
their construction."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from flashwatch.runreport import load_run
from flashwatch.sinks import read_jsonl
from reproduction import score as S

FLAT = 2.0
N = 1000  # steps per synthetic run
TH = S.THRESHOLDS
HEAD = dict(layer="transformer.h.0.attn", head=0, tied_rowmax_ratio=0.1,
            attention_max_logit=10.0, delta_drift_z=0.0, delta_coherence=0.0,
            wq_spectral_norm=1.0, delta_error_share=0.0, delta_error_share_mean=0.0,
            head_mode="STANDARD", recommended_mode="STANDARD", flagged=False)


def write_run(root, config, arm, seed, losses, *, head=None, grad=None, events=None,
              warmup=50, every=5):
    """ROOT/CONFIG/ARM-sSEED as reproduction.run writes it. head(t): overrides of HEAD's
    fields at monitored step t (a dict for one head, a list of dicts for several);
    grad(t): the gradient norm; events: {step: [event dicts]}."""
    d = root / config / f"{arm}-s{seed}"
    d.mkdir(parents=True)
    grad = grad or (lambda t: 1.0)
    with open(d / "train.jsonl", "w") as f:
        for t, x in enumerate(losses):
            f.write(json.dumps({"step": t, "loss": x, "grad_norm": grad(t), "lr": 0.0,
                                "seconds": 0.0, "monitored": t % every == 0}) + "\n")
    with open(d / "flashwatch.jsonl", "w") as f:
        for t in range(0, len(losses), every):
            over = head(t) if head else {}
            heads = [{**HEAD, **o, "head": i}
                     for i, o in enumerate(over if isinstance(over, list) else [over])]
            f.write(json.dumps({"step": t, "heads": heads, "events": (events or {}).get(t, []),
                                "full": True}) + "\n")
    tail = losses[-100:]
    (d / "summary.json").write_text(json.dumps({
        "config": config, "arm": arm, "seed": seed, "settings": {"warmup": warmup},
        "final_loss_mean_last100": sum(tail) / len(tail)}))
    return d


def spike_at(step):
    """Losses flat until a non-finite loss at `step`: first_spike gives exactly `step`."""
    return [FLAT] * step + [math.nan]


def logit_above(*spans):
    """Max logit 150 (over the 100 threshold) on [a, b) spans, 10 elsewhere."""
    return lambda t: dict(attention_max_logit=150.0 if any(a <= t < b for a, b in spans)
                          else 10.0)


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
    def head(t):
        return dict(attention_max_logit=10.0 + t / 10, wq_spectral_norm=1.0 + t / 500,
                    tied_rowmax_ratio=(t % 70) / 100, delta_drift_z=math.sin(t))
    d = write_run(tmp_path, "c", "unmitigated", 0, [FLAT + math.sin(t) for t in range(N)],
                  head=head, grad=lambda t: 1.0 + (t % 13))
    reports = load_run(d)["reports"]
    train = read_jsonl(d / "train.jsonl")
    full = S.detector_scores(reports, train, 50)
    cut = S.detector_scores([r for r in reports if r["step"] <= 600], train[:601], 50)
    for name, (steps, values) in cut.items():
        assert np.array_equal(steps, full[name][0][:len(steps)]), name
        np.testing.assert_array_equal(values, full[name][1][:len(values)], err_msg=name)
        assert steps[-1] >= 595, name


def test_wilson_interval_for_7_of_10():
    # the bounds solve (p − π)² = z² π (1 − π) / n for π
    z, n, p = 1.959963984540054, 10, 0.7
    a = 1 + z * z / n
    roots = sorted(np.roots([a, -(2 * p + z * z / n), p * p]).real)
    low, high = S.wilson(7, 10)
    assert (low, high) == pytest.approx(roots, rel=1e-12)
    assert 0.39 < low < 0.40 and 0.89 < high < 0.90
    assert S.wilson(0, 0) == (None, None)


def test_mcnemar_exact_is_the_two_sided_binomial_test():
    n = 9  # b = 8, c = 1
    pmf = [math.comb(n, k) * 0.5 ** n for k in range(n + 1)]
    expected = sum(q for q in pmf if q <= pmf[1] * (1 + 1e-12))  # as or less likely than 1
    assert S.mcnemar_exact(8, 1) == pytest.approx(expected) == pytest.approx(20 / 512)
    assert S.mcnemar_exact(1, 8) == S.mcnemar_exact(8, 1)
    assert S.mcnemar_exact(3, 3) == 1.0 and S.mcnemar_exact(0, 0) == 1.0


def _auroc_root(tmp_path, pos_head, neg_head):
    for seed in (0, 1):
        write_run(tmp_path, "c", "unmitigated", seed, spike_at(600), head=pos_head)
    for seed in (2, 3):
        write_run(tmp_path, "c", "fused", seed, [FLAT] * N)
        write_run(tmp_path, "c", "unmitigated", seed, [FLAT] * N, head=neg_head)
    return S.find_runs(tmp_path)


def test_auroc_is_1_when_separated_and_half_when_identical(tmp_path):
    def logit(v):
        return lambda t: dict(attention_max_logit=v)
    assert S.auroc(_auroc_root(tmp_path / "a", logit(50.0), logit(10.0)), "max_logit",
                   TH) == 1.0
    assert S.auroc(_auroc_root(tmp_path / "b", logit(10.0), logit(10.0)), "max_logit",
                   TH) == 0.5
    assert S.auroc(_auroc_root(tmp_path / "c", logit(10.0), logit(50.0)), "max_logit",
                   TH) == 0.0
    # the score 50 steps before the event, not at it: a rise from 555 on is not seen
    late = _auroc_root(tmp_path / "d", lambda t: dict(attention_max_logit=50.0 if t >= 555
                                                      else 10.0), logit(10.0))
    assert S.auroc(late, "max_logit", TH) == 0.5


def test_seed_filters(tmp_path):
    for seed in range(8):
        write_run(tmp_path, "c", "unmitigated", seed, [FLAT] * 200)
    assert [r.seed for r in S.find_runs(tmp_path, seeds_mod=(4, 3))] == [3, 7]
    assert [r.seed for r in S.find_runs(tmp_path, exclude_mod=(4, 3))] == [0, 1, 2, 4, 5, 6]


def test_a_configuration_held_out_whole_joins_the_filtered_one(tmp_path, capsys):
    for seed in range(4):
        write_run(tmp_path, "a", "unmitigated", seed, [FLAT] * 200)
        write_run(tmp_path, "b", "unmitigated", seed, [FLAT] * 200)
    S.main(["--root", str(tmp_path), "--config", "a", "--seeds-mod", "4", "3", "--whole", "b",
            "--json"])
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [(r["config"], r["seed"]) for r in runs] == [("a", 3)] + [("b", s) for s in range(4)]


def test_cli_json_round_trip(tmp_path, capsys):
    write_run(tmp_path, "c", "unmitigated", 0, spike_at(600), head=logit_above((400, N)))
    write_run(tmp_path, "c", "fused", 1, [FLAT] * N)
    write_run(tmp_path, "c", "unmitigated", 1, [FLAT] * N, head=logit_above((500, 520)))
    write_run(tmp_path, "c", "unmitigated", 2, [FLAT] * N)  # no twin, no spike
    assert S.main(["--root", str(tmp_path), "--json"]) == 0  # the pre-registered ones
    assert json.loads(capsys.readouterr().out)["thresholds"] == S.PREREGISTERED
    assert S.main(["--root", str(tmp_path), "--json", "--defaults"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"outcome", "thresholds", "runs", "detectors"}
    assert out["outcome"]["GAP_NATS"] == 0.2 and out["outcome"]["SUSTAIN"] == 100
    assert out["thresholds"] == S.THRESHOLDS
    runs = {r["seed"]: r for r in out["runs"]}
    assert [(r["arm"], r["event_step"], r["event_kind"]) for r in runs.values()] == [
        ("unmitigated", 600, "spike"), ("unmitigated", None, None),
        ("unmitigated", None, "unlabelled")]
    assert runs[0]["alarms"]["max_logit"] == [400] and runs[1]["alarms"]["max_logit"] == [500]
    assert runs[1]["final_gap"] == 0.0 and runs[0]["final_gap"] is None
    m = out["detectors"]["max_logit"]
    assert (m["n_pos"], m["n_neg"], m["hits"], m["median_lead"]) == (1, 1, 1, 200)
    assert m["false_alarms_per_run"] == 0.5 and m["auroc"] == 1.0  # 150 against 10 at 550
    assert set(m) == {"n_pos", "n_neg", "hits", "hit_rate", "wilson_low", "wilson_high",
                      "median_lead", "false_alarms_per_run", "late", "auroc"}

    S.main(["--root", str(tmp_path), "--json", "--defaults", "--thresholds",
            "max_logit=200", "--seeds-mod", "2", "0"])
    out = json.loads(capsys.readouterr().out)
    assert [r["seed"] for r in out["runs"]] == [0, 2]
    assert out["thresholds"]["max_logit"] == 200 and out["runs"][0]["alarms"]["max_logit"] == []

    S.main(["--root", str(tmp_path), "--json", "--defaults", "--sweep", "max_logit", "100",
            "200"])
    sweep = json.loads(capsys.readouterr().out)["sweep"]
    assert [(s["threshold"], s["hits"]) for s in sweep] == [(100, 1), (200, 0)]

    S.main(["--root", str(tmp_path), "--defaults"])
    text = capsys.readouterr().out
    assert "| max_logit | 100 | 1/1 |" in text and "unlabelled" in text
    with pytest.raises(SystemExit):
        S.main(["--root", str(tmp_path), "--thresholds", "bogus=1"])


def test_arm_table_pairs_arms_by_seed(tmp_path, capsys):
    jump = [FLAT] * 300 + [FLAT + 3.0] * 700  # the EMA climbs 1 nat: a spike
    for seed in range(3):
        write_run(tmp_path, "c", "fused", seed, [FLAT] * N)
        write_run(tmp_path, "c", "unmitigated", seed, jump if seed < 2 else [FLAT] * N)
        write_run(tmp_path, "c", "auto", seed, [FLAT] * N)
    rows = {r["arm"]: r for r in S.arm_table(tmp_path, "c", ["unmitigated", "auto"])}
    assert rows["unmitigated"]["event_rate"] == pytest.approx(2 / 3)
    auto = rows["auto"]
    assert (auto["n"], auto["events"], auto["pairs"], auto["b"], auto["c"]) == (3, 0, 3, 2, 0)
    assert auto["mcnemar_p"] == S.mcnemar_exact(2, 0) == 0.5
    assert auto["final_loss_diff_median"] == pytest.approx(-3.0)
    assert auto["final_loss_median"] == FLAT
    S.main(["--root", str(tmp_path), "--config", "c", "--arms-compare", "auto", "--json"])
    assert json.loads(capsys.readouterr().out)["arms"]["c"][0]["b"] == 2
    only = S.arm_table(tmp_path, "c", ["auto"], seeds={1, 2})[0]  # seed 0 left out
    assert (only["pairs"], only["b"], list(only["final_losses"])) == (2, 1, [1, 2])
    S.main(["--root", str(tmp_path), "--config", "c", "--arms-compare", "unmitigated", "auto",
            "--plot", str(tmp_path / "img"), "t"])
    assert (tmp_path / "img" / "benchmark_arms_t_c.png").stat().st_size > 0


def test_tune_takes_the_threshold_that_catches_most_events_within_the_false_alarm_bar(
        tmp_path):
    """Five positive runs whose max logit reaches 150 at event − 200, five negatives that
    reach 120 (one of them 200) at step 500: 100 catches all five but alarms in every
    negative (5 false alarms in 10 runs: 0.5 per run); a threshold in (120, 150] catches
    all five with one false alarm in ten runs (0.1 ≤ 0.2)."""
    runs = []
    for seed in range(5):
        runs.append(S.load(write_run(tmp_path, "c", "unmitigated", seed, spike_at(700),
                                     head=logit_above((500, N)))))
    for seed in range(5, 10):
        write_run(tmp_path, "c", "fused", seed, [FLAT] * N)
        level = 200.0 if seed == 5 else 120.0
        runs.append(S.load(write_run(
            tmp_path, "c", "unmitigated", seed, [FLAT] * N,
            head=lambda t, lv=level: dict(attention_max_logit=lv if t >= 500 else 10.0))))
    low = S.detector_metrics(runs, "max_logit", {**TH, "max_logit": 100.0})
    assert (low["hits"], low["false_alarms_per_run"]) == (5, 0.5)
    got = S.tune(runs, "max_logit", TH)
    assert got["within_bar"] and 120.0 < got["threshold"] <= 150.0
    assert (got["hits"], got["false_alarms_per_run"], got["median_lead"]) == (5, 0.1, 200)


def test_basin_counts_runs_ending_high_and_scores_the_early_loss_level(tmp_path, capsys):
    """Seeds 0, 1 end at 3.0 (their loss is high from step 0), seed 2 at FLAT; the arm
    "clip" ends at FLAT everywhere: 2 runs above the cut, both rescued by clip."""
    for seed in range(3):
        level = 3.0 if seed < 2 else FLAT
        write_run(tmp_path, "c", "unmitigated", seed, [level] * N)
        write_run(tmp_path, "c", "clip", seed, [FLAT] * N)
    res = S.basin(tmp_path, "c", 2.5, ["clip"])
    assert res["arms"]["unmitigated"]["high"] == 2
    clip = res["arms"]["clip"]
    assert (clip["high"], clip["b"], clip["c"]) == (0, 2, 0)
    assert clip["mcnemar_p"] == S.mcnemar_exact(2, 0)
    assert all(row["loss_level"] == 1.0 for row in res["auroc"].values())
    assert S.main(["--root", str(tmp_path), "--config", "c", "--basin", "2.5",
                   "--arms-compare", "clip", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["c"]["arms"]["clip"]["b"] == 2


def test_control_counts_gaps_with_the_roles_swapped_and_the_sign_of_the_final_gap(
        tmp_path, capsys):
    worse = [FLAT] * 300 + [FLAT + 0.5] * 700
    short = [FLAT] * 300 + [FLAT + 0.5] * 60 + [FLAT] * 640  # parts < SUSTAIN steps
    cases = {0: (worse, [FLAT] * N),  # the paper run degrades: an event
             1: ([FLAT] * N, worse),  # the fused one does: the swapped rule fires
             2: ([FLAT - 0.1] * N, short),  # better at the end, no event either way
             3: ([FLAT + 0.1] * N, [FLAT] * N)}  # worse at the end, gap below the margin
    for seed, (paper, fused) in cases.items():
        write_run(tmp_path, "c", "unmitigated", seed, paper)
        write_run(tmp_path, "c", "fused", seed, fused)
    write_run(tmp_path, "c", "unmitigated", 4, worse)  # no twin: left out
    got = S.control(tmp_path, "c")
    assert (got["n"], got["events"], got["swapped"], got["paper_worse"]) == (4, 1, 1, 2)
    assert got["sign_p"] == S.mcnemar_exact(2, 2) == 1.0
    assert got["final_gap_median"] == pytest.approx(0.0)
    assert S.control(tmp_path, "c", {0, 3})["paper_worse"] == 2
    assert S.main(["--root", str(tmp_path), "--config", "c", "--control", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["control"]["c"]["swapped"] == 1
