"""flashwatch.integrations.torchtitan on torchtitan 0.3.0's own Trainer and training loop
with the attention backends its language models are built with: FlexAttention (its
default; no SDPA swapped in) and varlen (its llama3_debugmodel_varlen_attn). The loop,
SelectiveAC, FSDP2 of 1 and BF16 weights as in test_torchtitan_trainer.py, watched by
`watched(config, ...)`; each step's batch packs documents, positions restarting at 0 at
each document's start as torchtitan's text dataloader writes them, from which the
Trainer's post_dataloading_process builds the masks (the model's get_attention_masks: a
BlockMask of packed-document mask mods, or varlen's cumulative document offsets).

The backward runs on stand-ins (tests/attention_standins.py), for the test only: torch
2.13 has no FlexAttention backward on the CPU and no CPU kernel for varlen's op. Every
head of every monitored step against the FP64 truth of the q and k its layer's inner
attention received in the step's forward (not activation checkpointing's recompute),
per document and causal inside each (tests/trainers/test_torchtitan_flex.py's
document_truth, independent of torchtitan's masks); the δ error reaches every report
(the backward reached flashwatch); 0 monitor errors."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from _helpers import ListSink
from _trainers import TITAN_VOCAB, record
from attention_standins import cpu_varlen, differentiable_flex
from test_torchtitan_flex import LAYERS, check_report, document_truth
from test_torchtitan_trainer import RandomTokens, _site_row, titan_config

from flashwatch.integrations.torchtitan import watched

BOS = 1  # a document's first token (the others are drawn from 2 up)
STEPS = 3
MEASURED = ("each step: max logit ≤ 1e-4, ties exact vs FP64 per document; δ error from "
            "its backward; 0 errors")


class PackedTokens(RandomTokens):
    """RandomTokens whose rows pack documents: seeded by (split, n, r), row b cut at
    1 + b % 3 seeded points, every document starting with BOS at position 0."""

    @dataclass(kw_only=True, slots=True)
    class Config(RandomTokens.Config):
        pass

    def __iter__(self):
        B, n = self.shape[0], self.shape[1] - 1  # seq_len tokens a row
        while True:
            g = torch.Generator().manual_seed(10_000 * self.split + 100 * self.n + self.rank)
            self.n += 1
            t = torch.randint(BOS + 1, TITAN_VOCAB, self.shape, generator=g)
            positions = torch.empty(B, n, dtype=torch.long)
            for b in range(B):
                cuts = torch.randperm(n - 2, generator=g)[:1 + b % 3].add(1).sort().values
                start = 0
                for i in range(n):
                    if i in cuts.tolist():
                        start = i
                    positions[b, i] = i - start
                t[b, :-1][positions[b] == 0] = BOS
            yield {"input": t[:, :-1], "positions": positions}, t[:, 1:]


class InnerCalls:
    """q, k (as [B, H, N, D]) and scale of each layer's inner attention call in each
    forward of the model, and the forward's positions; the calls of activation
    checkpointing's recompute (inside no forward of the whole model) are left out."""

    def __init__(self, model, inner_class):
        self.steps: list[tuple[torch.Tensor, list]] = []
        self._inside = False
        model.register_forward_pre_hook(self._enter, with_kwargs=True)
        model.register_forward_hook(self._leave)
        inner = [m for m in model.modules() if isinstance(m, inner_class)]
        assert len(inner) == LAYERS
        for m in inner:
            m.register_forward_pre_hook(self._call, with_kwargs=True)

    def _enter(self, module, args, kwargs):
        self._inside = True
        self.steps.append((kwargs["positions"].clone(), []))

    def _leave(self, module, args, out):
        self._inside = False

    def _call(self, module, args, kwargs):
        if self._inside:
            q, k = (x.detach().transpose(1, 2).clone() for x in args[:2])
            self.steps[-1][1].append((q, k, kwargs.get("scale"), kwargs["attention_masks"]))


def documents(positions):
    """(row, start, end) of each document of a [B, N] positions tensor: a document
    starts where its position is 0."""
    docs = []
    for b, row in enumerate(positions.tolist()):
        starts = [i for i, p in enumerate(row) if p == 0] + [len(row)]
        docs += [(b, s, e) for s, e in zip(starts, starts[1:], strict=False)]
    return docs


def train_and_check(cfg, inner_class, *, cast=None):
    """Build the watched trainer from `cfg` (every step monitored) and train it, each
    report against the FP64 document truth of its forward's inner attention calls
    (inner_class: the backend's module; cast: the dtype the backend casts q and k to
    before its op); the trainer, its layers' inner attention calls per step."""
    sink = ListSink()
    trainer = watched(cfg, sinks=[sink], every_n_steps=1).build()
    seen = InnerCalls(trainer.model_parts[0], inner_class)
    try:
        trainer.train()
        assert trainer.flashwatch.watcher.monitor_errors_total == 0
        trainer.sites = [_site_row(s) for s in trainer.flashwatch.watcher.sites]
    finally:
        trainer.close()
    reports, steps = sink.reports, seen.steps
    assert [r.step for r in reports] == list(range(STEPS)) and len(steps) == STEPS
    worst, ties, masked = 0.0, 0, False
    for report, (positions, step_calls) in zip(reports, steps, strict=True):
        assert report.monitor_errors_total == 0
        if cast is not None:
            step_calls = [(q.to(cast), k.to(cast), s, m) for q, k, s, m in step_calls]
        docs = documents(positions)
        err, tied = check_report(report, step_calls, docs, rows=positions.numel())
        worst, ties = max(worst, err), ties + tied
        # the documents change the truth: a truth that ignored them would fail
        whole = [(b, 0, positions.shape[1]) for b in range(positions.shape[0])]
        masked |= any(any(not torch.equal(a, b) for a, b in zip(
            document_truth(q, k, s, docs), document_truth(q, k, s, whole), strict=True))
            for q, k, s, _ in step_calls)
        # the backward of the step reached flashwatch: δ error on every head
        assert all(h.delta_error_rows > 0 and h.delta_error_share > 0 for h in report.heads)
    assert ties > 0 and masked  # the exact tie comparison and the documents could fail
    print(f"max logit rel. error ≤ {worst:.2e}, {ties} tied rows in the truth")
    return trainer, steps


def _config(tmp_path, backend):
    cfg = titan_config(tmp_path, steps=STEPS, dtype="bfloat16", backend=backend)
    cfg.dataloader = PackedTokens.Config()
    cfg.checkpoint.enable = False
    return cfg


MODEL = "llama3_debugmodel, 2 layers"


# flex_attention run eagerly (a measured step) says it once per process
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_its_flex_attention_loop_is_measured_per_document(titan, tmp_path):
    """torchtitan's default backend: FlexAttention (its class-level torch.compile'd
    flex_attention, run eagerly on measured steps) with the BlockMask the Trainer builds
    from the batch's positions; its backward through torch's math flex implementation."""
    from torch.nn.attention.flex_attention import BlockMask
    from torchtitan.models.common.attention import FlexAttention

    with differentiable_flex():
        trainer, steps = train_and_check(_config(tmp_path, "flex"), FlexAttention)
    for _, step_calls in steps:
        assert all(isinstance(m, BlockMask) and q.dtype == torch.bfloat16
                   for q, _, _, m in step_calls)
    record(("torchtitan 0.3.0", f"{MODEL}, FlexAttention backend (its default)",
            "its Trainer via watched(): packed documents, SelectiveAC, BF16 weights, FSDP2 "
            "of 1, 1 process, flex backward on a stand-in (torch's math flex)"),
           trainer.sites, MEASURED)


def test_its_varlen_loop_is_measured_per_document(titan, tmp_path):
    """torchtitan's varlen backend (VarlenAttention: q, k, v packed to [B·N, H, D] in
    BF16, window (-1, 0), the documents' cumulative offsets from the batch's positions),
    its op and the op's backward run by the stand-in CPU kernels."""
    from torchtitan.models.common.attention import VarlenAttention, VarlenMetadata

    with cpu_varlen() as op_calls:
        trainer, steps = train_and_check(_config(tmp_path, "varlen"), VarlenAttention,
                                         cast=torch.bfloat16)
    for _, step_calls in steps:
        assert all(isinstance(m, VarlenMetadata) for *_, m in step_calls)
    # each forward's calls ran on the stand-in; SelectiveAC saves the op's outputs (its
    # save list names it), so the backward recomputes none
    assert len(op_calls) == STEPS * LAYERS
    for (q, k, _, _), (oq, ok) in zip(steps[-1][1], op_calls[-LAYERS:], strict=True):
        assert torch.equal(oq, q.transpose(1, 2).flatten(0, 1))  # what the truth read
        assert torch.equal(ok, k.transpose(1, 2).flatten(0, 1))
    record(("torchtitan 0.3.0", f"{MODEL}, varlen backend",
            "its Trainer via watched(): packed documents, SelectiveAC, BF16 weights, FSDP2 "
            "of 1, 1 process, varlen's op and backward on stand-in CPU kernels"),
           trainer.sites, MEASURED)
