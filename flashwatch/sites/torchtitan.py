"""torchtitan 0.3's attention (torchtitan/models/common/attention.py `GQAttention`): the
projections sit one level down, in `qkv_linear`, and the attention call is made by the
sibling `inner_attention` (SDPA, FlexAttention or varlen), so the site is the attention
module itself, e.g. "layers.0.attention". Heads: n_heads, n_kv_heads, head_dim on it.

- `fuse_qkv=True` (the default since 0.3): one Linear `qkv_linear.wqkv`, rows
  [n_kv_heads, heads_per_kv + 2, head_dim]: per K/V group its query heads, then k, then
  v — the "per_group_qkv" layout (flashwatch/sites/layouts.py).
- `fuse_qkv=False`: `qkv_linear.wq`, `wk`, `wv`.
Older torchtitan (wq, wk, wv directly on the attention module) is discovery's generic
separate-projection layout.
"""

from flashwatch.sites.layouts import TrainerLayout

FUSED = TrainerLayout(trainer="torchtitan", holder="qkv_linear", requires=("inner_attention",),
                      fused="wqkv", fused_layout="per_group_qkv")
SEPARATE = TrainerLayout(trainer="torchtitan", holder="qkv_linear",
                         requires=("inner_attention",), separate=("wq", "wk", "wv"))
LAYOUTS = (FUSED, SEPARATE)
