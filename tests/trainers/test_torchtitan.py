"""flashwatch.watch on torchtitan 0.3.0's own Llama3 (tests/trainers/_trainers.py):
found without sites=, one site per layer named by its attention module, 16 heads each,
and every head's max logit and tied rows equal to the FP64 truth of the step's forward,
over two BF16 AdamW steps."""

from __future__ import annotations

import pytest
import torch
from _trainers import TITAN_VOCAB, titan_llama, titan_sites, watch_and_check


@pytest.mark.parametrize("ac", [None, "full", "selective"])
@pytest.mark.parametrize("fuse_qkv", [True, False], ids=["wqkv", "wq_wk_wv"])
def test_llama3_found_and_measured(fuse_qkv, ac):
    """Activation checkpointing by torchtitan's FullAC and SelectiveAC (SelectiveAC
    crashed the monitored step before flashwatch/monitor/checkpointing.py)."""
    watch_and_check(titan_llama(fuse_qkv=fuse_qkv, ac=ac), TITAN_VOCAB, titan_sites(),
                    row=("torchtitan 0.3.0", f"Llama3, fuse_qkv={fuse_qkv}",
                         f"1 process, BF16 autocast, AC {ac or 'none'}"))


@pytest.mark.parametrize("fuse_qkv", [True, False], ids=["wqkv", "wq_wk_wv"])
def test_llama3_gqa_found_and_measured(fuse_qkv):
    """16 query heads on 4 KV heads: the fused wqkv holds per KV group 4 heads' q rows,
    then k, then v."""
    watch_and_check(titan_llama(fuse_qkv=fuse_qkv, n_kv_heads=4), TITAN_VOCAB,
                    titan_sites(), row=("torchtitan 0.3.0", f"Llama3 GQA, fuse_qkv={fuse_qkv}",
                                        "1 process, BF16 autocast"))


def test_parallelized_llama3_on_one_cpu_rank(torchtitan_on_cpu, gloo_world, tmp_path):
    """torchtitan's parallelize_llama as its trainer calls it (SelectiveAC, then FSDP2
    with BF16 parameters over a mesh of 1 rank), on CPU with gloo."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.models.llama3 import parallelize_llama

    model = titan_llama()
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    parallelize_llama(model, parallel_dims=dims, training=TrainingConfig(),
                      parallelism=ParallelismConfig(), compile_config=CompileConfig(),
                      ac_config=SelectiveAC.Config(), dump_folder=str(tmp_path))
    assert type(model).__name__ == "FSDPLlama3Model"  # fully_shard's class: it ran
    watch_and_check(model, TITAN_VOCAB, titan_sites(),
                    row=("torchtitan 0.3.0", "Llama3, fuse_qkv=True",
                         "parallelize_llama: SelectiveAC + FSDP2, 1 gloo rank"))


@pytest.mark.parametrize("ac", [None, "selective"])
def test_llama3_compiled_per_block(ac, torchtitan_on_cpu):
    """torchtitan's apply_compile (each TransformerBlock compiled, fullgraph=True, after
    activation checkpointing as parallelize_llama orders them), aot_eager on CPU: the
    monitored steps measure what the compiled blocks compute."""
    from torchtitan.config import CompileConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.compile import apply_compile

    torch._dynamo.reset()
    model = titan_llama(ac=ac)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    apply_compile(model, compile_config=CompileConfig(enable=True, backend="aot_eager"),
                  parallel_dims=dims)
    watch_and_check(model, TITAN_VOCAB, titan_sites(),
                    row=("torchtitan 0.3.0", "Llama3, fuse_qkv=True",
                         f"apply_compile per block (aot_eager), AC {ac or 'none'}"))
