"""The sinks' public import path (`fw.sinks.JsonlSink`, `from flashwatch.sinks import
JsonlSink`); they live in flashwatch/report/sinks.py."""

from flashwatch.report.sinks import DEFAULT_FULL_EVERY, ConsoleSink, JsonlSink, Sink, read_jsonl

__all__ = ["DEFAULT_FULL_EVERY", "ConsoleSink", "JsonlSink", "Sink", "read_jsonl"]
