"""reproduction/: the study's runner (run.py), sweep and tables/plots (analyze.py)."""

from __future__ import annotations

import io
import json
import math

import pytest

from reproduction import analyze
from reproduction import run as R

TINY = dict(n_layer=1, n_head=2, n_embd=32, block=32, batch=2, steps=12, every=2, warmup=2)


def test_first_spike_finds_the_jump_and_not_the_noise():
    flat = [3.0 - 0.001 * i + (0.3 if i % 2 else -0.3) for i in range(300)]
    assert R.first_spike(flat, warmup=10) is None  # ±0.3 noise never moves the EMA 1 nat
    jump = flat[:200] + [6.0] * 100
    s = R.first_spike(jump, warmup=10)
    # EMA 0.95 needs log(1 - 1/3.x)/log(0.95) ≈ 8 steps to climb 1 nat of a ~3.2 nat jump
    assert s is not None and 200 < s < 215
    assert R.first_spike(flat[:50] + [math.nan], warmup=10) == 50
    assert R.first_spike([math.inf], warmup=10) == 0


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    s = R.settings_for("nope-grammar", {"steps": 1000, "warmup": 100, "lr": 1e-3,
                                         "min_lr_frac": 0.1})
    assert R.lr_at(0, s) == pytest.approx(1e-5)
    assert R.lr_at(99, s) == pytest.approx(1e-3)
    assert R.lr_at(999, s) == pytest.approx(1e-4, rel=1e-3)
    assert R.lr_at(550, s) == pytest.approx(0.55e-3, rel=1e-6)


def test_unknown_configuration_and_arm_are_named():
    with pytest.raises(ValueError, match="no-such"):
        R.settings_for("no-such")
    with pytest.raises(ValueError, match="bogus"):
        R.run("nope-grammar", "bogus", 0, None)
    with pytest.raises(ValueError, match="paper backend"):
        R.run("nope-grammar-fused", "fp32_delta", 0, None)


def test_data_kinds_have_what_their_names_say():
    uni = R.make_data(dict(data="uniform", vocab=16), seed=0)
    assert int(uni.max()) == 15 and int(uni.min()) == 0
    rep = R.make_data(dict(data="repeat", vocab=32), seed=0)
    # Every segment is said at least twice, so most tokens repeat the one a segment
    # length (4..16) back; i.i.d. tokens over 32 symbols would give 13 × 1/32 ≈ 0.41.
    repeats = sum((rep[k:] == rep[:-k]).float().mean().item() for k in range(4, 17))
    assert repeats > 0.8
    with pytest.raises(ValueError, match="data"):
        R.make_data(dict(data="nope", vocab=4), seed=0)


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("repro")
    out = {}
    for arm in R.ARMS:
        d = root / "nope-grammar" / f"{arm}-s0"
        out[arm] = R.run("nope-grammar", arm, 0, d, dict(TINY), stream=io.StringIO())
    return root, out


def test_every_arm_runs_and_records_its_modes(tiny_runs):
    root, out = tiny_runs
    for arm, summ in out.items():
        assert summ["steps_done"] == TINY["steps"]
        assert summ["monitor_errors_total"] == 0
        lines = (root / "nope-grammar" / f"{arm}-s0" / "train.jsonl").read_text().splitlines()
        assert [json.loads(x)["step"] for x in lines] == list(range(TINY["steps"]))
        reports = (root / "nope-grammar" / f"{arm}-s0" / "flashwatch.jsonl").read_text()
        every = 1 if arm == "qk_clip" else TINY["every"]  # QK-clip acts on every step
        assert len(reports.splitlines()) == TINY["steps"] // every
    (modes,) = out["fp32_o"]["final_modes"].values()
    assert modes == ["FP32_O", "FP32_O"]
    (modes,) = out["beta"]["final_modes"].values()
    assert modes == ["BETA", "BETA"]
    (modes,) = out["unmitigated"]["final_modes"].values()
    assert modes == ["STANDARD", "STANDARD"]
    # hand-set modes are not alerts
    assert out["beta"]["first_alert"] is None or out["beta"]["first_alert"]["reason"] != \
        "set by user"


def test_arms_share_data_and_init_so_only_the_modes_differ(tiny_runs):
    root, _ = tiny_runs

    def first_loss(arm):
        line = (root / "nope-grammar" / f"{arm}-s0" / "train.jsonl").open().readline()
        return json.loads(line)["loss"]
    # step 0 runs before any mode could change (auto acts from step 1 at the earliest):
    assert first_loss("unmitigated") == first_loss("auto")
    # fp32_delta keeps the forward exactly and changes only δ, hence the later steps
    assert first_loss("fp32_delta") == first_loss("unmitigated")

    def last_loss(arm):
        lines = (root / "nope-grammar" / f"{arm}-s0" / "train.jsonl").read_text().split("\n")
        return json.loads(lines[-2])["loss"]
    assert last_loss("fp32_delta") != last_loss("unmitigated")
    # BETA changes the arithmetic of step 0 already, but not the loss by more than BF16
    assert first_loss("beta") == pytest.approx(first_loss("unmitigated"), abs=0.05)


def test_analyze_tables_and_plots(tiny_runs, tmp_path):
    root, _ = tiny_runs
    table = analyze.search(root, tmp_path)
    assert table.count("\n| nope-grammar |") == 1
    assert (tmp_path / "repro_search_loss.png").stat().st_size > 1000
    table = analyze.compare(root, "nope-grammar", tmp_path)
    summary = [r.split("|") for r in table.split("\n\n")[0].splitlines()[2:]]
    assert [(c[1].strip(), c[2].strip()) for c in summary] == [
        (arm, "1") for arm in R.ARMS]
    rows = [r for r in table.split("\n\n")[1].splitlines()[2:]]
    assert [r.split("|")[1].strip() for r in rows] == list(R.ARMS)
    for name in ("repro_compare_heads.png", "repro_compare_growth.png", "repro_compare_loss.png"):
        assert (tmp_path / name).stat().st_size > 1000
    with pytest.raises(SystemExit, match="no runs"):
        analyze.compare(root, "other", tmp_path)


def test_grad_error_changes_only_delta_between_its_two_backwards():
    # dV = Pᵀ dO does not involve δ, so it must be bit-identical; dQ and dK must differ
    # (the BF16 O of a paper-arithmetic forward is not the FP32 O).
    import torch

    from reproduction.fp32_delta import Fp32DeltaAttention as _PaperAttention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 48, 16, generator=g).bfloat16() for _ in range(3))
    do = torch.randn(2, 2, 48, 16, generator=g).bfloat16()
    grads = []
    for fp32 in (False, True):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        o = _PaperAttention.apply(qq, kk, vv)
        _PaperAttention.fp32_delta = fp32
        o.backward(do)
        grads.append((qq.grad, kk.grad, vv.grad))
    _PaperAttention.fp32_delta = False
    assert torch.equal(grads[0][2], grads[1][2])
    assert not torch.equal(grads[0][0], grads[1][0])
    assert not torch.equal(grads[0][1], grads[1][1])


def test_grad_error_measures_every_head_with_bounded_statistics():
    import torch

    from examples.gpt import GPT, GPTConfig
    from reproduction.grad_error import measure

    s = R.settings_for("uniform-v4", dict(TINY))
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=4, n_layer=1, n_head=2, n_embd=32,
                          position_embedding=False))
    rows = measure(model, R.make_data(s, 0), s, batches=3, seed=0)
    assert [(r["layer"], r["head"]) for r in rows] == [(0, 0), (0, 1)]
    for r in rows:
        assert 0 < r["rel_error"] < 0.1  # BF16 δ error: small but not zero
        assert 0 < r["coherence"] <= 1 + 1e-9
        assert -1 - 1e-9 <= r["align_sigma"] <= 1 + 1e-9
        assert r["tied"] > 0.5  # 4 symbols, no position embedding: most rows tie


def test_largest_rise_measures_the_worst_spike():
    base = [2.0] * 200
    assert analyze.largest_rise(base) == 0.0
    bumped = base[:100] + [2.6] * 100 + [2.0] * 100  # EMA climbs to ≈ 0.6 above best
    assert 0.59 < analyze.largest_rise(bumped) < 0.6
    assert math.isinf(analyze.largest_rise(base + [math.nan]))


def test_twins_table_gaps_are_against_the_fused_run_of_the_same_seed(tiny_runs):
    root, out = tiny_runs
    fused = R.run("nope-grammar-fused", "unmitigated", 0,
                  root / "nope-grammar-fused" / "unmitigated-s0", dict(TINY),
                  stream=io.StringIO())
    table = analyze.twins(root, "nope-grammar")
    (row,) = [r.split("|") for r in table.split("\n\n")[1].splitlines()[2:]]
    assert row[1].strip() == "0"
    want = out["unmitigated"]["final_loss_mean_last100"] - fused["final_loss_mean_last100"]
    assert row[5].strip() == f"{want:+.2f}"
    want = out["fp32_delta"]["final_loss_mean_last100"] - fused["final_loss_mean_last100"]
    assert row[6].strip() == f"{want:+.2f}"


def test_checkpoints_sign_statistic_is_bounded_by_the_batch_count(tiny_runs):
    from reproduction import checkpoints

    root, _ = tiny_runs
    run = root / "nope-grammar" / "unmitigated-s0"
    assert checkpoints.checkpoints(run) == [(TINY["steps"], run / "model.pt")]
    for batches in (1, 4):
        rows = checkpoints.measure_run(run, batches)
        assert len(rows) == TINY["n_layer"] * TINY["n_head"]
        for r in rows:
            # z = Σ S_b / sqrt(Σ S_b²): exactly ±1 for one batch, |z| ≤ sqrt(batches)
            if batches == 1:
                assert abs(r["sign_z"]) == pytest.approx(1.0)
            assert abs(r["sign_z"]) <= math.sqrt(batches) + 1e-9
            assert r["rel_error"] >= 0 and r["step"] == TINY["steps"]


def test_deltas_pools_checkpoint_rows(tiny_runs, tmp_path):
    from reproduction import checkpoints

    root, _ = tiny_runs
    rows = checkpoints.measure_run(root / "nope-grammar" / "unmitigated-s0", 2)
    path = tmp_path / "ck.json"
    path.write_text(json.dumps({"run": rows}))
    text = analyze.deltas([path], batches=2)
    rms = math.sqrt(sum(r["sign_z"] ** 2 for r in rows) / len(rows))
    assert text.startswith(f"{len(rows)} head-checkpoints") and f"rms {rms:.2f}" in text
    assert text.count("\n| 0 |") == 1  # the one layer of TINY
    path.write_text(json.dumps({"run": [dict(r, step=0) for r in rows]}))
    with pytest.raises(SystemExit, match="no checkpoint rows"):  # step 0 is left out
        analyze.deltas([path])


def test_summaries_has_one_record_per_run(tiny_runs):
    root, out = tiny_runs
    recs = json.loads(analyze.summaries(root))
    mine = [r for r in recs if r["config"] == "nope-grammar"]
    assert sorted(r["arm"] for r in mine) == sorted(R.ARMS)
    for r in mine:
        assert r["final_loss"] == round(out[r["arm"]]["final_loss_mean_last100"], 4)
        assert r["steps"] == TINY["steps"] and r["max_grad_norm"] > 0
