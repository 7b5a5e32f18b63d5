"""What to do about a head: the policy's two hazards and two fixes with hysteresis
(policy.py) and the opt-in per-head QK-clip (qkclip.py).

May import: flashwatch.config, flashwatch.kernels, flashwatch.report, flashwatch.sites,
flashwatch.signals, flashwatch.parallel, flashwatch._checks.
"""
