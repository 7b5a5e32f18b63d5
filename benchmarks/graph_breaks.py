"""Graph breaks torch.compile (Dynamo) finds in a watched model's forward, unmonitored
and monitored step (the first one, before the watcher has seen the layers' calls, and a
later one, with the probe traced into the graph: flashwatch/monitor/traced.py), for
examples/gpt.py's GPT and a tiny Hugging Face Llama (CPU):
    python benchmarks/graph_breaks.py
Printed side by side with the unwatched model's count; nothing is asserted here
(tests/monitor/test_compile.py asserts the GPT's 0 on unmonitored steps).
"""

from __future__ import annotations

import os
import sys

import torch
import torch._dynamo

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import flashwatch as fw  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402


def _models():
    torch.manual_seed(0)
    yield "gpt (2 layers)", GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=2,
                                           n_embd=32))
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return
    yield "hf llama (2 layers)", LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="sdpa"))


def _breaks(model, x) -> int:
    torch._dynamo.reset()
    return torch._dynamo.explain(model)(x).graph_break_count


def _logits(out):
    return out[0] if isinstance(out, tuple) else out.logits


def main() -> None:
    x = torch.randint(0, 32, (2, 16))
    print(f"{'model':22s} {'unwatched':>9s} {'unmonitored':>11s} {'monitored, first':>16s} "
          f"{'monitored, traced':>17s}")
    for name, model in _models():
        plain = _breaks(model, x)
        w = fw.watch(model, every_n_steps=2)
        first = _breaks(model, x)  # force_eager: nothing compiles (explain says -1)
        _logits(model(x)).float().sum().backward()  # measured eagerly: layers seen
        w.step()  # step 1: unmonitored
        unmonitored = _breaks(model, x)
        w.step()  # step 2: monitored, traced
        traced = _breaks(model, x)
        w.remove()
        first = "eager" if first < 0 else str(first)
        print(f"{name:22s} {plain:9d} {unmonitored:11d} {first:>16s} {traced:17d}")


if __name__ == "__main__":
    main()
