"""Every head's mode on every rank, and the mode events waiting to be seen run.

A head's mode is set where the head is held (by hand: `user_change`; by a decision:
`set_all`) and learnt elsewhere from the monitored step's exchange, whose MODE_FIELDS
(flashwatch/monitor/aggregate.py) carry, at the heads a rank holds and -inf elsewhere:

    mode      the modes it has set
    ran       the modes its kernel ran (STANDARD where a layer could not run them)
    user_set  1 where they were set by hand since they were last exchanged
    seen      what the rank saw of a head's modes since the last report: 0 nothing to
              judge by, 1 routed calls ran them, 2 its layer failed to run them

A mode event (a decision's switch, a hand-set mode) stands as applied once a measurement
shows it run. Its head may be held by another rank (another pipeline stage, another
tensor-parallel rank), so every rank keeps every head's pending events and settles them
from the reduced `seen`: confirmed (report.confirmed, what counters count) or withdrawn
(applied=False), on every rank alike, so rank 0 reports every rank's events once. A
hand-set mode is known on its own rank only until the exchange carries it: the other
ranks then log it as an event of their own ("set by user on the rank that holds it")
and restart its signals and policy; until then (the rank's part of the exchange
failed) it stays flagged, and a heal that adopts another rank's state keeps it.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch

from flashwatch.kernels.common import Mode
from flashwatch.monitor.aggregate import HOLDERS
from flashwatch.parallel.sharding import unnarrowed_tp
from flashwatch.report.records import Event

SEEN_NOTHING, SEEN_RUN, SEEN_FAILING = 0.0, 1.0, 2.0
ELSEWHERE = "its modes did not run on the rank that holds it (that rank's log says why)"


class HeadModes:
    def __init__(self, keys: list[tuple[str, int]], states, set_local, ledger) -> None:
        self.keys, self.states, self._set_local, self.ledger = keys, states, set_local, ledger
        self.index = {k: i for i, k in enumerate(keys)}
        n = len(keys)
        self.relayout()
        self.modes = torch.zeros(n, dtype=torch.int64)  # every head's, held here or not
        self.user_set = torch.zeros(n, dtype=torch.bool)  # set by hand, not exchanged yet
        self.pending: dict[int, list[Event]] = {}  # head -> applied events not seen run
        self.unreported: list = []  # hand-set mode changes not yet in a StepReport
        self.confirmed: list = []  # events seen run since the last report
        self.seen = torch.zeros(n, dtype=torch.float64)  # this rank's, at its heads
        self.reasons: dict[int, str] = {}  # head -> why its layer failed here
        self.withdrawn: list = []  # copies of events withdrawn by the last exchange

    def relayout(self) -> None:
        self.positions, self.held = self.layout()

    def layout(self, heads: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, held): the global heads this rank's layers hold, in its layers'
        order, and as a mask over the table; `heads` {id(state): heads} in place of a
        state's own (a layer about to be narrowed to its tensor-parallel part)."""
        heads = heads or {}
        parts = [heads.get(id(st), st.heads) for st in self.states]
        positions = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        held = torch.zeros(len(self.keys), dtype=torch.bool)
        held[positions] = True
        return positions, held

    # ----------------------------------------------------------------- setting modes

    def user_change(self, st, new: torch.Tensor, step: int) -> tuple[list, torch.Tensor]:
        """Modes set by hand on a layer this rank holds: (the events, the changed heads)."""
        changed = torch.zeros(len(self.keys), dtype=torch.bool)
        events = []
        for h in range(st.site.num_heads):
            if int(new[h]) != int(st.modes[h]):
                changed[st.offset + h] = True
                event = Event(step=step, layer=st.site.name, head=st.site.head_offset + h,
                              from_mode=Mode(int(st.modes[h])), to_mode=Mode(int(new[h])),
                              reason="set by user", applied=True)
                events.append(event)
                self.unreported.append(event)  # goes out with the next report
                self._hold(st.offset + h, event)
        self.set_modes(st, new)
        self.user_set |= changed  # carried by the next exchange
        return events, changed

    def set_modes(self, st, new: torch.Tensor) -> None:
        self._set_local(st, new)
        self.modes[st.offset:st.offset + st.site.num_heads] = new.long()

    def global_modes(self) -> torch.Tensor:
        """[n] int64: the modes of every head, this rank's own as its layers hold them
        (a loaded state sets them there), the others' as the last exchange told."""
        modes = self.modes.clone()
        for st in self.states:
            modes[st.offset:st.offset + st.site.num_heads] = st.modes.long()
        return modes

    def set_all(self, modes: torch.Tensor, keep_hand_set: bool = False) -> None:
        """Every head's modes [n]: this rank's layers run theirs. keep_hand_set: heads set
        by hand here and not exchanged yet keep their modes (a heal from a rank that
        could not know them)."""
        modes = modes.long().clone()
        if keep_hand_set:
            mine = self.user_set & self.held
            modes[mine] = self.global_modes()[mine]
        self.modes = modes
        new_modes = modes.to(torch.int32)
        for st in self.states:
            self.set_modes(st, new_modes[st.offset:st.offset + st.site.num_heads].clone())

    def hold(self, events: list) -> None:
        """A decision's applied switches: pending until a measurement shows them run,
        on every rank, wherever the head is held."""
        for e in events:
            if e.applied and e.kind == "mode":
                i = self.index.get((e.layer, e.head))
                if i is not None:
                    self._hold(i, e)

    def _hold(self, i: int, event: Event) -> None:
        if event.to_mode != Mode.STANDARD:
            self.pending.setdefault(i, []).append(event)

    # --------------------------------------------------------- before the exchange

    def judge(self) -> dict[str, str]:
        """This rank's layers whose non-STANDARD modes did not run since the last report
        (name -> why), and `seen` at its heads (local facts, counted once here)."""
        not_applied = {}
        self.seen.zero_()
        self.reasons = {}
        for st in self.states:
            heads = slice(st.offset, st.offset + st.site.num_heads)
            reason = st.not_applied()
            if reason is not None:  # say so, never claim the modes applied
                not_applied[st.site.name] = reason
                if st.module_calls or st.fallback_calls or st.shadowed:  # seen failing now
                    self.ledger.error(f"mitigation {st.site.name}", RuntimeError(reason))
                    self.seen[heads] = SEEN_FAILING
                    self.reasons.update({i: reason for i in range(heads.start, heads.stop)})
                    st.silent_reported |= not st.buf.calls  # said, with its modes
            elif st.routed_calls > 0:
                self.seen[heads] = SEEN_RUN
                st.unmitigable = None
            if st.buf.forwards and not st.buf.calls and not st.silent_reported:
                st.silent_reported = True  # logged and counted once
                why = (f"its attention calls were not measured: {st.buf.unmeasured}"
                       if st.buf.unmeasured is not None else
                       "without an attention call flashwatch sees (F.scaled_dot_product_"
                       "attention, flex_attention, varlen_attn or flashwatch.attention); "
                       "make it call one (Hugging Face: attn_implementation='sdpa' or "
                       "'flex_attention') or leave it out of `sites`")
                self.ledger.error(f"attention of {st.site.name}", RuntimeError(
                    f"{st.site.name} ran {st.buf.forwards} forward(s) in a monitored step "
                    f"and measured nothing: its ties, max logit and δ error are NaN and "
                    f"QK-clip cannot act there; {why}"))
            st.module_calls = st.routed_calls = st.fallback_calls = 0
        return not_applied

    def ran(self, not_applied: dict) -> torch.Tensor:
        """What the kernel runs at each head: not a layer's modes it cannot apply."""
        ran = self.global_modes()
        for st in self.states:
            if st.site.name in not_applied:
                ran[st.offset:st.offset + st.site.num_heads] = int(Mode.STANDARD)
        return ran

    def fields(self, not_applied: dict) -> dict[str, torch.Tensor]:
        """This rank's part of the mode fields of the exchange, -inf at heads held
        elsewhere."""
        fill = torch.full((len(self.keys),), -math.inf, dtype=torch.float64)
        out = {k: torch.where(self.held, v, fill) for k, v in (
            ("mode", self.global_modes().double()), ("ran", self.ran(not_applied).double()),
            ("user_set", self.user_set.double()), ("seen", self.seen.clone()))}
        # summed: how many ranks hold each head, not counting a layer this rank has not
        # narrowed to its tensor-parallel heads (it measures none of them)
        holding = self.held.clone()
        for st in self.states:
            if unnarrowed_tp(st.site) is not None:
                holding[st.offset:st.offset + st.site.num_heads] = False
        out[HOLDERS] = holding.double()
        return out

    # ---------------------------------------------------------- after the exchange

    def learn(self, maxes: dict[str, np.ndarray] | None, not_applied: dict, step: int
              ) -> tuple[torch.Tensor, torch.Tensor, list, dict]:
        """The exchange's mode fields (None: it failed; this rank's own facts only) →
        (the modes each head ran, -1 unknown; the heads set by hand anywhere, whose
        signals and policy restart; events of hand-set modes held elsewhere; layers held
        elsewhere whose modes did not run, name -> why)."""
        self.withdrawn = []
        ran = self.ran(not_applied)
        n = len(self.keys)
        if maxes is None:
            self._settle(torch.where(self.held, self.seen, 0.0), step)
            return ran, torch.zeros(n, dtype=torch.bool), [], {}
        mode, user_set, ran_all, seen = (torch.from_numpy(maxes[k]) for k in (
            "mode", "user_set", "ran", "seen"))
        elsewhere = ~self.held & torch.isfinite(mode)
        told = user_set > 0
        events = []
        for i in (elsewhere & told & (mode.long() != self.modes)).nonzero().flatten().tolist():
            layer, head = self.keys[i]
            e = Event(step=step, layer=layer, head=head, from_mode=Mode(int(self.modes[i])),
                      to_mode=Mode(int(mode[i])), applied=True,
                      reason="set by user on the rank that holds it")
            events.append(e)
            self.unreported.append(e)
            self._hold(i, e)
        self.modes[elsewhere] = mode[elsewhere].long()
        self.user_set &= ~told  # carried: the other ranks know them now
        failed_there = {self.keys[i][0]: ELSEWHERE for i in (
            elsewhere & torch.isfinite(ran_all) & (ran_all != mode)).nonzero().flatten().tolist()}
        self._settle(torch.where(torch.isfinite(seen), seen, 0.0), step)
        ran = torch.where(self.held, ran, torch.where(torch.isfinite(ran_all), ran_all,
                                                      torch.full_like(ran_all, -1.0)).long())
        return ran, told, events, failed_there

    def _settle(self, seen: torch.Tensor, step: int) -> None:
        """Pending events of heads seen run are confirmed, of heads seen failing
        withdrawn (applied=False; copies not yet reported go out in `withdrawn`)."""
        self.withdrawn = []
        for i in list(self.pending):
            if seen[i] == SEEN_RUN:
                self.confirmed += [e for e in self.pending.pop(i) if e.applied]
            elif seen[i] == SEEN_FAILING:
                reason = self.reasons.get(i, ELSEWHERE)
                for e in self.pending.pop(i):
                    e.applied = False
                    e.reason = f"{e.reason}; not applied: {reason}"
                    if not any(e is u for u in self.unreported):
                        self.withdrawn.append(replace(e))
