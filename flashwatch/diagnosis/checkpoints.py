"""State dicts as training jobs save them, into the model that reads them.

What a CHECKPOINT file or folder holds (`read_state`):
  nanoGPT ckpt.pt          {"model_args": {...}, "model": state dict}: builds itself
  a state dict under a key {"model" | "state_dict" | "module" | "model_state_dict" |
                           "state_dict_ema": state dict, ...}: the README's quickstart,
                           Lightning's .ckpt ("state_dict", keys prefixed with the
                           LightningModule's attribute), DeepSpeed's "module"
  a bare state dict        {name: tensor}
  torch.distributed.checkpoint folder   (.metadata; torchtitan, FSDP2 jobs): read without
                           a process group, straight into the model's own tensors, so
                           memory holds the model once and the reader's buffers
  safetensors folder       model.safetensors or sharded (model-0000x-of-0000y.safetensors
                           with its index) without a config.json: read shard by shard
All but nanoGPT's need the model to load into: `--model module:function` or a Hugging
Face config. Key prefixes that wrappers add are taken off (`match_keys`): DDP's and
DeepSpeed's leading `module.`, torch.compile's `_orig_mod.`, FSDP1's
`_fsdp_wrapped_module.`, checkpoint_wrapper's `_checkpoint_wrapped_module.`, and a
leading path common to every key when the model's keys lack it (Lightning's `model.`,
torchtitan's top-level `model.`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

STATE_KEYS = ("model", "state_dict", "module", "model_state_dict", "state_dict_ema")
WRAPPER_SEGMENTS = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
ACCEPTED = ("a Hugging Face folder (config.json), a nanoGPT ckpt.pt, a state dict file "
            "(.pt/.pth/.bin/.ckpt: bare or under 'model', 'state_dict', 'module'), a "
            "torch.distributed.checkpoint folder (.metadata), a safetensors folder, or "
            "module:function")


def kind_of(path: Path) -> str:
    """'hf', 'dcp', 'safetensors' (folders) or 'file'; ValueError naming what is there."""
    if path.is_file():
        return "file"
    if not path.is_dir():
        raise ValueError(f"checkpoint {str(path)!r} is neither a directory, a file nor "
                         f"module:function; accepted: {ACCEPTED}")
    if (path / "config.json").is_file():
        return "hf"
    if (path / ".metadata").is_file():
        return "dcp"
    if any(path.glob("*.safetensors")):
        return "safetensors"
    found = sorted(p.name for p in path.iterdir())[:8]
    raise ValueError(f"checkpoint folder {str(path)!r} holds {found or 'nothing'}; accepted: "
                     f"{ACCEPTED}")


def read_file(path: Path) -> tuple[dict, str, dict | None]:
    """(state dict, what it was, nanoGPT model_args or None) of a torch.save file."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # not a zip checkpoint, or pickled classes beyond tensors
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:
            raise ValueError(f"{path}: torch.load(weights_only=True) cannot read it "
                             f"({str(e).splitlines()[0][:160]}); accepted: {ACCEPTED}") from e
    if not isinstance(ckpt, dict):
        raise ValueError(f"{path} holds a {type(ckpt).__name__}, not a dict; accepted: "
                         f"{ACCEPTED}")
    if isinstance(ckpt.get("model_args"), dict) and _is_state(ckpt.get("model")):
        return ckpt["model"], "nanoGPT ckpt.pt", ckpt["model_args"]
    for key in STATE_KEYS:
        if _is_state(ckpt.get(key)):
            what = "Lightning .ckpt" if "pytorch-lightning_version" in ckpt else \
                f"a state dict under {key!r}"
            return ckpt[key], what, None
    if _is_state(ckpt):
        return ckpt, "a state dict", None
    raise ValueError(f"{path}: found keys {list(ckpt)[:8]}, no state dict (a dict of tensors, "
                     f"bare or under {', '.join(map(repr, STATE_KEYS))}) and not nanoGPT's "
                     f"'model_args' + 'model'; accepted: {ACCEPTED}")


def _is_state(x) -> bool:
    return isinstance(x, dict) and len(x) > 0 and all(
        isinstance(k, str) for k in x) and any(isinstance(v, torch.Tensor) for v in x.values())


def strip_wrappers(key: str) -> str:
    """A key without the segments DDP, compile, FSDP1 and checkpoint_wrapper add."""
    for seg in WRAPPER_SEGMENTS:
        key = key.replace(seg, "")
    return key.removeprefix("module.")


def match_keys(keys, wanted) -> dict[str, str]:
    """{checkpoint key: model key} for the keys that name a model tensor, after the wrapper
    segments and then a common leading path the model lacks are taken off."""
    wanted = set(wanted)
    plain = {k: strip_wrappers(k) for k in keys}
    best = {k: v for k, v in plain.items() if v in wanted}
    firsts = {v.split(".", 1)[0] for v in plain.values() if "." in v}
    for first in firsts:  # Lightning's "model.", torchtitan's "model.": try each head
        cut = {k: v[len(first) + 1:] for k, v in plain.items() if v.startswith(first + ".")}
        hit = {k: v for k, v in cut.items() if v in wanted}
        if len(hit) > len(best):
            best = hit
    return best


def load_into(model: nn.Module, state: dict, source: str) -> None:
    """Copy `state` into `model` through `match_keys`; ValueError naming what is missing."""
    own = model.state_dict()
    mapping = match_keys(state, own)
    _check_complete(model, own, mapping, {k: tuple(v.shape) for k, v in state.items()
                                          if isinstance(v, torch.Tensor)}, source)
    with torch.no_grad():
        for k, name in mapping.items():
            own[name].copy_(state[k])


def _check_complete(model, own, mapping, shapes: dict, source) -> None:
    """Every parameter has a weight of its shape; buffers (causal masks, rotary tables) a
    model rebuilds itself may be absent."""
    got = set(mapping.values())
    filled = {own[k].data_ptr() for k in got}  # tied weights (lm_head = wte) come once
    buffers = {name for name, _ in model.named_buffers()}
    missing = [k for k in own if k not in got and k not in buffers
               and own[k].data_ptr() not in filled]
    for k, name in mapping.items():
        shape = tuple(shapes[k])
        if shape != tuple(own[name].shape):
            raise ValueError(f"{source}: {k!r} has shape {list(shape)}, the model's {name!r} "
                             f"{list(own[name].shape)}: the builder makes another model size")
    if missing:
        sample = sorted(shapes)[:4]
        raise ValueError(f"{source}: no weights for {len(missing)} of the "
                         f"{type(model).__name__}'s {len(own)} tensors (first: "
                         f"{missing[:3]}); the checkpoint's keys look like {sample}: pass "
                         "the builder of the model that saved it (--model module:function)")


def read_dcp(model: nn.Module, path: Path) -> str:
    """Load a torch.distributed.checkpoint folder into `model` in place, no process group."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(path)).read_metadata()
    tensors = {k: m for k, m in meta.state_dict_metadata.items()
               if isinstance(m, dcp.TensorStorageMetadata)}
    own = model.state_dict()
    mapping = match_keys(tensors, own)
    _check_complete(model, own, mapping, {k: tuple(m.size) for k, m in tensors.items()},
                    str(path))
    # DCP reads straight into these tensors (the model's own storage): one copy in memory
    target = {k: own[name] for k, name in mapping.items()}
    dcp.load(target, checkpoint_id=str(path), no_dist=True)
    return f"torch.distributed.checkpoint ({len(target)} tensors)"


def read_safetensors(model: nn.Module, path: Path) -> str:
    """Load every *.safetensors file of a folder into `model`, one shard at a time."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    own = model.state_dict()
    keys = {}
    for f in files:
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                keys[k] = (f, fh.get_slice(k).get_shape())
    mapping = match_keys(keys, own)
    _check_complete(model, own, mapping, {k: s for k, (_, s) in keys.items()}, str(path))
    with torch.no_grad():
        for f in files:
            with safe_open(str(f), "pt") as fh:
                for k in fh.keys():
                    if k in mapping:
                        own[mapping[k]].copy_(fh.get_tensor(k))
    return f"safetensors ({len(files)} file{'s' * (len(files) > 1)})"

