"""Which query rows are real tokens, and the score masks of a forward, built once.

Padding rows are left out of ties, max logit and δ statistics: a [PAD] query's scores
are not the model's (all-MiniLM-L6-v2, 8 sentences with 42 of 160 rows padding: a head's
max logit 9.45 from a padding row, 7.34 over real tokens). Where the mask comes from:
  - `Watcher.set_valid_tokens(mask)`: [B, N], True (or 1) = real token; it applies to the
    forwards that follow until it is changed or cleared with None;
  - Hugging Face models: the `attention_mask` their forward receives (`hook_models`),
    read at each forward of the outermost PreTrainedModel in the watched model (in an
    encoder-decoder model it covers the encoder's layers, `decoder_attention_mask` the
    decoder's). A mask given by hand wins over it.
A call whose [B, Nq] is not the mask's (cross-attention, a cached decode step) counts
every row, and says so once per layer.

The additive score mask (causal, sliding window, the call's attn_mask) is the same for
every layer of a forward: built once per (mask, shape) and reused (`Tokens.bias`).
"""

from __future__ import annotations

import inspect
import math
import sys
from dataclasses import dataclass

import torch
from torch import nn

from flashwatch.monitor import probe


@dataclass(frozen=True, eq=False)
class ValidRows:
    """The real query rows of calls of one [B, Nq], on one device."""

    mask: torch.Tensor  # [B, Nq] float 1 real, 0 padding
    row_bias: torch.Tensor  # [B, 1, Nq, 1] FP32: 0 real, -inf padding
    count: torch.Tensor  # [] float64 real rows


_CACHE = 8  # score masks kept per step: one per distinct mask and shape of a forward


class Tokens:
    """A watcher's valid-token mask and the per-forward caches built from it."""

    def __init__(self, warn_once):
        self.warn_once = warn_once  # (st, key, message)
        self.explicit: torch.Tensor | None = None  # set_valid_tokens: [B, N], 0 = padding
        # a Hugging Face model's masks: (mask, the ids of the modules it covers or None)
        self.auto: list = []
        self._rows: dict = {}
        self._bias: list = []  # (attn_mask, its version, key, bias)

    def set(self, mask: torch.Tensor | None) -> None:
        self.explicit = mask
        self._rows.clear()

    def clear(self) -> None:
        """A new step: the caches go, the masks stay."""
        self._rows.clear()
        self._bias.clear()

    def rows(self, st, B: int, Nq: int, device) -> ValidRows | None:
        mask = self.explicit
        if mask is None:
            mask = next((m for m, ids in self.auto
                         if ids is None or id(st.site.module) in ids), None)
        if mask is None:
            return None
        if tuple(mask.shape) != (B, Nq):
            self.warn_once(st, "tokens", f"flashwatch: {st.site.name}: an attention call "
                           f"with {B} × {Nq} query rows, not the valid-token mask's "
                           f"{tuple(mask.shape)} (cross-attention, or a cached decode "
                           f"step?): its rows are all counted, padding or not")
            return None
        key = (id(mask), device)
        got = self._rows.get(key)
        if got is None or got[0] is not mask:
            m = mask.to(device, non_blocking=True) != 0
            bias = torch.zeros(B, 1, Nq, 1, device=device).masked_fill_(
                ~m[:, None, :, None], -math.inf)
            got = (mask, ValidRows(mask=m.double(), row_bias=bias,
                                   count=m.sum(dtype=torch.float64)))
            self._rows[key] = got
        return got[1]

    def bias(self, attn_mask, causal: bool, window, Nq: int, Nk: int, device):
        """probe.score_bias of the call, reused while the same mask and shape recur."""
        version = None if attn_mask is None else attn_mask._version
        key = (bool(causal), window, Nq, Nk, device)
        for m, ver, k, b in self._bias:
            if m is attn_mask and ver == version and k == key:
                return b
        b = probe.score_bias(Nq, Nk, causal=causal, attn_mask=attn_mask,
                             sliding_window=window, device=device)
        if len(self._bias) >= _CACHE:
            self._bias.pop(0)
        self._bias.append((attn_mask, version, key, b))
        return b


def as_mask(mask) -> torch.Tensor | None:
    """`Watcher.set_valid_tokens`'s argument checked: a [B, N] bool tensor, or None."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"set_valid_tokens(mask): mask must be a [batch, tokens] tensor "
                        f"(True or 1 = a real token) or None, got {type(mask).__name__}")
    if mask.dim() != 2:
        raise ValueError(f"set_valid_tokens(mask): mask must be [batch, tokens] (the "
                         f"attention_mask a tokenizer returns), got shape "
                         f"{tuple(mask.shape)}")
    return mask.detach()


def hook_models(model: nn.Module, tokens: Tokens) -> list:
    """Forward pre-hooks on the outermost Hugging Face PreTrainedModels in `model` that
    hand the masks of each forward to `tokens.auto`: `attention_mask` (an encoder-
    decoder's: its encoder's layers only) and `decoder_attention_mask` (its decoder's).
    A forward that passes none, or a 4-D mask (those hide keys, not query rows), leaves
    the rows unmasked. Returns the handles."""
    tf = sys.modules.get("transformers")  # not imported by the user: no HF model here
    base = getattr(tf, "PreTrainedModel", None) if tf is not None else None
    if base is None:
        return []
    handles, inside = [], []
    for name, m in model.named_modules():
        if not isinstance(m, base) or any(name.startswith(p) for p in inside):
            continue
        inside.append(f"{name}." if name else "")
        try:
            params = list(inspect.signature(m.forward).parameters)
        except (TypeError, ValueError):
            continue
        scopes = _scopes(m)
        masks = [(p, params.index(p), scopes[p]) for p in scopes if p in params]
        if masks:
            handles.append(m.register_forward_pre_hook(_mask_hook(tokens, masks),
                                                       with_kwargs=True))
    return handles


def _scopes(m: nn.Module) -> dict:
    """Which layers each mask argument covers: None = all of them."""
    if not getattr(getattr(m, "config", None), "is_encoder_decoder", False):
        return {"attention_mask": None}
    out = {}
    for arg, part in (("attention_mask", "get_encoder"), ("decoder_attention_mask",
                                                            "get_decoder")):
        sub = getattr(m, part, None)
        sub = sub() if callable(sub) else None
        if isinstance(sub, nn.Module):
            out[arg] = {id(x) for x in sub.modules()}
    return out


def _mask_hook(tokens: Tokens, masks: list):
    def hook(module, args, kwargs):
        # kept as given: converted once, on the first monitored call that reads it
        found = []
        for name, position, ids in masks:
            m = kwargs.get(name, args[position] if len(args) > position else None)
            if isinstance(m, torch.Tensor) and m.dim() == 2:
                found.append((m, ids))
        tokens.auto = found
    return hook
