"""benchmarks/gpu_check.py --dry-run: every stage's code path on the CPU, its JSON written
after every sub-check, a failing or killed sub-check leaving the earlier results."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GRID = ("N48_D16_causal", "N40_D16_full")
CHECKS = {"a": ("warm",) + GRID + ("tf32_probe",), "b": GRID + ("tuned_configs", "masked"),
          "c": ("eager", "compiled", "reduce_overhead", "real_model_gpt2", "real_model_smollm"),
          "t": tuple(p.name for p in sorted((ROOT / "tests" / "kernels").glob("test_triton_*.py"))
                     if p.name != "test_triton_tuning.py"),
          "f": ("flex", "flex_routed", "varlen")}


def run(tmp_path, *args, env=None, timeout=600):
    out = tmp_path / "gpu.json"
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environ.update(OMP_NUM_THREADS="1", **(env or {}))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"),
                           "--dry-run", "--out", str(out), *args], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=timeout)
    data = json.loads(out.read_text()) if out.exists() else None
    return proc, data


def checks_of(data, stage):
    return data["stages"][stage]["checks"]


@pytest.mark.parametrize("stage", ["a", "b", "c", "t", "f"])
def test_stage_writes_every_sub_check(tmp_path, stage):
    proc, data = run(tmp_path, "--stage", stage, *(["--no-warm"] if stage == "b" else []))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert data["meta"]["dry_run"] is True and list(data["stages"]) == [stage]
    got = checks_of(data, stage)
    assert tuple(got) == CHECKS[stage]
    for name, entry in got.items():
        assert entry["status"] == "ok", (name, entry)
        assert isinstance(entry["result"], dict) and entry["seconds"] >= 0
    if stage == "a":
        for name in GRID:
            res = got[name]["result"]
            # every mode, every output, and the counters, checked and recorded
            assert len(res["errors"]) == 3 * 4
            assert all(e["ok"] and e["err"] <= 2 * e["pt_err"] + 1e-4
                       for e in res["errors"].values())
            assert all(res["counters"][k] for k in ("tied", "guarded", "rows", "max_logit"))
            assert sum(res["counters"]["tied_rows"]) > 0
            assert sum(res["counters"]["guarded_rows"]) > 0  # odd heads pass the guard
        tf32 = got["tf32_probe"]["result"]  # the CPU has no TF32: exact either way
        assert tf32["tf32_allowed_seen"] is False and tf32["rel_err_split"] < 1e-6
    if stage == "b":
        res = got[GRID[0]]["result"]
        assert set(res["variants"]) == {"sdpa_flash", "counters_off", "counters_on",
                                        "all_beta", "all_fp32_o"}
        assert all(v["tflops"]["fwd_bwd"] > 0 for v in res["variants"].values())
        assert set(res["fwd_bwd_ratios"]) == set(res["meets_target"])
        masked = got["masked"]["result"]
        assert set(masked["fwd_bwd_ms"]) == {"plain_full", "plain_causal", "key_padding",
                                             "softcap", "sliding_window", "sdpa_key_padding"}
        assert all(r > 0 for r in masked["ratios"].values())
    if stage == "f":  # flex forward on the CPU, against FP64; varlen has no CPU kernel
        flex = got["flex"]["result"]
        assert flex["ok"] and flex["max_logit_rel_err"] < 1e-4 and flex["tie_count_errors"] == 0
        assert "skipped" in got["varlen"]["result"]
        routed = got["flex_routed"]["result"]  # the reference kernel on the CPU, forward
        assert routed["ok"] and routed["routed_calls"] == 2 and routed["out_rel_err"] < 1e-2
    if stage == "t":  # collected in the interpreter; on the GPU they run compiled
        assert all(" collected" in got[f]["result"]["summary"] for f in CHECKS["t"])
    if stage == "c":
        phases = got["eager"]["result"]["phases"]
        assert set(phases) == {"not_watched", "watched_sdpa", "watched_routed"}
        # eager on the CPU: flashwatch/synccount.py counts; an unwatched step syncs never
        assert phases["not_watched"]["syncs"] == {"unmon": 0}
        assert phases["watched_routed"]["syncs"]["mon"] is not None
        assert got["compiled"]["result"]["phases"]["not_watched"]["syncs"] == {"unmon": None}
        real = got["real_model_gpt2"]["result"]  # --dry-run: MiniLM on the CPU
        assert real["model"] == "minilm" and real["errors"] == 0 and real["monitored_ratio"] > 0


def test_compile_estimate_in_meta(tmp_path):
    proc, data = run(tmp_path, "--stage", "b", "--budget", "b=0")
    est = data["meta"]["compile_estimate"]
    assert "error" not in est, est
    # (a) tunes each fwd and bwd key of the 8-point grid once; (b) adds the
    # counters-off forward keys; (c) GPT-2's T=1024 keys
    assert est["a"]["autotune_runs"] == 16 and est["b"]["autotune_runs"] == 8
    assert est["c"]["autotune_runs"] == 3
    assert est["a"]["kernel_compiles"] > est["b"]["kernel_compiles"] > 0


def test_budget_skips_the_rest(tmp_path):
    proc, data = run(tmp_path, "--stage", "b", "--budget", "b=0")
    assert proc.returncode == 0
    got = checks_of(data, "b")
    assert tuple(got) == ("warm",) + CHECKS["b"]  # b run alone warms the cache first
    assert {e["status"] for e in got.values()} == {"skipped"}


def test_failure_is_recorded_and_the_run_goes_on(tmp_path):
    proc, data = run(tmp_path, "--stage", "b", "--no-warm",
                     env={"FLASHWATCH_GPU_CHECK_FAIL": GRID[0]})
    assert proc.returncode == 1  # a failed sub-check: not ok, not a crash
    got = checks_of(data, "b")
    assert got[GRID[0]]["status"] == "error"
    assert "injected" in got[GRID[0]]["error"]
    assert got[GRID[1]]["status"] == "ok" and got["tuned_configs"]["status"] == "ok"


def test_kill_keeps_the_results_written_before(tmp_path):
    proc, data = run(tmp_path, "--stage", "c",
                     env={"FLASHWATCH_GPU_CHECK_KILL": "compiled"})
    assert proc.returncode == 3  # killed inside the second sub-check
    got = checks_of(data, "c")
    assert list(got) == ["eager"] and got["eager"]["status"] == "ok"
    assert got["eager"]["result"]["phases"]["watched_sdpa"]["ms"]["mon"] > 0
    assert not (tmp_path / "gpu.json.tmp").exists()


def test_bad_arguments(tmp_path):
    proc, _ = run(tmp_path, "--budget", "x=3")
    assert proc.returncode == 2 and "STAGE=SECONDS" in proc.stderr
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"),
                          "--stage", "a", "--out", str(tmp_path / "x.json")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert out.returncode == 2 and "--dry-run" in out.stderr  # no CUDA here
