"""What the Lightning and Hugging Face callbacks share: how they take their arguments,
the watcher they open and close, and the bounded key set they log
(docs/integrations.md)."""

from __future__ import annotations

import dataclasses
import logging
import math

import flashwatch
from flashwatch._checks import check_bool, check_int, log_once
from flashwatch.config import WatchConfig, unknown_fields
from flashwatch.kernels.common import Mode
from flashwatch.report import metrics
from flashwatch.report.records import StepReport

log = logging.getLogger("flashwatch")


@dataclasses.dataclass(frozen=True)
class Options:
    """The options both callbacks take besides WatchConfig's fields (their docstrings
    say what each does)."""

    sinks: tuple = ()
    sites: object = None
    log_per_head: bool = False
    top_k: int = 3
    prometheus_port: int | None = None
    prometheus_addr: str = "127.0.0.1"
    prometheus_rank_zero_only: bool = False
    prometheus_certfile: str | None = None
    prometheus_keyfile: str | None = None

    def __post_init__(self) -> None:
        check_bool("log_per_head", self.log_per_head)
        check_int("top_k", self.top_k, min=0, hint="0 = no worst-head keys")
        if self.prometheus_port is not None:
            check_int("prometheus_port", self.prometheus_port, min=0, max=65535,
                      hint="or None for no endpoint")
        check_bool("prometheus_rank_zero_only", self.prometheus_rank_zero_only)
        object.__setattr__(self, "sinks", tuple(self.sinks or ()))
        for s in self.sinks:
            if not callable(getattr(s, "write", None)):
                raise TypeError(f"sinks: {s!r} has no write(report) method; pass flashwatch "
                                f"sinks such as flashwatch.report.sinks.JsonlSink(path)")

    def prometheus(self) -> dict | None:
        """PrometheusSink arguments of the callback's own endpoint, None for none."""
        if self.prometheus_port is None:
            return None
        return dict(port=self.prometheus_port, addr=self.prometheus_addr,
                    rank_zero_only=self.prometheus_rank_zero_only,
                    certfile=self.prometheus_certfile, keyfile=self.prometheus_keyfile)


OPTIONS = tuple(f.name for f in dataclasses.fields(Options))


def configure(owner: str, config: WatchConfig | None, kwargs: dict
              ) -> tuple[WatchConfig, Options]:
    """Split a callback's keyword arguments into its WatchConfig (`config`, default the
    defaults, with the WatchConfig fields among `kwargs` over it) and its Options. Errors
    name the callback, the argument and the fix."""
    problem = unknown_fields(kwargs, extra=OPTIONS)
    if problem:
        raise TypeError(f"{owner} got {problem}; it takes config= (a flashwatch.WatchConfig), "
                        f"WatchConfig's fields as keywords, and {', '.join(OPTIONS)}")
    fields = {k: v for k, v in kwargs.items() if k not in OPTIONS}
    try:
        cfg = WatchConfig.from_kwargs(config, **fields)
        options = Options(**{k: v for k, v in kwargs.items() if k in OPTIONS})
    except (TypeError, ValueError) as e:
        raise type(e)(f"{owner}: {e}") from None
    return cfg, options


class Reports:
    """The newest report not yet logged, and the events confirmed in every report seen
    (counters count what ran, never a decision: StepReport.confirmed)."""

    def __init__(self):
        self.latest: StepReport | None = None
        self.mitigations_total = 0  # mode switches seen run, since this callback began
        self.qk_clips_total = 0  # QK-clips whose effect was seen

    def add(self, report: StepReport | None) -> None:
        if report is None:
            return
        self.latest = report
        for e in report.confirmed:
            if e.applied and e.kind == "mode":
                self.mitigations_total += 1
            elif e.applied and e.kind == "qk_clip":
                self.qk_clips_total += 1

    def take(self) -> StepReport | None:
        report, self.latest = self.latest, None
        return report


def open_watcher(model, config, options: Options, sites, *, local_rank: int,
                 rank: int) -> flashwatch.Watcher:
    """`flashwatch.watch` with the user's sinks and, when the options ask for one, a
    Prometheus endpoint of the callback's own."""
    own = []
    prometheus = options.prometheus()
    if prometheus is not None:
        from flashwatch.integrations.prometheus import PrometheusSink

        # Raises on a taken port: better to stop before the first step than to train
        # for days without the endpoint an operator expects.
        own.append(PrometheusSink(**prometheus, local_rank=local_rank, rank=rank))
    try:
        return flashwatch.watch(model, config=config, sinks=[*options.sinks, *own],
                                sites=sites)
    except Exception:
        for s in own:  # free the Prometheus port
            s.close()
        raise


def guard(failed: set, what: str, fn, *args):
    """fn(*args), or None after logging its failure once per `what` (in the caller's
    `failed`): an integration's step, logging or saving never stops training."""
    try:
        return fn(*args)
    except Exception as e:
        log_once(log, failed, what, "flashwatch: %s failed (%s: %s); training continues",
                 what, type(e).__name__, e, level=logging.ERROR, exc_info=e)
        return None


def restore(watcher: flashwatch.Watcher, state: dict, where: str) -> None:
    """watcher.load_state_dict(state) from the trainer's checkpoint (`where`, for the
    message); a state it cannot take is logged and the watcher starts fresh."""
    try:
        watcher.load_state_dict(state)
    except Exception as e:
        log.error("flashwatch: could not restore the watcher from %s (%s: %s); monitoring "
                  "starts fresh (modes STANDARD)", where, type(e).__name__, e)


def close_watcher(watcher: flashwatch.Watcher, user_sinks) -> dict:
    """Removes the watcher (the model is left as it was) and closes the sinks the
    callback opened; returns the watcher's final state. Sinks the user passed are the
    user's to close: the next fit() or train() writes to them again."""
    state = watcher.state_dict()
    watcher.sinks = [s for s in watcher.sinks if not any(s is u for u in user_sinks)]
    watcher.remove()
    return state


def logged_metrics(report: StepReport, watcher: flashwatch.Watcher, reports: Reports, *,
                   top_k: int, log_per_head: bool) -> dict[str, float]:
    """The logged keys of one report (listed in FlashWatchCallback's docstring; the
    per-layer and per-head ones are the metrics table's layer_max and logged rows); NaN
    values, i.e. not measured yet, are left out."""
    m = {
        "flashwatch/monitor_step": report.step,
        "flashwatch/monitor_seconds": report.monitor_seconds,
        "flashwatch/monitor_errors_total": watcher.monitor_errors_total,
        "flashwatch/mitigations_total": reports.mitigations_total,
        "flashwatch/qk_clips_total": reports.qk_clips_total,
        "flashwatch/heads_not_standard": sum(h.head_mode != Mode.STANDARD
                                             for h in report.heads),
    }
    layers = report.layer_summaries()  # NaN maxima are left out below
    for layer, summary in layers.items():
        for key in (*(f"{f}_max" for f in metrics.LAYER_MAX), "heads_not_standard",
                    "heads_flagged"):
            m[f"flashwatch/{layer}/{key}"] = summary[key]
    index = {layer: i for i, layer in enumerate(layers)}
    for i, h in enumerate(report.worst(top_k), start=1):
        for field in metrics.LOGGED:
            m[f"flashwatch/worst_{i}/{field}"] = getattr(h, field)
        m[f"flashwatch/worst_{i}/layer_index"] = index[h.layer]
        m[f"flashwatch/worst_{i}/head"] = h.head
    if log_per_head:
        for h in report.heads:
            for field in metrics.LOGGED:
                m[f"flashwatch/{h.layer}/head_{h.head}/{field}"] = getattr(h, field)
            m[f"flashwatch/{h.layer}/head_{h.head}/head_mode"] = int(h.head_mode)
    return {k: float(v) for k, v in m.items() if not math.isnan(v)}
