"""What `flashwatch diagnose` reads: checkpoints and token data.

Checkpoints (`load_checkpoint`):
  a directory with config.json   a Hugging Face model, the class it was saved as
                                 (flashwatch/diagnosis/hf.py), local_files_only=True,
                                 attn_implementation="sdpa"; sharded safetensors included
  nanoGPT ckpt.pt                {"model_args": {...}, "model": state dict}, built as
                                 flashwatch/nanogpt.py's GPT (nanoGPT's module names)
  other state dicts              a file (bare, under "model"/"state_dict"/"module", a
                                 Lightning .ckpt), a torch.distributed.checkpoint folder
                                 or a safetensors folder, loaded into the model `builder`
                                 makes (flashwatch/diagnosis/checkpoints.py)
  module:function                an importable function returning the model (the current
                                 directory is searched first, as `python -c` would)
builder: `module:function` or a Hugging Face config (a folder or its config.json).
Data (`load_tokens`): nanoGPT's .bin (uint16 memmap), .npy, .pt (a tensor of token ids,
1-D stream or 2-D rows), or any other file as UTF-8 text, tokenized with the
checkpoint's tokenizer (Hugging Face directories) or as bytes (vocabularies ≤ 256).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from flashwatch.diagnosis import checkpoints, hf

NANOGPT_ARGS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "dropout",
                "position_embedding")


@dataclasses.dataclass
class Loaded:
    """A checkpoint, ready to measure."""

    model: nn.Module
    kind: str  # what was read: "nanoGPT ckpt.pt", "Lightning .ckpt", ...
    loss_fn: Callable | None = None  # None: diagnose's default next-token loss
    objective: str = "next-token cross-entropy"

    def describe(self) -> dict:
        return dict(checkpoint_kind=self.kind, model_class=type(self.model).__name__,
                    objective=self.objective)


def load_checkpoint(spec: str, device: str | torch.device = "cpu",
                    builder: str | None = None) -> Loaded:
    """The model a CHECKPOINT argument names (module docstring), on `device`."""
    path = Path(spec)
    if not path.exists() and ":" in spec and not spec.startswith(("/", ".")):
        got = Loaded(_from_function(spec), "module:function")
    else:
        got = _from_path(path, builder)
    if got.loss_fn is None and type(got.model).__module__.startswith("transformers."):
        got.loss_fn, got.objective = hf.objective(got.model, path if path.is_dir() else None)
    got.model = got.model.to(device)
    return got


def load_model(spec: str, device: str | torch.device = "cpu",
               builder: str | None = None) -> nn.Module:
    """The model alone (`load_checkpoint`)."""
    return load_checkpoint(spec, device, builder).model


def _from_path(path: Path, builder: str | None) -> Loaded:
    kind = checkpoints.kind_of(path)
    if kind == "hf" and builder is None:
        return Loaded(hf.load_folder(path), f"Hugging Face folder ({_shards(path)})")
    if kind == "file":
        state, what, args = checkpoints.read_file(path)
        if args is not None and builder is None:
            return Loaded(_nanogpt(state, args), what)
        model = _build(builder, path, what)
        checkpoints.load_into(model, state, str(path))
        return Loaded(model, what)
    if kind == "hf":
        kind = "safetensors"  # a folder with its config, read into the builder's model
    model = _build(builder, path, "a torch.distributed.checkpoint folder" if kind == "dcp"
                   else "a safetensors folder")
    what = checkpoints.read_dcp(model, path) if kind == "dcp" else \
        checkpoints.read_safetensors(model, path)
    return Loaded(model, what)


def _shards(path: Path) -> str:
    n = len(list(path.glob("*.safetensors"))) or len(list(path.glob("*.bin")))
    return f"{n} weight file{'s' * (n != 1)}"


def _build(builder: str | None, path: Path, what: str) -> nn.Module:
    """The empty model a state dict loads into."""
    if builder is None:
        raise ValueError(f"{path} is {what}; it needs the model to load into: pass --model "
                         "module:function (returning the model) or --model <Hugging Face "
                         "config folder>")
    b = Path(builder)
    if b.is_dir() or b.name == "config.json":
        return hf.build_from_config(b if b.is_dir() else b.parent)
    return _from_function(builder)


def _nanogpt(state: dict, model_args: dict) -> nn.Module:
    from flashwatch.nanogpt import GPT, GPTConfig
    args = {k: v for k, v in model_args.items() if k in NANOGPT_ARGS}
    model = GPT(GPTConfig(**args))
    checkpoints.load_into(model, state, "nanoGPT ckpt.pt")  # attn.bias (a mask): dropped
    return model


def _from_function(spec: str) -> nn.Module:
    module_name, _, fn_name = spec.partition(":")
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:  # `flashwatch diagnose mymodel:build` finds ./mymodel.py, as `python -c` would
        sys.path.insert(0, cwd)
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{spec!r}: cannot import {fn_name!r} from {module_name!r} ({e}); "
                         "module:function is searched in the current directory and "
                         "sys.path") from e
    finally:
        if added:
            sys.path.remove(cwd)
    model = fn()
    if not isinstance(model, nn.Module):
        raise TypeError(f"{spec!r} returned {type(model).__name__}, expected a "
                        "torch.nn.Module")
    return model


def context_length(model: nn.Module) -> int | None:
    """The longest input the model takes (block_size, max_position_embeddings)."""
    cfg = getattr(model, "config", None)
    for attr in ("block_size", "max_position_embeddings", "n_positions"):
        value = getattr(cfg, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def load_tokens(data: str | Path, checkpoint: str | None = None,
                model: nn.Module | None = None):
    """Token ids from a DATA argument, a 1-D stream or 2-D rows: .bin and .npy stay
    memory-mapped numpy arrays (OpenWebText's train.bin is 9 GB; only the drawn windows
    are read), .pt and text become int64 tensors."""
    path = Path(data)
    if not path.is_file():
        raise FileNotFoundError(f"--data {str(data)!r} is not a file")
    if path.suffix == ".bin":
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
    elif path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
        if tokens.dtype.kind not in "iu":
            raise ValueError(f"{path} must hold integer token ids, got dtype {tokens.dtype}")
    elif path.suffix == ".pt":
        tokens = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(tokens, torch.Tensor) or tokens.dtype.is_floating_point:
            raise ValueError(f"{path} must hold an integer tensor of token ids, got "
                             f"{getattr(tokens, 'dtype', type(tokens).__name__)}")
        tokens = tokens.long()
    else:
        tokens = _tokenize(path.read_text(encoding="utf-8"), checkpoint, model)
    if tokens.ndim not in (1, 2) or tokens.shape[-1] < 2:
        raise ValueError(f"{path}: token ids must be a 1-D stream or 2-D rows with at least 2 "
                         f"tokens, got shape {list(tokens.shape)}")
    return tokens


def _tokenize(text: str, checkpoint: str | None, model: nn.Module | None) -> torch.Tensor:
    if checkpoint is not None and Path(checkpoint).is_dir() and \
            (Path(checkpoint) / "tokenizer_config.json").is_file():
        auto = hf.transformers_module().AutoTokenizer
        tok = auto.from_pretrained(checkpoint, local_files_only=True)
        return torch.tensor(tok(text)["input_ids"], dtype=torch.int64)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(vocab, int) and vocab >= 256:
        if vocab > 256:
            raise ValueError(f"the checkpoint has no tokenizer file and a vocabulary of "
                             f"{vocab}; pass token ids (.bin, .npy, .pt) as --data")
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)
    raise ValueError("cannot tokenize text for this checkpoint (no tokenizer, vocabulary "
                     "is not bytes); pass token ids (.bin, .npy, .pt) as --data")


def make_batches(tokens, n: int, batch_size: int, block: int,
                 seed: int = 0) -> list[torch.Tensor]:
    """n int64 batches [batch_size, block + 1]: random windows of a stream (seeded, as
    nanoGPT's get_batch draws them), or rows of 2-D data in order (cropped to block + 1)."""
    if tokens.ndim == 2:
        if len(tokens) < n * batch_size:
            raise ValueError(f"the data has {len(tokens)} rows; {n} batches of {batch_size} "
                             "need more: lower --batches or --batch-size")
        return [_ids(tokens[i * batch_size:(i + 1) * batch_size, :block + 1])
                for i in range(n)]
    if len(tokens) < block + 2:
        raise ValueError(f"the data has {len(tokens)} tokens, fewer than a window of "
                         f"{block + 1}; lower --block or give more data")
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ix = torch.randint(len(tokens) - block - 1, (batch_size,), generator=gen)
        out.append(torch.stack([_ids(tokens[i:i + block + 1]) for i in ix.tolist()]))
    return out


def _ids(a) -> torch.Tensor:
    return a.long() if isinstance(a, torch.Tensor) else torch.from_numpy(
        np.array(a, dtype=np.int64))  # a copy: memmaps are read-only


def describe(spec: str) -> str:
    """A short label for a checkpoint: its file or folder name."""
    path = Path(spec)
    return path.name if path.exists() else spec
