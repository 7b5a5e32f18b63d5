"""GPU check of flashwatch in two runs of ≤ 8 minutes each on one lent GPU (docs/gpu_check.md).

    python benchmarks/gpu_check.py --stage ab --out gpu_ab.json   # run 1: (a) then (b)
    python benchmarks/gpu_check.py --stage c --out gpu_c.json     # run 2
    python benchmarks/gpu_check.py --dry-run --stage all --out /tmp/dry.json   # CPU

(a) correctness per (N, D, causal) of GRID at B 8, H 16, bf16, autotuned, heads in the
    modes STANDARD, BETA, FP32_O by turn: O, dQ, dK, dV of each mode's heads against FP64
    math attention under |out − ref| ≤ 2·|pt − ref| + 1e-4 (pt: bf16 math), counters
    equal to a brute-force count over exact FP32 scores. First "warm": every Triton
    compile of the grid in parallel worker processes, into Triton's disk cache.
(b) speed per (N, D, causal): fwd, bwd, fwd+bwd ms and TFLOP/s of the kernel (counters
    off / on, all BETA, all FP32_O) and SDPA's flash backend, side by side; then the
    autotuner's picks.
(c) watcher overhead on GPT-2 Small, eager / torch.compile / mode="reduce-overhead"
    (benchmarks/bench_watcher.py overhead_modes): step times, syncs per step
    (torch.cuda.set_sync_debug_mode), peak memory, dynamo counters.
(f) FlexAttention and varlen on their real kernels in a watched BF16 model, forward and
    backward, against FP64 (benchmarks/gpu_flex.py; the CPU tests use stand-ins).
The JSON at --out is rewritten (tmp file + rename) after every sub-check; a stage past
its budget (--budget) records the rest as skipped; a failing sub-check is recorded as an
error and the run goes on. --dry-run: every stage's code path on the CPU at tiny shapes
with the reference backend (Triton's interpreter under TRITON_INTERPRET=1), same JSON.
FLASHWATCH_GPU_CHECK_FAIL / _KILL=<sub-check> make one sub-check raise / kill the process
(tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import flashwatch as fw  # noqa: E402
from benchmarks import bench_watcher, gpu_flex  # noqa: E402
from flashwatch.kernels.common import GUARD_NATS, Mode  # noqa: E402
from tests.oracle import causal_mask, math_attention  # noqa: E402  (the tests' oracle)

REAL = dict(device="cuda", B=8, H=16, grid=[(n, d, c) for c in (True, False)
                                            for d in (128, 64) for n in (4096, 2048)],
            rep_ms=100, backend="triton")
DRY = dict(device="cpu", B=1, H=3, grid=[(48, 16, True), (40, 16, False)], rep_ms=5,
           backend="triton" if os.environ.get("TRITON_INTERPRET") == "1" else "reference")
# a run ≤ 420 s + ≈ 30 s of start-up
BUDGET_S = {"a": 300, "b": 120, "c": 420, "t": 420, "f": 300}
# one sub-check; w (warm) is in a
CHECK_TIMEOUT_S = {"a": 240, "b": 90, "c": 200, "t": 300, "f": 200}
MODES = (Mode.STANDARD, Mode.BETA, Mode.FP32_O)
VARIANTS = ("counters_off", "counters_on", "all_beta", "all_fp32_o")
TARGETS = {"sdpa_over_counters_off": 0.9, "counters_on": 0.03, "all_beta": 0.05,
           "all_fp32_o": 0.10}  # issue 3: ≥ 0.9 × SDPA; slowdowns vs counters off


class Report:
    """The JSON report, rewritten atomically after every change: a kill loses nothing."""

    def __init__(self, path: Path, meta: dict):
        self.path, self.data = path, {"meta": meta, "stages": {}}
        path.parent.mkdir(parents=True, exist_ok=True)
        self.write()

    def write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout("sub-check timed out")


def run_stage(report: Report, stage: str, checks: list, budget_s: float, timeout_s: float):
    """Run (name, fn) checks in order; each result is written before the next starts."""
    t0 = time.time()
    st = report.data["stages"][stage] = {"budget_s": budget_s, "checks": {}}
    for name, fn in checks:
        left = budget_s - (time.time() - t0)
        t1 = time.time()
        if left <= 0:
            st["checks"][name] = {"status": "skipped", "reason": f"stage budget {budget_s} s"}
            report.write()
            continue
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(max(1, int(min(left, timeout_s))))
        try:
            if os.environ.get("FLASHWATCH_GPU_CHECK_KILL") == name:
                os._exit(3)
            if os.environ.get("FLASHWATCH_GPU_CHECK_FAIL") == name:
                raise RuntimeError("failure injected by FLASHWATCH_GPU_CHECK_FAIL")
            result = fn()
            status = "ok" if result.get("ok", True) else "fail"
            entry = {"status": status, "result": result}
        except Exception as e:  # recorded, and the run goes on
            entry = {"status": "error", "error": f"{type(e).__name__}: {e}"}
        finally:
            signal.alarm(0)
            gc.collect()  # the last check's tensors go before the next allocates its own
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        entry["seconds"] = round(time.time() - t1, 2)
        st["checks"][name] = entry
        st["seconds"] = round(time.time() - t0, 2)
        report.write()
        print(f"[{stage}] {name}: {entry['status']} ({entry['seconds']} s)", flush=True)


# ------------------------------------------------------------------ helpers
def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, device: str, rep_ms: int, grad_to_none=()) -> float:
    """Mean ms per call: triton.testing.do_bench on CUDA, a wall-clock window on CPU."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, rep=rep_ms, grad_to_none=list(grad_to_none))
    fn()
    n, t0 = 0, time.perf_counter()
    while n < 2 or (time.perf_counter() - t0) * 1e3 < rep_ms:
        for t in grad_to_none:
            t.grad = None
        fn()
        n += 1
    return (time.perf_counter() - t0) * 1e3 / n


def _scale(d: int) -> float:
    return 2.0 ** -math.ceil(math.log2(math.sqrt(d)))  # a power of two ≤ 1/sqrt(D)


def inputs(cfg: dict, n: int, d: int, seed: int = 0):
    """q, k multiples of 1/8 in [-2, 2] (exact FP32 scores; q × 32 on odd heads), a third
    of the keys copied (planted ties), v and dO normal; bf16 on the device."""
    g = torch.Generator().manual_seed(seed)
    shape = (cfg["B"], cfg["H"], n, d)
    q, k = ((torch.randint(-16, 17, shape, generator=g) / 8) for _ in range(2))
    k[:, :, n - n // 3:] = k[:, :, :n // 3]
    q[:, 1::2] *= 32  # odd heads: row maxima of 100s of nats, past BETA's 60-nat guard
    v, do = (torch.randn(shape, generator=g) for _ in range(2))
    return [t.to(torch.bfloat16).to(cfg["device"]) for t in (q, k, v, do)]


def head_modes(h: int) -> list[int]:
    return [int(MODES[i % len(MODES)]) for i in range(h)]


def math_fwd_bwd(q, k, v, do, causal, scale, dtype):
    """(o, dq, dk, dv) of math attention in `dtype`, one batch element at a time."""
    outs = [[], [], [], []]
    for b in range(q.shape[0]):
        leaves = [t[b:b + 1].detach().to(dtype).requires_grad_() for t in (q, k, v)]
        o = math_attention(*leaves, causal=causal, scale=scale, dtype=dtype)
        o.backward(do[b:b + 1].to(dtype))
        for acc, t in zip(outs, [o.detach()] + [x.grad for x in leaves], strict=True):
            acc.append(t)
    return [torch.cat(x) for x in outs]


def brute_counters(q, k, causal, scale, modes, beta=2.0, eps=1e-3):
    """(tied, guarded, max_logit) per head from the full FP32 score matrix."""
    beta_h = torch.tensor(modes, device=q.device).eq(int(Mode.BETA)).view(-1, 1)
    tied_n = guarded_n = 0
    m_max = torch.full((q.shape[1],), -math.inf, device=q.device)
    for b in range(q.shape[0]):
        s = torch.matmul(q[b].float(), k[b].float().transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(causal_mask(*s.shape[-2:], s.device), -math.inf)
        m = s.amax(-1)
        tied = ((s >= (m - eps).unsqueeze(-1)) & (s != -math.inf)).sum(-1) >= 2
        excess = torch.where(m > 0, (beta - 1.0) * m, -m)
        guarded = tied & beta_h & (excess > GUARD_NATS[q.dtype])
        tied_n, guarded_n = tied_n + tied.sum(-1), guarded_n + guarded.sum(-1)
        m_max = torch.maximum(m_max, m.amax(-1))
    return tied_n.cpu(), guarded_n.cpu(), m_max.cpu()


def run_kernel(cfg, q, k, v, do, causal, scale, modes, stats=None):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = fw.attention(*leaves, causal=causal, scale=scale, head_modes=modes, stats=stats,
                     backend=cfg["backend"])
    o.backward(do)
    return [o.detach()] + [t.grad for t in leaves]


# ------------------------------------------------------------------ (w) and (a)
def warm(cfg: dict, dry: bool) -> dict:
    """Compile every kernel variant of the grid in parallel processes (Triton's cache)."""
    combos = sorted({(d, c) for _, d, c in cfg["grid"]})
    procs = []
    for d, c in combos:
        for stats in (True, False):
            n = max(n for n, dd, cc in cfg["grid"] if (dd, cc) == (d, c))
            cmd = [sys.executable, __file__, "--warm-one", f"{n},{d},{int(c)},{int(stats)}"]
            procs.append(((d, c, stats), subprocess.Popen(
                cmd + (["--dry-run"] if dry else []), cwd=ROOT, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True)))
    out = {}
    try:
        for key, p in procs:
            text, _ = p.communicate()
            out[str(key)] = {"returncode": p.returncode, "tail": text[-300:]}
    finally:  # a timeout of this sub-check leaves no worker compiling on
        for _, p in procs:
            if p.poll() is None:
                p.kill()
    return {"ok": all(r["returncode"] == 0 for r in out.values()), "workers": out}


def warm_one(cfg: dict, spec: str) -> None:
    """One worker of warm(): the autotuned kernel at B 2 compiles every config of its
    keys. The binaries are the grid's: B and H are runtime ints, which Triton
    specialises only on == 1 and divisibility by 16 (B 2 and 8 alike; H kept)."""
    n, d, causal, stats = (int(x) for x in spec.split(","))
    small = dict(cfg, B=2)
    q, k, v, do = inputs(small, n, d)
    st = fw.AttentionStats.zeros(cfg["H"], device=cfg["device"]) if stats else None
    if stats:
        run_kernel(small, q, k, v, do, bool(causal), _scale(d), head_modes(cfg["H"]), st)
    else:
        with torch.no_grad():
            fw.attention(q, k, v, causal=bool(causal), scale=_scale(d),
                         backend=cfg["backend"])
    _sync(cfg["device"])


def check_correct(cfg: dict, n: int, d: int, causal: bool) -> dict:
    q, k, v, do = inputs(cfg, n, d, seed=n + d + causal)
    H, scale, modes = cfg["H"], _scale(d), head_modes(cfg["H"])
    stats = fw.AttentionStats.zeros(H, device=cfg["device"])
    outs = run_kernel(cfg, q, k, v, do, causal, scale, modes, stats)
    ref = math_fwd_bwd(q, k, v, do, causal, scale, torch.float64)
    pt = math_fwd_bwd(q, k, v, do, causal, scale, torch.bfloat16)
    errors, ok = {}, True
    for mode in MODES:
        heads = [h for h in range(H) if modes[h] == int(mode)]
        for name, out, r, p in zip(("o", "dq", "dk", "dv"), outs, ref, pt, strict=True):
            err = (out[:, heads].double() - r[:, heads]).abs().max().item()
            pt_err = (p[:, heads].double() - r[:, heads]).abs().max().item()
            good = bool(torch.isfinite(out[:, heads]).all()) and err <= 2 * pt_err + 1e-4
            errors[f"{mode.name}.{name}"] = {"err": err, "pt_err": pt_err, "ok": good}
            ok &= good
    tied, guarded, max_logit = brute_counters(q, k, causal, scale, modes)
    got = {"tied": stats.tied_rows.cpu(), "guarded": stats.guarded_rows.cpu(),
           "max_logit": stats.max_logit.cpu()}
    counters = {
        "tied": torch.equal(got["tied"], tied), "guarded": torch.equal(got["guarded"], guarded),
        "rows": stats.rows.cpu().tolist() == [cfg["B"] * n] * H,
        "max_logit": torch.equal(got["max_logit"], max_logit),
        "tied_rows": got["tied"].tolist(), "guarded_rows": got["guarded"].tolist()}
    ok &= all(counters[k] for k in ("tied", "guarded", "rows", "max_logit"))
    ok &= counters["tied_rows"] != [0] * H  # the planted ties must be there
    return {"ok": ok, "errors": errors, "counters": counters}


# ------------------------------------------------------------------ (b)
def flops(b, h, n, d, causal) -> float:
    f = 4.0 * b * h * n * n * d  # QKᵀ and PV, 2 flops per multiply-add
    return f / 2 if causal else f


def check_speed(cfg: dict, n: int, d: int, causal: bool) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, do = inputs(cfg, n, d)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    H, dev = cfg["H"], cfg["device"]
    modes = {"counters_off": [0] * H, "counters_on": [0] * H,
             "all_beta": [int(Mode.BETA)] * H, "all_fp32_o": [int(Mode.FP32_O)] * H}
    stats = fw.AttentionStats.zeros(H, device=dev)

    def make(variant):
        if variant == "sdpa_flash":
            def fwd():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, is_causal=causal)
            return fwd
        st, m = (stats if variant == "counters_on" else None), modes[variant]
        return lambda: fw.attention(q, k, v, causal=causal, head_modes=m, stats=st,
                                    backend=cfg["backend"])

    f, res = flops(cfg["B"], H, n, d, causal), {}
    for variant in ("sdpa_flash",) + VARIANTS:
        fwd = make(variant)
        fwd().backward(do)  # tunes and compiles outside the timing
        ms_f = time_ms(fwd, dev, cfg["rep_ms"])
        o = fwd()
        ms_b = time_ms(lambda o=o: o.backward(do, retain_graph=True), dev, cfg["rep_ms"],
                       (q, k, v))
        ms_fb = time_ms(lambda fwd=fwd: fwd().backward(do), dev, cfg["rep_ms"], (q, k, v))
        res[variant] = {"ms": {"fwd": ms_f, "bwd": ms_b, "fwd_bwd": ms_fb},
                        "tflops": {"fwd": f / ms_f * 1e-9, "bwd": 2.5 * f / ms_b * 1e-9,
                                   "fwd_bwd": 3.5 * f / ms_fb * 1e-9}}
    base = res["counters_off"]["ms"]["fwd_bwd"]
    ratios = {"sdpa_over_counters_off": res["sdpa_flash"]["ms"]["fwd_bwd"] / base}
    ratios.update({v: res[v]["ms"]["fwd_bwd"] / base - 1 for v in VARIANTS[1:]})
    verdicts = {k: (r >= TARGETS[k]) if k.startswith("sdpa") else (r <= TARGETS[k])
                for k, r in ratios.items()}
    return {"variants": res, "fwd_bwd_ratios": ratios, "meets_target": verdicts}


def check_masked(cfg: dict, n: int, d: int) -> dict:
    """What the masked kernel variants cost (their own, smaller autotune blocks:
    triton_tuning.tuned_space): fwd+bwd ms of a padded batch (bool key-padding mask,
    half the batch padded by n/8), softcap 50 and a causal sliding window of n/4, each
    against the same call without it, and the padded batch against SDPA with the same
    mask (its kernel choice: flash takes no mask). Ratios > 1: slower than the plain call;
    the window does less work, so its ratio should be well under 1."""
    q, k, v, do = inputs(cfg, n, d)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    keep = torch.ones(cfg["B"], 1, 1, n, dtype=torch.bool, device=cfg["device"])
    keep[: max(1, cfg["B"] // 2), ..., n - n // 8:] = False

    def call(causal, **kw):
        return lambda: fw.attention(q, k, v, causal=causal, backend=cfg["backend"], **kw)
    calls = {"plain_full": call(False), "plain_causal": call(True),
             "key_padding": call(False, attn_mask=keep),
             "softcap": call(True, softcap=50.0),
             "sliding_window": call(True, sliding_window=max(1, n // 4)),
             "sdpa_key_padding": lambda: torch.nn.functional.scaled_dot_product_attention(
                 q, k, v, attn_mask=keep)}
    ms = {}
    for name, fwd in calls.items():
        fwd().backward(do)  # tunes and compiles outside the timing
        ms[name] = time_ms(lambda fwd=fwd: fwd().backward(do), cfg["device"], cfg["rep_ms"],
                           (q, k, v))
    return {"fwd_bwd_ms": ms, "ratios": {
        "key_padding_over_plain": ms["key_padding"] / ms["plain_full"],
        "key_padding_over_sdpa": ms["key_padding"] / ms["sdpa_key_padding"],
        "softcap_over_plain": ms["softcap"] / ms["plain_causal"],
        "sliding_window_over_plain": ms["sliding_window"] / ms["plain_causal"]}}


def tuned_configs() -> dict:
    """The autotuner's pick per key, from flashwatch/kernels/triton_attention.py's TUNED."""
    from flashwatch.kernels import triton_attention as ta

    tuned = getattr(ta, "TUNED", ())
    return {"configs": {f"{getattr(t, 'fn', t).__name__}{key}": str(c)
                        for t in tuned for key, c in getattr(t, "cache", {}).items()}}


# ------------------------------------------------------------------ compile counts
def compile_estimate(cfg: dict) -> dict:
    """Triton compiles and autotune runs each stage would trigger on the GPU, from
    flashwatch/kernels/triton_tuning.py's spaces and keys. A compiled variant is one (kernel, D,
    causal, counters, config): N enters the key as its power-of-two bucket but the
    kernel as runtime ints (specialised only on divisibility by 16), so N 2048 and 4096
    share binaries but each tunes. Plus the untuned δ and dQ-out kernels, one per D."""
    from flashwatch.kernels import triton_tuning as tt

    def space(table, d):
        fixed = (tt.FWD_FIXED if table is tt.FWD_SPACE else tt.BWD_FIXED)
        return len(table[128 if d > 64 else 64]) if tt.AUTOTUNE else len(fixed)

    stages = {"a": [(n, d, c, True) for n, d, c in cfg["grid"]],
              "b": [(n, d, c, s) for n, d, c in cfg["grid"] for s in (False, True)],
              "c": [(1024, 64, True, s) for s in (False, True)]}
    stages["c_alone"] = stages["c"]  # run 2 on a fresh machine: nothing cached
    seen_keys, seen_bins, out = set(), set(), {}
    for stage, keys in stages.items():
        if stage == "c_alone":
            seen_keys, seen_bins = set(), set()
        tunes = compiles = 0
        for n, d, c, s in keys:
            b = tt.bucket(n)
            for kernel, key, bin_ in (("fwd", (b, d, c, s), (d, c, s)),
                                      ("bwd", (b, d, c), (d, c))):
                size = space(tt.FWD_SPACE if kernel == "fwd" else tt.BWD_SPACE, d)
                if (kernel, key) not in seen_keys:
                    seen_keys.add((kernel, key))
                    tunes += 1
                if (kernel, bin_) not in seen_bins:
                    seen_bins.add((kernel, bin_))
                    compiles += size
        out[stage] = {"autotune_runs": tunes, "kernel_compiles": compiles}
    out["note"] = ("a, b, c: new ones in this order within one warm Triton cache; "
                   "c_alone: stage c on a fresh machine; plus the untuned helper kernels "
                   "and stage b's `masked` sub-check (key padding, softcap, sliding "
                   "window: 3 more forward and backward variants, each tuned over its "
                   "own space)")
    return out


def real_model(device: str, name: str, sizes, dry: bool) -> dict:
    """benchmarks/bench_real_model.py's side-by-side measure on this device: medians of
    unwatched, monitored and unmonitored steps (--dry-run: MiniLM, 4 × 32, CPU)."""
    from benchmarks import bench_real_model

    if dry:
        name, sizes = "minilm", (4, 32)
    r = bench_real_model.measure(name, sizes, rounds=1 if dry else 3, block=2 if dry else 4,
                                 device=device)
    m = r["median"]
    plain = m["unwatched"]["total"]
    return {"ok": r["errors"] == 0, "model": name, "batch": list(sizes),
            "unwatched_s": plain, "monitored_ratio": m["monitored"]["total"] / plain,
            "paired_extra_s": m["paired"]["total"],
            "amortised_every_10": 1 + m["paired"]["total"] / (10 * plain),
            "step_s": m["monitored"]["step"], "errors": r["errors"]}


def tf32_probe(device: str, dry: bool) -> dict:
    """The probe's FP32 softmax · [K V] (flashwatch/monitor/probe.py fp32_matmul) with TF32
    allowed, against FP64: the split keeps it within 1e-5 where a plain TF32 matmul is
    ≈ 5e-4 off (--dry-run on the CPU: no TF32, both FP32)."""
    from flashwatch.monitor import probe

    B, H, N = (2, 2, 128) if dry else (8, 16, 1024)
    g = torch.Generator(device=device).manual_seed(0)
    p = torch.softmax(3 * torch.randn(B, H, 64, N, generator=g, device=device), -1)
    kv = torch.randn(B, H, N, 256, generator=g, device=device).bfloat16().float()
    truth = p.double() @ kv.double()
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        split, plain = probe.fp32_matmul(p, kv), p @ kv
        allowed = probe.tf32_allowed(p.device)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    top = float(truth.abs().max())
    err_split = float((split.double() - truth).abs().max()) / top
    err_plain = float((plain.double() - truth).abs().max()) / top
    return {"ok": err_split < 1e-5, "tf32_allowed_seen": allowed,
            "rel_err_split": err_split, "rel_err_plain_tf32": err_plain}


STAGES = {"a": "correctness", "b": "speed", "c": "watcher overhead",
          "t": "the Triton test files, compiled", "f": "FlexAttention and varlen kernels"}
# (t): the CPU suite's Triton tests (interpreter-sized shapes: masks, softcap, ragged
# blocks, exact counters, five matmuls a block pair) run natively, one pytest per file.
# FLASHWATCH_TRITON_AUTOTUNE=0: one fixed config per kernel variant, so the compiles fit.
# test_triton_tuning.py is left out: it checks the autotuner, which this turns off.
NATIVE_TESTS = ("test_triton_api.py", "test_triton_attention.py", "test_triton_backward.py",
                "test_triton_helpers.py", "test_triton_masks.py",
                "test_triton_sliding_window.py")


def native_tests(name: str, dry: bool) -> dict:
    """One test file under pytest with TRITON_INTERPRET=0 (--dry-run: collected only, in
    the interpreter). ok when pytest passes and nothing was skipped."""
    env = dict(os.environ, TRITON_INTERPRET="1" if dry else "0",
               FLASHWATCH_TRITON_AUTOTUNE="0", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
           *(["--collect-only"] if dry else []), str(ROOT / "tests" / "kernels" / name)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=CHECK_TIMEOUT_S["t"] - 10)
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    summary = lines[-1] if lines else p.stderr[-300:]
    return {"ok": p.returncode == 0 and "skipped" not in summary, "summary": summary,
            "tail": (p.stdout + p.stderr)[-1500:]}


def plan(stage: str, cfg: dict, dry: bool, warm_first: bool = True) -> list:
    """[(stage, [(sub-check name, fn)])] in run order."""
    def key(n, d, c):
        return f"N{n}_D{d}_{'causal' if c else 'full'}"

    checks = {
        "a": [("warm", lambda: warm(cfg, dry))] + [
            (key(*p), lambda p=p: check_correct(cfg, *p)) for p in cfg["grid"]] + [
            ("tf32_probe", lambda: tf32_probe(cfg["device"], dry))],
        "b": [(key(*p), lambda p=p: check_speed(cfg, *p)) for p in cfg["grid"]] + [
            ("tuned_configs", tuned_configs),
            ("masked", lambda: check_masked(cfg, *cfg["grid"][0][:2]))],
        "c": [(m, lambda m=m: bench_watcher.overhead_modes(cfg["device"], m, dry))
              for m in ("eager", "compiled", "reduce_overhead")] + [
            # issues 36/40: a monitored step (every row's max logit and ties) against an
            # unwatched one on real-sized models, side by side
            (f"real_model_{m}", lambda m=m, b=b: real_model(cfg["device"], m, b, dry))
            for m, b in (("gpt2", (8, 1024)), ("smollm", (4, 1024)))],
        "t": [(f, lambda f=f: native_tests(f, dry)) for f in NATIVE_TESTS],
        "f": [(name, lambda fn=fn: fn(cfg["device"], dry))
              for name, fn in (("flex", gpu_flex.flex), ("flex_routed", gpu_flex.flex_routed),
                               ("varlen", gpu_flex.varlen))],
    }
    todo = "abctf" if stage == "all" else stage
    warmer = checks["a"].pop(0)
    if warm_first:  # the first of a and b warms the cache
        checks["a" if "a" in todo else "b"].insert(0, warmer)
    return [(s, checks[s]) for s in "abctf" if s in todo]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", default="ab", choices=("a", "b", "c", "t", "f", "ab", "all"),
                    help="ab then c: two runs of ≤ 8 min each; t, f if the loan has time")
    ap.add_argument("--out", required=False, default=str(ROOT / "gpu_check.json"))
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, reference")
    ap.add_argument("--budget", action="append", default=[], metavar="STAGE=SECONDS",
                    help=f"a stage's time budget (default {BUDGET_S})")
    ap.add_argument("--no-warm", action="store_true",
                    help="no parallel compile first (Triton's cache is warm already)")
    ap.add_argument("--warm-one", help=argparse.SUPPRESS)  # a worker of warm()
    args = ap.parse_args()
    cfg = DRY if args.dry_run else REAL
    if args.warm_one:
        warm_one(cfg, args.warm_one)
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on the CPU", file=sys.stderr)
        return 2
    if not args.dry_run and os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: this runs the compiled kernels", file=sys.stderr)
        return 2
    budget = dict(BUDGET_S)
    for item in args.budget:
        name, _, secs = item.partition("=")
        if name not in BUDGET_S or not secs.replace(".", "", 1).isdigit():
            ap.error(f"--budget takes STAGE=SECONDS with STAGE in a, b, c, t, f; got {item!r}")
        budget[name] = float(secs)
    meta = {"argv": sys.argv[1:], "dry_run": args.dry_run, "torch": torch.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "device": torch.cuda.get_device_name() if not args.dry_run else "cpu",
            "config": {k: v for k, v in cfg.items()}, "budget_s": budget,
            "stages": {s: STAGES[s] for s in ("abctf" if args.stage == "all" else args.stage)}}
    try:
        meta["compile_estimate"] = compile_estimate(REAL)
    except Exception as e:  # the kernels' tuning module moved: say so, go on
        meta["compile_estimate"] = {"error": f"{type(e).__name__}: {e}"}
    report = Report(Path(args.out), meta)
    for stage, checks in plan(args.stage, cfg, args.dry_run, not args.no_warm):
        run_stage(report, stage, checks, budget[stage], CHECK_TIMEOUT_S[stage])
    bad = [f"{s}.{n}" for s, st in report.data["stages"].items()
           for n, c in st["checks"].items() if c["status"] in ("fail", "error")]
    print(f"wrote {args.out}; not ok: {bad or 'none'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
