"""What `flashwatch diagnose` reads: checkpoints and token data.

Checkpoints (`load_model`):
  a directory with config.json   a Hugging Face causal LM, `from_pretrained` with
                                 local_files_only=True and attn_implementation="sdpa"
  a file (ckpt.pt)               nanoGPT's format: {"model_args": {...}, "model": state
                                 dict} (torch.compile's "_orig_mod." prefixes allowed),
                                 built as flashwatch/nanogpt.py's GPT (nanoGPT's module names)
  module:function                an importable function returning the model
Data (`load_tokens`): nanoGPT's .bin (uint16 memmap), .npy, .pt (a tensor of token ids,
1-D stream or 2-D rows), or any other file as UTF-8 text, tokenized with the
checkpoint's tokenizer (Hugging Face directories) or as bytes (vocabularies ≤ 256).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from flashwatch._checks import missing_extra

NANOGPT_ARGS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "dropout",
                "position_embedding")


def load_model(spec: str, device: str | torch.device = "cpu") -> nn.Module:
    """The model a CHECKPOINT argument names (module docstring), on `device`."""
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"checkpoint {spec!r} is a directory without config.json; "
                             "pass a Hugging Face model directory (save_pretrained)")
        auto = _transformers().AutoModelForCausalLM
        model = auto.from_pretrained(path, local_files_only=True, attn_implementation="sdpa")
    elif path.is_file():
        model = _nanogpt(path)
    elif ":" in spec:
        model = _from_function(spec)
    else:
        raise ValueError(f"checkpoint {spec!r} is neither a directory, a file nor "
                         "module:function; pass a Hugging Face directory, a nanoGPT "
                         "ckpt.pt or e.g. mypkg.models:build")
    return model.to(device)


def _transformers():
    """transformers, an extra: only Hugging Face checkpoints need it."""
    try:
        import transformers
    except ImportError as e:
        raise missing_extra("transformers", "transformers", "flashwatch diagnose") from e
    return transformers


def _nanogpt(path: Path) -> nn.Module:
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if not (isinstance(ckpt, dict) and isinstance(ckpt.get("model_args"), dict)
            and isinstance(ckpt.get("model"), dict)):
        keys = list(ckpt)[:8] if isinstance(ckpt, dict) else type(ckpt).__name__
        raise ValueError(f"{path} is not a nanoGPT checkpoint (a dict with 'model_args' and "
                         f"'model'; found {keys}); for other formats pass module:function "
                         "returning the model")
    from flashwatch.nanogpt import GPT, GPTConfig
    args = {k: v for k, v in ckpt["model_args"].items() if k in NANOGPT_ARGS}
    model = GPT(GPTConfig(**args))
    state = {k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()}
    own = model.state_dict()
    state = {k: v for k, v in state.items() if k in own or not k.endswith(".attn.bias")}
    model.load_state_dict(state)  # nanoGPT's causal-mask buffer (attn.bias) is dropped
    return model


def _from_function(spec: str) -> nn.Module:
    module_name, _, fn_name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"checkpoint {spec!r}: cannot import {fn_name!r} from "
                         f"{module_name!r} ({e})") from e
    model = fn()
    if not isinstance(model, nn.Module):
        raise TypeError(f"checkpoint {spec!r} returned {type(model).__name__}, expected "
                        "a torch.nn.Module")
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
        tok = _transformers().AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
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
    """A short label for a checkpoint (its step when a nanoGPT file says it)."""
    path = Path(spec)
    if path.is_dir() and (path / "config.json").is_file():
        arch = json.loads((path / "config.json").read_text()).get("architectures", ["hf"])
        return f"{path.name} ({arch[0]})"
    return path.name if path.exists() else spec
