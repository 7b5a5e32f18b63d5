"""The probe's bookkeeping for a watched layer's calls: sample rows and recompute them
in FP32 on the forward (flashwatch/monitor/probe.py), c[T] when the gradient arrives, and each
micro-batch's samples reduced into the step's totals on the device. ProbeRecorder is the
half of capture.Recorder that measures; the other half routes calls to the kernel."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time

import torch

from flashwatch.config import WatchConfig
from flashwatch.kernels.common import Mode, no_autocast
from flashwatch.monitor import probe, samples
from flashwatch.monitor.checkpointing import recomputing
from flashwatch.monitor.layer_state import LayerState, to_device
from flashwatch.monitor.ledger import ErrorLedger
from flashwatch.monitor.tokens import Tokens
from flashwatch.parallel.sharding import unnarrowed_tp


@dataclasses.dataclass(frozen=True, eq=False)
class EveryRow:
    """What gives c on every row of a call flashwatch's kernel ran, from its dO."""

    out: torch.Tensor  # [B, H, Nq, Dv] the call's output: the O its backward's δ reads
    o32: torch.Tensor  # [B, H, Nq, Dv] the kernel's FP32 O (accumulator / l)
    fp32_heads: torch.Tensor | None  # [H] bool, the call's device: FP32_O heads (δ exact)
    bf16_delta: bool  # backend="paper": δ is a BF16 product and rowsum
    valid: torch.Tensor | None  # [B, Nq] float 1 real query, 0 padding (None: all real)


@dataclasses.dataclass(frozen=True, eq=False)
class ProbedCall:
    """One probed call, kept for its gradient (`ProbeRecorder._grad_hook`)."""

    sample: samples.Sample
    every_row: EveryRow | None  # None: c on the sampled rows only, against the probe's O
    rows: int  # B·Nq, rows of the call


class ProbeRecorder:
    """Per-call measurement state shared by a watcher's layers: the row-sampling
    generator and the step's reduced totals."""

    def __init__(self, config: WatchConfig, states: list[LayerState], cadence,
                 ledger: ErrorLedger, n_heads: int | None = None) -> None:
        self.config, self.states, self.cadence, self.ledger = config, states, cadence, ledger
        # the per-head totals span the global head table (flashwatch/parallel/layout.py);
        # None: this rank's layers are all of it
        self.n_heads = sum(st.site.num_heads for st in states) if n_heads is None else n_heads
        self.gen = torch.Generator().manual_seed(config.seed)
        # samples.totals of the step's samples reduced so far (`_sample_done`), and how many
        # samples got their c since
        self.totals: samples.Totals | None = None
        self.samples_done = 0
        self.traced_ids = itertools.count()  # ids of the probed calls in compiled code
        self.tokens = Tokens(self.warn_once)  # real query rows and the forward's masks

    def warn_once(self, st: LayerState, key: str, message: str) -> None:
        self.ledger.warn_once((st.site.name, key), message)

    def _safe_probe(self, st, q, k, v, out, causal, scale, mask, routed, grad=True,
                    softcap=None, sliding_window=None, score_fn=None, grad_view=None):
        """The probe on an eager call; grad=False: its ties and max logit only.
        score_fn: the call's own scores (flashwatch/monitor/flex.py); grad_view(g): the
        gradient of `out` as [B, H, N, Dv] where `out` is packed (varlen's [T, H, Dv])."""
        t0 = time.perf_counter()
        with self.ledger.guard(f"probe {st.site.name}"):
            if recomputing():
                st.compiled.checkpointed = True  # keeps the eager path (traced.py cannot trace it)
                if grad:
                    self._hook_recompute(st, out, grad_view)
            else:
                view = (lambda t: t) if grad_view is None else grad_view
                probed = self._probe(st, q, k, v, view(out), causal, scale, mask, routed,
                                     st.buf.x, softcap, sliding_window, score_fn)
                if probed is not None and grad:
                    if out.requires_grad:  # the hook goes on the tensor autograd sees
                        hook = self._grad_hook(st, probed)
                        out.register_hook(hook if grad_view is None
                                          else lambda g: hook(grad_view(g)))
                    else:  # a reentrant checkpoint's first forward: its recompute hooks it
                        st.buf.no_grad_samples.append(probed)
        self.ledger.seconds += time.perf_counter() - t0

    def traced_probe(self, st, q, k, v, out, x, mask, causal, scale):
        """torch.ops.flashwatch.probe (a compiled monitored step, flashwatch/monitor/traced.py):
        the eager probe on the call, X handed in by the layer's Interceptor; the
        gradient arrives through torch.ops.flashwatch.probe_grad (`traced_grad`)."""
        if not self.cadence.measuring or self.cadence.removed or recomputing():
            return -1  # a checkpoint's recompute inside the compiled backward: counted
        if q.dim() == 4 and q.shape[1] != st.site.num_heads:
            # not the layer's heads (split by tensor parallelism after this graph was
            # traced, a folded decode call): as the eager path, never misattributed
            if unnarrowed_tp(st.site) is not None:
                st.compiled.sdpa_seen = False  # split: the next one runs eagerly, narrows
            self.warn_once(st, "heads", f"flashwatch: {st.site.name}: a compiled attention "
                           f"call with {q.shape[1]} heads, not the layer's "
                           f"{st.site.num_heads}; not measured")
            return -1
        t0 = time.perf_counter()
        call = -1
        try:
            if x is None and st.compiled.q_path is not None:
                self.warn_once(st, "traced x", f"flashwatch: {st.site.name}: inside compiled "
                                f"code no F.linear call on the Q projection's weight came "
                                f"before SDPA; using q-space sketch terms and no "
                                f"delta_error_share there")
            probed = self._probe(st, q, k, v, out, causal, scale, mask, False, x)
            if probed is not None:
                call = next(self.traced_ids)
                st.buf.traced_pending[call] = probed
        except Exception as e:
            self.ledger.error(f"probe {st.site.name}", e)
        self.ledger.seconds += time.perf_counter() - t0
        return call

    def traced_grad(self, st, call: int, grad) -> None:
        """torch.ops.flashwatch.probe_grad: the gradient of probed call `call` (each
        further backward through it, retain_graph, counts as in eager)."""
        if self.cadence.removed:
            return
        probed = st.buf.traced_pending.get(call)
        if probed is not None:
            self._grad_hook(st, probed)(grad)
        else:  # its sample was reduced (a further backward, retain_graph) or never made
            self.warn_once(st, "traced grad", f"flashwatch: {st.site.name}: a gradient "
                            f"inside compiled code found no probed call to pair with (a "
                            f"further backward through a reduced call, or a backward "
                            f"after step()); its δ error is not measured")

    def _probe(self, st, q, k, v, out, causal, scale, mask, routed, x, softcap=None,
               sliding_window=None, score_fn=None):
        """Every row's max logit and ties (unless the kernel counted them), the sampled
        rows' FP32 recomputation, kept as a Sample; returns the ProbedCall for the
        gradient step, None if not probed."""
        cfg = self.config
        o32_all, st.buf.o32 = (st.buf.o32 if routed else None), None
        counted, st.buf.kernel_counted = st.buf.kernel_counted and routed, False
        if q.dim() != 4 or out.shape[:3] != q.shape[:3]:
            self.warn_once(st, "shape", f"flashwatch: {st.site.name}: attention on shape "
                            f"{tuple(q.shape)} is not [B, H, N, D]; not probed")
            return None
        B, H, Nq, D = q.shape
        Nk = k.shape[2]
        scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
        with torch.no_grad(), no_autocast(q.device):
            q, k, v, out = q.detach(), k.detach(), v.detach(), out.detach()
            n_rows = B * Nq if cfg.rows_per_head == "all" else cfg.rows_per_head
            rows = probe.rows_on(*probe.sample_rows(self.gen, B, Nq, n_rows), q.device)
            R = rows.t.numel()
            consts = st.on_device(q.device)  # Ω_x, Ω_a, Ω_q, heads
            st.buf.sampled = st.buf.sampled or R < B * Nq  # G from some rows only
            valid = self.tokens.rows(st, B, Nq, q.device)
            bias = self.tokens.bias(mask, causal, sliding_window, Nq, Nk, q.device)
            rec = probe.recompute(q, k, v, rows, causal=causal, scale=scale,
                                  attn_mask=mask, eps=cfg.eps, softcap=softcap,
                                  sliding_window=sliding_window, bias=bias,
                                  row_bias=None if valid is None else valid.row_bias,
                                  every_row=not counted, score_fn=score_fn)
            o_used = probe.take(out, rows, 2)
            fp32_heads = st.modes == int(Mode.FP32_O)  # CPU: .any() syncs nothing
            fp32_dev = None
            if routed and bool(fp32_heads.any()):
                # δ of these heads came from the kernel's FP32 O; its residual error is at
                # FP32 rounding, far below what the probe resolves: count it as 0. A where,
                # not boolean indexing (nonzero: a host sync on CUDA).
                fp32_dev = to_device(fp32_heads, q.device)
                o_used = torch.where(fp32_dev[None, :, None, None], rec.o32, o_used.float())
            every_row = None
            if o32_all is not None:
                # O_fp32 = the kernel's FP32 accumulator divided by l: exactly what the
                # FP32_O fix hands δ, so c measures the rounding that fix removes. Both
                # are saved for the backward anyway: holding them costs no memory.
                every_row = EveryRow(out=out, o32=o32_all.permute(1, 0, 2, 3),
                                     fp32_heads=fp32_dev, bf16_delta=st.buf.o32_paper,
                                     valid=None if valid is None else valid.mask)
            xr, qr = self._rows_in(st, x, q, rows)
            weight = None if valid is None else probe.take(valid.mask, rows, 1)
        sample = samples.Sample(
            heads=consts.heads, rows_at=rows, tied=rec.tied, row_max=rec.row_max,
            rows=0 if counted else rec.visible if rec.visible is not None else (
                B * Nq if valid is None else valid.count),
            o_used=o_used, o32=rec.o32, pk=rec.pk, x=xr, q=qr, weight=weight, omegas=consts,
            share_scale=scale ** 2 * B * Nq / R, shape=(B, Nq))
        st.buf.samples.append(sample)
        st.buf.probe_rows += R
        return ProbedCall(sample=sample, every_row=every_row, rows=B * Nq)

    def _rows_in(self, st, x, q, rows):
        """(X at the sampled rows, None) where the Q projection's input fits the call,
        else (None, q at the rows in FP32): the q-space sketch terms, and no δ share."""
        B, _, Nq, _ = q.shape
        if x is not None and x.dim() == 3 and B == 1 and x.shape[0] * x.shape[1] == Nq:
            x = x.reshape(1, Nq, x.shape[2])  # packed documents (varlen): [b, s] → [1, T]
        if x is not None and x.dim() == 3 and x.shape[:2] == (B, Nq) and \
                x.shape[2] == st.site.d_model:
            return probe.take(x.detach(), rows, 1), None
        if x is not None:
            self.warn_once(st, "x", f"flashwatch: {st.site.name}: the Q projection's "
                            f"input has shape {tuple(x.shape)}, not [B, Nq, d_model] = "
                            f"{[B, Nq, st.site.d_model]} as q's batch and query length "
                            f"give it; using q-space sketch terms (no δ error share)")
        return None, probe.take(q, rows, 2).float()

    def _hook_recompute(self, st, out, grad_view=None):
        """Activation checkpointing's recompute of a call already counted: count nothing
        again. Non-reentrant: the first forward's output got the gradient hook, done.
        Reentrant: the first forward ran without grad and left its sample; the gradient
        flows through this recomputed output, so hook that sample here. Recomputes run
        in reverse call order, hence the last sample first."""
        if not (out.requires_grad and st.buf.no_grad_samples):
            return
        packed, out = out, (out if grad_view is None else grad_view(out))
        call = st.buf.no_grad_samples.pop()
        sample = call.sample
        # the call's shape, known on the host (b.max() would be a host sync)
        if out.dim() != 4 or not (sample.shape[0] <= out.shape[0]
                                  and sample.shape[1] <= out.shape[2]
                                  and sample.o32.shape[1] == out.shape[1]
                                  and sample.o32.shape[3] == out.shape[3]):
            self.warn_once(st, "recompute", f"flashwatch: {st.site.name}: a recomputed "
                            f"call's output {tuple(out.shape)} does not fit the sample of "
                            f"its first forward; its δ error is not measured")
            return
        hook = self._grad_hook(st, call)
        packed.register_hook(hook if grad_view is None else lambda g: hook(grad_view(g)))

    def _grad_hook(self, st, call: ProbedCall):
        """c[T] of the sampled rows while dO is at hand: against the kernel's own O_fp32
        where flashwatch's kernel ran (`every_row`, which also gives c on every row),
        else against the probe's FP32 recomputation. The sketch and the sums follow in
        samples.totals, for a micro-batch's calls at once (`_sample_done`)."""
        def hook(grad):
            if self.cadence.removed:
                return None
            t0 = time.perf_counter()
            with self.ledger.guard(f"gradient probe {st.site.name}"):
                with torch.no_grad(), no_autocast(grad.device):
                    s, every = call.sample, call.every_row
                    R = s.n_rows
                    if every is not None:  # c = δ_used - rowsum(dO ∘ O_fp32)
                        if every.bf16_delta:  # the paper backward's δ: product and sum in BF16
                            c_all = (grad * every.out).sum(-1).double() - (
                                grad.float() * every.o32).sum(-1, dtype=torch.float64)
                        else:
                            c_all = (grad.float() * (every.out.float() - every.o32)).sum(
                                -1, dtype=torch.float64)
                        if every.fp32_heads is not None:  # δ used the FP32 O: no error
                            c_all = c_all.masked_fill(every.fp32_heads[None, :, None], 0.0)
                        if every.valid is not None:  # padding queries: not the model's
                            c_all = c_all * every.valid[:, None, :]
                        # The sampled rows' c is the kernel's own: exactly what FP32_O
                        # removes. Elsewhere it is against the probe's FP32 recomputation,
                        # which also counts the rounding of P̄ in O (reads high: docs/limits.md).
                        c = probe.take(c_all, s.rows_at, 2)  # [E, H, w]
                        sums = torch.stack([c_all.sum((0, 2)), c_all.square().sum((0, 2))])
                        st.buf.delta_rows += c_all.shape[0] * c_all.shape[2]
                        g = None
                    else:  # c follows in samples.totals, with the other layers' rows
                        c, sums, g = None, None, probe.take(grad, s.rows_at, 2)
                        st.buf.delta_rows += R
                        st.buf.delta_missed += call.rows - R
                    if not s.has_grad:
                        s.c, s.c_all, s.g = c, sums, g
                    else:  # a further backward through the call (retain_graph): its
                        # gradient adds to W^Q's, so its c counts too, as a record of its
                        # own; its rows' ties were counted with the forward's
                        st.buf.samples.append(dataclasses.replace(
                            s, c=c, c_all=sums, g=g, tied=None, row_max=None, rows=0))
                    st.buf.grad_rows += R
                    if s.x is not None:
                        st.buf.share_rows += R
                    self._sample_done()
            self.ledger.seconds += time.perf_counter() - t0
            return None
        return hook

    def clear_step(self) -> None:
        """Empty every accumulator of the step being measured (after its report, after a
        failed one, on load)."""
        for st in self.states:
            st.reset()
        self.totals, self.samples_done = None, 0
        self.tokens.clear()

    def _sample_done(self) -> None:
        """Once as many calls as there are layers have their c (a micro-batch, usually),
        reduce them into the step's totals: memory stays one micro-batch of samples
        however many micro-batches an optimizer step accumulates."""
        self.samples_done += 1
        if self.samples_done < len(self.states):
            return
        self.samples_done = 0
        done = [s for st in self.states for s in st.buf.samples if s.has_grad]
        # Into a copy: if the reduction fails, the samples stay for step() to reduce.
        acc = None if self.totals is None else self.totals.copy()
        self.totals = samples.totals(done, self.n_heads, self.config.sketch_dim, acc,
                                    device=done[0].o32.device if done else "cpu")
        for st in self.states:
            st.buf.samples = [s for s in st.buf.samples if not s.has_grad]
            # reduced: only a further backward (retain_graph) would look for it again
            st.buf.traced_pending = {i: call for i, call in st.buf.traced_pending.items()
                                     if not call.sample.has_grad}
