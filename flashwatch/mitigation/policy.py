"""Mitigation policy (docs/design.md §6): per head, STANDARD → BETA → FP32_O, never down. Two
hazards, two fixes.

(a) The δ error is a large share of the W^Q gradient: `share` (delta_error_share) ≥
    delta_share_threshold on delta_share_steps consecutive monitored steps → FP32_O
    directly, from STANDARD or BETA, no tie gate, no min_history (reason "[delta_share]").
    A step counts only where the head's W^Q gradient is a signal (docs/design.md §6):
    ‖dW^Q‖ ≥ delta_share_min_grad_layer × its layer's median head and ≥
    delta_share_min_grad_peak × its own running peak (the largest ‖dW^Q‖ seen, decaying
    by GRAD_PEAK_DECAY per monitored step). A share > 1 (the estimated error exceeds the
    gradient itself) is clamped to 1 for the rule and named in the reason; the report
    keeps the raw number. Without gradient norms (offline replays) every step counts.
(b) The δ error persists in sign, or W^Q grows abnormally, while ties are elevated. A
    head is *flagged* for it on a monitored step when
      its window holds ≥ min_history steps, and
      tie_ratio ≥ tie_ratio_threshold, and
      ( drift:  delta_drift_z ≥ drift_z_threshold and delta_coherence ≥ coherence_threshold
        or growth: spectral_growth ≥ spectral_growth_threshold and
                   spectral_growth ≥ spectral_growth_factor × median spectral_growth and
                   max logit ≥ growth_min_logit ).
    The median is over the finite spectral_growth of all heads given to the policy (the
    lower middle value for an even count), so growth shared by most heads (warmup, a
    learning-rate change) flags nobody; the logit floor (c) keeps ordinary early growth,
    at small logits, from flagging anybody (reason "[drift]", "[wq_growth]").
    After `patience` consecutive flagged steps: BETA where BETA is safe, i.e. its shift
    lies at most beta_max_excess nats above the row max ((β − 1)·max logit, see
    `beta_excess`; at most 20 on backend="paper", see `beta_limit`); FP32_O where it is
    not or the max logit is NaN (BETA's unguarded paper form shrinks tied rows' O from
    ≈ 23.7 nats and zeroes them from ≈ 88; the fused kernels guard at 60).
NaN in any input makes its comparison False, so NaN never flags.

State machine per head (the same in "advise" and "auto"):
  STANDARD  flagged for `patience` steps → BETA (or FP32_O, above); rule (a) → FP32_O.
  BETA      counts monitored steps since the switch; once ≥ verify_steps, `patience`
            consecutive steps whose drift persists (z and coherence over threshold, ties
            not required: BETA does not remove ties, it removes their bias) → FP32_O
            ("[drift_persists]"). If the drift decayed, the head stays in BETA (and may
            still escalate later if the drift comes back). A max logit beyond the BETA
            limit → FP32_O at once ("[beta_unsafe]"); rule (a) → FP32_O.
  FP32_O    final.
Modes only go up, so there is no flapping. Every event's reason starts with the rule
in brackets and gives the numbers that decided it.

mitigation "off": flags are still reported; recommended = applied modes; no events.
"advise": the state machine runs on a recommended mode per head (never below the
applied one); events have applied=False; applied modes are returned unchanged and no
window is reset (nothing changed in training, so the window keeps describing the same
regime, and a drift that persists leads to an FP32_O recommendation after verify_steps).
"auto": the state machine runs on the applied modes passed in; a change is applied from
the next step, its event has applied=True and `reset_window` asks the signals to empty
that head's window, so verification sees post-switch steps only.
A mode changed outside the policy (a user's choice, advice followed by hand) restarts
that head's patience and verification counters.

All inputs are the rank-reduced numbers, so every rank reaches the same decisions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from flashwatch._checks import check_int
from flashwatch.config import WatchConfig
from flashwatch.kernels.common import Mode
from flashwatch.report.records import Event
from flashwatch.signals.drift import SignalValues

STANDARD, BETA, FP32_O = int(Mode.STANDARD), int(Mode.BETA), int(Mode.FP32_O)

# The running peak of a head's ‖dW^Q‖ forgets its past by this factor per monitored step
# (halved after ≈ 700), so the large gradients of the first steps do not gate a long run.
GRAD_PEAK_DECAY = 0.999


# backend="paper" runs the authors' unguarded rule, whose block sum is floored at 1e-10:
# a tied row (two maxima) shifted x nats above its max sums to 2e^-x, under the floor
# from x ≈ 23.7, and its O then shrinks by 2e^-x / 1e-10 (≈ 0.002 at 30 nats).
# 20 nats keeps such rows off the floor.
PAPER_BETA_MAX_EXCESS = 20.0


def beta_limit(config: WatchConfig) -> float:
    """Largest BETA shift above the row max (nats) the policy accepts on config's backend."""
    if config.backend == "paper":
        return min(config.beta_max_excess, PAPER_BETA_MAX_EXCESS)
    return config.beta_max_excess


def beta_excess(max_logit: np.ndarray, beta: float) -> np.ndarray:
    """Nats by which BETA's shift lies above a row max r_m: (β − 1)·r_m for r_m > 0,
    −r_m otherwise (the shift is 0 there). NaN stays NaN."""
    with np.errstate(invalid="ignore"):
        return np.where(max_logit > 0, (beta - 1) * max_logit, -max_logit)


@dataclass
class Decision:
    modes: torch.Tensor  # int64 [n]: applied modes from the next step
    recommended: torch.Tensor  # int64 [n]: the state machine's mode (= modes in "auto")
    flagged: torch.Tensor  # bool [n]
    events: list[Event]
    reset_window: torch.Tensor  # bool [n]: empty these heads' signal windows now


@dataclass
class _Inputs:
    """`Policy.decide`'s per-head inputs as numpy [n] (float64; NaN never flags)."""
    tie: np.ndarray  # tie_ratio
    z: np.ndarray  # delta_drift_z
    coh: np.ndarray  # delta_coherence
    growth: np.ndarray  # spectral_growth
    fill: np.ndarray  # window_fill
    logit: np.ndarray | None  # max scaled score; None: not known
    share: np.ndarray | None  # delta_error_share; None: not measured
    grad: np.ndarray | None  # ‖dW^Q‖ (sqrt of wq_grad_sq); None: not known
    applied: np.ndarray  # int64: the modes in force this step


@dataclass
class _Flags:
    """What the rules read from one step's numbers, bool [n] per head unless noted."""
    ready: np.ndarray  # the window holds min_history steps
    drift: np.ndarray  # drift z and coherence over their thresholds
    spectral: np.ndarray  # W^Q growth over threshold, factor × median and logit floor
    median: float  # median finite spectral_growth over all heads (NaN: none)
    hazard: np.ndarray  # rule (b): ready, ties and (drift or spectral)
    share_high: np.ndarray  # rule (a): δ-error share over its threshold, gradient a signal
    flagged: np.ndarray  # hazard or share_high
    excess: np.ndarray  # float64: nats BETA's shift would sit above the row max
    beta_safe: np.ndarray  # excess within beta_limit (NaN: not safe)


@dataclass
class _Moves:
    """One step of the state machine, before it is kept: int64 [n] modes and counters,
    bool [n] rules."""
    cur: np.ndarray  # the mode each head is in ("advise": the recommendation)
    target: np.ndarray  # the mode each head goes to
    rule_unsafe: np.ndarray  # BETA outgrown: FP32_O now
    rule_share: np.ndarray  # rule (a): FP32_O
    streak: np.ndarray  # consecutive qualifying steps, this one counted
    since_switch: np.ndarray  # monitored steps in the current mode, this one counted
    share_streak: np.ndarray  # consecutive large-share steps, this one counted

    @property
    def go(self) -> np.ndarray:
        return self.target != self.cur


def _grad_ok(cfg: WatchConfig, grad: np.ndarray | None, peak: np.ndarray,
             layers: list[np.ndarray]) -> np.ndarray:
    """‖dW^Q‖ ≥ delta_share_min_grad_layer × the layer's median head and ≥
    delta_share_min_grad_peak × the head's running peak (True where not known)."""
    if grad is None:
        return np.ones(peak.size, dtype=bool)
    floor = cfg.delta_share_min_grad_peak * peak
    for idx in layers:
        g = grad[idx]
        g = g[np.isfinite(g)]
        if g.size:
            floor[idx] = np.maximum(floor[idx], cfg.delta_share_min_grad_layer * _median(g))
    with np.errstate(invalid="ignore"):
        return grad >= floor  # NaN: False


def _flags(cfg: WatchConfig, x: _Inputs, grad_ok: np.ndarray | None = None) -> _Flags:
    """The rules' conditions (module docstring), evaluated on one step's inputs; grad_ok:
    `_grad_ok` (None: every gradient counts as meaningful)."""
    n = x.tie.size
    grad_ok = np.ones(n, dtype=bool) if grad_ok is None else grad_ok
    with np.errstate(invalid="ignore"):  # comparisons with NaN are False: never flag
        ready = x.fill >= cfg.min_history
        ties = x.tie >= cfg.tie_ratio_threshold
        drift = (x.z >= cfg.drift_z_threshold) & (x.coh >= cfg.coherence_threshold)
        finite_growth = x.growth[np.isfinite(x.growth)]
        median = _median(finite_growth) if finite_growth.size else math.nan
        spectral = (x.growth >= cfg.spectral_growth_threshold) & (
            x.growth >= cfg.spectral_growth_factor * median)
        if x.logit is not None:  # rule (c): ordinary growth at small logits is no hazard
            spectral &= x.logit >= cfg.growth_min_logit
        hazard = ready & ties & (drift | spectral)
        # a share > 1 counts as 1: over every threshold (≤ 1) either way
        share_high = np.zeros(n, dtype=bool) if x.share is None else (
            grad_ok & (np.minimum(x.share, 1.0) >= cfg.delta_share_threshold))
        excess = np.zeros(n) if x.logit is None else beta_excess(x.logit, cfg.beta)
        beta_safe = excess <= beta_limit(cfg)  # NaN (no logit measured): not safe
    return _Flags(ready=ready, drift=drift, spectral=spectral, median=median, hazard=hazard,
                  share_high=share_high, flagged=hazard | share_high, excess=excess,
                  beta_safe=beta_safe)


def _median(x: np.ndarray) -> float:
    """torch.median's: the lower of the two middle values (not their mean)."""
    return float(np.partition(x, (x.size - 1) // 2)[(x.size - 1) // 2])


def _g(x) -> str:
    """Numbers in reasons: 3 significant digits, readable in logs."""
    return f"{float(x):.3g}"


class Policy:
    """Decides per-head modes from `SignalValues` and tie ratios, one monitored step at a time."""

    def __init__(self, config: WatchConfig, heads: list[tuple[str, int]]) -> None:
        if not isinstance(config, WatchConfig):
            raise TypeError(f"config must be a flashwatch.WatchConfig, got "
                            f"{type(config).__name__}")
        if not isinstance(heads, (list, tuple)) or not heads or not all(
            isinstance(h, tuple) and len(h) == 2 and isinstance(h[0], str)
            and isinstance(h[1], int) for h in heads
        ):
            raise TypeError("heads must be a non-empty list of (layer name, head index) tuples, "
                            "e.g. [('transformer.h.0.attn', 0), ...]")
        if config.min_history > config.window:
            raise ValueError(
                f"min_history={config.min_history} exceeds window={config.window}: the window "
                f"never holds that many steps, so no decision could ever be made; lower "
                f"min_history or raise window"
            )
        self.config = config
        self.heads = list(heads)
        n = len(self.heads)
        self.recommended = torch.zeros(n, dtype=torch.int64)  # state-machine mode per head
        self.streak = torch.zeros(n, dtype=torch.int64)  # consecutive qualifying steps
        self.since_switch = torch.zeros(n, dtype=torch.int64)  # monitored steps in this mode
        self.share_streak = torch.zeros(n, dtype=torch.int64)  # consecutive large-share steps
        self.grad_peak = torch.zeros(n, dtype=torch.float64)  # running peak of ‖dW^Q‖
        names = [layer for layer, _ in self.heads]
        self._layers = [np.flatnonzero(np.array([m == name for m in names]))
                        for name in dict.fromkeys(names)]

    @property
    def n_heads(self) -> int:
        return len(self.heads)

    def decide(self, step: int, tie_ratio: torch.Tensor, values: SignalValues,
               modes: torch.Tensor, *, max_logit: torch.Tensor | None = None,
               share: torch.Tensor | None = None,
               grad_sq: torch.Tensor | None = None) -> Decision:
        """One monitored step. max_logit [n]: the heads' max scaled score (None: not
        known, then BETA counts as safe and the growth rule has no logit floor: for
        offline replays of old logs). share [n]: delta_error_share (None: not measured,
        rule (a) stays off). grad_sq [n]: each head's ‖dW^Q‖² (None: not known, then
        only the share's bound of 1 decides whether it is a measurement)."""
        check_int("step", step, hint="the optimizer step")
        x = self._inputs(tie_ratio, values, modes, max_logit, share, grad_sq)
        peak = self.grad_peak.numpy() * GRAD_PEAK_DECAY
        if x.grad is not None:
            peak = np.fmax(peak, x.grad)  # NaN (no gradient) keeps the decayed peak
        flags = _flags(self.config, x, _grad_ok(self.config, x.grad, peak, self._layers))
        self.grad_peak = torch.from_numpy(peak)
        t = torch.from_numpy
        no_reset = np.zeros(self.n_heads, dtype=bool)
        if self.config.mitigation == "off":
            return Decision(t(x.applied), t(x.applied.copy()), t(flags.flagged), [],
                            t(no_reset))
        auto = self.config.mitigation == "auto"
        moves = self._moves(x, flags, auto)
        go = moves.go
        events = [self._event(step, i, x, flags, moves, auto)
                  for i in np.flatnonzero(go).tolist()]
        moves.streak[go] = 0
        moves.since_switch[go] = 0
        self.recommended = t(moves.target.copy())
        self.streak, self.since_switch = t(moves.streak), t(moves.since_switch)
        self.share_streak = t(moves.share_streak)
        if auto:
            return Decision(t(moves.target.copy()), t(moves.target.copy()), t(flags.flagged),
                            events, t(go))
        return Decision(t(x.applied), t(moves.target.copy()), t(flags.flagged), events,
                        t(no_reset))

    def _inputs(self, tie_ratio: torch.Tensor, values: SignalValues, modes: torch.Tensor,
                max_logit: torch.Tensor | None, share: torch.Tensor | None,
                grad_sq: torch.Tensor | None = None) -> _Inputs:
        """decide()'s arguments checked and as numpy: ≈ 1 µs an op on [n] arrays against
        ≈ 5 µs for torch's on the CPU."""
        n = self.n_heads
        tie = self._vec("tie_ratio", tie_ratio)
        z = self._vec("values.delta_drift_z", values.delta_drift_z)
        coh = self._vec("values.delta_coherence", values.delta_coherence)
        growth = self._vec("values.spectral_growth", values.spectral_growth)
        fill = self._vec("values.window_fill", values.window_fill)
        logit = None if max_logit is None else self._vec("max_logit", max_logit)
        share = None if share is None else self._vec("share", share)
        grad = None if grad_sq is None else np.sqrt(self._vec("grad_sq", grad_sq))
        if not isinstance(modes, torch.Tensor) or tuple(modes.shape) != (n,) or (
                modes.dtype.is_floating_point or modes.dtype == torch.bool):
            raise TypeError(f"modes must be an int tensor [{n}] of flashwatch.Mode values, got "
                            f"{getattr(modes, 'dtype', type(modes).__name__)} "
                            f"{list(getattr(modes, 'shape', []))}")
        applied = modes.detach().to("cpu", torch.int64).numpy().copy()
        if ((applied < STANDARD) | (applied > FP32_O)).any():
            raise ValueError(f"modes must hold flashwatch.Mode values 0..2, got {applied.tolist()}")
        return _Inputs(tie=tie, z=z, coh=coh, growth=growth, fill=fill, logit=logit,
                       share=share, grad=grad, applied=applied)

    def _moves(self, x: _Inputs, flags: _Flags, auto: bool) -> _Moves:
        """Where each head goes this step (module docstring's state machine)."""
        cfg = self.config
        # In "auto" the applied modes are the truth; in "advise" the recommendation never
        # sits below what is applied. A mode changed outside the policy (a user's choice,
        # advice followed by hand) restarts that head's counters.
        streak, since_switch = self.streak.numpy().copy(), self.since_switch.numpy().copy()
        cur = x.applied if auto else np.maximum(self.recommended.numpy(), x.applied)
        external = cur != self.recommended.numpy()
        streak[external] = 0
        since_switch[external] = 0
        since_switch += 1  # this step is one more monitored step in the current mode
        share_streak = np.where(flags.share_high, self.share_streak.numpy() + 1, 0)

        # What moves a head up from its current mode this step.
        qualifies = (cur == STANDARD) & flags.hazard
        in_beta = cur == BETA
        if not auto:  # advice escalates only once BETA was really applied (by the user)
            in_beta &= x.applied == BETA
        verify = in_beta & flags.ready & flags.drift
        qualifies = np.where(in_beta, verify, qualifies)
        streak = np.where(qualifies, streak + 1, 0)
        rule_flag = (streak >= cfg.patience) & (
            ~in_beta | (since_switch >= cfg.verify_steps)) & (cur != FP32_O)
        # (b) BETA only where its shift stays inside the guard; a BETA head whose logits
        # outgrew it goes to FP32_O now (the paper's unguarded rule zeroes rows there).
        rule_unsafe = (cur == BETA) & ~flags.beta_safe & (x.logit is not None)
        # (a) a large δ-error share goes to FP32_O directly, whatever the ties.
        rule_share = (share_streak >= cfg.delta_share_steps) & (cur != FP32_O)
        target = np.where(rule_flag, cur + 1, cur)
        target = np.where(rule_flag & (cur == STANDARD) & ~flags.beta_safe, FP32_O, target)
        target = np.where(rule_unsafe | rule_share, FP32_O, target)
        return _Moves(cur=cur, target=target, rule_unsafe=rule_unsafe, rule_share=rule_share,
                      streak=streak, since_switch=since_switch, share_streak=share_streak)

    def _event(self, step: int, i: int, x: _Inputs, flags: _Flags, moves: _Moves,
               auto: bool) -> Event:
        """Head i's mode change, with the rule that moved it and its numbers."""
        cfg = self.config
        frm, to = Mode(int(moves.cur[i])), Mode(int(moves.target[i]))
        if moves.rule_share[i]:
            reason = (f"[delta_share] δ-error share of the W^Q gradient {_g(x.share[i])} ≥ "
                      f"{_g(cfg.delta_share_threshold)} for {cfg.delta_share_steps} "
                      f"monitored steps")
            if x.share[i] > 1:
                reason += " (> 1: the estimated error exceeds the gradient; counted as 1)"
            if x.grad is not None:
                reason += (f", ‖dW^Q‖ {_g(x.grad[i])} above its floors (layer median × "
                           f"{_g(cfg.delta_share_min_grad_layer)}, running peak × "
                           f"{_g(cfg.delta_share_min_grad_peak)})")
        elif moves.rule_unsafe[i]:
            reason = "[beta_unsafe] " + self._unsafe_text(i, x.logit, flags.excess)
        else:
            reason = self._reason(i, frm, x, flags, moves.since_switch)
            if to == Mode.FP32_O and frm == Mode.STANDARD:
                reason += "; " + self._unsafe_text(i, x.logit, flags.excess)
        layer, head = self.heads[i]
        return Event(step=step, layer=layer, head=head, from_mode=frm, to_mode=to,
                     reason=reason, applied=auto)

    def _unsafe_text(self, i, logit, excess) -> str:
        cfg = self.config
        return (f"BETA unsafe at max logit {_g(logit[i])}: its shift would sit {_g(excess[i])} "
                f"nats above the row max ((β−1)·max logit, β {_g(cfg.beta)}), over "
                f"the BETA limit {_g(beta_limit(cfg))} (beta_max_excess, backend {cfg.backend}); "
                "FP32_O instead")

    def restart(self, mask: torch.Tensor) -> None:
        """Restart the patience and verification counters of the masked heads (their mode
        was changed by hand): verification then measures only what came after."""
        mask = mask.to("cpu", torch.bool)
        self.streak[mask] = 0
        self.since_switch[mask] = 0

    def _reason(self, i: int, frm: Mode, x: _Inputs, flags: _Flags,
                since_switch: np.ndarray) -> str:
        cfg = self.config
        drift_text = (f"drift z {_g(x.z[i])} ≥ {_g(cfg.drift_z_threshold)}, coherence "
                      f"{_g(x.coh[i])} ≥ {_g(cfg.coherence_threshold)}")
        for_steps = f"for {cfg.patience} monitored step{'s' * (cfg.patience != 1)}"
        if frm == Mode.BETA:
            return (f"[drift_persists] drift persists {int(since_switch[i])} monitored "
                    f"steps after the switch to BETA (verify_steps {cfg.verify_steps}): "
                    f"{drift_text} {for_steps}")
        rules = [name for name, hit in (("drift", flags.drift[i]),
                                        ("wq_growth", flags.spectral[i])) if hit]
        parts = [f"tie ratio {_g(x.tie[i])} ≥ {_g(cfg.tie_ratio_threshold)}"]
        if flags.drift[i]:
            parts.append(drift_text)
        if flags.spectral[i]:
            floor = "" if x.logit is None else (f", max logit {_g(x.logit[i])} ≥ "
                                                f"{_g(cfg.growth_min_logit)}")
            parts.append(f"W^Q spectral growth {_g(x.growth[i])} ≥ "
                         f"{_g(cfg.spectral_growth_threshold)} and ≥ "
                         f"{_g(cfg.spectral_growth_factor)} × median {_g(flags.median)}{floor}")
        return f"[{'+'.join(rules)}] " + ", ".join(parts) + f" {for_steps}"

    def _vec(self, name: str, t) -> np.ndarray:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor [{self.n_heads}], got "
                            f"{type(t).__name__}")
        if tuple(t.shape) != (self.n_heads,):
            raise ValueError(f"{name} must have shape [{self.n_heads}] (one entry per head in "
                             f"`heads`), got {list(t.shape)}")
        return t.detach().to("cpu", torch.float64).numpy()

    def state_dict(self) -> dict:
        return {"heads": list(self.heads), "recommended": self.recommended.clone(),
                "streak": self.streak.clone(), "since_switch": self.since_switch.clone(),
                "share_streak": self.share_streak.clone(), "grad_peak": self.grad_peak.clone()}

    def load_state_dict(self, sd: dict) -> None:
        heads = [tuple(h) for h in sd.get("heads", [])]
        if heads != self.heads:
            raise ValueError(
                f"state is for {len(heads)} heads {heads[:3]}… but this policy watches "
                f"{self.n_heads} heads {self.heads[:3]}…; build Policy with the saved run's heads"
            )
        names = ("recommended", "streak", "since_switch", "share_streak")
        for name in names if "share_streak" in sd else names[:3]:  # states before v2
            t = sd.get(name)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (self.n_heads,):
                raise ValueError(f"state entry {name!r} must be an int64 tensor "
                                 f"[{self.n_heads}], got {t!r:.80}")
            setattr(self, name, t.detach().to("cpu", torch.int64).clone())
        peak = sd.get("grad_peak")  # states before issue 37: no peak yet (0: no floor)
        if peak is not None:
            if not isinstance(peak, torch.Tensor) or tuple(peak.shape) != (self.n_heads,):
                raise ValueError(f"state entry 'grad_peak' must be a float64 tensor "
                                 f"[{self.n_heads}], got {peak!r:.80}")
            self.grad_peak = peak.detach().to("cpu", torch.float64).clone()
