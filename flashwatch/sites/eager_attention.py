"""Attention layers that make no attention call flashwatch sees, found when the watcher
attaches.

flashwatch measures and routes a layer's F.scaled_dot_product_attention calls, its
calls to flashwatch.attention, and torch's FlexAttention (torch.nn.attention.
flex_attention) and varlen calls (flashwatch/monitor/flex.py). A layer that computes
softmax(QKᵀ)V itself makes none of them: its reports would hold NaN max logits and no δ
rows, and QK-clip would never fire.
Hugging Face layers say which function they call through `config._attn_implementation`:
"sdpa" calls SDPA (transformers' integrations/sdpa_attention.py); "flex_attention"
calls torch's flex_attention (integrations/flex_attention.py, compiled: flashwatch's
measured steps run it eagerly, where it is seen); "eager" computes matmul + softmax in
the modeling module (`eager_attention_forward`), "flash_attention_*" calls its own
kernels. Some classes never call an attention function whatever the setting (Bloom:
baddbmm with ALiBi, then softmax).

Measuring such a layer would need the probe to recompute exactly what that function
computes, so these layers are refused by name at attach, with the fix: load the model
with attn_implementation="sdpa" (or "flex_attention") where transformers supports it
for that model, or "fw_attention" (flashwatch/integrations/hf_attention.py:
flashwatch.attention, which also computes Gemma2's logit softcapping, tanh(s / c)·c,
that SDPA cannot).
Hand-written attention that no attribute reveals is caught at the first monitored step
instead (the watcher's "made no attention call flashwatch saw" warning).
"""

from __future__ import annotations

from torch import nn

# Implementations whose calls flashwatch sees: SDPA, torch's flex_attention (its
# higher-order op: flashwatch/monitor/flex.py), and flashwatch.attention registered by
# flashwatch/integrations/hf_attention.py (its NAME; not imported: no transformers here).
WATCHABLE = ("sdpa", "flex_attention", "fw_attention")
FW_FIX = ('call flashwatch.integrations.hf_attention.register() and load the model with '
          'attn_implementation="fw_attention" (or model.set_attn_implementation('
          '"fw_attention")) to watch it')

# Attention classes whose forward computes attention itself, whatever the config says.
NEVER_SDPA = {"BloomAttention": "it computes baddbmm(ALiBi, Q, Kᵀ) and a softmax itself"}


def no_sdpa_reason(module: nn.Module) -> str | None:
    """Why `module` (an attention layer) makes no attention call flashwatch can see (SDPA,
    FlexAttention, flashwatch.attention), or None when nothing says so."""
    cls = type(module).__name__
    for base in type(module).__mro__:  # a watched class is a subclass of the original
        if base.__name__ in NEVER_SDPA:
            return f"{base.__name__}: {NEVER_SDPA[base.__name__]}, never SDPA"
    config = getattr(module, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if not isinstance(impl, str) or impl in WATCHABLE:
        return None
    softcap = getattr(module, "attn_logit_softcapping", None) or getattr(
        config, "attn_logit_softcapping", None)
    why = (f'{cls} runs attn_implementation="{impl}", which makes no attention call '
           f'flashwatch sees (SDPA or FlexAttention)')
    if softcap:
        return (f"{why}, and its logits are softcapped (tanh(s / {softcap})·{softcap}), "
                f"which SDPA cannot compute; {FW_FIX}")
    return (f'{why}; load the model with attn_implementation="sdpa" (or '
            f'"flex_attention") to watch it')


def refuse_no_sdpa(sites) -> None:
    """ValueError naming every site whose layer makes no attention call flashwatch sees
    (`no_sdpa_reason`)."""
    bad = [(s.name, r) for s in sites if (r := no_sdpa_reason(s.module)) is not None]
    if not bad:
        return
    lines = [f"  - {name}: {reason}" for name, reason in bad[:8]]
    if len(bad) > 8:
        lines.append(f"  - ... and {len(bad) - 8} more")
    raise ValueError(
        f"flashwatch cannot measure {len(bad)} attention layer(s): it sees "
        "F.scaled_dot_product_attention, FlexAttention and flashwatch.attention calls, "
        "and these make none:\n" + "\n".join(lines)
        + '\nLoad the model with attn_implementation="sdpa" (e.g. '
        'AutoModelForCausalLM.from_pretrained(..., attn_implementation="sdpa"), or '
        'model.set_attn_implementation("sdpa") on a loaded model; "flex_attention" is '
        'watched too), or with "fw_attention" '
        '(flashwatch.integrations.hf_attention.register() first; it also computes '
        'softcapping), or pass sites= without these layers.'
    )
