"""reproduction/score.py's statistics over synthetic run directories (the Wilson interval,
McNemar's exact test, AUROC, tuning a threshold within the false-alarm bar, arms compared
by seed, the basin outcome, the negative control) and its command line. The outcome and
the detectors themselves: tests/test_score.py."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from _helpers import FLAT, N, logit_above, spike_at, write_run

from reproduction import score as S

TH = S.THRESHOLDS


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
    assert sorted(res["auroc"]) == [100, 200, 300, 500, 800]
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
