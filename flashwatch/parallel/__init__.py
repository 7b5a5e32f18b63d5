"""What a distributed job changes: the cross-rank exchange on the monitor's own process
group (reduce.py), the rows and gradients of sharded W^Q a rank holds (sharding.py),
and W^Q spectral norms, fault-symmetric where sharded (power.py).

May import: flashwatch.kernels, flashwatch.sites, flashwatch.signals, flashwatch._checks.
"""
