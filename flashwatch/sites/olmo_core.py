"""OLMo-core 3's attention (olmo_core/nn/attention `Attention`): Linears `w_q`, `w_k`,
`w_v` (and `w_out`) on the module, heads in n_heads, n_kv_heads, head_dim; the call is
the module's own (its attention backend calls SDPA on the torch backend). QK-norm:
`q_norm`/`k_norm` over the whole width (applied before the head split) or per head
(`use_head_qk_norm`, after it); flashwatch/sites/layouts.py's QCheck reads either."""

from flashwatch.sites.layouts import TrainerLayout

LAYOUTS = (TrainerLayout(trainer="OLMo-core", separate=("w_q", "w_k", "w_v")),)
