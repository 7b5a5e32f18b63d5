"""flashwatch on torchtitan 0.3.0's Llama3 with the attention backends its language models
are built with: FlexAttention (its default) and varlen. It no longer builds the SDPA one
for them (models/common/config_utils.py get_attention_config: "sdpa is no longer
supported for language models"), which the other tests of this folder swap in.

Both backends mask by documents: torchtitan's dataloader ends each document with the
tokenizer's EOS and starts the next one's positions at 0, and the model's
get_attention_masks turns the positions into a BlockMask of causal & packed-document
mask mods (flex) or cumulative document offsets (varlen). Here the tokens are seeded
random ids with EOS where documents end, the positions as that dataloader makes them.

Forward-only monitored steps on CPU (torch has no FlexAttention backward on CPU; its
Trainer trains through both backends, the backward on stand-ins, in
test_torchtitan_trainer_flex.py):
watched after the model is built, the masks made by the model's own code and a forward
under no_grad, then watcher.step(). On measured steps flashwatch runs torch.compile'd
functions eagerly, torchtitan's compiled create_block_mask and flex_attention among
them, so nothing is compiled by inductor here. Every head of every layer against the
FP64 truth of the q and k its layer's inner attention received, computed per document
(causal inside each), independently of torchtitan's masks.

varlen: torch's op (torch_attn::_varlen_attn, which flashwatch reads) runs flash
attention, which has no CPU kernel; the `varlen_on_cpu` fixture registers a stand-in
CPU kernel for that op (tests/attention_standins.py), for the test only."""

from __future__ import annotations

import math

import pytest
import torch
from _trainers import TITAN_HEADS, TITAN_VOCAB, record
from attention_standins import cpu_varlen

import flashwatch as fw

LAYERS = 2
N = 64  # tokens per row
EOS = 1  # the document separator of these tokens (the others are drawn from 2 up)
EPS = fw.WatchConfig().eps
NAMES = [f"layers.{i}.attention" for i in range(LAYERS)]
# where each row's documents end (an EOS); a row's last document runs to its end
PACKINGS = {
    "causal": ([], []),  # one document per row: plain causal attention
    "documents": ([20, 41], [9]),
    "documents_batch_1": ([20, 41],),  # torchtitan's batch-1 packed-document mask_mod
}
DTYPES = {torch.float32: "FP32", torch.bfloat16: "BF16"}
MEASURED = "every head: max logit ≤ 1e-4, ties exact vs FP64 per document; 0 errors"


def _llama(backend: str, dtype=torch.float32, n_kv_heads=None):
    """torchtitan's Llama3 debugmodel (its registry, `backend` as its inner attention)
    cut to 2 layers, its parameters in `dtype`; n_kv_heads: GQA, its layers rebuilt by
    the registry's layer builder with the debugmodel's sizes (_trainers.titan_llama)."""
    from torchtitan.models.common import compute_ffn_hidden_dim
    from torchtitan.models.llama3 import _build_llama3_layers, model_registry

    cfg = model_registry("debugmodel", attn_backend=backend).model
    cfg.layers = cfg.layers[:LAYERS]
    if n_kv_heads is not None:
        cfg.layers = _build_llama3_layers(
            n_layers=LAYERS, dim=cfg.dim, n_heads=TITAN_HEADS, n_kv_heads=n_kv_heads,
            hidden_dim=compute_ffn_hidden_dim(cfg.dim, multiple_of=256),
            rope=cfg.layers[0].attention.rope, attn_backend=backend)
    torch.manual_seed(0)
    model = cfg.build()
    model.init_states()
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def _packed(ends, seed):
    """(tokens [B, N], positions [B, N], documents [(row, start, end)]) for rows whose
    documents end at `ends` (an EOS there): positions restart at 0 after each EOS, as
    torchtitan's text dataloader writes them."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(EOS + 1, TITAN_VOCAB, (len(ends), N), generator=g)
    positions = torch.empty_like(tokens)
    docs = []
    for b, row in enumerate(ends):
        tokens[b, row] = EOS
        start = 0
        for t in range(N):
            positions[b, t] = t - start
            if tokens[b, t] == EOS or t == N - 1:
                docs.append((b, start, t + 1))
                start = t + 1
    return tokens, positions, docs


def _inputs_seen(model):
    """What each layer's inner attention is called with: per call (q, k [B, H, N, D],
    scale, attention_masks); and the hooks' handles."""
    calls, handles = [], []

    def hook(module, args, kwargs):
        q, k = args[0].detach().transpose(1, 2), args[1].detach().transpose(1, 2)
        calls.append((q, k, kwargs.get("scale"), kwargs.get("attention_masks")))

    for i in range(LAYERS):
        inner = model.get_submodule(f"layers.{i}.attention.inner_attention")
        handles.append(inner.register_forward_pre_hook(hook, with_kwargs=True))
    return calls, handles


def document_truth(q, k, scale, docs):
    """FP64 per head: the max scaled score over every query row, and the rows with a
    tie (a second score within EPS of the row's max); each document's rows see the keys
    of that document up to their own position."""
    H = q.shape[1]
    if k.shape[1] != H:
        k = k.repeat_interleave(H // k.shape[1], 1)
    scale = scale or 1 / math.sqrt(q.shape[-1])
    mx = torch.full((H,), -math.inf, dtype=torch.float64)
    tied = torch.zeros(H, dtype=torch.int64)
    for b, s, e in docs:
        scores = (q[b, :, s:e].double() @ k[b, :, s:e].double().transpose(-1, -2)) * scale
        scores = scores.masked_fill(torch.ones(e - s, e - s, dtype=torch.bool).triu(1),
                                    -math.inf)
        rowmax = scores.amax(-1, keepdim=True)
        tied += ((scores >= rowmax - EPS).sum(-1) >= 2).sum(-1)
        mx = torch.maximum(mx, rowmax.amax((-2, -1)))
    return mx, tied


def check_report(report, calls, docs, rows):
    """The report holds the 16 heads of both layers, each measured (no NaN), its max
    logit within 1e-4 and its tied rows equal to the document truth of the q and k its
    layer's inner attention received; (the largest relative max-logit error, the tied
    rows of the truth)."""
    by = {(h.layer, h.head): h for h in report.heads}
    assert sorted(by) == sorted((n, h) for n in NAMES for h in range(TITAN_HEADS))
    assert len(calls) == LAYERS
    worst, ties = 0.0, 0
    for name, (q, k, scale, _) in zip(NAMES, calls, strict=True):
        mx, tied = document_truth(q, k, scale, docs)
        for h in range(TITAN_HEADS):
            rec = by[(name, h)]
            assert not math.isnan(rec.attention_max_logit), (name, h)
            assert rec.attention_max_logit == pytest.approx(float(mx[h]), rel=1e-4), (name, h)
            assert round(rec.tied_rowmax_ratio * rows) == int(tied[h]), (name, h)
            worst = max(worst, abs(rec.attention_max_logit - float(mx[h])) / abs(float(mx[h])))
        ties += int(tied.sum())
    return worst, ties


def run_and_check(model, packing, *, steps=2, cast=None):
    """Watched, `steps` monitored forward-only steps on `packing`'s documents, each
    report checked (check_report); cast: the dtype the backend casts q and k to before
    its kernel (varlen: BF16), which the truth then reads. The watcher's sites."""
    calls, handles = _inputs_seen(model)
    w = fw.watch(model, config=fw.WatchConfig(every_n_steps=1))
    try:
        assert [s.name for s in w.sites] == NAMES
        worst, ties, masked = 0.0, 0, False
        for step in range(steps):
            tokens, positions, docs = _packed(PACKINGS[packing], seed=step)
            calls.clear()
            with torch.no_grad():
                masks = model.get_attention_masks(positions)  # torchtitan's own masks
                model(tokens, positions, masks)
            report = w.step()
            assert w.monitor_errors_total == 0 and report.monitor_errors_total == 0
            if cast is not None:
                calls[:] = [(q.to(cast), k.to(cast), s, m) for q, k, s, m in calls]
            err, tied = check_report(report, calls, docs, rows=tokens.numel())
            worst, ties = max(worst, err), ties + tied
            # the documents change the truth: a truth that ignored them would fail
            whole = [(b, 0, N) for b in range(tokens.shape[0])]
            masked |= any(any(not torch.equal(a, b) for a, b in zip(
                document_truth(q, k, s, docs), document_truth(q, k, s, whole), strict=True))
                for q, k, s, _ in calls)
    finally:  # a failed check leaves no watcher measuring (nor the stance it set)
        w.remove()
        for h in handles:
            h.remove()
    assert ties > 0  # the exact tie comparison could fail
    assert masked == (packing != "causal")
    print(f"{packing}: max logit rel. error ≤ {worst:.2e}, {ties} tied rows in the truth")
    return w.sites, calls


# ------------------------------------------------------------------- FlexAttention


def _model_name(n_kv_heads):
    return ("Llama3" if n_kv_heads is None else "Llama3 GQA") + ", fuse_qkv=True"


# flex_attention run eagerly (a measured step) says it once per process
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("packing,dtype,n_kv_heads", [
    ("causal", torch.float32, None), ("documents", torch.float32, None),
    ("documents", torch.bfloat16, None), ("documents_batch_1", torch.float32, None),
    ("documents", torch.float32, 4)],
    ids=["causal-fp32", "documents-fp32", "documents-bf16", "documents_batch_1-fp32",
         "documents-fp32-gqa"])
def test_flex_attention_layers_measured_per_document(packing, dtype, n_kv_heads):
    """torchtitan's default backend: FlexAttention, its class-level torch.compile'd
    flex_attention (run eagerly on measured steps), a BlockMask of
    get_causal_mask_mod & get_efficient_causal_mask_mod_for_packed_document (batch 1:
    its other mask_mod, which indexes one buffer with another); GQA: 16 query heads on
    4 KV heads (enable_gqa)."""
    from torch.nn.attention.flex_attention import BlockMask
    from torchtitan.models.common.attention import FlexAttention

    model = _llama("flex", dtype, n_kv_heads)
    assert all(isinstance(model.get_submodule(f"layers.{i}.attention.inner_attention"),
                          FlexAttention) for i in range(LAYERS))
    sites, calls = run_and_check(model, packing)
    assert all(isinstance(m, BlockMask) and q.dtype == dtype
               and k.shape[1] == (n_kv_heads or TITAN_HEADS) for q, k, _, m in calls)
    record(("torchtitan 0.3.0", _model_name(n_kv_heads),
            f"FlexAttention (its default backend), {packing.replace('_', ' ')}, "
            f"{DTYPES[dtype]} weights, forward only"), sites, MEASURED)


# ------------------------------------------------------------------------- varlen

@pytest.fixture
def varlen_on_cpu():
    """CPU kernels for torch_attn::_varlen_attn and its backward while the test runs
    (attention_standins.cpu_varlen: flash attention's math per document in FP32, keys
    aligned with queries at the documents' ends), removed after; the (query, key) of
    each call the forward ran."""
    with cpu_varlen() as seen:
        yield seen


def test_varlen_stand_in_is_attention_per_document(varlen_on_cpu):
    """The stand-in is SDPA's causal attention on each document (the FP32 reference)."""
    from torch.nn.attention.varlen import varlen_attn

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(24, 4, 8, generator=g).bfloat16() for _ in range(3))
    cu = torch.tensor([0, 5, 16, 24], dtype=torch.int32)
    out = varlen_attn(q, k, v, cu, cu, 11, 11, window_size=(-1, 0))
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        want = torch.nn.functional.scaled_dot_product_attention(
            *(x[s:e].float().transpose(0, 1) for x in (q, k, v)), is_causal=True)
        torch.testing.assert_close(out[s:e].float(), want.transpose(0, 1), atol=1e-2,
                                   rtol=1e-2)
    assert len(varlen_on_cpu) == 1


@pytest.mark.parametrize("packing,n_kv_heads", [
    ("causal", None), ("documents", None), ("documents", 4)],
    ids=["causal", "documents", "documents-gqa"])
def test_varlen_layers_measured_per_document(packing, n_kv_heads, varlen_on_cpu):
    """torchtitan's varlen backend (VarlenAttention: q, k, v packed to [B·N, H, D] and
    cast to BF16, window (-1, 0), the documents' cumulative offsets from
    create_varlen_metadata_for_document), its op run by the stand-in CPU kernel; GQA:
    16 query heads on 4 KV heads."""
    from torchtitan.models.common.attention import VarlenAttention, VarlenMetadata

    model = _llama("varlen", n_kv_heads=n_kv_heads)
    assert all(isinstance(model.get_submodule(f"layers.{i}.attention.inner_attention"),
                          VarlenAttention) for i in range(LAYERS))
    sites, calls = run_and_check(model, packing, cast=torch.bfloat16)
    assert all(isinstance(m, VarlenMetadata) and k.shape[1] == (n_kv_heads or TITAN_HEADS)
               for _, k, _, m in calls)
    # the op ran on the stand-in (2 steps × 2 layers) with the q and k the truth read
    assert len(varlen_on_cpu) == 2 * LAYERS
    for (q, k, _, _), (oq, ok) in zip(calls, varlen_on_cpu[-LAYERS:], strict=True):
        assert torch.equal(oq, q.transpose(1, 2).flatten(0, 1))
        assert torch.equal(ok, k.transpose(1, 2).flatten(0, 1))
    record(("torchtitan 0.3.0", _model_name(n_kv_heads),
            f"varlen, {packing}, FP32 weights (its op in BF16), forward only, a stand-in "
            "CPU kernel for torch_attn::_varlen_attn"), sites, MEASURED)
