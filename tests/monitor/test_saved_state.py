"""flashwatch/monitor/saved_state.py in one process: a state is read by (layer, global
head), whatever order its table had, and a state of the format before (version 1: each
rank's own layers, modes as one tensor per layer) still loads. The layouts themselves
(pipeline and tensor-parallel ranks) are in tests/parallel/test_global_books.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from scaled_heads import N_LAYERS, VOCAB, Stage, batch, full_model

import flashwatch as fw

BETA, FP32_O = int(fw.Mode.BETA), int(fw.Mode.FP32_O)
SET = {("layers.1.attention", 2): BETA, ("layers.2.attention", 0): FP32_O}
NAMES = [f"layers.{i}.attention" for i in range(N_LAYERS)]


def _watched(steps=2):
    """The 4-layer model in one process, SET by hand, `steps` monitored steps run."""
    model = Stage(full_model(), list(range(N_LAYERS)), first=True, last=True)
    w = fw.watch(model, every_n_steps=1, rows_per_head="all")
    for (layer, head), mode in SET.items():
        modes = [0] * 4
        modes[head] = mode
        w.set_head_modes(layer, modes)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(steps):
        tokens = batch(i)
        F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB),
                        tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
        w.step()
    return model, w


def _set_modes(w) -> dict:
    return {(name, h): int(m) for name, modes in w.head_modes().items()
            for h, m in enumerate(modes) if m}


def _fresh():
    model = Stage(full_model(), list(range(N_LAYERS)), first=True, last=True)
    return fw.watch(model, every_n_steps=1, rows_per_head="all")


def test_a_state_saved_in_another_head_order_loads_by_key():
    """Interleaved pipeline ranks list rank 0's layers first (0, 2, 1, 3): a state in
    that order gives every head its own mode, signals and policy counters."""
    _, w = _watched()
    sd = w.state_dict()
    order = [0, 2, 1, 3]  # layers
    perm = torch.tensor([4 * layer + h for layer in order for h in range(4)])
    n = len(sd["heads"])

    def permuted(part):
        return {k: v[perm] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n
                else v for k, v in part.items()}

    other = dict(sd, heads=[sd["heads"][i] for i in perm.tolist()], modes=sd["modes"][perm],
                 user_set=sd["user_set"][perm], signals=permuted(sd["signals"]),
                 policy=dict(permuted(sd["policy"]),
                             heads=[sd["heads"][i] for i in perm.tolist()]),
                 qk_clip=permuted(sd["qk_clip"]))
    assert other["heads"][4] == ("layers.2.attention", 0)
    got = _fresh()
    got.load_state_dict(other)
    assert _set_modes(got) == SET
    mine, want = got._pipeline.signals.state_dict(), w._pipeline.signals.state_dict()
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(mine[k].nan_to_num(-7.0), v.nan_to_num(-7.0)), k
    assert torch.equal(got._pipeline.policy.since_switch, w._pipeline.policy.since_switch)
    got.remove()
    w.remove()


def test_a_state_of_other_heads_is_refused_naming_them():
    _, w = _watched(steps=1)
    sd = w.state_dict()
    sd["heads"] = [("layers.9.attention", h) if layer == NAMES[3] else (layer, h)
                   for layer, h in sd["heads"]]
    got = _fresh()
    with pytest.raises(ValueError, match=r"not saved \[\('layers.3.attention', 0\)"):
        got.load_state_dict(sd)
    got.remove()
    w.remove()


def test_a_version_1_state_still_loads():
    """Version 1, as saved before the global head table: the layers of this process as
    (name, heads), modes and warm starts as one entry per layer, no head keys."""
    _, w = _watched()
    sd = w.state_dict()
    v1 = {k: v for k, v in sd.items() if k not in ("heads", "user_set")}
    v1.update(version=1, sites=[(name, 4) for name in NAMES],
              modes=[sd["modes"][4 * i:4 * i + 4].clone() for i in range(N_LAYERS)],
              power_v=[sd["power_v"][name][1] for name in NAMES])
    got = _fresh()
    got.load_state_dict(v1)
    assert _set_modes(got) == SET
    for st in got.layer_states:
        assert torch.equal(st.power_v, sd["power_v"][st.site.name][1])
    got.remove()
    with pytest.raises(ValueError, match="version 3"):
        _fresh().load_state_dict(dict(sd, version=3))
    w.remove()
