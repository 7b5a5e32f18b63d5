"""Explicit attention sites: layers that `find_sites` does not recognise, given by hand.

As a dict keyed by module name, each value `make_site`'s keyword arguments:

    find_sites(model, sites={
        "blocks.0.attn": dict(num_heads=8, q_module="qkv"),      # fused QKV Linear
        "blocks.1.attn": dict(num_heads=8, q_module="to_q", head_dim=64),
    })

or as a list of `AttentionSite` (e.g. `find_sites(model) + [make_site(model, ...)]` to add
one custom layer to those found automatically). flashwatch/sites/site.py holds AttentionSite,
discovery's entry point and the checks every site passes (overlap; orientation, in
flashwatch/sites/orientation.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from flashwatch._checks import check_int
from flashwatch.sites import layouts
from flashwatch.sites.site import (
    AttentionSite,
    canonical_name,
    get_submodule,
    parse_index,
    parse_slice,
)
from flashwatch.sites.weights import rows_at, weight_of

SPEC_KEYS = ("num_heads", "q_module", "wq", "num_kv_heads", "head_dim", "q_slice_of_output",
             "q_layout", "q_channels", "k_module", "k_channels")


def explicit_sites(
    model: nn.Module,
    sites: Sequence[AttentionSite] | Mapping[str, Mapping[str, Any]],
) -> list[AttentionSite]:
    """`find_sites`'s sites= when it is not None: a dict {module_name: make_site kwargs}
    built into sites, or a list of AttentionSite checked to belong to `model`."""
    if isinstance(sites, Mapping):
        found = []
        for name, spec in sites.items():
            if not isinstance(spec, Mapping):
                raise TypeError(
                    f"sites[{name!r}] must be a dict of make_site arguments such as "
                    f"dict(num_heads=8, q_module='q_proj'), got {type(spec).__name__}"
                )
            unknown = sorted(set(spec) - set(SPEC_KEYS))
            if unknown:
                raise ValueError(f"sites[{name!r}] has unknown keys {unknown}; "
                                 f"allowed keys are {list(SPEC_KEYS)}")
            found.append(make_site(model, name, **spec))
    elif isinstance(sites, Sequence) and not isinstance(sites, str):
        found = list(sites)
        for i, site in enumerate(found):
            if not isinstance(site, AttentionSite):
                raise TypeError(f"sites[{i}] must be an AttentionSite, got "
                                f"{type(site).__name__}; build one with make_site(model, ...)")
            if get_submodule(model, site.name) is not site.module and not any(
                    m is site.module and canonical_name(model, n) == site.name
                    for n, m in model.named_modules()):
                raise ValueError(f"sites[{i}]: model.{site.name or '<root>'} is not "
                                 f"site.module; name must be the module's path in this model "
                                 f"(or its canonical_name)")
    else:
        raise TypeError(
            "sites must be None, a dict {module_name: dict(num_heads=..., q_module=...)} or "
            f"a list of AttentionSite, got {type(sites).__name__}"
        )
    return found


def make_site(
    model: nn.Module,
    name: str,
    *,
    num_heads: int,
    q_module: str | nn.Module | None = None,
    wq: Callable[[], torch.Tensor] | torch.Tensor | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    q_slice_of_output: tuple[int, int] | None = None,
    q_layout: str | None = None,
    q_channels: Sequence[int] | torch.Tensor | None = None,
    k_module: str | nn.Module | None = None,
    k_channels: Sequence[int] | torch.Tensor | None = None,
) -> AttentionSite:
    """An explicit site for an attention module that `find_sites` does not recognise.

    name: path of the attention module in `model` (the one whose forward calls attention).
    num_heads: query heads. num_kv_heads: defaults to num_heads.
    q_module: the module whose input is X: a path relative to the site module (tried
      first, e.g. "qkv") or to the model, or the module itself.
    wq: W^Q as [H, head_dim, d_model] or [H*head_dim, d_model] (nn.Linear orientation):
      a tensor (an nn.Parameter stays current, optimizers update it in place) or a
      callable returning one. Default: read from q_module when it is an nn.Linear or a
      Conv1D, channels q_slice_of_output.
    head_dim: defaults to d_model // num_heads.
    q_slice_of_output: (start, stop) of the Q channels in q_module's output, head-major.
      Default (0, num_heads * head_dim): right for a plain Q projection and for fused
      [q | k | v] projections (nanoGPT, timm); for a q_module whose layout is known
      (`layouts.known_layout`: GPT-NeoX, Bloom, Falcon query_key_value, a gated q_proj)
      that layout instead.
    q_layout: an interleaved layout of q_module's outputs (flashwatch/sites/layouts.py):
      "per_head_qkv" (GPT-NeoX, Bloom: [q_h | k_h | v_h] per head), "per_group_qkv"
      (Falcon's new architecture), "per_head_q_gate" (Qwen3-Next's gated q_proj), or "q".
    q_channels: the Q output channels themselves, head-major ([H * head_dim] ints).
    At most one of q_slice_of_output, q_layout, q_channels. The slice is checked at
    discovery against q_module (`check_orientation`) and, on the first monitored call,
    against the q that reaches SDPA (flashwatch.sites.layouts.QCheck).
    k_module: the nn.Linear computing K (a path as q_module's, or the module), which
      QK-clip scales; k_channels: its K output channels, head-major ([Hkv * head_dim]
      ints). Default channels: those of q_layout's K when k_module is q_module (a fused
      projection: "q" means [Q | K | V]), else the first Hkv * head_dim. Without
      k_module, QK-clip is refused for this site (it needs W^K).
    """
    module = _site_module(model, name)
    where = f"site {name!r}"
    check_int(f"{where}: num_heads", num_heads, min=1, hint="the query heads of the layer")
    if wq is not None and not isinstance(wq, torch.Tensor) and not callable(wq):
        raise TypeError(f"{where}: wq must be a tensor or a callable returning one, got "
                        f"{type(wq).__name__}")
    q_mod = _resolve_q_module(model, name, module, q_module)
    q_weight = weight_of(q_mod) if q_mod is not None else None  # [out, in] view or None
    d_model = _d_model(where, wq, q_mod, q_weight)
    if head_dim is None:
        head_dim = _default_head_dim(where, d_model, num_heads)
    kv = num_heads if num_kv_heads is None else num_kv_heads
    if q_slice_of_output is None and q_channels is None and q_layout is None:
        q_layout = layouts.known_layout(module, q_mod, num_heads, kv, head_dim)
    index = _explicit_index(where, num_heads, kv, head_dim, q_slice=q_slice_of_output,
                            q_layout=q_layout, q_channels=q_channels)
    k_mod = _resolve_q_module(model, name, module, k_module, "k_module")
    k_index = None if k_mod is None else _k_index(where, k_mod, k_mod is q_mod, q_layout,
                                                   num_heads, kv, head_dim, k_channels)
    return AttentionSite(
        name=name, module=module, num_heads=num_heads, num_kv_heads=kv,
        head_dim=head_dim, d_model=d_model, q_module=q_mod, kind="explicit",
        q_slice_of_output=None, wq_source=_wq_source(where, wq, q_mod, q_weight, index),
        q_index=None if q_mod is None else index, layout=q_layout or "q",
        k_module=k_mod, k_index=k_index,
    )


def _k_index(where: str, k_mod: nn.Module, fused: bool, q_layout: str | None, H: int,
             Hkv: int, D: int, k_channels) -> torch.Tensor:
    """An explicit site's K channels in k_module's output (make_site's k_channels)."""
    if not isinstance(k_mod, nn.Linear):
        raise ValueError(f"{where}: k_module is {type(k_mod).__name__}; QK-clip scales the "
                         "rows of an nn.Linear's weight, so k_module must be one")
    if k_channels is not None:
        index = parse_index(k_channels, Hkv * D, where)
    elif fused:
        index = layouts.k_index(q_layout or "q", H, Hkv, D)
    else:
        index = torch.arange(Hkv * D)
    if int(index.max()) >= k_mod.out_features:
        raise ValueError(f"{where}: the K channels go up to {int(index.max())}, past the "
                         f"{k_mod.out_features} outputs of k_module; pass k_channels=")
    return index


def _site_module(model: nn.Module, name: str) -> nn.Module:
    """The attention module at path `name` in `model`."""
    if not isinstance(name, str):
        raise TypeError(f"site name must be a str module path, got {type(name).__name__}")
    module = get_submodule(model, name)
    if module is None:
        raise ValueError(f"site {name!r}: the model has no module named {name!r}; use a "
                         "name from model.named_modules()")
    return module


def _d_model(where: str, wq: Callable[[], torch.Tensor] | torch.Tensor | None,
             q_mod: nn.Module | None, q_weight: torch.Tensor | None) -> int:
    """The width of X (W^Q's last dim): from wq when given, else q_module's weight."""
    if isinstance(wq, torch.Tensor):
        return wq.shape[-1]
    if q_weight is not None:
        return q_weight.shape[1]
    if wq is not None:
        return wq().shape[-1]
    raise ValueError(
        f"{where}: cannot tell W^Q: q_module is "
        f"{type(q_mod).__name__ if q_mod is not None else 'None'}; pass wq= (a tensor "
        "[H, head_dim, d_model] or a callable returning one) or q_module= an nn.Linear"
    )


def _default_head_dim(where: str, d_model: int, num_heads: int) -> int:
    """d_model // num_heads, when the heads split d_model evenly."""
    if d_model % num_heads != 0:
        raise ValueError(f"{where}: d_model={d_model} is not a multiple of "
                         f"num_heads={num_heads}; pass head_dim= explicitly")
    return d_model // num_heads


def _wq_source(where: str, wq: Callable[[], torch.Tensor] | torch.Tensor | None,
               q_mod: nn.Module | None, q_weight: torch.Tensor | None,
               index: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The getter the site reads W^Q through: wq as given (a tensor is wrapped), or by
    default q_module's weight rows `index` (`rows_at`)."""
    if wq is None:
        if q_weight is None:
            raise ValueError(f"{where}: q_module is {type(q_mod).__name__}, not an nn.Linear "
                             "or Conv1D, so W^Q cannot be read from it; pass wq=")
        if int(index.max()) >= q_weight.shape[0]:
            raise ValueError(f"{where}: the Q channels go up to {int(index.max())}, past the "
                             f"{q_weight.shape[0]} outputs of q_module")
        return rows_at(q_mod, index)
    if isinstance(wq, torch.Tensor):
        return lambda: wq
    return wq


def _explicit_index(where: str, H: int, Hkv: int, D: int, *, q_slice: tuple[int, int] | None,
                    q_layout: str | None,
                    q_channels: Sequence[int] | torch.Tensor | None) -> torch.Tensor:
    """The Q channels an explicit site asks for (make_site's three ways to say it)."""
    given = [n for n, v in (("q_slice_of_output", q_slice), ("q_layout", q_layout),
                            ("q_channels", q_channels)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"{where}: pass at most one of q_slice_of_output, q_layout and "
                         f"q_channels, got {given}")
    if q_channels is not None:
        return parse_index(q_channels, H * D, where)
    if q_layout is not None:
        if q_layout not in layouts.LAYOUTS:
            raise ValueError(f"{where}: q_layout must be one of {layouts.LAYOUTS}, got "
                             f"{q_layout!r}")
        if H % Hkv:
            raise ValueError(f"{where}: num_heads={H} is not a multiple of num_kv_heads={Hkv}")
        return layouts.q_index(q_layout, H, Hkv, D)
    start, stop = parse_slice(q_slice or (0, H * D), where)
    if stop - start != H * D:
        raise ValueError(f"{where}: q_slice_of_output={q_slice} spans {stop - start} channels "
                         f"but num_heads * head_dim = {H} * {D} = {H * D}; the slice must "
                         "cover exactly the Q channels")
    return torch.arange(start, stop)


def _resolve_q_module(model: nn.Module, name: str, module: nn.Module,
                      q_module: str | nn.Module | None, arg: str = "q_module"
                      ) -> nn.Module | None:
    if q_module is None or isinstance(q_module, nn.Module):
        return q_module
    if not isinstance(q_module, str):
        raise TypeError(f"site {name!r}: {arg} must be a module path (str), an nn.Module "
                        f"or None, got {type(q_module).__name__}")
    found = get_submodule(module, q_module)
    if found is None:
        found = get_submodule(model, q_module)
    if found is None:
        children = [n for n, _ in module.named_children()]
        raise ValueError(f"site {name!r}: {arg}={q_module!r} is neither a submodule of the "
                         f"site (children: {children}) nor of the model")
    return found
