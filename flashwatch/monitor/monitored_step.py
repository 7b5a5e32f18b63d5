"""The monitored step: from the layers' buffers to a StepReport, the same on every rank.

    run(step)
      1. judge modes      which layers' modes ran since the last report (local facts)
      2. buffers          the layers' StepBuffers and the probe totals (monitor/capture.py)
      3. W^Q norms        plain ones locally; sharded ones by a fault-symmetric collective
      4. one move         every device tensor to the host in one copy (aggregate.to_host)
      5. exchange         one SUM and one MAX on the monitor's own group, issued whatever
                          failed locally (flashwatch/parallel/reduce.py)
      6. finish           named per-head arrays, identical on every rank (aggregate.finish)
      7. decide           signals → policy → QK-clip plan
      8. vote             one MAX all_reduce: a rank that failed, or holds other modes,
                          makes every rank take the lowest healthy rank's state
      9. QK-clip, report  weights change only where every rank agreed

A failure at any stage is counted on the rank where it happened; the collectives of
steps 3, 5 and 8 are issued on every rank in the same order and shapes regardless.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import numpy as np
import torch

from flashwatch.config import WatchConfig
from flashwatch.kernels.common import Mode
from flashwatch.mitigation.policy import Decision, Policy
from flashwatch.mitigation.qkclip import QKClip
from flashwatch.monitor import aggregate, clipping, samples
from flashwatch.monitor.agreement import Agreement
from flashwatch.monitor.capture import Recorder
from flashwatch.monitor.head_modes import HeadModes
from flashwatch.monitor.layer_state import LayerState
from flashwatch.monitor.ledger import ErrorLedger
from flashwatch.parallel import layout, reduce
from flashwatch.parallel.layout import HeadTable
from flashwatch.parallel.power import NotNarrowed, RemoteFailure, spectral_norms
from flashwatch.report import metrics
from flashwatch.report.records import HeadRecord, StepReport
from flashwatch.signals.drift import HeadSignals, SignalValues

# The signals a report carries: SignalValues' fields that are rows of the metrics table
# (spectral_growth and window_fill feed the policy only).
SIGNAL_COLUMNS = tuple(f.name for f in dataclasses.fields(SignalValues)
                       if f.name in metrics.BY_NAME)

# Stop the warm-started power iteration of a sharded W^Q (FSDP2; whole weights use the
# Gram matrix, flashwatch/signals/spectral.py) once σ changes by less than this between
# iterations: its growth rule acts on changes of 20 %, and 1e-6 took 16 iterations a
# layer against ≈ 7 on the benchmark GPT for digits no rule reads (error against
# matrix_norm stays < 1e-3: tests/parallel/test_distributed.py).
SPECTRAL_TOL = 1e-5


@dataclasses.dataclass(frozen=True, eq=False)
class Decided:
    """What a monitored step decided, after the vote (`StepPipeline._decide_together`)."""

    decision: Decision | None  # None: nothing decided here, or the vote overrode it
    values: SignalValues | None  # None: signals not updated this step
    arrays: aggregate.HeadArrays | None  # the reduced per-head numbers, None: none
    clips: list  # QK-clip events of this step


class StepPipeline:
    """A watcher's monitored-step machinery and its decision state (signals, policy,
    QK-clip, events), which the Watcher saves and restores."""

    def __init__(self, config: WatchConfig, states: list[LayerState], recorder: Recorder,
                 ledger: ErrorLedger, monitor: reduce.MonitorGroup, set_modes,
                 table: HeadTable | None = None) -> None:
        self.config, self.states, self.recorder = config, states, recorder
        self.ledger, self.monitor, self._set_local = ledger, monitor, set_modes
        # Every global head of the job by (layer name, head), the same on every rank; this
        # rank's layers sit at their offsets in it (flashwatch/parallel/layout.py).
        self.table = table or layout.build([[(st.site.name, st.site.num_heads)
                                             for st in states]])
        self.heads = self.table.keys
        n = len(self.heads)
        # every head's modes and pending mode events (flashwatch/monitor/head_modes.py)
        self.book = HeadModes(self.heads, states, set_modes, ledger)
        self.positions, self.held = self.book.positions, self.book.held
        self.signals = HeadSignals(n, config.sketch_dim, config.window)
        self.policy = Policy(config, self.heads)
        self.qk_clip = QKClip(config, [st.site for st in states],
                              offsets=[st.offset for st in states], n_heads=n,
                              layers=clipping.clip_layers(self.table))
        self.buffers = reduce.Buffers(aggregate.shapes(n, config.sketch_dim))
        self.agreement = Agreement(monitor, ledger, self.buffers)
        self.events: list = []  # every mode change and QK-clip since the start
        self.realign_to: int | None = None  # step count the ranks agreed on, if moved

    def narrow(self, st: LayerState, site) -> None:
        """One of this rank's layers, watched whole, split by tensor parallelism after
        attach (`site`: its part on this rank): its state, the heads this rank holds
        and QK-clip's rows follow. The head table, keyed by global heads, is unchanged;
        the replica counts travel in every exchange (aggregate.HOLDERS)."""
        i = next(j for j, s in enumerate(self.states) if s is st)
        offset = self.table.offset(site.name, site.head_offset)
        # everything made first (any of it may raise), then assigned: all or nothing
        fields = st.narrowed(site, offset)
        positions, held = self.book.layout({id(st): fields["heads"]})
        norm = self.qk_clip.site_norm(site)
        st.narrow(fields)
        self.book.positions, self.book.held = self.positions, self.held = positions, held
        self.qk_clip.replace_site(i, site, offset, norm)

    @property
    def unreported(self) -> list:
        """Mode events not yet in a StepReport (set by hand here or learnt)."""
        return self.book.unreported

    @unreported.setter
    def unreported(self, events: list) -> None:
        self.book.unreported = events

    def user_change(self, st: LayerState, new: torch.Tensor, step: int) -> None:
        """Modes set by hand (Watcher.set_head_modes): an event per changed head, out
        with the next report and applied once a report sees it run; those heads' signals
        and policy judge the new mode on what comes after it only."""
        events, changed = self.book.user_change(st, new, step)
        self.events += events
        if changed.any():  # other ranks restart these heads at the exchange
            self.signals.reset_window(changed)
            self.policy.restart(changed)

    def global_modes(self) -> torch.Tensor:
        return self.book.global_modes()

    def run(self, step: int) -> StepReport:
        """A monitored step's report, as a fixed schedule of collectives that every rank
        runs to the end whatever raised on it (flashwatch/parallel/reduce.py):

            local    judge modes, buffers, W^Q norms (sharded: collectives of their own,
                     fault-symmetric), one move to the host        each stage guarded
            EXCHANGE one SUM + one MAX                 always: a failed rank sends fills
                                                       and, if it can, its mode fields
            local    modes of other ranks, finish, decide          each stage guarded
            VOTE     one MAX                           always: a failed rank says so
            HEAL     one broadcast                     iff the vote (read with numpy, the
                                                       same on every rank) disagreed
            local    QK-clip, the report

        Between two collectives nothing of torch decides what comes next: the exchange
        and the vote fill and read numpy buffers (reduce.Buffers). Only a broken group
        (a collective that raised: a rank that never came) stops the schedule."""
        not_applied = self._local("judge modes", self.book.judge, {})
        parts = self._local("step totals", self._step_buffers, None)
        sigma = self._spectral()  # every rank: sharded W^Q norms are collectives
        local = measured = None
        if parts is not None:
            measured = self._local("step totals", lambda: self._contribution(*parts, sigma),
                                   None)
        # the mode fields go out even where the measurement failed (a hand-set mode must
        # reach the other ranks before a heal could undo it)
        modes = self._local("modes", lambda: self.book.fields(not_applied), None)
        if modes is not None:
            local = measured if measured is not None else self._local(
                "step totals", lambda: aggregate.fills(len(self.heads), self.config.sketch_dim),
                None)
            if local is not None:
                local.update(modes)
        # a layer this rank failed to narrow (tensor parallelism): its heads miss here
        unsplit = any(st.buf.split_failed for st in self.states)
        self._local("step totals", self.recorder.clear_step, None)
        red = self._exchange(local, step, failed=measured is None or unsplit)
        ran, elsewhere = self._local("modes of other ranks", lambda: self._learn(
            red, not_applied, step), (None, {}))
        decided = self._decide_together(step, red)
        if decided.arrays is None:
            raise RuntimeError(f"no numbers to report at step {step}: "
                               f"{self.monitor.broken or 'see the errors logged above'}")
        return self._report(step, decided, ran, {**not_applied, **elsewhere},
                            self.book.withdrawn)

    def _learn(self, red, not_applied: dict, step: int) -> tuple[torch.Tensor, dict]:
        """The exchange's mode fields (head_modes.HeadModes.learn): the modes each head
        ran and the layers held elsewhere whose modes did not run; hand-set modes of
        other ranks logged, and every hand-set head's signals and policy restarted."""
        ran, told, events, elsewhere = self.book.learn(
            None if red is None else red.maxes, not_applied, step)
        self.events += events
        if told.any():  # set by hand anywhere: judged on what follows only
            self.signals.reset_window(told)
            self.policy.restart(told)
        return ran, elsewhere

    def _local(self, stage: str, fn, failed):
        """A local stage of the schedule: its result, or `failed` with the error counted
        (log once, flashwatch_monitor_errors_total)."""
        try:
            return fn()
        except Exception as e:
            self.ledger.error(stage, e)
            return failed

    def _contribution(self, layers, totals, sigma) -> dict[str, torch.Tensor]:
        return aggregate.contribution(aggregate.place(
            aggregate.to_host(aggregate.gather(layers, totals, sigma)),
            self.positions, len(self.heads)))

    def _step_buffers(self) -> tuple[list, dict]:
        """The layers' buffers and the probe totals of every call not reduced yet, where
        they were accumulated (flashwatch/monitor/samples.py, flashwatch/monitor/aggregate.py)."""
        rest = [smp for st in self.states for smp in st.buf.samples]
        device = (self.recorder.totals["G"].device if self.recorder.totals is not None
                  else rest[0].o32.device if rest else "cpu")
        tot = samples.totals(rest, len(self.heads), self.config.sketch_dim, self.recorder.totals,
                           device=device)
        layers = [aggregate.LayerBuffers(
            num_heads=st.site.num_heads,
            tied_rows=st.buf.stats.tied_rows, rows=st.buf.stats.rows,
            guarded_rows=st.buf.stats.guarded_rows, max_logit=st.buf.stats.max_logit,
            wq_grad_sq=st.buf.wq_grad_sq, grad_rows=st.buf.grad_rows,
            delta_rows=st.buf.delta_rows, delta_missed=st.buf.delta_missed,
            share_rows=st.buf.share_rows, sampled=st.buf.sampled,
            averaged=st.buf.wq_grad_averaged, divisor=st.buf.wq_grad_divisor,
            refused=st.wq_refused is not None)
            for st in self.states]
        return layers, tot

    def _spectral(self) -> list:
        """Each layer's W^Q spectral norms [H] where they are computed (NaN: failed).
        Plain W^Q from their Gram matrices, same-shape ones batched over layers; sharded
        (DTensor) ones by the fault-symmetric sharded power iteration, on every rank."""
        cfg = self.config
        try:  # no torch call of ours before it: its collectives are issued on every rank
            norms = spectral_norms([st.site for st in self.states],
                                   [st.power_v for st in self.states], cfg.power_iters,
                                   monitor=self.monitor, max_iters=cfg.power_max_iters,
                                   tol=SPECTRAL_TOL)
        except Exception as e:
            self.ledger.error("spectral norms", e)
            norms = [e] * len(self.states)
        out = []
        for st, got in zip(self.states, norms, strict=True):
            if isinstance(got, Exception):
                if not isinstance(got, RemoteFailure | NotNarrowed):  # counted where it happened
                    self.ledger.error(f"spectral norm {st.site.name}", got)
                out.append(torch.full((st.site.num_heads,), math.nan, dtype=torch.float64))
                continue
            s, st.power_v = got
            out.append(s)
        return out

    def _exchange(self, local: dict | None, step: int, failed: bool = False):
        """reduce.exchange on the monitor's group, or None once the group is broken.
        Ranks at different step counts are told so (every rank: it is in the reduced
        numbers) and realigned to the highest."""
        monitor = self.monitor if self.monitor.distributed else None
        if monitor is not None and monitor.broken is not None:
            return None
        try:
            red = reduce.exchange(monitor, local, local, self.buffers.shapes, step=step,
                                  buffers=self.buffers, failed=failed)
        except Exception as e:
            self.ledger.error("cross-rank reduction", e)
            return None
        if red.local_error is not None:
            self.ledger.error("cross-rank reduction", red.local_error)
        if not red.in_step:
            self.ledger.error("step alignment", RuntimeError(
                f"ranks reached different monitored steps (lowest step count "
                f"{red.steps[0]}, highest {red.steps[1]}; this rank {step}): every rank must "
                f"call watcher.step() once per optimizer step and load the same watcher "
                f"state; decisions are skipped and step counts realigned to "
                f"{red.steps[1]}"))
            self.realign_to = red.steps[1] + 1  # the Watcher moves its count there
        elif red.failed_ranks and local is not None:
            self.ledger.warn_once("remote", f"flashwatch: {red.failed_ranks} rank(s) failed "
                              f"to measure step {step}; its numbers miss their rows and "
                              f"no mode changes are decided from it")
        return red

    def _decide_together(self, step: int, red) -> Decided:
        """finish → signals → policy → QK-clip plan, each rank applies its decision,
        then the vote that every rank issues: if any rank failed (or now holds other
        modes), every rank takes the state of the lowest rank that did not fail, so
        modes stay identical everywhere."""
        decision = values = arrays = None
        failed, clip_plan = red is None, None
        try:
            if red is not None:
                arrays = aggregate.finish(red.sums, red.maxes, red.sums[aggregate.HOLDERS])
                if red.in_step and not red.failed_ranks:
                    values, decision = self._decide(step, arrays)
                    clip_plan = clipping.plan(self.config, arrays)
        except Exception as e:
            self.ledger.error("decide", e)
            failed, decision = True, None
        if decision is not None:  # applied before the vote: the vote sees what runs
            failed |= self._local("apply decision", lambda: self._set_decided(decision),
                                  True) is True
        mode_hash = self._local("vote", self._mode_hash, None)
        agreed = self.agreement.vote(failed or mode_hash is None, mode_hash or 0.0)
        if not agreed and not self.agreement.is_source:
            decision = None  # this rank takes the source rank's state instead
        if decision is not None:
            self.events.extend(decision.events)
        if not agreed:
            clip_plan = None  # weights change only where every rank agreed
            self.agreement.heal(self._state, self._adopt)
        if decision is not None:  # pending until seen run where the head is held
            self._local("apply decision", lambda: self.book.hold(decision.events), None)
        clips = self._local("qk_clip", lambda: self._clip(step, arrays, clip_plan), [])
        return Decided(decision=decision, values=values, arrays=arrays, clips=clips)

    def _clip(self, step: int, a, max_logit) -> list:
        """QK-clip after the vote, written on every rank or none (monitor/clipping.py)."""
        clips, confirmed = clipping.run(
            self.qk_clip, self.agreement, self.ledger, step, a, max_logit, self.global_modes,
            {st.site.name: st.wq_refused for st in self.states}, self.table)
        self.book.confirmed += confirmed
        self.events.extend(clips)
        return clips

    def _decide(self, step: int, a: aggregate.HeadArrays):
        t = torch.from_numpy
        values = self.signals.update(t(a.G), t(a.sigma), t(a.delta_sum_w), t(a.delta_sq_w),
                                      t(a.share), share_weight=t(a.wq_grad_sq))
        modes = self.global_modes()
        decision = self.policy.decide(step, t(a.tie_ratio), values, modes,
                                       max_logit=t(a.max_logit), share=t(a.share),
                                       grad_sq=t(a.wq_grad_sq))
        return values, decision

    def _mode_hash(self) -> float:
        """What the vote compares: every head's modes and, with QK-clip on, its books
        (a failure on one rank while booking a clip must not leave the ranks deciding
        different clips from then on: the heal sends them too)."""
        h = hashlib.blake2b(self.global_modes().to(torch.int64).numpy().tobytes(),
                            digest_size=8)
        if self.config.qk_clip_threshold is not None:
            h.update(clipping.books_bytes(self.qk_clip))
        return float(int.from_bytes(h.digest(), "little") >> 12)  # 52 bits: exact in a float

    def _state(self) -> dict:
        """What a disagreeing vote's source rank sends (agreement.Agreement.heal)."""
        return dict(signals=self.signals.state_dict(), policy=self.policy.state_dict(),
                    modes=self.global_modes(), qk_clip=self.qk_clip.state_dict())

    def _adopt(self, state: dict) -> None:
        """The source rank's state, the modes first (and again if they fail: they are
        what runs next step); each part counted if it fails."""
        def adopt_modes():  # hand-set here, not exchanged yet: the source cannot know them
            self.book.set_all(state["modes"], keep_hand_set=True)

        if self._local("state broadcast", adopt_modes, False) is False:
            self._local("state broadcast", adopt_modes, None)
        self._local("state broadcast",
                    lambda: self.signals.load_state_dict(state["signals"]), None)
        self._local("state broadcast", lambda: self.policy.load_state_dict(state["policy"]),
                    None)
        self._local("state broadcast",
                    lambda: self.qk_clip.load_state_dict(state["qk_clip"]), None)

    def _set_decided(self, decision) -> None:
        """A decision's modes on this rank's layers (the events are kept after the
        vote)."""
        self.book.set_all(decision.modes)
        if decision.reset_window.any():
            self.signals.reset_window(decision.reset_window)

    def _report(self, step, decided: Decided, ran, not_applied, withdrawn) -> StepReport:
        a, values, decision = decided.arrays, decided.values, decided.decision
        n = len(self.heads)
        nan = np.full(n, np.nan)
        modes = self.global_modes()
        cols = dict(
            tied_rowmax_ratio=a.tie_ratio, attention_max_logit=a.max_logit,
            delta_error_sum=a.delta_sum, delta_error_rows=a.delta_rows,
            delta_error_all_rows=(a.delta_rows > 0) & (a.delta_missed == 0),
            delta_error_share=a.share, wq_grad_norm=np.sqrt(a.wq_grad_sq),
            guarded_rows=a.guarded.astype(np.int64),
            wq_spectral_norm=a.sigma)
        # values None: nothing was decided this step (signals not updated): NaN
        for f in SIGNAL_COLUMNS:
            cols[f] = nan if values is None else getattr(values, f)
        # One tolist() per field, not a tensor index per head and field (5,120 heads:
        # benchmarks/bench_scale.py).
        columns = {k: (v.tolist() if hasattr(v, "tolist") else list(v))
                   for k, v in cols.items()}
        ran = modes if ran is None else torch.where(ran < 0, modes, ran)  # unknown: as set
        recommended = (decision.recommended if decision is not None else modes).tolist()
        flagged = (decision.flagged if decision is not None
                   else torch.zeros(n, dtype=torch.bool)).tolist()
        names = list(columns)
        records = [HeadRecord(layer=layer, head=head, **dict(zip(names, vals, strict=True)),
                              head_mode=Mode(m), recommended_mode=Mode(r), flagged=bool(f))
                   for (layer, head), m, r, f, *vals in zip(
                       self.heads, ran.tolist(), recommended, flagged, *columns.values(),
                       strict=True)]
        events = self.unreported + withdrawn + \
            (list(decision.events) if decision is not None else []) + decided.clips
        self.unreported = []
        report = StepReport(step=step, heads=records, events=events,
                            unmitigable=not_applied, qk_clips_total=self.qk_clip.total)
        report.confirmed = self.book.confirmed  # events seen run: counters count these
        self.book.confirmed = []
        return report
