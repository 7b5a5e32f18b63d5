"""Discovery of attention layers ("sites") in a model.

A site is one attention module: the module whose forward makes the attention call, its
head counts, its W^Q per head ([H, d_head, d_model], docs/design.md §1 step 2 and §5) and
the module whose input is X, the input of the Q projection.

`find_sites(model)` recognises these layouts by the names of a module's direct children:

- "nanogpt": a child `c_attn` that is an nn.Linear(C, 3C) (fused q, k, v; W^Q is rows
  [0, C) of its weight) and a head count attribute such as `n_head`.
- "gpt2_conv1d": a child `c_attn` of class `Conv1D` (transformers' GPT-2), whose weight
  is [C, 3C] and computes y = x @ W + b, i.e. transposed relative to nn.Linear.
- "hf": separate Q, K, V nn.Linear children: `q_proj`/`k_proj`/`v_proj` (Llama, Mistral,
  Qwen, OPT, BART, ...), `query`/`key`/`value` (BERT, RoBERTa), `q`/`k`/`v` (T5),
  `wq`/`wk`/`wv` (torchtitan's Llama); heads from the module or its `config`,
  grouped-query attention allowed.
- "gated_q": q_proj with 2·H·head_dim outputs, [q_h | gate_h] per head (Qwen3-Next).
- "fused_qkv": one Linear for q, k and v: `query_key_value` of GPT-NeoX/Pythia and Bloom
  (per head [q_h | k_h | v_h]) or Falcon (its three layouts), `qkv_proj` (Phi-3:
  [Q | K | V] with grouped K, V). Other classes owning a `query_key_value` are refused
  by name (their row order is unknown).
- The trainers' layouts, each declared in its own module (a `layouts.TrainerLayout`):
  torchtitan 0.3 (flashwatch/sites/torchtitan.py: `qkv_linear.wqkv` per K/V group or
  `qkv_linear.wq/wk/wv`, the call in the sibling `inner_attention`), OLMo-core
  (olmo_core.py: `w_q`, `w_k`, `w_v`), Megatron-core (megatron.py: `linear_qkv` per
  query group, counts on its `config`). Fused per-group projections split by
  ColwiseParallel over whole groups are this rank's groups.

The Q channels of each layout are a `q_index` (flashwatch/sites/layouts.py). Layers that make
no SDPA call (HF attn_implementation="eager", Bloom) are refused by name at discovery
(flashwatch/sites/eager_attention.py).

Anything else is given explicitly, as a dict keyed by module name or a list of
`AttentionSite` (`make_site`, flashwatch/sites/explicit.py).

Every site's W^Q is checked once against its q_module (`check_orientation`,
flashwatch/sites/orientation.py), so a transposed or mis-sliced weight fails loudly at
discovery instead of producing quietly wrong numbers for days. A slice that is
consistent with q_module but not the layer's Q (the K rows of an interleaved projection)
passes that check; flashwatch.sites.layouts.QCheck compares it with the q the layer hands SDPA
on its first monitored call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from flashwatch._checks import check_int
from flashwatch.sites.weights import as_slice

KINDS = ("nanogpt", "hf", "gpt2_conv1d", "fused_qkv", "gated_q", "explicit")


@dataclass(eq=False)
class AttentionSite:
    """One attention layer and how to read its W^Q.

    name: module path in the model (as in `model.named_modules()`; "" for the root);
      `find_sites` returns it canonical, without wrapper segments (`canonical_name`).
    module: the module whose forward performs the attention call.
    num_heads, num_kv_heads: query heads and key/value heads (equal unless grouped-query).
    head_dim, d_model: per-head width and the width of X.
    q_module: the module whose input is X; its output, restricted to the channels
      q_slice_of_output = (start, stop), is q laid out head-major ([..., H, head_dim]).
      None when unknown (then there is no X and no orientation check).
    kind: "nanogpt" | "hf" | "gpt2_conv1d" | "fused_qkv" (a `query_key_value` or
      `qkv_proj` Linear) | "gated_q" (q_proj output [q_h | gate_h] per head) | "explicit".
    wq_source: a callable returning W^Q as [H, head_dim, d_model] or, in nn.Linear
      orientation, [H * head_dim, d_model]; read through `wq()`.
    q_index: the Q channels of q_module's output, [H * head_dim] int64, head-major
      (flashwatch/sites/layouts.py); q_slice_of_output is (start, stop) when they are one
      contiguous run, None otherwise (interleaved layouts). Derived from the slice when
      not given.
    layout: the name of that layout, for messages (flashwatch.sites.layouts.LAYOUTS).
    k_module, k_index: the module computing K and its K channels ([Hkv * head_dim],
      head-major), when known (QK-clip scales them); None for explicit sites.
    global_heads, head_offset: under tensor parallelism the site is this rank's part
      of the layer: num_heads (and num_kv_heads, q_index, W^Q) are its local heads, which
      are heads [head_offset, head_offset + num_heads) of the layer's global_heads.
      None and 0 otherwise. channel_offsets: then the global output channels of this
      rank's first rows of q_module and k_module (QK-clip writes the global channels
      q_index + offset, k_index + offset). output_gathered: its Q projection is split
      by tensor parallelism but its output gathered (ColwiseParallel with
      output_layouts=Replicate(), HF's "colwise_gather_output"), so every rank computes
      every head: found at the first call with all the layer's heads.
    """

    name: str
    module: nn.Module = field(repr=False)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    d_model: int
    q_module: nn.Module | None = field(repr=False)
    kind: str
    q_slice_of_output: tuple[int, int] | None
    wq_source: Callable[[], torch.Tensor] = field(repr=False)
    q_index: torch.Tensor | None = field(default=None, repr=False)
    layout: str = "q"
    k_module: nn.Module | None = field(default=None, repr=False)
    k_index: torch.Tensor | None = field(default=None, repr=False)
    global_heads: int | None = None
    head_offset: int = 0
    channel_offsets: tuple[int, int] | None = None
    output_gathered: bool = False

    @property
    def layer_heads(self) -> int:
        """The layer's head count across the job (its local heads without TP)."""
        return self.num_heads if self.global_heads is None else self.global_heads

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"AttentionSite name must be a str, got {type(self.name).__name__}")
        where = f"AttentionSite {self.name!r}"
        if not isinstance(self.module, nn.Module):
            raise TypeError(f"{where}: module must be an nn.Module, got "
                            f"{type(self.module).__name__}")
        for attr in ("num_heads", "num_kv_heads", "head_dim", "d_model"):
            check_int(f"{where}: {attr}", getattr(self, attr), min=1)
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"{where}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}; each kv head serves a whole group of "
                "query heads, so pass the counts the model actually uses"
            )
        if self.kind not in KINDS:
            raise ValueError(f"{where}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.q_module is not None and not isinstance(self.q_module, nn.Module):
            raise TypeError(f"{where}: q_module must be an nn.Module or None, got "
                            f"{type(self.q_module).__name__}")
        if self.q_index is not None:
            self.q_index = parse_index(self.q_index, self.num_heads * self.head_dim, where)
            self.q_slice_of_output = as_slice(self.q_index)
        if self.q_module is not None and self.q_slice_of_output is None \
                and self.q_index is None:
            raise ValueError(f"{where}: q_module is set but q_slice_of_output is None; pass "
                             "(start, stop) of the Q channels in q_module's output")
        if self.q_slice_of_output is not None and self.q_index is None:
            start, stop = parse_slice(self.q_slice_of_output, where)
            if stop - start != self.num_heads * self.head_dim:
                raise ValueError(
                    f"{where}: q_slice_of_output={self.q_slice_of_output} spans "
                    f"{stop - start} channels but num_heads * head_dim = "
                    f"{self.num_heads} * {self.head_dim} = {self.num_heads * self.head_dim}; "
                    "the slice must cover exactly the Q channels"
                )
            self.q_slice_of_output = (start, stop)
            self.q_index = torch.arange(start, stop)
        if self.k_index is not None:
            self.k_index = parse_index(self.k_index, self.num_kv_heads * self.head_dim, where)
        if not callable(self.wq_source):
            raise TypeError(f"{where}: wq_source must be a callable returning W^Q, got "
                            f"{type(self.wq_source).__name__}")

    def wq(self) -> torch.Tensor:
        """W^Q per head, [num_heads, head_dim, d_model], detached; a view of the live weight
        wherever the layout allows one, so it reflects every optimizer step."""
        w = self.wq_source()
        H, D, C = self.num_heads, self.head_dim, self.d_model
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"site {self.name!r}: wq_source returned "
                            f"{type(w).__name__}, expected a torch.Tensor")
        if w.dim() == 2 and tuple(w.shape) == (H * D, C):
            w = w.unflatten(0, (H, D))  # a view even for a transposed (Conv1D) weight
        if tuple(w.shape) != (H, D, C):
            raise RuntimeError(
                f"site {self.name!r}: W^Q has shape {list(w.shape)}, expected "
                f"[{H}, {D}, {C}] ([num_heads, head_dim, d_model]) or [{H * D}, {C}]"
            )
        return w.detach()


# --- helpers -------------------------------------------------------------------------


# Attribute names under which wrappers hold the module they wrap: torch.compile's
# OptimizedModule, checkpoint_wrapper's CheckpointWrapper, FSDP1's FullyShardedDataParallel.
WRAPPER_ATTRS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
# `module` is an ordinary name, so it is dropped only below these wrapper classes.
MODULE_WRAPPERS = ("DistributedDataParallel", "DataParallel")


class ModelParts(nn.Module):
    """The model parts one pipeline rank holds (torchtitan's `model_parts`: two or more
    stages per rank under interleaved schedules), watched as one model: each part under
    its index, which `canonical_name` drops, so a layer keeps the name it has in the
    whole model ("layers.3.attention", not "1.layers.3.attention")."""

    def __init__(self, parts):
        super().__init__()
        for i, part in enumerate(parts):
            if not isinstance(part, nn.Module):
                raise TypeError(f"model part {i} must be a torch.nn.Module, got "
                                f"{type(part).__name__}")
            self.add_module(str(i), part)


def canonical_name(model: nn.Module, name: str) -> str:
    """`name` (a path in model.named_modules()) without the segments wrappers add:
    `_orig_mod` (torch.compile), `_checkpoint_wrapped_module` (checkpoint_wrapper),
    `_fsdp_wrapped_module` (FSDP1), DDP's `module` and ModelParts' part index. FSDP2's
    fully_shard adds none.
    "_orig_mod.transformer.h.0._checkpoint_wrapped_module.attn" -> "transformer.h.0.attn".
    """
    kept, parent = [], model
    for part in name.split(".") if name else []:
        wrapper = part in WRAPPER_ATTRS or isinstance(parent, ModelParts) or (
            part == "module" and type(parent).__name__ in MODULE_WRAPPERS)
        if not wrapper:
            kept.append(part)
        parent = getattr(parent, "_modules", {}).get(part)  # None off the model: kept as is
    return ".".join(kept)


def get_submodule(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def parse_slice(value: Any, where: str) -> tuple[int, int]:
    ok = (isinstance(value, (tuple, list)) and len(value) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
          and 0 <= value[0] < value[1])
    if not ok:
        raise ValueError(f"{where}: q_slice_of_output must be (start, stop) with "
                         f"0 <= start < stop, got {value!r}")
    return int(value[0]), int(value[1])


def parse_index(value: Any, size: int, where: str) -> torch.Tensor:
    """A channel index as a 1-D int64 CPU tensor of `size` distinct non-negative ints."""
    try:
        index = torch.as_tensor(value).to("cpu")
    except Exception as e:
        raise TypeError(f"{where}: a channel index must be a 1-D int tensor or list, got "
                        f"{type(value).__name__}") from e
    if index.dtype.is_floating_point or index.dtype == torch.bool or index.dim() != 1 \
            or index.numel() != size or (index.numel() and int(index.min()) < 0) \
            or torch.unique(index).numel() != index.numel():
        raise ValueError(f"{where}: a channel index must hold {size} distinct non-negative "
                         f"ints (heads × head_dim, head-major), got {describe(value)}")
    return index.long()


def q_rows(site: AttentionSite, t: torch.Tensor) -> torch.Tensor:
    """The Q channels of a tensor laid out like q_module's outputs on dim 0 (its weight
    in nn.Linear orientation, or that weight's gradient), head-major [H * D, ...]: a
    slice (a view) for a contiguous layout, an index_select (a copy) for interleaved ones."""
    if site.q_slice_of_output is not None:
        a, b = site.q_slice_of_output
        return t[a:b]
    return t.index_select(0, site.q_index.to(t.device))


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor {list(value.shape)}"
    return f"a {type(value).__name__}"
