"""flashwatch.watch on OLMo-core 3.0.0's own transformer (tests/trainers/_trainers.py):
found without sites=, one site per block named by its attention module, 8 heads each,
and every head's max logit and tied rows equal to the FP64 truth of the step's forward,
over two BF16 AdamW steps."""

from __future__ import annotations

import pytest
from _trainers import OLMO_VOCAB, olmo_sites, olmo_transformer, watch_and_check

VARIANTS = {
    "plain": {},
    "gqa": dict(n_kv_heads=2),  # 8 query heads on 2 KV heads
    "qk_norm": dict(qk_norm="whole"),  # OLMo 2: RMSNorm over all heads' q, over all k
    "head_qk_norm": dict(qk_norm="head"),  # use_head_qk_norm: over each head's q and k
    "gqa_head_qk_norm": dict(n_kv_heads=2, qk_norm="head"),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_transformer_found_and_measured(variant):
    watch_and_check(olmo_transformer(**VARIANTS[variant]), OLMO_VOCAB, olmo_sites(),
                    row=("OLMo-core 3.0.0", f"llama_like, {variant}",
                         "1 process, BF16 autocast"))
