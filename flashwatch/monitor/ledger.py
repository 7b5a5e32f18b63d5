"""The watcher's error ledger: a failure inside flashwatch is logged once (per place and
exception type), counted in flashwatch_monitor_errors_total, and never raised into
training; warnings are logged once per key."""

from __future__ import annotations

import contextlib
import logging

import torch

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

    @contextlib.contextmanager
    def guard(self, where: str):
        """Run a block of ours inside the user's forward or backward: a failure is
        counted, never raised, and the grad mode is the user's again afterwards (a
        `torch.no_grad()` whose exit failed would leave it off for the rest of training)."""
        grad = torch.is_grad_enabled()
        try:
            yield
        except Exception as e:
            self.error(where, e)
        finally:
            if torch.is_grad_enabled() != grad:
                torch.set_grad_enabled(grad)
