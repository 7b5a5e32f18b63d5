"""Hugging Face Trainer: a small Llama (built from a config, nothing downloaded) trained
in BF16 with FlashWatchTrainerCallback, on CPU.

python examples/train_hf.py --steps 200 --out runs/hf
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from flashwatch.integrations.transformers import FlashWatchTrainerCallback  # noqa: E402
from flashwatch.report.sinks import JsonlSink  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/hf"))
    args = ap.parse_args()

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    tokens = torch.randint(0, 256, (512, 64))  # use your tokenized dataset here
    data = [{"input_ids": t, "labels": t} for t in tokens]
    trainer = Trainer(model=model, train_dataset=data, args=TrainingArguments(
        output_dir=str(args.out), max_steps=args.steps, per_device_train_batch_size=8,
        gradient_accumulation_steps=2, learning_rate=3e-3, bf16=True, use_cpu=True,
        logging_steps=min(10, args.steps), save_steps=100, report_to="none",
        disable_tqdm=True))
    # The one line: flashwatch as a callback; WatchConfig fields are its arguments.
    trainer.add_callback(FlashWatchTrainerCallback(
        trainer, mitigation="auto", every_n_steps=2,
        sinks=[JsonlSink(args.out / "flashwatch.jsonl")]))
    trainer.train()  # resume_from_checkpoint=True also brings the watcher back
    keys = {k for h in trainer.state.log_history for k in h if k.startswith("flashwatch/")}
    print(f"logged {len(keys)} flashwatch keys through trainer.log to {args.out}")


if __name__ == "__main__":
    main()
