"""The real trainers' models for tests/trainers, built tiny with the trainers' own code
(torchtitan 0.3.0's Llama3, OLMo-core 3.0.0's transformer; nothing of theirs is copied
here), a BF16 training step that records what each forward handed SDPA, and what
torchtitan needs to run its parallelize/compile/pipeline functions on a CPU."""

from __future__ import annotations

import contextlib
import importlib

import torch
import torch.nn.functional as F
from sdpa_calls import SdpaCalls, check_heads, head_truth

import flashwatch as fw

# ------------------------------------------------------------------------- torchtitan

TITAN_HEADS = 16  # debugmodel: dim 256, 16 heads of 16, vocab 2048
TITAN_VOCAB = 2048


def titan_llama(*, fuse_qkv=True, n_kv_heads=None, ac=None, n_layers=2, seed=0,
                sharded=False):
    """torchtitan's Llama3 "debugmodel" cut to `n_layers` layers. fuse_qkv: one
    `attention.qkv_linear.wqkv` (rows per KV group: its heads' q, then k, then v) or
    `wq`/`wk`/`wv`; n_kv_heads < 16: GQA; ac: None, "full" or "selective" (torchtitan's
    FullAC / SelectiveAC, each block in a checkpoint_wrapper). sharded: with the
    sharding configs torchtitan's trainer sets (SequenceParallel on, its default), which
    its parallelize functions apply.

    The registry's layers use FlexAttention, which needs a BlockMask built by a compiled
    create_block_mask from positions; on CPU we swap in torchtitan's own SDPA backend (a
    causal F.scaled_dot_product_attention), as a user debugging on CPU would."""
    from torchtitan.models.common import compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import _build_llama3_layers, model_registry

    cfg = model_registry("debugmodel").model
    # fuse_qkv and n_kv_heads are arguments of the registry's layer builder only (not
    # fields a Config can flip: the fused and separate QKV configs are different
    # classes), so the layers are rebuilt with the debugmodel's own sizes and RoPE.
    cfg.layers = _build_llama3_layers(
        n_layers=n_layers, dim=cfg.dim, n_heads=TITAN_HEADS, n_kv_heads=n_kv_heads,
        hidden_dim=compute_ffn_hidden_dim(cfg.dim, multiple_of=256),
        rope=cfg.layers[0].attention.rope, fuse_qkv=fuse_qkv, attn_backend="flex")
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    if sharded:
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        set_llama3_sharding_config(cfg, enable_sp=True)
    torch.manual_seed(seed)
    model = cfg.build()
    model.init_states()  # parameters by the configs' param_init, and the RoPE buffer
    if ac is not None:
        from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

        policy = {"full": FullAC, "selective": SelectiveAC}[ac]
        # apply() also turns Dynamo's LRU cache off for the process (SAC × PP × Flex)
        policy.Config().build().apply(model)
    return model


def titan_sites(n_layers=2):
    return [f"layers.{i}.attention" for i in range(n_layers)]


# torchtitan.tools.utils sets device_type = _get_available_device_type() or "cuda" at
# import, and these modules copy it (`from torchtitan.tools.utils import device_type`):
# without an accelerator every one says "cuda". ParallelDims' mesh (parallelize_llama,
# pipeline_llm) then calls torch.cuda.set_device ("torch._C has no attribute
# _cuda_setDevice" on a CPU torch), and init_distributed picks nccl and synchronizes
# torch.cuda. activation checkpointing and apply_compile read neither. Its Trainer also
# asks the device module for a name, properties and memory statistics (metrics.py's
# DeviceMemoryMonitor), which torch.cpu does not have.
TITAN_DEVICE_MODULES = ("torchtitan.tools.utils", "torchtitan.distributed.parallel_dims",
                        "torchtitan.distributed.utils", "torchtitan.components.metrics")


class _CpuDevice:
    """torch.cpu with what torchtitan's Trainer asks of a device module besides: a
    name, a device's total memory, memory statistics (none), set_device and the index
    of the one CPU device."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(device=None):
        return "cpu"

    @staticmethod
    def get_device_properties(device=None):
        import types

        return types.SimpleNamespace(total_memory=1 << 34, name="cpu")

    @staticmethod
    def memory_stats(device=None):
        return {}

    @staticmethod
    def reset_peak_memory_stats(device=None):
        pass

    @staticmethod
    def empty_cache():
        pass

    @staticmethod
    def set_device(device):
        pass

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def current_device():  # torch.cpu's is "cpu"; barrier(device_ids=[...]) wants an int
        return 0


@contextlib.contextmanager
def torchtitan_on_cpu():
    """torchtitan's module-level device_type "cpu" and device_module a CPU one while
    inside, the values it had after."""
    saved = []
    for name in TITAN_DEVICE_MODULES:
        mod = importlib.import_module(name)
        for attr, value in (("device_type", "cpu"), ("device_module", _CpuDevice())):
            if hasattr(mod, attr):
                saved.append((mod, attr, getattr(mod, attr)))
                setattr(mod, attr, value)
    # torchtitan 0.3.0's Trainer.train calls torch.distributed.set_timeout after its
    # first step (set_pg_timeouts), which torch 2.13.0 lacks ("module 'torch.distributed'
    # has no attribute 'set_timeout'", with or without flashwatch); its ProcessGroup has
    # the method
    import torch.distributed as dist

    if not hasattr(dist, "set_timeout"):
        def set_timeout(timeout, group=None):
            (group or dist.group.WORLD).set_timeout(timeout)

        saved.append((dist, "set_timeout", None))
        dist.set_timeout = set_timeout
    # Its PP loop calls schedule.step(arg_mbs=, kwarg_mbs=, target_mbs=): microbatch lists,
    # which torch 2.13.0's step() lacks (they land in **kwargs and are split as one batch:
    # "Expecting 2 arg_mbs but got 1"); single-stage schedules (1F1B, GPipe) get them
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    plain_step = PipelineScheduleSingle.step

    def step(self, *args, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None,
             return_outputs=True, loss_kwargs=None, **kwargs):
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return plain_step(self, *args, losses=losses, return_outputs=return_outputs,
                              loss_kwargs=loss_kwargs, **kwargs)
        self._stage.has_backward = self._has_backward  # what step() does before its split
        self._stage.clear_runtime_states()
        self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs,
                                loss_kwargs=loss_kwargs)
        return None

    saved.append((PipelineScheduleSingle, "step", plain_step))
    PipelineScheduleSingle.step = step
    try:
        yield
    finally:
        for mod, attr, value in reversed(saved):
            if value is None:
                delattr(mod, attr)
            else:
                setattr(mod, attr, value)


# --------------------------------------------------------------------------- OLMo-core

OLMO_HEADS = 8  # d_model 128: 8 heads of 16
OLMO_VOCAB = 256


def olmo_transformer(*, n_kv_heads=None, qk_norm=None, n_layers=2, seed=0):
    """OLMo-core's llama_like transformer, d_model 128, 8 heads, on its "torch" attention
    backend (TorchAttentionBackend: repeats K/V for GQA, then a causal
    F.scaled_dot_product_attention). qk_norm: None, "whole" (RMSNorm over all heads'
    q and over all k, before the head split: OLMo 2) or "head" (use_head_qk_norm: over
    each head's q and k, Qwen3-style)."""
    from olmo_core.nn.attention import AttentionBackendName
    from olmo_core.nn.transformer import TransformerConfig

    cfg = TransformerConfig.llama_like(
        d_model=128, vocab_size=OLMO_VOCAB, n_layers=n_layers, n_heads=OLMO_HEADS,
        n_kv_heads=n_kv_heads, qk_norm=qk_norm is not None,
        use_head_qk_norm=qk_norm == "head", hidden_size_multiple_of=128,
        attn_backend=AttentionBackendName.torch, init_seed=seed)
    model = cfg.build(init_device="cpu")
    model.init_weights(max_seq_len=64, device=torch.device("cpu"))  # seeded by init_seed
    return model


def olmo_sites(n_layers=2):
    return [f"blocks.{i}.attention" for i in range(n_layers)]


# ------------------------------------------------------------------------ the training


def train(model, watcher, vocab, *, steps=2, B=2, N=64, lr=1e-3, seed=0):
    """`steps` AdamW steps in BF16 autocast on seeded random tokens, next-token
    cross-entropy, watcher.step() after each; per step (its report, the SDPA calls its
    forward made, in call order). Only the forward is recorded: activation
    checkpointing's recompute in the backward is not."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (B, N + 1), generator=g)
        with SdpaCalls() as seen, torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append((watcher.step(), seen.calls))
    return out


# What the tests found, for docs/compatibility.md's trainers table
# (tests/trainers/test_zz_compatibility.py): (trainer, model, recipe) -> (layout, measured)
ROWS: dict[tuple[str, str, str], tuple[str, str]] = {}


def record(key: tuple[str, str, str], watcher_sites, measured: str) -> None:
    """Row `key` of the table, written by a test after its checks passed."""
    s = watcher_sites[0]
    heads = f"{s.layer_heads} heads" + (f" on {s.num_kv_heads * s.layer_heads // s.num_heads}"
                                        " KV" if s.num_kv_heads != s.num_heads else "")
    ROWS[key] = (f"{s.name}: {s.kind}, {s.layout}, {heads}", measured)


def watch_and_check(model, vocab, sites, row=None):
    """fw.watch(model) without sites=, two monitored steps (train), then: no monitor
    error, and each report holds exactly the heads of `sites` (one per attention call,
    in call order), every head's max logit within 1e-4 and tied rows equal to the FP64
    truth of that step's forward."""
    w = fw.watch(model, every_n_steps=1)
    steps = train(model, w, vocab)
    w.remove()
    assert w.monitor_errors_total == 0
    for report, calls in steps:
        check_heads(report, calls, sites, rel=1e-4)
    # the truth has tied rows (0-14 per head of 128 rows at seed 0; 8 to 202 in all over
    # the two steps of each model tested): the exact tie comparison above could fail
    assert sum(int(head_truth(c)[0].sum()) for _, calls in steps for c in calls) > 0
    if row is not None:
        record(row, w.sites, "every head: max logit ≤ 1e-4, ties exact vs FP64; 0 errors")


# --------------------------------------------------------------- sharded-model steps


def forward_backward(model, tokens):
    """A forward and backward in FP32 (so the unsharded model is a truth to 1e-4), the
    weights left as they are (W^Q σ is then the unsharded model's); the SDPA calls of
    the forward. The loss is any function of the logits (the truths are of the forward):
    under TP they are this rank's vocabulary shard (the trainer's loss_parallel takes
    them as they are), or a DTensor."""
    with SdpaCalls() as seen:
        logits = model(tokens)
    logits = logits.full_tensor() if callable(getattr(logits, "full_tensor", None)) else logits
    logits.float().square().mean().backward()
    model.zero_grad()
    return seen.calls


def step_record(watcher, calls) -> dict:
    """watcher.step() after `forward_backward`, as a rank saves it: the FP64 truths of
    its own SDPA calls, its monitor errors, and every (layer, head, max logit, tie ratio,
    W^Q σ) of the report."""
    report = watcher.step()
    return dict(calls=[head_truth(c) for c in calls], errors=watcher.monitor_errors_total,
                heads=[(h.layer, h.head, h.attention_max_logit, h.tied_rowmax_ratio,
                        h.wq_spectral_norm) for h in report.heads])
