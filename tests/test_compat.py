"""Compatibility: tiny Hugging Face models of many architectures (random init from their
config classes, no download) × {FP32, BF16, BF16 autocast}.

Per architecture and recipe: discovery; `attention_max_logit` against FP64 scores
computed here from the q, k (and mask) each SDPA or flex_attention call received,
captured by our own TorchFunctionMode; `wq_spectral_norm` against the per-head W^Q
slice read from the weight as the modeling code splits it (TRUE_WQ); and head modes
set on a layer either run (output within BF16 rounding of SDPA's: the 2× rule against
an FP64 copy of the model) or are reported unmitigable. Architectures flashwatch
refuses are checked to be refused with a message naming why. Flex rows run forwards
only (torch has no FlexAttention backward on a CPU).

docs/compatibility.md is this file's table: FLASHWATCH_WRITE_COMPAT=1 rewrites it, and
`test_the_committed_table_is_current` fails when it differs from what the suite finds.
"""

from __future__ import annotations

import copy
import functools
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import flashwatch as fw
from flashwatch import Mode
from flashwatch.integrations import hf_attention
from flashwatch.kernels import dispatch
from flashwatch.mitigation.qkclip import qk_norm
from flashwatch.sites.layouts import QCheck
from standins import HF_ARCHS, hf_inputs, hf_tiny

pytestmark = pytest.mark.usefixtures("one_thread")

ARCHS = ["llama", "llama_flex", "mistral", "qwen2", "qwen3", "olmo2", "qwen3_next", "gemma2",
         "gemma2_fw", "gemma3", "phi3", "gpt_neox", "falcon", "falcon_new", "bloom", "gpt2",
         "opt", "bert", "roberta", "vit", "t5", "bart"]


def _installed(arch: str) -> bool:
    import transformers
    from transformers.utils import is_torch_flex_attn_available

    flex = HF_ARCHS[arch][3].get("attn_implementation") == "flex_attention"
    return all(hasattr(transformers, c) for c in HF_ARCHS[arch][:2]) and (
        not flex or is_torch_flex_attn_available())


MISSING = [a for a in ARCHS if not _installed(a)]  # dropped: this transformers lacks them
ARCHS = [a for a in ARCHS if a not in MISSING]
RECIPES = ["fp32", "bf16", "autocast"]
TABLE = Path(__file__).resolve().parent.parent / "docs" / "compatibility.md"


def _flex_hop():
    try:
        from torch._higher_order_ops.flex_attention import flex_attention
    except ImportError:
        return None
    return flex_attention


FLEX_HOP = _flex_hop()


def _split(w, H, parts, D):  # [out, C] viewed per head: [H, parts, D, C]
    return w.view(H, parts, D, -1)


# W^Q per head [H, D, C] as each modeling_*.py splits its projection (written from the
# modeling code, not from flashwatch/sites/layouts.py).
TRUE_WQ = {
    "gpt_neox": lambda a: _split(a.query_key_value.weight, 4, 3, 8)[:, 0],
    "falcon": lambda a: _split(a.query_key_value.weight, 4, 3, 8)[:, 0],
    "falcon_new": lambda a: a.query_key_value.weight.view(2, 4, 8, -1)[:, :2].reshape(4, 8, -1),
    "bloom": lambda a: _split(a.query_key_value.weight, 4, 3, 8)[:, 0],
    "phi3": lambda a: a.qkv_proj.weight[:32].view(4, 8, -1),
    "qwen3_next": lambda a: a.q_proj.weight.view(4, 16, -1)[:, :8],
    "gpt2": lambda a: a.c_attn.weight[:, :32].T.reshape(4, 8, -1),
    "bert": lambda a: a.query.weight.view(4, 8, -1),
    "roberta": lambda a: a.query.weight.view(4, 8, -1),
    "t5": lambda a: a.q.weight.view(4, 8, -1),
}


# Notes on what each tiny model exercises (the facts behind its row).
NOTES = {
    "llama": "GQA 4:2, rotary", "llama_flex": 'attn_implementation="flex_attention": '
    "BlockMask (causal, padded keys), transformers' score_mod closure; forward only",
    "mistral": "sliding window 8 < 12 tokens: a bool mask",
    "qwen2": "q/k/v biases", "qwen3": "q_norm/k_norm per head_dim", "olmo2":
    "q_norm/k_norm over all heads", "qwen3_next": "full-attention layers only; gated "
    "q_proj; q_norm/k_norm", "gemma2": "attn softcapping; transformers has no SDPA path",
    "gemma2_fw": 'attn_implementation="fw_attention": flashwatch.attention(softcap=50)',
    "gemma3": "sliding window; q_norm/k_norm", "phi3": "qkv_proj [Q | K | V], GQA",
    "gpt_neox": "query_key_value per head [q|k|v], partial rotary",
    "falcon": "query_key_value per head [q|k|v]; a bool causal mask",
    "falcon_new": "new_decoder_architecture: per group [q..q|k|v]",
    "bloom": "ALiBi, baddbmm + softmax", "gpt2": "Conv1D c_attn",
    "opt": "q_proj; learned positions", "bert": "query/key/value; encoder",
    "roberta": "query/key/value; encoder; positions after padding_idx",
    "vit": "encoder over 16 patches + CLS", "t5": "q/k/v; relative position bias as "
    "a float mask; encoder, decoder, cross", "bart": "encoder, decoder, cross-attention",
}


def _true_wq(arch, attn):
    return TRUE_WQ.get(arch, lambda a: a.q_proj.weight.view(4, 8, -1))(attn)


class Scores(TorchFunctionMode):
    """FP64 max logit per head of every SDPA call, keyed by the running watched layer:
    scale·q·kᵀ, causal and bool masks as -inf, float masks added (as SDPA does), with
    q and k cast as autocast casts SDPA's inputs; flex_attention op calls the same, their
    BlockMask's mask_mod made dense by torch's create_mask (the call Dynamo traces is
    seen again when it runs: that one counts; tests/integrations/test_hf_flex.py checks
    that mask, and that transformers' score_mod leaves Llama's scores as they are); the
    padded query rows of `real` ([B, N] bool, the inputs' attention_mask) left out, in
    the layers it covers (an encoder-decoder's encoder: `covered` holds their modules'
    ids; None: all)."""

    def __init__(self, sites, real=None, covered=None):
        super().__init__()
        self.real, self.covered = real, covered
        self.modules = {s.name: s.module for s in sites}
        self.current, self.max, self.x, self.q = [None], {}, {}, {}
        self.checks = {s.name: QCheck(s) for s in sites}
        self.handles = [h for c in self.checks.values() for h in c.arm()]
        for s in sites:
            self.handles += [
                s.module.register_forward_pre_hook(
                    lambda mod, a, n=s.name: self.current.__setitem__(0, n)),
                s.q_module.register_forward_pre_hook(self._keep_x(s.name))]

    def _keep_x(self, name):
        def hook(module, args):  # X of the layer's first call; None: the input unchanged
            self.x.setdefault(name, args[0].detach())
        return hook

    def __enter__(self):  # flashwatch.attention calls of attn_implementation="fw_attention"
        hf_attention.dispatch = SimpleNamespace(attention=self._fw_attention)
        return super().__enter__()

    def __exit__(self, *exc):
        hf_attention.dispatch = dispatch
        return super().__exit__(*exc)

    def _fw_attention(self, q, k, v, *, causal=False, scale=None, attn_mask=None,
                      softcap=None, backend="auto", sliding_window=None):
        # The window is also in attn_mask (hf_attention passes both): the oracle reads it
        # there, as transformers built it.
        self._seen(q, k, v, attn_mask=attn_mask, is_causal=causal, scale=scale,
                   softcap=softcap)
        return dispatch.attention(q, k, v, causal=causal, scale=scale, attn_mask=attn_mask,
                                  softcap=softcap, backend=backend,
                                  sliding_window=sliding_window)

    def _seen(self, *args, **kwargs):
        name = self.current[0]
        if name is not None:
            self._record(*args, **kwargs)
            if name not in self.q:  # the layout check of the layer's first call
                self.q[name] = self.checks[name](self.x.get(name), args[0])

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self._seen(*args, **kwargs)
        elif FLEX_HOP is not None and func is FLEX_HOP and not torch.compiler.is_compiling():
            from torch.nn.attention.flex_attention import create_mask

            q, k, v, _, block_mask, scale = args[:6]
            mask = create_mask(block_mask[-1], q.shape[0], 1, q.shape[2], k.shape[2],
                               device=q.device)
            self._seen(q, k, v, attn_mask=mask, scale=scale)
        return func(*args, **kwargs)

    def _record(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False, softcap=None):
        if torch.is_autocast_enabled("cpu"):
            dt = torch.get_autocast_dtype("cpu")
            q, k = q.to(dt), k.to(dt)
        q, k = q.double(), k.double()
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        s = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
        if softcap is not None:  # Gemma2: before the masks
            s = softcap * torch.tanh(s / softcap)
        if is_causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
        if attn_mask is not None:
            s = s.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool \
                else s + attn_mask.double()
        name = self.current[0]
        real = self.real
        if real is not None and tuple(real.shape) == (s.shape[0], s.shape[2]) and (
                self.covered is None or id(self.modules[name]) in self.covered):
            s = s.masked_fill(~real[:, None, :, None], -math.inf)
        m = s.amax((0, 2, 3))
        self.max[name] = torch.maximum(self.max[name], m) if name in self.max else m


def _flex(model) -> bool:
    return model.config._attn_implementation == "flex_attention"


def _loss(out):
    t = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    return t.float().square().mean()


def _forward(model, inputs, recipe):
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if recipe == "autocast" else \
        torch.autocast("cpu", enabled=False)
    with ctx:
        return model(**inputs)


def _out(o):
    t = o.logits if getattr(o, "logits", None) is not None else o.last_hidden_state
    return t.detach().double()


@functools.cache
def outcome(arch: str, recipe: str) -> dict:
    """What flashwatch does on this architecture and recipe, checked against the truth
    (assertions inside); the table row comes from it."""
    model, kind = hf_tiny(arch)
    if recipe == "bf16":
        model = model.to(torch.bfloat16)
    inputs = hf_inputs(kind, B=2, N=12, padded=True)
    try:
        w = fw.watch(model, every_n_steps=1, rows_per_head="all")
    except ValueError as e:
        msg = str(e)
        assert "never SDPA" in msg or "attn_implementation" in msg, msg
        why = "ALiBi baddbmm, no SDPA" if "never SDPA" in msg else \
            "eager softcapping, no SDPA" if "softcapped" in msg else "no SDPA call"
        return dict(layout="-", measured=f"refused ({why})", mitigable="-", qk_clip="-")
    sites = {s.name: s for s in w.sites}
    real = inputs.get("attention_mask")
    covered = ({id(m) for m in model.get_encoder().modules()}
               if model.config.is_encoder_decoder else None)
    grad = not _flex(model)  # torch has no FlexAttention backward on a CPU
    with Scores(w.sites, None if real is None else real.bool(), covered) as oracle, \
            torch.set_grad_enabled(grad):
        out = _forward(model, inputs, recipe)
        if grad:
            _loss(out).backward()
    report = w.step()
    for h in oracle.handles:
        h.remove()
    assert report is not None and w.monitor_errors_total == 0, w.monitor_errors_total
    got = {(h.layer, h.head): h for h in report.heads}
    assert all(oracle.q.values()) and len(oracle.q) == len(sites)  # layouts.QCheck passed
    for name, site in sites.items():
        want = oracle.max[name]  # every watched layer made an SDPA call
        fw_max = torch.tensor([got[(name, h)].attention_max_logit for h in range(4)])
        torch.testing.assert_close(fw_max.double(), want, rtol=1e-4, atol=1e-5)
        sigma = torch.linalg.matrix_norm(_true_wq(arch, site.module).double(), ord=2)
        fw_sigma = torch.tensor([got[(name, h)].wq_spectral_norm for h in range(4)])
        torch.testing.assert_close(fw_sigma.double(), sigma, rtol=1e-3, atol=0)
    mitigable = _modes(model, w, inputs, recipe, next(iter(sites)))
    w.remove()
    first = next(iter(sites.values()))
    return dict(layout=f"{first.kind}, {first.layout}", measured="yes", mitigable=mitigable,
                qk_clip=_qk_clip(model, inputs, recipe, min(float(m.min()) for m in
                                                            oracle.max.values())))


def _qk_clip(model, inputs, recipe, lowest: float) -> str:
    """QK-clip at τ below every head's max logit, two monitored steps on the same input:
    confirmed clips (the max logit dropped), or refused with W^Q, W^K untouched."""
    before = [p.detach().clone() for p in model.parameters()]
    tau = lowest / 2 if lowest > 0 else lowest - 1.0
    w = fw.watch(model, every_n_steps=1, rows_per_head="all", mitigation="auto",
                 qk_clip_threshold=tau)
    reports = []
    for _ in range(2):
        with torch.no_grad():
            _forward(model, inputs, recipe)
        reports.append(w.step())
    w.remove()
    norms = {qk_norm(s) for s in w.sites}
    if norms != {None}:
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        assert reports[-1].qk_clips_total == 0
        return "refused (QK-norm: " + ", ".join(sorted(n.replace("`", "") for n in norms
                                                        if n)) + ")"
    assert reports[-1].qk_clips_total > 0, [e.reason for r in reports for e in r.events]
    return f"yes ({reports[-1].qk_clips_total} confirmed)"


def _modes(model, w, inputs, recipe, layer) -> str:
    """FP32_O on every head of `layer`: the output within the 2× rule of SDPA's against
    an FP64 copy, or the layer listed unmitigable."""
    ref = copy.deepcopy(model).double()
    if ref.config._attn_implementation in ("fw_attention", "flex_attention"):
        ref.set_attn_implementation("eager")  # FP64: transformers' own path, uncompiled
    with torch.no_grad():
        base = _out(_forward(model, inputs, recipe))
        exact = _out(ref(**inputs))
        w.set_head_modes(layer, [Mode.FP32_O] * 4)
        moded = _out(_forward(model, inputs, recipe))
    report = w.step()
    if layer in report.unmitigable:
        assert not any(h.head_mode != Mode.STANDARD for h in report.heads if h.layer == layer)
        return "unmitigable: " + _short(report.unmitigable[layer])
    assert all(h.head_mode == Mode.FP32_O for h in report.heads if h.layer == layer)
    err, base_err = (moded - exact).abs().max(), (base - exact).abs().max()
    assert err <= 2 * base_err + 1e-5 * exact.abs().max(), (float(err), float(base_err))
    return "yes (FP32_O ran)"


def test_interleaved_layouts_count_their_own_q_gradient():
    """‖dW^Q_h‖² (delta_error_share's denominator) of GPT-NeoX's per-head [q|k|v] rows:
    the Q rows as modeling_gpt_neox splits them, not the first H·D rows."""
    from flashwatch.parallel.sharding import wq_grad_sq
    from flashwatch.sites import find_sites

    site = find_sites(hf_tiny("gpt_neox")[0])[0]
    grad = torch.randn(96, 32, generator=torch.Generator().manual_seed(0))
    got, averaged = wq_grad_sq(site, grad)
    got = got.double()  # FP32 sums of squares: 1e-6 relative
    want = _split(grad.double(), 4, 3, 8)[:, 0].square().sum((1, 2))
    assert not averaged and torch.allclose(got, want, rtol=1e-6)
    assert not torch.allclose(got, grad[:32].double().view(4, 8, 32).square().sum((1, 2)))


def _short(reason: str) -> str:
    for key, text in (("attn_mask", "SDPA gets an attn_mask"), ("dropout", "attention dropout"),
                      ("no attention call", "no routable call"),
                      ("score_mod", "flex score_mod not the identity")):
        if key in reason:
            return text
    return reason[:40]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_architecture(arch, recipe):
    row = outcome(arch, recipe)
    assert row["measured"] == "yes" or arch in ("gemma2", "bloom"), row


def table() -> str:
    lines = [
        "# Compatibility",
        "",
        "Generated by `FLASHWATCH_WRITE_COMPAT=1 pytest tests/test_compat.py` from tiny",
        "random-init Hugging Face models (2 layers, width 32, 4 heads), on a padded batch",
        "(2 × 12 tokens, the first right-padded by 4: text models pass SDPA a mask).",
        "Every `yes` in *measured* is checked there: max logit against FP64 scores of the",
        "q, k each SDPA (or flex_attention) call received, W^Q spectral norms against the",
        "modeling code's per-head split. *Mitigable*: FP32_O set on one layer either ran",
        "(output within the 2× rule of SDPA's) or the report lists the layer unmitigable,",
        "with why.",
        "Here routed calls run the PyTorch reference; on CUDA they run the Triton kernels,",
        "which take the same masks and softcap (`test_masked_hf_calls_run_the_triton_kernels`",
        "runs Mistral's and Gemma2's padded batches through them in Triton's interpreter).",
        "*QK-clip*: τ = half the smallest max logit, two monitored steps on one input;",
        "`yes (n confirmed)` counts clips the next measurement confirmed; `refused`",
        "layers are left untouched (their q/k norm undoes any scaling of W^Q, W^K).",
        "Refused architectures make no attention call flashwatch sees (SDPA, FlexAttention:",
        "flashwatch/sites/eager_attention.py);",
        'Gemma2 is watched with attn_implementation="fw_attention"',
        "(flashwatch/integrations/hf_attention.py). `llama_flex` is Llama loaded with",
        'attn_implementation="flex_attention": transformers\' compiled flex_attention runs',
        "eagerly on measured steps and flashwatch reads torch's op (score_mod and mask_mod",
        "applied to its FP32 scores); forward only here (torch has no FlexAttention",
        "backward on a CPU). Its head modes run: transformers passes its own score_mod",
        "closure, the identity for Llama (softcap and biases folded in for others, which",
        "flashwatch's kernel does not take), and the mask becomes a dense boolean mask.",
        "Hand-written FlexAttention models (causal, packed documents with padding,",
        "softcap, ALiBi; grouped-query; eager, compiled, activation checkpointing) and",
        "varlen (packed documents, causal and windowed) are checked against FP64 in",
        "tests/monitor/test_flex.py and test_flex_capture.py (head modes, log-sum-exp).",
        "Not in the installed transformers, so not tested: "
        f"{', '.join(MISSING) or 'none'}.",
        "",
        "| architecture | recipe | discovery (kind, layout) | measured | mitigable | QK-clip "
        "| notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for arch in ARCHS:
        for recipe in RECIPES:
            r = outcome(arch, recipe)
            lines.append(f"| {arch} ({HF_ARCHS[arch][0].removesuffix('Config')}) | {recipe} "
                         f"| {r['layout']} | {r['measured']} | {r['mitigable']} "
                         f"| {r['qk_clip']} | {NOTES[arch]} |")
    return "\n".join(lines) + "\n"


# The trainers' table follows this heading; tests/trainers/test_zz_compatibility.py writes it.
TRAINERS = "\n## Trainers\n"


def test_the_committed_table_is_current():
    text = table()
    if os.environ.get("FLASHWATCH_WRITE_COMPAT") == "1":
        old = TABLE.read_text() if TABLE.exists() else ""
        TABLE.write_text(text + (TRAINERS + old.split(TRAINERS, 1)[1] if TRAINERS in old
                                 else ""))
    assert TABLE.exists(), f"{TABLE} is missing: run FLASHWATCH_WRITE_COMPAT=1 pytest {__file__}"
    assert TABLE.read_text().split(TRAINERS, 1)[0] == text, (
        "docs/compatibility.md differs from what the suite finds; rerun with "
        "FLASHWATCH_WRITE_COMPAT=1")


def _tiny_hf(cls_cfg: str, cls_model: str, **extra):
    """1 layer, 2 heads of head_dim 16 (a head dim the Triton kernels take) on 1 KV head."""
    import transformers as T

    if extra.get("attn_implementation") == hf_attention.NAME:
        hf_attention.register()
    cfg = getattr(T, cls_cfg)(vocab_size=64, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=1, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=16,
                              max_position_embeddings=64, **extra)
    torch.manual_seed(0)
    return getattr(T, cls_model)(cfg).to(torch.bfloat16)


@pytest.mark.parametrize("arch", ["mistral", "gemma2_fw"])
def test_masked_hf_calls_run_the_triton_kernels(monkeypatch, arch):
    """What backend="auto" does on CUDA, shown in Triton's interpreter: a padded batch's
    mask (Mistral: with its sliding window; Gemma2: with its softcap) runs the Triton
    kernels with FP32_O on every head. Their output is within the 2× rule of the model's
    own BF16 output against FP64, no layer is unmitigable, no monitor error."""
    pytest.importorskip("triton")
    from flashwatch.kernels import triton_attention

    model = _tiny_hf("MistralConfig", "MistralForCausalLM", sliding_window=6) \
        if arch == "mistral" else _tiny_hf("Gemma2Config", "Gemma2ForCausalLM",
                                           sliding_window=6, attn_logit_softcapping=5.0,
                                           attn_implementation=hf_attention.NAME)
    with torch.no_grad():  # scores of a few units, so the cap and the masks matter
        for p in (model.model.layers[0].self_attn.q_proj, model.model.layers[0].self_attn.k_proj):
            p.weight.mul_(40)
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, 8:] = 0
    real = mask.bool()
    own = copy.deepcopy(model)  # the model's own attention: SDPA, or Gemma2's eager
    if arch != "mistral":
        own.set_attn_implementation("eager")
    ref = copy.deepcopy(own).double()
    if arch != "mistral":  # its calls are flashwatch.attention's: "auto" is Triton on CUDA
        def auto_is_triton(*args, backend="auto", **kwargs):
            return dispatch.attention(*args, backend="triton" if backend == "auto"
                                      else backend, **kwargs)
        monkeypatch.setattr(hf_attention, "dispatch", SimpleNamespace(attention=auto_is_triton))
    calls = []
    forward = triton_attention.forward
    monkeypatch.setattr(triton_attention, "forward",
                        lambda *a, **k: calls.append(k.get("attn_mask")) or forward(*a, **k))
    with torch.no_grad():
        exact = ref(input_ids=ids, attention_mask=mask).logits[real]
        base = own(input_ids=ids, attention_mask=mask).logits.double()[real]
        w = fw.watch(model, every_n_steps=1, backend="triton", route_all=True)
        w.set_head_modes("model.layers.0.self_attn", [Mode.FP32_O] * 2)
        w.step()
        moded = model(input_ids=ids, attention_mask=mask).logits.double()[real]
        report = w.step()
    w.remove()
    assert calls and all(m is not None for m in calls)  # the masked call ran Triton
    assert not report.unmitigable and report.monitor_errors_total == 0
    assert all(h.head_mode == Mode.FP32_O for h in report.heads)
    err, base_err = (moded - exact).abs().max(), (base - exact).abs().max()
    assert err <= 2 * base_err + 1e-5 * exact.abs().max(), (float(err), float(base_err))
