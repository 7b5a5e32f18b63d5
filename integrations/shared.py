"""What the Lightning and Hugging Face callbacks share: their own options, the watcher
they open and close, and the bounded key set they log (docs/integrations.md)."""

from __future__ import annotations

import math

import flashwatch
from flashwatch.kernels.common import Mode
from flashwatch.report import LAYER_MAX, StepReport

# Per worst head and per head (opt-in): these fields, under their own names.
HEAD_KEYS = ("tied_rowmax_ratio", "attention_max_logit", "delta_error_sum",
             "r_projection_cumulative", "delta_drift_z", "delta_coherence", "wq_spectral_norm")


# The options both callbacks take besides WatchConfig's fields.
OPTIONS = ("sinks", "sites", "log_per_head", "top_k", "prometheus_port", "prometheus_addr",
           "prometheus_rank_zero_only", "prometheus_certfile", "prometheus_keyfile")


def set_options(cb, owner: str, *, sinks, sites, log_per_head, top_k, prometheus_port,
                prometheus_addr, prometheus_rank_zero_only, prometheus_certfile,
                prometheus_keyfile) -> None:
    """Checks the options both callbacks take besides WatchConfig's and sets them on the
    callback `cb`: sinks, sites, log_per_head, top_k, prometheus (PrometheusSink
    arguments, None = no endpoint), and watcher = None."""
    if not isinstance(log_per_head, bool):
        raise TypeError(f"{owner}: log_per_head must be a bool, got {log_per_head!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"{owner}: top_k must be an int ≥ 0 (0 = no worst-head keys), got "
                         f"{top_k!r}")
    if prometheus_port is not None and (isinstance(prometheus_port, bool)
                                        or not isinstance(prometheus_port, int)):
        raise TypeError(f"{owner}: prometheus_port must be an int or None, got "
                        f"{prometheus_port!r}")
    cb.sinks = list(sinks or [])
    for s in cb.sinks:
        if not callable(getattr(s, "write", None)):
            raise TypeError(f"{owner}: sinks: {s!r} has no write(report) method; pass "
                            f"flashwatch sinks such as flashwatch.sinks.JsonlSink(path)")
    cb.sites = sites
    cb.log_per_head, cb.top_k = log_per_head, top_k
    cb.prometheus = None if prometheus_port is None else dict(
        port=prometheus_port, addr=prometheus_addr, rank_zero_only=prometheus_rank_zero_only,
        certfile=prometheus_certfile, keyfile=prometheus_keyfile)
    cb.watcher = None


def open_watcher(model, config, sinks: list, sites, prometheus: dict | None, *,
                 local_rank: int, rank: int) -> flashwatch.Watcher:
    """`flashwatch.watch` with the user's sinks and, when `prometheus` holds
    PrometheusSink options, an endpoint of the callback's own."""
    own = []
    if prometheus is not None:
        from flashwatch.integrations.prometheus import PrometheusSink

        # Raises on a taken port: better to stop before the first step than to train
        # for days without the endpoint an operator expects.
        own.append(PrometheusSink(**prometheus, local_rank=local_rank, rank=rank))
    try:
        return flashwatch.watch(model, config=config, sinks=sinks + own, sites=sites)
    except Exception:
        for s in own:  # free the Prometheus port
            s.close()
        raise


def close_watcher(watcher: flashwatch.Watcher, user_sinks: list) -> dict:
    """Removes the watcher (the model is left as it was) and closes the sinks the
    callback opened; returns the watcher's final state. Sinks the user passed are the
    user's to close: the next fit() or train() writes to them again."""
    state = watcher.state_dict()
    watcher.sinks = [s for s in watcher.sinks if not any(s is u for u in user_sinks)]
    watcher.remove()
    return state


def logged_metrics(report: StepReport, watcher: flashwatch.Watcher, *, top_k: int,
                   log_per_head: bool) -> dict[str, float]:
    """The logged keys of one report (listed in FlashWatchCallback's docstring); NaN
    values, i.e. not measured yet, are left out."""
    m = {
        "flashwatch/monitor_step": report.step,
        "flashwatch/monitor_seconds": report.monitor_seconds,
        "flashwatch/monitor_errors_total": watcher.monitor_errors_total,
        "flashwatch/mitigations_total": sum(e.applied and e.kind == "mode"
                                            for e in watcher.events),
        "flashwatch/qk_clips_total": report.qk_clips_total,
        "flashwatch/heads_not_standard": sum(h.head_mode != Mode.STANDARD
                                             for h in report.heads),
    }
    layers = report.layer_summaries()  # NaN maxima are left out below
    for layer, summary in layers.items():
        for key in (*(f"{f}_max" for f in LAYER_MAX), "heads_not_standard", "heads_flagged"):
            m[f"flashwatch/{layer}/{key}"] = summary[key]
    index = {layer: i for i, layer in enumerate(layers)}
    for i, h in enumerate(report.worst(top_k), start=1):
        for field in HEAD_KEYS:
            m[f"flashwatch/worst_{i}/{field}"] = getattr(h, field)
        m[f"flashwatch/worst_{i}/layer_index"] = index[h.layer]
        m[f"flashwatch/worst_{i}/head"] = h.head
    if log_per_head:
        for h in report.heads:
            for field in HEAD_KEYS:
                m[f"flashwatch/{h.layer}/head_{h.head}/{field}"] = getattr(h, field)
            m[f"flashwatch/{h.layer}/head_{h.head}/head_mode"] = int(h.head_mode)
    return {k: float(v) for k, v in m.items() if not math.isnan(v)}
