"""`find_sites(model)`: a model's attention sites, discovered or given, checked once
(no site inside another, every layer calls SDPA, W^Q oriented as its q_module computes
q) and named canonically.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from flashwatch.sites.discovery import discover
from flashwatch.sites.eager_attention import refuse_no_sdpa
from flashwatch.sites.explicit import explicit_sites
from flashwatch.sites.orientation import check_orientation
from flashwatch.sites.site import AttentionSite, canonical_name


def find_sites(
    model: nn.Module,
    sites: Sequence[AttentionSite] | Mapping[str, Mapping[str, Any]] | None = None,
) -> list[AttentionSite]:
    """The attention sites of `model`, in `named_modules()` order, orientation-checked.

    sites: None to discover them (layouts in the module docstring); a dict
      {module_name: spec} where spec holds `make_site`'s keyword arguments; or a list of
      `AttentionSite`. Explicit sites replace discovery, they are not added to it.
    A module inside a site is never a second site (HF attention contains q_proj, ...).
    Site names are canonical (`canonical_name`): the same for the model compiled,
    checkpoint-wrapped or FSDP-wrapped, so a watcher's state moves between them.
    Layers that make no SDPA call (HF attn_implementation="eager", Bloom) are refused
    with ValueError (flashwatch/sites/eager_attention.py).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if sites is None:
        found = discover(model)
    else:
        found = explicit_sites(model, sites)
    if not found:
        raise ValueError("sites is empty; pass None to discover the attention layers or "
                         "at least one site")
    _check_disjoint(found)
    refuse_no_sdpa(found)
    for site in found:
        check_orientation(site)
    named = [_canonical(model, site) for site in found]
    seen: dict[str, int] = {}
    for site in named:
        seen[site.name] = seen.get(site.name, 0) + 1
    twice = sorted(n for n, c in seen.items() if c > 1)
    if twice:  # the global head table is keyed by name: one name, one layer
        raise ValueError(f"two attention layers are both named {twice[:3]} once wrapper "
                         "segments are dropped (model parts holding the same layer?); "
                         "watch each model once")
    return named


def _canonical(model: nn.Module, site: AttentionSite) -> AttentionSite:
    name = canonical_name(model, site.name)
    return site if name == site.name else dataclasses.replace(site, name=name)


def _check_disjoint(sites: list[AttentionSite]) -> None:
    """No site may contain another (or repeat it): one attention call would count twice.

    Sharing a helper module (a rotary table, say) between sites is fine.
    """
    for i, site in enumerate(sites):
        inner = {id(m) for m in site.module.modules()}
        for other in sites[i + 1:]:
            if id(other.module) in inner or id(site.module) in set(map(id, other.module.modules())):
                raise ValueError(
                    f"sites {site.name!r} and {other.name!r} overlap (one contains the other "
                    "or they are the same module); list each attention module once"
                )
