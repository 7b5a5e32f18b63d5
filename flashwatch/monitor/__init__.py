"""Measuring a training step: the forward swap and step hooks (attach.py), what a layer's
calls and gradients record (capture.py, probing.py, probe.py; traced.py inside compiled
graphs), one layer's state (layer_state.py), the error ledger (ledger.py), and the
monitored step that turns the buffers into one StepReport, the same on every rank
(monitored_step.py, aggregate.py, agreement.py: the vote and heal).

May import: every part below it (kernels, config, report, sites, signals, parallel,
mitigation) and flashwatch._checks; never the watcher, diagnosis or integrations.
"""
