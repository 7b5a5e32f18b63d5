"""What a monitored step tells and where it goes: the report types (records.py), the one
metrics table every sink and dashboard reads (metrics.py), the JSONL and console sinks
(sinks.py) and `flashwatch report`'s plots of a finished run (runreport.py).

May import: flashwatch.kernels (Mode), flashwatch._checks.
"""

from flashwatch.report.records import Event, HeadRecord, StepReport

__all__ = ["Event", "HeadRecord", "StepReport"]
