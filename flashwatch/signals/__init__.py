"""Numbers over steps and weights: κ, drift z and coherence per head (drift.py), W^Q
spectral norms by the Gram matrix and power iteration (spectral.py), and the small
products these and the probe run through numpy on the CPU (smallops.py).

May import: torch, numpy, flashwatch._checks.
"""
