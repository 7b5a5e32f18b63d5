"""`flashwatch diagnose`: which heads of a saved model look like the BF16 failure, without
training it. The measurement and verdicts (diagnose.py, measure.py, rank.py), loading
models and tokens (load.py), the Markdown report (report.py) and the CLI (cli.py).

Named diagnosis, not diagnose: `flashwatch.diagnose` is the public function.
May import: flashwatch.kernels, flashwatch.sites, flashwatch.mitigation (QK-clip
factors), flashwatch.monitor (traced.autocast_qkv: q, k, v as SDPA receives them, the
watcher's function), flashwatch.nanogpt, flashwatch._checks.
"""
