"""torchtitan 0.3.0's Module.parallelize gives every module that has a sharding config an
instance attribute `forward` (torchtitan/protocols/module.py, Module.parallelize:
`self.forward = forward_with_redistribution`, a closure over the `self.forward` found
then), the attention modules flashwatch watches among them; its trainer sets the
configs (Llama3Model.Config.update_from_config → set_llama3_sharding_config) and
parallelize_llama calls Module.parallelize on the default spmd_types backend. Watched
after parallelize, such a layer was left unmeasured (NaN, no monitor error); flashwatch
now wraps that forward, whether it attached before parallelize or after."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flashwatch as fw

LAYERS = 2
VOCAB = 2048  # the debugmodel's


def _llama(sharded: bool, seed=0):
    """torchtitan's Llama3 debugmodel cut to 2 layers, on its SDPA backend (the
    registry's FlexAttention needs a compiled BlockMask: tests/trainers/_trainers.py),
    with the sharding configs torchtitan's trainer sets if `sharded`."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    cfg = model_registry("debugmodel").model
    cfg.layers = cfg.layers[:LAYERS]
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    if sharded:
        set_llama3_sharding_config(
            cfg, enable_sp=ParallelismConfig().enable_sequence_parallel)
    torch.manual_seed(seed)
    model = cfg.build()
    model.init_states()
    return model


def _dims():
    from torchtitan.distributed import ParallelDims

    return ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)


def _parallelize_llama(model, tmp_path):
    """As torchtitan's trainer calls it (FSDP2 with BF16 parameters over one rank)."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.llama3 import parallelize_llama

    parallelize_llama(model, parallel_dims=_dims(), training=TrainingConfig(),
                      parallelism=ParallelismConfig(), compile_config=CompileConfig(),
                      ac_config=None, dump_folder=str(tmp_path))


def _attentions(model):
    return [model.get_submodule(f"layers.{i}.attention") for i in range(LAYERS)]


def _heads(model, watcher, steps=3):
    """Each step's heads (every step monitored): max logit, tied rows, δ error sum."""
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (2, 33), generator=g)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        report = watcher.step()
        out.append([(h.layer, h.head, h.attention_max_logit, h.tied_rowmax_ratio,
                     h.delta_error_sum) for h in report.heads])
    return out


def _watched(model, parallelize, watch_first: bool):
    """(heads of 3 steps, monitor errors, torchtitan's forward of each attention module
    is what remove() left there)."""
    if watch_first:
        w = fw.watch(model, every_n_steps=1)
        parallelize(model)
        titan = [a.__dict__["forward"] for a in _attentions(model)]
    else:
        parallelize(model)
        titan = [a.__dict__["forward"] for a in _attentions(model)]
        w = fw.watch(model, every_n_steps=1)
    assert all(f.__qualname__.endswith("forward_with_redistribution") for f in titan)
    heads = _heads(model, w)
    w.remove()
    restored = all(a.__dict__["forward"] is f
                   for a, f in zip(_attentions(model), titan, strict=True))
    return heads, w.monitor_errors_total, restored


@pytest.mark.parametrize("watch_first", [False, True], ids=["parallelize_then_watch",
                                                             "watch_then_parallelize"])
def test_module_parallelize_forward_is_measured(watch_first, torchtitan_on_cpu, gloo_world):
    """Module.parallelize alone (parallelize_llama's first step; at 1 rank it changes no
    number): measured exactly as the same model without sharding configs, whose
    attention modules keep their class forward."""
    plain = _llama(sharded=False)
    assert not any("forward" in a.__dict__ for a in _attentions(plain))
    w = fw.watch(plain, every_n_steps=1)
    want = _heads(plain, w)
    w.remove()
    assert all(h[2] == h[2] for step in want for h in step)  # measured: no NaN
    got = _watched(_llama(sharded=True), lambda m: m.parallelize(_dims()), watch_first)
    assert got == (want, 0, True)


def test_parallelize_llama_then_watch(torchtitan_on_cpu, gloo_world, tmp_path):
    """The whole parallelize_llama (then fully_shard at 1 rank, BF16 parameters): watched
    after it, measured as when watched before it."""
    def parallelize(model):
        _parallelize_llama(model, tmp_path)

    after = _watched(_llama(sharded=True), parallelize, watch_first=False)
    before = _watched(_llama(sharded=True), parallelize, watch_first=True)
    assert after == before and after[1:] == (0, True)
    assert all(h[2] == h[2] for step in after[0] for h in step)
