"""What a distributed job changes: the cross-rank exchange on the monitor's own process
group (reduce.py) and W^Q rows, norms and gradients of sharded weights (sharding.py).

May import: flashwatch.kernels, flashwatch.sites, flashwatch.signals, flashwatch._checks.
"""
