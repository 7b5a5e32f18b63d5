"""QK-clip inside a monitored step (flashwatch/mitigation/qkclip.py does the arithmetic):
planned before the vote, booked and scaled after it, and written on every rank or none.

    plan        before the vote: the reduced max logits the clip will act on (their
                factors checked), the same on every healthy rank; None: no clip
    run         after the vote: each rank books the step's clips (confirmations, stops,
                new clips) and scales the channels it holds into new tensors, nothing
                written; one 1-value MAX (agreement.Agreement.all_ready), issued by every
                rank whenever a clip was planned, whatever raised before it, says whether
                all succeeded; then every rank writes its channels (keeping the old
                values), a second 1-value MAX says whether every write succeeded, and
                where one failed every rank puts its channels back; where nothing is
                written, or it is put back, the books go back to where they were.
                Written on one rank only, a clip would leave DDP replicas with different
                weights for the rest of the run (DDP never compares them):
                tests/parallel/test_faults.py injects failures into the scaling, the
                books and the write on one rank.
    books_bytes the books in the vote's hash: a rank whose books differ anyway (a
                failed roll-back) is healed with the others' in the vote's broadcast.
"""

from __future__ import annotations

import torch

from flashwatch.config import WatchConfig
from flashwatch.mitigation import qkclip
from flashwatch.mitigation.qkclip import QKClip
from flashwatch.monitor.agreement import Agreement
from flashwatch.monitor.ledger import ErrorLedger
from flashwatch.parallel.layout import HeadTable


def plan(config: WatchConfig, a) -> torch.Tensor | None:
    """The reduced max logits QK-clip will act on, checked before the vote (its factors
    are a pure function of them, the same on every rank); None: no clip."""
    if config.qk_clip_threshold is None or config.mitigation == "off":
        return None
    max_logit = torch.from_numpy(a.max_logit)
    qkclip.clip_factors(max_logit, config.qk_clip_threshold)
    return max_logit


def run(clip: QKClip, agreement: Agreement, ledger: ErrorLedger, step: int, a,
        max_logit: torch.Tensor | None, modes, refused_here: dict, table: HeadTable
        ) -> tuple[list, list]:
    """(the step's QK-clip events, the confirmed ones among them), the weights written
    on every rank or on none (module docstring). modes: a callable giving every head's
    modes; refused_here: layer name -> why its W^Q slice was refused on this rank."""
    if max_logit is None:
        return [], []
    books = booked = None
    try:
        books = clip.state_dict()
        booked = _book(clip, step, a, max_logit, modes(), refused_here, table)
    except Exception as e:
        ledger.error("qk_clip", e)
    if agreement.all_ready(booked is not None):  # a collective: every rank issues it
        written = True
        try:
            clip.commit()
        except Exception as e:
            ledger.error("qk_clip", e)
            written = False
        if agreement.all_ready(written):  # the second: every rank wrote all of it
            clip.undo = []
            stops, confirmed, rest = booked
            return stops + confirmed + rest, confirmed
        # a rollback that fails too is counted and leaves this rank's clip in place
        _undo(ledger, clip.rollback)
    clip.writes = []
    if books is not None:
        _undo(ledger, lambda: clip.load_state_dict(books))
    return [], []


def _undo(ledger: ErrorLedger, fn) -> None:
    try:
        fn()
    except Exception as e:
        ledger.error("qk_clip", e)


def _book(clip: QKClip, step: int, a, max_logit, modes, refused_here: dict,
          table: HeadTable) -> tuple[list, list, list]:
    """(stops, confirmed, other events) of the step's QK-clip, its channels scaled into
    clip.writes; raises where any of it failed on this rank."""
    stops = []
    for name, heads in table.layers:  # a W^Q slice refused on a rank: stop there
        at = table.offset(name)
        refused = torch.from_numpy(a.refused[at:at + heads])
        if refused.any():
            stops += clip.stop_layer(
                step, name, refused_here.get(name) or "its W^Q slice failed the check on "
                "a rank", heads=refused)
    # clips of the last step count once this measurement shows them
    confirmed, failed = clip.confirm(max_logit, step)
    events = clip.apply(step, max_logit, modes)
    if clip.scale_errors:  # one error, naming every layer it hit
        names = [name for name, _ in clip.scale_errors]
        raise RuntimeError(f"qk_clip of {names}: {clip.scale_errors[0][1]}")
    return stops, confirmed, failed + events


def books_bytes(clip: QKClip) -> bytes:
    """Every tensor of the QK-clip books as bytes, NaN made one value (the vote hashes
    them: flashwatch/monitor/monitored_step.py)."""
    parts = []
    for key in qkclip.STATE:
        t = getattr(clip, key).detach().cpu()
        if t.is_floating_point():
            t = torch.nan_to_num(t, nan=-1.0, posinf=-2.0, neginf=-3.0)
        parts.append(t.contiguous().numpy().tobytes())
    return b"".join(parts)


def clip_layers(table: HeadTable) -> list[tuple]:
    """QK-clip's books over every layer of the table: (name, offset, heads, K heads,
    QK-norm) from the facts its first holder gave at attach (flashwatch/watcher.py)."""
    out = []
    for name, heads in table.layers:
        facts = table.layer_facts(name)
        out.append((name, table.offset(name), heads, int(facts.get("kv_heads", heads)),
                    facts.get("qk_norm")))
    return out
