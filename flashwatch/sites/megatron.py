"""Megatron-core's self-attention (megatron/core/transformer/attention.py `SelfAttention`):
one fused Linear `linear_qkv` whose rows are grouped per query group, [q_g0 .. q_g(r-1) |
k_g | v_g] with r = num_attention_heads / num_query_groups (the "per_group_qkv" layout),
the call made by the sibling `core_attention`. Head counts live on its TransformerConfig
(`config.num_attention_heads`, `config.num_query_groups`, `config.kv_channels`), the
global ones even under tensor parallelism, which splits `linear_qkv` over whole groups.
Megatron's own core attention (baddbmm + softmax, or Transformer Engine's fused kernels)
calls no SDPA; a layer whose core attention does is measured."""

from torch import nn

from flashwatch.sites.layouts import TrainerLayout


def heads(module: nn.Module) -> tuple[int | None, int | None, int | None]:
    config = getattr(module, "config", None)
    H = getattr(config, "num_attention_heads", None)
    groups = getattr(config, "num_query_groups", None) or H
    return H, groups, getattr(config, "kv_channels", None)


LAYOUTS = (TrainerLayout(trainer="Megatron-core", requires=("core_attention",),
                         fused="linear_qkv", fused_layout="per_group_qkv", heads=heads),)
