"""Small stand-ins for model families flashwatch must find without importing them.

Written for these tests (no dependency on `transformers` or `timm`); they copy only the
parts that discovery and the watcher look at: module names, attribute names, weight
layouts and the attention call (F.scaled_dot_product_attention inside the attention
module's forward). Each model has forward(idx, targets=None) -> (logits, loss) like
examples.gpt.GPT, so watcher tests can drive all of them the same way.

- TinyLlama: Hugging Face Llama layout, model.layers.{i}.self_attn with q_proj/k_proj/
  v_proj/o_proj, head counts only on `config` (as in recent transformers), grouped-query
  attention (4 query heads share 2 kv heads) and head_dim * heads != hidden_size.
- TinyGPT2: Hugging Face GPT-2 layout, transformer.h.{i}.attn with a fused `c_attn`
  of class Conv1D (weight [in, out], y = x @ W + b), num_heads/head_dim/split_size.
- TinyViTish: timm-like `qkv` Linear and `num_heads`, which discovery does not know;
  it needs explicit sites.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import flashwatch as fw
from flashwatch import Mode


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor | None:
    if targets is None:
        return None
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


# --- Llama -------------------------------------------------------------------------


@dataclass
class LlamaConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16  # 4 * 16 = 64 != 32 on purpose: head_dim must come from config


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        H, Hkv, C = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
        self.q_proj = nn.Linear(C, H * self.head_dim, bias=False)
        self.k_proj = nn.Linear(C, Hkv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(C, Hkv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(H * self.head_dim, C, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Real Llama applies rotary embeddings to q and k here; they act after the Q
        # projection and change nothing that discovery looks at, so they are left out.
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        # Grouped-query attention: kv head j serves query heads [j*g, (j+1)*g).
        k = k.repeat_interleave(self.num_key_value_groups, dim=1)
        v = v.repeat_interleave(self.num_key_value_groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)
        return self.o_proj(y.transpose(1, 2).reshape(*x.shape[:-1], -1))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        C, M = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(C, M, bias=False)
        self.up_proj = nn.Linear(C, M, bias=False)
        self.down_proj = nn.Linear(M, C, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size)
        self.self_attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size)
        self.mlp = LlamaMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = nn.RMSNorm(config.hidden_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class TinyLlama(nn.Module):
    """Names as in transformers' LlamaForCausalLM: model.layers.{i}.self_attn."""

    def __init__(self, config: LlamaConfig | None = None):
        super().__init__()
        self.config = config or LlamaConfig()
        self.model = LlamaModel(self.config)
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        logits = self.lm_head(self.model(idx))
        return logits, _lm_loss(logits, targets)


# --- GPT-2 -------------------------------------------------------------------------


@dataclass
class GPT2Config:
    vocab_size: int = 64
    n_positions: int = 32
    n_embd: int = 32
    n_layer: int = 2
    n_head: int = 4


class Conv1D(nn.Module):
    """transformers' GPT-2 projection: weight [nx, nf] (in, out), y = x @ W + b."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.nx = nx
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        # transformers starts the bias at zero; non-zero here so tests see it handled.
        self.bias = nn.Parameter(torch.randn(nf) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight)
        return out.view(*x.shape[:-1], self.nf)


class GPT2Attention(nn.Module):
    def __init__(self, config: GPT2Config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.embed_dim = config.n_embd
        self.num_heads = config.n_head
        self.head_dim = self.embed_dim // self.num_heads
        self.split_size = self.embed_dim
        self.c_attn = Conv1D(3 * self.embed_dim, self.embed_dim)
        self.c_proj = Conv1D(self.embed_dim, self.embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(self.split_size, dim=2)
        shape = (*x.shape[:-1], -1, self.head_dim)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(*x.shape[:-1], -1))


class GPT2MLP(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.c_fc = Conv1D(4 * config.n_embd, config.n_embd)
        self.c_proj = Conv1D(config.n_embd, 4 * config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, config: GPT2Config, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = GPT2MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList([GPT2Block(config, i) for i in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class TinyGPT2(nn.Module):
    """Names as in transformers' GPT2LMHeadModel: transformer.h.{i}.attn."""

    def __init__(self, config: GPT2Config | None = None):
        super().__init__()
        self.config = config or GPT2Config()
        self.transformer = GPT2Model(self.config)
        self.lm_head = nn.Linear(self.config.n_embd, self.config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        logits = self.lm_head(self.transformer(idx))
        return logits, _lm_loss(logits, targets)


# --- a layout discovery does not know ------------------------------------------------


class VitishAttention(nn.Module):
    """timm-like: fused `qkv` Linear laid out [q | k | v], heads in `num_heads`."""

    def __init__(self, dim: int = 32, num_heads: int = 4):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.num_heads, C // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, H, T, D]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class TinyViTish(nn.Module):
    """Token model built from VitishAttention blocks: blocks.{i}.attn."""

    def __init__(self, vocab_size: int = 64, dim: int = 32, num_heads: int = 4, depth: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList()
        for _ in range(depth):
            block = nn.Module()
            block.norm = nn.LayerNorm(dim)
            block.attn = VitishAttention(dim, num_heads)
            self.blocks.append(block)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.embed(idx)
        for block in self.blocks:
            x = x + block.attn(block.norm(x))
        logits = self.head(x)
        return logits, _lm_loss(logits, targets)


# ------------------------------------------------------------------ planted failures


class TiedAttention(nn.Module):
    """nanoGPT-style layer that calls flashwatch.attention (so a watcher always routes
    it). tie=True sets W^K = 0 and b^K = 0.5: every key is equal, so every row's scores
    are tied (except each sequence's first row, which sees one key)."""

    def __init__(self, C: int = 32, H: int = 2, tie: bool = False):
        super().__init__()
        self.c_attn = nn.Linear(C, 3 * C)
        self.n_head = H
        if tie:
            with torch.no_grad():
                self.c_attn.weight[C:2 * C].zero_()
                self.c_attn.bias[C:2 * C].fill_(0.5)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        return fw.attention(q, k, v, causal=True).transpose(1, 2).reshape(B, T, C)


def leaning_dispatch(real, bias: float):
    """Wrap flashwatch.kernels.dispatch.call_kernel into a kernel whose low-precision O leans
    positive by `bias`·|O| in STANDARD and BETA heads (as a real kernel's rounding can),
    while FP32_O heads' δ uses the FP32 O. The gradient is unchanged (detached)."""

    def leaning(q, k, v, *, head_modes, **kw):
        out = real(q, k, v, head_modes=head_modes, **kw)
        lean = (head_modes != int(Mode.FP32_O)).to(out.dtype).view(1, -1, 1, 1)
        return out + (bias * lean * out.detach().abs()).detach()

    return leaning


# --- tiny Hugging Face models, random init from config classes (no download) ----------
# transformers is imported inside: the stand-ins above stay free of it.

HF_COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=64)


def hf_tiny(arch: str, seed: int = 0):
    """(model, kind) for `arch` in HF_ARCHS: 2 layers, width 32, 4 heads; kind is
    "causal" (input_ids), "encoder" (input_ids), "seq2seq" (input_ids and
    decoder_input_ids) or "vision" (pixel_values 16×16, 4×4 patches)."""
    import transformers as T

    spec = HF_ARCHS[arch]
    cfg_cls, model_cls, kind, extra = spec
    if extra.get("attn_implementation") == "fw_attention":
        from flashwatch.integrations.hf_attention import register

        register()
    cfg = getattr(T, cfg_cls)(**{**_common(arch), **extra})
    torch.manual_seed(seed)
    return getattr(T, model_cls)(cfg).eval(), kind


def _common(arch: str) -> dict:
    if arch in ("gpt2",):
        return dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    if arch in ("t5",):
        return dict(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    if arch in ("bart",):
        return dict(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
                    encoder_attention_heads=4, decoder_attention_heads=4,
                    encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)
    if arch in ("opt",):
        return dict(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                    num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32)
    if arch in ("vit",):
        return dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, image_size=16, patch_size=4)
    return dict(HF_COMMON)


HF_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "causal", dict(num_key_value_heads=2)),
    # torch's flex_attention (transformers' integrations/flex_attention.py), read by
    # flashwatch/monitor/flex.py
    "llama_flex": ("LlamaConfig", "LlamaForCausalLM", "causal",
                   dict(num_key_value_heads=2, attn_implementation="flex_attention")),
    "mistral": ("MistralConfig", "MistralForCausalLM", "causal",
                dict(num_key_value_heads=2, sliding_window=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "causal", dict(num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "causal",
              dict(num_key_value_heads=2, head_dim=8)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", "causal", dict(num_key_value_heads=2)),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", "causal",
                   dict(num_key_value_heads=2, head_dim=8, layer_types=["full_attention"] * 2,
                        num_experts=0, mlp_only_layers=[0, 1])),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", "causal",
               dict(num_key_value_heads=2, head_dim=8, sliding_window=8)),
    # Gemma2 through flashwatch.attention(softcap=): flashwatch/integrations/hf_attention.py
    "gemma2_fw": ("Gemma2Config", "Gemma2ForCausalLM", "causal",
                  dict(num_key_value_heads=2, head_dim=8, sliding_window=8,
                       attn_implementation="fw_attention")),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", "causal",
               dict(num_key_value_heads=2, head_dim=8, sliding_window=8)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", "causal",
             dict(num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", "causal", dict(rotary_pct=0.5)),
    "falcon": ("FalconConfig", "FalconForCausalLM", "causal",
               dict(new_decoder_architecture=False, multi_query=False)),
    "falcon_mq": ("FalconConfig", "FalconForCausalLM", "causal",
                  dict(new_decoder_architecture=False, multi_query=True)),
    "falcon_new": ("FalconConfig", "FalconForCausalLM", "causal",
                   dict(new_decoder_architecture=True, num_kv_heads=2)),
    "bloom": ("BloomConfig", "BloomForCausalLM", "causal", dict(n_head=4)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", "causal", dict(bos_token_id=1, eos_token_id=2)),
    "opt": ("OPTConfig", "OPTForCausalLM", "causal", dict()),
    "bert": ("BertConfig", "BertModel", "encoder", dict()),
    "roberta": ("RobertaConfig", "RobertaModel", "encoder", dict(pad_token_id=1)),
    "vit": ("ViTConfig", "ViTModel", "vision", dict()),
    "t5": ("T5Config", "T5Model", "seq2seq", dict()),
    "bart": ("BartConfig", "BartModel", "seq2seq", dict()),
}


def hf_inputs(kind: str, B: int = 2, N: int = 12, seed: int = 0, padded: bool = False
              ) -> dict:
    """Model inputs for hf_tiny's `kind`, from a private generator. padded: text inputs
    get an attention_mask with the first sequence's last N // 3 tokens padding (right
    padding, as a fine-tuning collator pads: every query row still sees a real key)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (B, N), generator=g)
    if kind == "vision":
        return dict(pixel_values=torch.randn(B, 3, 16, 16, generator=g))
    out = dict(input_ids=ids)
    if kind == "seq2seq":
        out["decoder_input_ids"] = ids.flip(1)
    if padded:
        mask = torch.ones_like(ids)
        mask[0, N - N // 3:] = 0
        out["attention_mask"] = mask
    return out


@dataclass
class MegatronConfig:
    """The fields of Megatron-core's TransformerConfig its SelfAttention reads."""

    hidden_size: int = 32
    num_attention_heads: int = 4
    num_query_groups: int = 2
    kv_channels: int = 16  # 4 · 16 = 64 != 32 on purpose: head_dim from kv_channels
    num_layers: int = 2
    vocab_size: int = 64


class MegatronCoreAttention(nn.Module):
    """Megatron's `core_attention` slot, filled with SDPA ([s, b, h, d] in and out)."""

    def forward(self, q, k, v):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.permute(2, 0, 1, 3).flatten(2)


class MegatronSelfAttention(nn.Module):
    """Megatron-core SelfAttention's layout: `linear_qkv` rows per query group [q_g0 ..
    q_g(r-1) | k_g | v_g], split as its get_query_key_value_tensors does (local groups
    from the tensor's width, so ColwiseParallel over whole groups works), sequence-first
    activations, `core_attention` and `linear_proj` siblings, counts on `config`."""

    def __init__(self, config: MegatronConfig):
        super().__init__()
        self.config = config
        H, G, D = config.num_attention_heads, config.num_query_groups, config.kv_channels
        self.linear_qkv = nn.Linear(config.hidden_size, (H + 2 * G) * D)
        self.core_attention = MegatronCoreAttention()
        self.linear_proj = nn.Linear(H * D, config.hidden_size)

    def forward(self, x):  # x: [s, b, hidden]
        c = self.config
        r, D = c.num_attention_heads // c.num_query_groups, c.kv_channels
        mixed = self.linear_qkv(x)
        mixed = mixed.view(*mixed.shape[:2], -1, (r + 2) * D)  # [s, b, groups, (r+2)·D]
        q, k, v = mixed.split([r * D, D, D], dim=-1)
        q = q.reshape(*q.shape[:2], -1, D)  # [s, b, groups · r, D], head g·r + j
        return self.linear_proj(self.core_attention(q, k, v))


class TinyMegatron(nn.Module):
    """decoder.layers.{i}.self_attention, as in Megatron-core's GPTModel."""

    def __init__(self, config: MegatronConfig | None = None):
        super().__init__()
        c = config or MegatronConfig()
        self.embedding = nn.Embedding(c.vocab_size, c.hidden_size)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(
            nn.ModuleDict(dict(input_layernorm=nn.LayerNorm(c.hidden_size),
                               self_attention=MegatronSelfAttention(c)))
            for _ in range(c.num_layers))
        self.output_layer = nn.Linear(c.hidden_size, c.vocab_size)

    def forward(self, idx, targets=None):
        x = self.embedding(idx).transpose(0, 1)  # [s, b, hidden]
        for layer in self.decoder.layers:
            x = x + layer["self_attention"](layer["input_layernorm"](x))
        logits = self.output_layer(x.transpose(0, 1))
        return logits, _lm_loss(logits, targets)
