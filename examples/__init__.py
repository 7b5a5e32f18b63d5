"""Examples: a small nanoGPT-style GPT (gpt.py) used by tests, demo and benchmarks."""
