"""flashwatch/parallel/power.py without processes: a collective of the sharded power
iteration that raises (a partner that never came) breaks the monitor's group for good,
and no sharded norm issues a collective after that. The norms themselves, on gloo
ranks: tests/parallel/test_distributed.py."""

from __future__ import annotations

import types

import pytest
import torch

from flashwatch.parallel import power


class _Monitor:
    distributed = True
    broken = None

    def subgroup(self, group):
        return group


def test_a_collective_that_raises_breaks_the_monitor_group(monkeypatch):
    import torch.distributed as dist

    calls = []

    def timed_out(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("Timed out waiting 60000ms for recv")

    monkeypatch.setattr(dist, "all_reduce", timed_out)
    rows, head = torch.randn(4, 8), torch.tensor([0, 0, 1, 1])
    with pytest.raises(power.CollectiveFailed, match="Timed out"):
        power.host_power_iteration(rows, head, 2, 8, None, 3, group=None)
    monitor = _Monitor()
    power._broken(monitor, power.RemoteFailure("another rank failed"))
    assert monitor.broken is None  # a flag another rank raised: the group still works
    power._broken(monitor, power.CollectiveFailed("Timed out"))
    assert "sharded power iteration" in monitor.broken
    # from then on a row-sharded site gets an error and no collective is issued
    monkeypatch.setattr(power, "is_row_sharded", lambda site: True)
    calls.clear()
    site = types.SimpleNamespace(name="layers.0.attention", q_module=None, global_heads=None,
                                 output_gathered=False)
    got = power.spectral_norms([site], [None], 3, monitor=monitor)
    assert isinstance(got[0], RuntimeError) and "unusable" in str(got[0]) and not calls
