"""Where flashwatch meets the user's stack: Lightning (lightning.py), the Hugging Face
Trainer (transformers.py) and attention implementation (hf_attention.py), Prometheus
(prometheus*.py); shared.py holds what both callbacks share.

May import: the public `flashwatch` package and any part of it. Lightning, transformers
and prometheus-client are imported here only.
"""
