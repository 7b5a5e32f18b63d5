"""A watcher's saved state over the job's global head table, loadable in any layout.

Version 2 (Watcher.state_dict) keeps every per-head quantity over the global head table,
keyed by (layer name, global head): the modes of every head (each rank knows them all
after a monitored step's exchange), the hand-set flags not exchanged yet, the signals,
the policy and QK-clip's books. Any rank's state therefore loads on every rank of the
same job (the Hugging Face callback saves rank 0's and loads it everywhere), and a
state saved by one process loads into a tensor- or pipeline-parallel job and back: each
rank takes the heads it holds. The table's order may differ between layouts: arrays are
reordered by key. The power iteration's warm start is a per-rank cache, kept by layer
name and head range where the loading rank holds the same rows (else it starts cold).

Version 1 (before the global table) held each rank's own layers with their local head
counts; it still loads into a watcher of the same layers.
"""

from __future__ import annotations

import torch

VERSION = 2


def order(saved: list, keys: list[tuple[str, int]]) -> torch.Tensor:
    """Indices into the saved heads of this table's heads, in this table's order; raises
    ValueError naming the heads one side has and the other lacks."""
    saved = [(str(k[0]), int(k[1])) for k in saved]
    where = {k: i for i, k in enumerate(saved)}
    missing = [k for k in keys if k not in where]
    extra = [k for k in saved if k not in set(keys)]
    if missing or extra or len(where) != len(saved):
        raise ValueError(f"the saved watcher watched {len(saved)} heads, this job {len(keys)}: "
                         f"not saved {missing[:4]}, not watched here {extra[:4]}; load a "
                         f"state of the same model (any parallel layout)")
    return torch.tensor([where[k] for k in keys], dtype=torch.int64)


def reorder(sd: dict, perm: torch.Tensor, n_saved: int) -> dict:
    """A sub-state (signals, policy, QK-clip) with every per-head tensor (first dim the
    saved head count) taken in this table's order."""
    if torch.equal(perm, torch.arange(n_saved)):
        return sd
    return {k: v[perm] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n_saved
            else v for k, v in sd.items()}


def warm_starts(states) -> dict:
    """layer name -> (first global head, v [local heads, d_model]) of this rank's
    power iterations."""
    return {st.site.name: (st.site.head_offset, st.power_v.clone())
            for st in states if st.power_v is not None}


def warm_start(saved: dict, st) -> torch.Tensor | None:
    """The saved warm start of `st`'s heads, if the state holds their rows."""
    got = saved.get(st.site.name)
    if got is None:
        return None
    first, v = got
    lo = st.site.head_offset - int(first)
    if not isinstance(v, torch.Tensor) or v.dim() != 2 or lo < 0 or \
            lo + st.site.num_heads > v.shape[0] or v.shape[1] != st.site.d_model:
        return None
    return v[lo:lo + st.site.num_heads].clone()
