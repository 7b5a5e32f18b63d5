"""`WatchConfig`: every knob of the watcher, with documented defaults, in one place."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import asdict, dataclass, fields

from flashwatch._checks import check_bool, check_float, check_int
from flashwatch.kernels.dispatch import BACKENDS

MITIGATIONS = ("off", "advise", "auto")


@dataclass(frozen=True)
class WatchConfig:
    """Configuration of `flashwatch.watch` and of both callbacks: every knob of the
    watcher, with its default. Frozen. Each field's meaning, and the measurement its
    default comes from, is in the comment above it; the groups are cadence and
    sampling, the kernel, the policy (docs/design.md §6), policy v2 and QK-clip."""

    # ---- Cadence and sampling
    # Monitor one optimizer step in this many (the others cost nothing beyond the
    # attention call itself). At 80 layers × 64 heads a monitored step costs each rank
    # ≈ 0.2–0.3 s (rank 0, with its sinks, up to 0.5 s), 0.4–1 % of a ≈ 5 s step of a 70B
    # model on 1,024 GPUs once amortised (benchmarks/RESULTS.md, "At scale"); raise it
    # for more margin.
    every_n_steps: int = 10
    # Query rows sampled per layer and monitored step for the δ probe (ties and max
    # logit cover every row whatever this is: the probe's FP32 QKᵀ of each call gives
    # them). The sampled rows' FP32 output and PK come from those scores: cost ∝
    # rows·N·D·H, tiny next to the layer's N²·D·H. Rounded up so that every batch
    # element drawn gives the same number of rows (⌈R/B⌉; exactly R when B divides it),
    # which lets them run as one batched matmul;
    # every row is equally likely to be drawn. "all": recompute every row of a foreign
    # kernel's call (e.g. SDPA) in FP32, so Σc and Σc² cover all rows (cost ≈ one FP32
    # attention forward per watched call; benchmarks/RESULTS.md). flashwatch's own
    # kernels give c on every row either way, from their FP32 O.
    rows_per_head: int | str = 64
    sketch_dim: int = 8  # k of the k×k sketch G_t of the W^Q gradient error
    window: int = 64  # monitored steps in the sliding window of drift z and coherence
    seed: int = 0  # seeds the sketch matrices and the row sampling

    # ---- Kernel
    # eps: tie tolerance in scaled-score units (docs/design.md §4); beta: β of the BETA
    # fix (paper: 2..8). Both apply to every attention call in a watched layer, also to
    # a flashwatch.attention call that passes its own (logged once).
    eps: float = 1e-3
    beta: float = 2.0
    # Attention backend for routed calls: "auto" | "reference" | "triton" | "paper"
    # (see flashwatch.attention).
    backend: str = "auto"
    # Route every watched attention call through flashwatch.attention (exact tie
    # counters on all rows) instead of only layers with a non-STANDARD head.
    route_all: bool = False

    # ---- Policy (docs/design.md §6). A head is flagged when its ties are elevated
    # (tied_rowmax_ratio ≥ tie_ratio_threshold) and either its δ error persists in sign
    # (delta_drift_z ≥ drift_z_threshold and delta_coherence ≥ coherence_threshold) or
    # its W^Q spectral norm grew abnormally (relative growth over the window ≥
    # spectral_growth_threshold and ≥ spectral_growth_factor × the median head's growth).
    # "off" (measure only) | "advise" (report the recommended mode) | "auto" (apply it
    # from the next step).
    mitigation: str = "advise"
    tie_ratio_threshold: float = 0.02  # i.i.d. Gaussian logits, N = 1024: ≈ 0.004
    # z ≈ N(0, 1) under zero-mean errors; largest z seen in 200 zero-mean streams × 1000
    # steps: 3.8.
    drift_z_threshold: float = 4.0
    # Zero-mean: ≈ 1/sqrt(window) = 0.125; a unit rank-1 bias b·R in k×k noise of std σ
    # per entry gives ≈ sqrt(W²b² + Wk²σ²) / (W sqrt(b² + k²σ²)) over W steps: 0.175 at
    # b = σ, k = 8, W = 64; the earlier default 0.3 missed biases below b ≈ 2.3σ
    # (tests/signals/test_signals.py).
    coherence_threshold: float = 0.15
    spectral_growth_threshold: float = 0.2
    spectral_growth_factor: float = 3.0
    patience: int = 3  # consecutive flagged monitored steps before acting
    min_history: int = 16  # monitored steps of history before any decision
    # Monitored steps after a switch to BETA before deciding whether the drift decayed;
    # if not, escalate to FP32_O.
    verify_steps: int = 32
    # For a W^Q sharded over ranks (FSDP2 rows; a W^Q this process holds whole needs no
    # iteration: its norm comes from the small d_head × d_head Gram matrix,
    # flashwatch/signals/spectral.py): the least number of warm-started power-iteration steps
    # per monitored step; it goes on until σ changes by < 1e-5 (relative), at most
    # power_max_iters.
    power_iters: int = 4
    # The most warm-started iterations per monitored step (sharded W^Q): 4–12 were
    # needed at 80 layers × 64 heads (benchmarks/RESULTS.md), 8–48 early in training
    # with AdamW at lr 1e-3 every 10 steps; 100 covers a fast-turning W^Q (4 left σ 1.6 %
    # low once). At d_head 128, d_model 8,192 one iteration reads W^Q twice, ≈ 0.11 ms
    # per layer on an H100-class GPU: 80 layers at the cap ≈ 0.9 s per monitored step;
    # lower it (≥ power_iters) to bound that.
    power_max_iters: int = 100

    # ---- Policy v2 (issue 13): two hazards, each with its own fix
    # (flashwatch/mitigation/policy.py)
    # The δ error's share of the head's W^Q gradient at or above which a head goes to
    # FP32_O directly (no tie gate). Measured 0.002 at initialisation, 0.014 at logits
    # ≈ 17, per-run medians 0.02–0.21 in a fused kernel and 0.14–0.40 in the paper's
    # BF16 arithmetic at lr 3e-2, logits in the thousands (docs/REPRODUCTION.md, study
    # v2). Real runs at an ordinary lr: `flashwatch demo --steps 600 --mitigation auto
    # --seed 0` (and 1), lr 3e-3: share median 0.0008, 99th percentile 0.006–0.008 over
    # 4,800 head-steps each, no event from any rule. Synthetic streams: 0 of 200 heads
    # switched in 1000 monitored steps at a true share of 0.07, all 200 at 0.2
    # (tests/mitigation/test_policy_rules.py).
    delta_share_threshold: float = 0.1
    # Consecutive monitored steps at or above the threshold before acting (one noisy
    # 64-row estimate never acts).
    delta_share_steps: int = 8
    # A step's share counts for the rule only where the head's W^Q gradient is a signal:
    # its ‖dW^Q‖ at least these fractions of its layer's median head and of its own
    # running peak (the largest ‖dW^Q‖ seen, decaying 0.999 per monitored step). A share
    # > 1 (the estimated error exceeds the gradient) counts as 1. The README's quickstart
    # on random tokens (lr 3e-3, 300 steps, seeds 0-3;
    # 1,500 steps, seed 0): layer 1's W^Q gradients fell to 0.2-2 % of their peak
    # (≈ 1e-6 against 5e-4 at the start, layer 0 ≈ 6e-5), and its shares rose to
    # 0.1-5.7; without the floors all 4 heads of layer 1 switched to FP32_O in every run,
    # with a peak floor of 0.003 in 2 of 4, with 0.01 in none (every share > 1 came at a
    # gradient ≤ 2.2 % of its peak). 0.03 leaves a 3× margin; the layer floor stops a
    # head whose gradient is 1e-4 of its layer's others (issue 37: a pretrained 135M
    # model). A planted lean of 1e-3·|O| (share 0.43-0.77, gradient ordinary) still
    # switches after delta_share_steps (tests/mitigation/test_policy_rules.py).
    delta_share_min_grad_layer: float = 0.1
    delta_share_min_grad_peak: float = 0.03
    # BETA is chosen only where its shift stays this many nats or less above the row
    # max, (β − 1)·max logit ≤ beta_max_excess (the fused and Triton kernels' underflow
    # guard, 60 nats; within it the shift is the authors' exact β·r_m). Elsewhere the
    # policy picks FP32_O, and a BETA head whose logits outgrow it goes to FP32_O. On
    # backend="paper" the limit is at most 20: the authors' unguarded rule floors a tied
    # row's block sum from ≈ 23.7 nats (O shrinks) and zeroes rows from ≈ 88 nats
    # (tests/mitigation/test_policy_rules.py).
    beta_max_excess: float = 60.0
    # The W^Q-growth rule flags a head only while its max logit is at least this. At
    # ordinary settings logits stay at 15–18 (lr 3e-3, docs/REPRODUCTION.md §1; the demo
    # ≈ 15) while heads grow ×5–7 at different rates, which the rule took for a hazard in
    # runs that never spiked; the δ error is a large share of the gradient only at
    # logits in the hundreds (docs/REPRODUCTION.md §2). The demo: 12 and 8 heads flagged
    # without the floor (seeds 0, 1), all at max logits ≤ 15; none with it.
    growth_min_logit: float = 100.0

    # ---- QK-clip (opt-in; flashwatch/mitigation/qkclip.py). Changes the model, unlike BETA and
    # FP32_O. τ: after each monitored step, heads whose max logit exceeds τ get W^Q rows
    # × η^α and W^K rows × η^(1−α), η = τ / max logit (Kimi K2 MuonClip, Megatron-LM
    # --qk-clip; Megatron's τ is 100). None: off. α: the share of the reduction put on
    # W^Q.
    qk_clip_threshold: float | None = None
    qk_clip_alpha: float = 0.5

    # ---- torch.distributed (flashwatch/parallel/reduce.py). The monitor talks on its own gloo
    # group; a rank waits at most this long in one of its collectives for a rank that
    # never comes (e.g. one that skipped a watcher.step()), then the group is marked
    # broken, the error counted, and training goes on without cross-rank decisions. Keep
    # it below the training's own collective timeout (NCCL's default: 600 s) so that ours
    # fires first. A monitored step's exchange itself takes milliseconds
    # (benchmarks/bench_reduce.py: ≤ 10 ms for 5,120 heads on 2 gloo ranks).
    collective_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        positive_ints = ("every_n_steps", "sketch_dim", "window", "patience",
                         "verify_steps", "power_iters", "power_max_iters")
        if self.rows_per_head != "all":
            if isinstance(self.rows_per_head, str):
                raise ValueError(f"rows_per_head must be a positive int or \"all\", got "
                                 f"{self.rows_per_head!r}")
            check_int("rows_per_head", self.rows_per_head, min=1)
        for name in positive_ints:
            check_int(name, getattr(self, name), min=1)
        check_int("min_history", self.min_history, min=0)
        check_int("seed", self.seed, min=0)
        if self.power_max_iters < self.power_iters:
            raise ValueError(f"power_max_iters must be ≥ power_iters ({self.power_iters}), "
                             f"got {self.power_max_iters}")
        if self.window < 2:
            raise ValueError(f"window must be ≥ 2 monitored steps, got {self.window}")
        check_float("eps", self.eps, above=0)
        check_float("beta", self.beta, above=1)
        check_float("tie_ratio_threshold", self.tie_ratio_threshold, min=0, max=1)
        check_float("drift_z_threshold", self.drift_z_threshold, above=0)
        check_float("coherence_threshold", self.coherence_threshold, above=0, max=1)
        check_float("spectral_growth_threshold", self.spectral_growth_threshold, above=0)
        check_float("spectral_growth_factor", self.spectral_growth_factor, above=0)
        if self.mitigation not in MITIGATIONS:
            raise ValueError(f"mitigation must be one of {MITIGATIONS}, got {self.mitigation!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        check_bool("route_all", self.route_all)
        check_float("delta_share_threshold", self.delta_share_threshold, above=0)
        check_int("delta_share_steps", self.delta_share_steps, min=1)
        check_float("delta_share_min_grad_layer", self.delta_share_min_grad_layer, min=0, max=1)
        check_float("delta_share_min_grad_peak", self.delta_share_min_grad_peak, min=0, max=1)
        check_float("beta_max_excess", self.beta_max_excess, above=0)
        check_float("growth_min_logit", self.growth_min_logit)
        if self.qk_clip_threshold is not None:
            check_float("qk_clip_threshold", self.qk_clip_threshold, above=0)
        check_float("qk_clip_alpha", self.qk_clip_alpha, min=0, max=1)
        check_float("collective_timeout_s", self.collective_timeout_s, above=0)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_kwargs(cls, base: WatchConfig | None = None, /, **kwargs) -> WatchConfig:
        """`base` (default: the defaults) with the fields in `kwargs` replaced; a
        TypeError names any keyword WatchConfig does not have and the closest field."""
        problem = unknown_fields(kwargs)
        if problem:
            raise TypeError(f"{problem}; valid options: {sorted(FIELD_NAMES)}")
        if base is None:
            return cls(**kwargs)
        if not isinstance(base, cls):
            raise TypeError(f"config must be a flashwatch.WatchConfig, got {base!r}; pass "
                            f"config=WatchConfig(...) or its fields as keywords")
        return dataclasses.replace(base, **kwargs) if kwargs else base


FIELD_NAMES = tuple(f.name for f in fields(WatchConfig))


def unknown_fields(names, extra=()) -> str | None:
    """None when every name is a WatchConfig field (or in `extra`), else "unknown
    option(s) [...]" with the closest valid name of each, for the caller's TypeError."""
    valid = (*FIELD_NAMES, *extra)
    unknown = sorted(set(names) - set(valid))
    if not unknown:
        return None
    close = {u: difflib.get_close_matches(u, valid, n=1) for u in unknown}
    hints = [repr(c[0]) if len(unknown) == 1 else f"{c[0]!r} for {u!r}"
             for u, c in close.items() if c]
    return f"unknown option(s) {unknown}" + (f" (did you mean {', '.join(hints)}?)"
                                             if hints else "")

