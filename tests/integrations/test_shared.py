"""flashwatch.integrations.shared, what the Lightning and Hugging Face callbacks share:
the logged counters count confirmed events, never decisions."""

from __future__ import annotations

from flashwatch import Mode


def test_logged_counters_count_confirmed_events_never_decisions():
    """flashwatch/mitigations_total and qk_clips_total count report.confirmed: a mode
    decided then withdrawn counts 0, a confirmed one counts once (both callbacks share
    this code, flashwatch/integrations/shared.py)."""
    from types import SimpleNamespace

    from flashwatch import Event, HeadRecord, StepReport
    from flashwatch.integrations import shared

    def ev(head, to_mode, applied=True, kind="mode"):
        return Event(step=1, layer="l", head=head, from_mode=Mode.STANDARD, to_mode=to_mode,
                     reason="test", applied=applied, kind=kind)

    heads = [HeadRecord(layer="l", head=h) for h in range(2)]
    decided, withdrawn = ev(0, Mode.FP32_O), ev(0, Mode.FP32_O, applied=False)
    ran, clip = ev(1, Mode.BETA), ev(1, Mode.STANDARD, kind="qk_clip")
    reports = shared.Reports()
    watcher = SimpleNamespace(monitor_errors_total=0)
    totals = []
    for events, confirmed in (([decided], []), ([withdrawn], []), ([ran, clip], []),
                              ([], [ran, clip]), ([], [])):
        reports.add(StepReport(step=len(totals), heads=heads, events=events,
                               confirmed=confirmed))
        m = shared.logged_metrics(reports.take(), watcher, reports, top_k=0,
                                  log_per_head=False)
        totals.append((m["flashwatch/mitigations_total"], m["flashwatch/qk_clips_total"]))
    assert totals == [(0, 0), (0, 0), (0, 0), (1, 1), (1, 1)]
