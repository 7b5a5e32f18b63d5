"""The vote that keeps every rank's head modes identical, and the heal when it fails;
and QK-clip's commit, which keeps replicas' weights identical.

After a monitored step's decision each rank votes with one 4-value MAX all_reduce on the
monitor's group: [this rank failed, a hash of the modes it now runs, −that hash, −(its
rank, or the world size if it failed)]. The reduced vector says, identically on every
rank, whether any rank failed, whether all hold the same modes, and the lowest rank that
did not fail (the source). If the vote disagrees, every rank takes the source's state
in one broadcast.

Fault symmetry: the vote is filled and read with numpy on a host buffer allocated at
attach (reduce.Buffers), so no torch call between it and the heal can fail on one rank
only and change whether the broadcast follows; the heal is issued by every rank the vote
told to, whatever failed (a source that cannot gather its state sends None).
"""

from __future__ import annotations

from flashwatch.monitor.ledger import ErrorLedger


class Agreement:
    def __init__(self, monitor, ledger: ErrorLedger, buffers) -> None:
        self.monitor, self.ledger, self.buffers = monitor, ledger, buffers
        self.source = 0  # the rank whose state a disagreeing vote adopts

    @property
    def is_source(self) -> bool:
        return self.monitor.rank == self.source

    def vote(self, failed: bool, mode_hash: float) -> bool:
        """True when no rank failed and all hold the same modes (one process: not failed).
        Sets `source`."""
        mon = self.monitor
        if not mon.distributed:
            return not failed
        if mon.broken is not None:
            return False  # no collective any more; nothing to heal from
        me = float(mon.world if failed else mon.rank)
        vote = self.buffers.vote
        vote[:] = (float(failed), mode_hash, -mode_hash, -me)
        try:
            mon.all_reduce_(self.buffers.vote_t, "max")
        except Exception as e:
            self.ledger.error("vote", e)
            self.source = mon.world  # the group broke: no heal
            return False
        any_failed, max_hash, neg_min_hash, neg_source = (float(x) for x in vote)
        self.source = int(-neg_source)  # the lowest rank that did not fail
        agree = any_failed == 0 and max_hash == -neg_min_hash
        if not agree:
            self.ledger.warn_once("vote", "flashwatch: ranks disagreed at a monitored step (a "
                                  "rank failed, or holds other head modes); every rank takes "
                                  "the decisions of the lowest rank that did not fail")
        return bool(agree)

    def all_ready(self, ready: bool) -> bool:
        """True when every rank is `ready` (one 1-value MAX on the monitor's group; one
        process: `ready`). QK-clip's commit: weights change on every rank or on none."""
        mon = self.monitor
        if not mon.distributed:
            return ready
        if mon.broken is not None:
            return False
        self.buffers.flag[0] = float(not ready)
        try:
            mon.all_reduce_(self.buffers.flag_t, "max")
        except Exception as e:
            self.ledger.error("qk_clip commit", e)
            return False
        return float(self.buffers.flag[0]) == 0.0

    def heal(self, state, adopt) -> None:
        """Every rank takes the source's state: `state()` there (tried twice: the
        broadcast must carry it), one broadcast_object_list, `adopt(state)` elsewhere. No
        healthy rank, or a broken group: nothing."""
        mon = self.monitor
        if not mon.distributed or self.source >= mon.world or mon.broken is not None:
            return
        import torch.distributed as dist

        box = [None]
        if self.is_source:
            box[0] = self._try(state) or self._try(state)
        try:
            dist.broadcast_object_list(box, src=self.source, group=mon.group)
        except Exception as e:
            mon.broken = f"a collective failed ({type(e).__name__}: {e})"
            self.ledger.error("state broadcast", e)
            return
        if not self.is_source and box[0] is not None:
            adopt(box[0])

    def _try(self, fn):
        try:
            return fn()
        except Exception as e:
            self.ledger.error("state broadcast", e)
            return None
