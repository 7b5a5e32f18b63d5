"""`attn_implementation="fw_attention"`: Hugging Face attention layers through
flashwatch.attention, for the layers whose own path flashwatch cannot see.

flashwatch watches a layer's SDPA calls. Gemma2's layers never make one: they softcap
their logits (s = cap·tanh(s/cap)), which SDPA cannot compute, so transformers runs them
"eager" (matmul + softmax) and flashwatch refuses them at attach. Registered as an
attention implementation, this module's `attention_forward` computes the same function
with flashwatch.attention(softcap=, attn_mask=), so those layers are measured (every row's
δ, exact ties and max logit) and their head modes run:

    from flashwatch.integrations.hf_attention import register
    register()  # once, before loading: adds "fw_attention" to transformers' registries
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="fw_attention")
    # or, on a loaded model: model.set_attn_implementation("fw_attention")

Not "flashwatch": transformers treats any implementation name containing "flash" as a
request for a flash-attention kernel and tries to load one.

Masks are built as for "sdpa" (bool, True = attend: padding, sliding window) and passed
as attn_mask. On CUDA the call runs flashwatch's Triton kernels; elsewhere the PyTorch
reference, which is exact but slower than SDPA. Attention dropout is refused (the
kernels have none): fine-tuning recipes set it to 0.
"""

from __future__ import annotations

import torch

from flashwatch._checks import missing_extra

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as e:
    raise missing_extra("transformers", "transformers",
                        "flashwatch.integrations.hf_attention") from e

from flashwatch.kernels import dispatch

NAME = "fw_attention"


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, softcap: float | None = None,
                      position_bias: torch.Tensor | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, H, Nq, D], key and value
    [B, H_kv, Nk, D] (H_kv dividing H), attention_mask from `sdpa_mask` or None,
    position_bias (T5's learned relative bias) added to the scores as SDPA's path adds it.
    Returns ([B, Nq, H, D], None) as every implementation does. sliding_window and the
    other keywords arrive already folded into the mask (sliding_window is also passed to
    the kernels where it lets them skip work: `_window`)."""
    if dropout:
        raise ValueError(f"attn_implementation={NAME!r} has no attention dropout, got "
                         f"dropout={dropout}; set the model config's attention_dropout "
                         f"to 0.0, or use the model's own implementation")
    if key.shape[1] != query.shape[1]:  # grouped-query attention
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    dev = query.device.type
    if torch.is_autocast_enabled(dev):  # as SDPA under autocast: q, k, v in its dtype
        dt = torch.get_autocast_dtype(dev)
        query, key, value = query.to(dt), key.to(dt), value.to(dt)
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    # As transformers' SDPA path: the causal flag only without a mask, never for a single
    # query (a decode step sees every cached key).
    causal = bool(query.shape[2] > 1 and attention_mask is None and is_causal)
    if position_bias is not None:
        attention_mask, causal = _with_bias(position_bias, attention_mask, causal, query, key)
    # A mask that needs a gradient (a learned bias) gets it from the reference only; the
    # Triton kernels ("auto" on CUDA) would refuse the call.
    learned = attention_mask is not None and attention_mask.requires_grad and \
        torch.is_grad_enabled()
    out = dispatch.attention(query, key, value, causal=causal, scale=scaling,
                             attn_mask=attention_mask, softcap=softcap,
                             backend="reference" if learned else "auto",
                             sliding_window=_window(kwargs.get("sliding_window"), query, key))
    return out.transpose(1, 2).contiguous(), None


def _window(window, query, key) -> int | None:
    """The layer's sliding window, for the kernels to skip the key blocks outside it (the
    mask already hides them: the result is the same, O(N·window) work instead of O(N²)).
    Only when query i is key i (Nq == Nk: training, prefill without a cache): with cached
    keys the window's top-left indices would not be the positions', so the mask alone
    holds it there."""
    if not window or query.shape[2] != key.shape[2]:
        return None
    return int(window)


def _with_bias(bias, mask, causal: bool, query, key):
    """(one float mask, causal=False): T5's position_bias with the keys that `mask` (bool:
    False hides; float: added) or the causal flag hide at finfo.min, as SDPA's path."""
    bias = bias[..., :key.shape[2]]
    if mask is not None and mask.dtype != torch.bool:
        return bias + mask, False
    if mask is None and causal:
        i = torch.arange(query.shape[2], device=bias.device)
        mask = i[:, None] >= torch.arange(key.shape[2], device=bias.device)[None, :]
    if mask is None:
        return bias, False
    low = max(torch.finfo(key.dtype).min, torch.finfo(bias.dtype).min)
    return torch.where(mask, bias, low), False


def register() -> None:
    """Adds attn_implementation="fw_attention" (this attention and SDPA's masks) to
    transformers' global registries. Idempotent."""
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
