"""The watcher's error ledger: a failure inside flashwatch is logged once (per place and
exception type), counted in flashwatch_monitor_errors_total, and never raised into
training; warnings are logged once per key."""

from __future__ import annotations

import logging

from flashwatch._checks import log_once

log = logging.getLogger("flashwatch")


class ErrorLedger:
    def __init__(self) -> None:
        self.total = 0  # errors counted (flashwatch_monitor_errors_total)
        self.seconds = 0.0  # time spent measuring since the last report
        self._keys: set = set()

    def error(self, where: str, exc: BaseException) -> None:
        self.total += 1
        log_once(log, self._keys, (where, type(exc).__name__),
                 "flashwatch: %s failed (%s: %s); training continues, the error is counted "
                 "in flashwatch_monitor_errors_total and logged once",
                 where, type(exc).__name__, exc, level=logging.ERROR, exc_info=exc)

    def warn_once(self, key, message: str) -> None:
        log_once(log, self._keys, key, "%s", message)
