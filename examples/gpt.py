"""The small nanoGPT-style GPT of the examples, tests and benchmarks: flashwatch/nanogpt.py
(it ships with the package, since `flashwatch demo` and `flashwatch diagnose` use it)."""

from flashwatch.nanogpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig

__all__ = ["GPT", "GPTConfig", "Block", "CausalSelfAttention", "MLP"]
