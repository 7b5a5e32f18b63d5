"""flashwatch/signals/drift.py's state: a step without data keeps it, a window reset keeps the
running sum and Σκ, memory stays fixed over 10,000 steps, a checkpoint round trip gives
identical outputs, and bad arguments are named. The calibration streams:
tests/signals/test_signals.py; the arithmetic against brute force:
tests/signals/test_signals_brute_force.py."""

from __future__ import annotations

import io
import math

import pytest
import torch

from flashwatch.signals.drift import HeadSignals

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")


def test_missing_data_keeps_state_and_repeats_values():
    n, k = 2, 4
    g = torch.Generator().manual_seed(7)
    s = HeadSignals(n, k, 8)
    for _ in range(5):
        last = s.update(torch.randn(n, k, k, generator=g, dtype=F64) + 1, torch.ones(n, dtype=F64))
    before = s.state_dict()
    G = torch.full((n, k, k), float("nan"), dtype=F64)
    out = s.update(G, torch.full((n,), 2.0, dtype=F64))
    after = s.state_dict()
    for name in HeadSignals._TENSORS:
        assert torch.equal(before[name].nan_to_num(7.0), after[name].nan_to_num(7.0)), name
    assert torch.isnan(out.r_projection).all()
    for field in ("r_projection_cumulative", "delta_drift_z", "delta_coherence",
                  "spectral_growth", "window_fill"):
        assert torch.equal(getattr(out, field), getattr(last, field)), field


def test_reset_window_keeps_running_sum_and_cumulative():
    n, k = 3, 4
    g = torch.Generator().manual_seed(8)
    s = HeadSignals(n, k, 8)
    for _ in range(10):
        s.update(torch.randn(n, k, k, generator=g, dtype=F64) + 1, torch.ones(n, dtype=F64))
    C, cum = s.C.clone(), s.kappa_cum.clone()
    s.reset_window(torch.tensor([False, True, False]))
    assert torch.equal(s.C, C) and torch.equal(s.kappa_cum, cum)
    assert s.fill.tolist() == [8, 0, 8]
    out = s.update(torch.full((n, k, k), float("nan"), dtype=F64), torch.ones(n, dtype=F64))
    assert out.delta_drift_z[1] == 0 and out.delta_coherence[1] == 0
    assert math.isnan(out.spectral_growth[1]) and out.window_fill[1] == 0


def _held_bytes(x):
    """Bytes of the tensors and arrays x holds through dicts, lists and tuples, plus one
    per entry: a container that grows step by step grows this."""
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (list, tuple, set)):
        return len(x) + sum(_held_bytes(v) for v in x)
    return getattr(x, "nbytes", 0)


def test_fixed_memory():
    n, k = 2, 4
    g = torch.Generator().manual_seed(9)
    s = HeadSignals(n, k, 16)
    G = torch.randn(10_000, n, k, k, generator=g, dtype=F64) + 0.5
    sigma = torch.ones(n, dtype=F64)
    for t in range(10_000):
        s.update(G[t], sigma)
        if t == 99:  # what a checkpoint holds, and what the object holds
            bytes_100 = _held_bytes(s.state_dict()), _held_bytes(vars(s))
    assert (_held_bytes(s.state_dict()), _held_bytes(vars(s))) == bytes_100


def test_state_dict_round_trip_gives_identical_outputs():
    n, k = 4, 5
    g = torch.Generator().manual_seed(10)
    stream = [(torch.randn(n, k, k, generator=g, dtype=F64) + 0.3,
               torch.rand(n, generator=g, dtype=F64) + 1) for _ in range(80)]
    stream[45][0][2] = float("nan")
    a = HeadSignals(n, k, 16)
    for G, sig in stream[:40]:
        a.update(G, sig)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)  # through a real checkpoint file format
    buf.seek(0)
    b = HeadSignals(n, k, 16)
    b.load_state_dict(torch.load(buf))
    for i, (G, sig) in enumerate(stream[40:]):
        if i == 20:
            for x in (a, b):
                x.reset_window(torch.tensor([True, False, True, False]))
        oa, ob = a.update(G, sig), b.update(G, sig)
        for field in oa.__dataclass_fields__:
            torch.testing.assert_close(getattr(oa, field), getattr(ob, field), rtol=0, atol=0,
                                       equal_nan=True)


@pytest.mark.parametrize("call, exc, words", [
    (lambda s: s.update(torch.zeros(2, 3, 3), torch.ones(3)), ValueError, ["G", "[3, 4, 4]"]),
    (lambda s: s.update(torch.zeros(3, 4, 4), torch.ones(2)), ValueError, ["sigma", "[3]"]),
    (lambda s: s.update([[0.0]], torch.ones(3)), TypeError, ["G", "torch.Tensor"]),
    (lambda s: s.update(torch.zeros(3, 4, 4, dtype=torch.int64), torch.ones(3)), TypeError,
     ["G", "floating"]),
    (lambda s: s.reset_window(torch.ones(3)), TypeError, ["mask", "bool"]),
    (lambda s: s.reset_window(torch.ones(2, dtype=torch.bool)), ValueError, ["mask", "[3]"]),
    (lambda s: s.load_state_dict({**s.state_dict(), "window": 9}), ValueError, ["window", "9"]),
    (lambda s: s.load_state_dict({**s.state_dict(), "C": torch.zeros(3)}), ValueError, ["'C'"]),
    (lambda s: HeadSignals(3, 4, 1), ValueError, ["window", "2"]),
    (lambda s: HeadSignals(0, 4, 8), ValueError, ["n_heads"]),
    (lambda s: HeadSignals(3, 4.0, 8), TypeError, ["sketch_dim"]),
])
def test_bad_arguments_are_named(call, exc, words):
    with pytest.raises(exc) as info:
        call(HeadSignals(3, 4, 8))
    for w in words:
        assert w in str(info.value)
