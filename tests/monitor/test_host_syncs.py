"""A monitored step costs at most 2 would-be CUDA host syncs whatever the number of layers
and micro-batches (one move of everything the step accumulated, plus the reduction, which
runs on the host); an unmonitored step costs none. Counted on the CPU by
flashwatch/synccount.py (its docstring has the rules), in every attention path: SDPA,
routed heads (FP32_O and BETA through flashwatch's kernel), route_all."""

from __future__ import annotations

import pytest

from benchmarks.bench_syncs import count

MONITORED_BOUND = 2


@pytest.mark.parametrize("path", ["sdpa", "routed", "route_all"])
@pytest.mark.parametrize("n_layer,micro", [(2, 1), (4, 3)])
def test_syncs_per_step_do_not_grow_with_layers_or_micro_batches(one_thread, path, n_layer,
                                                                 micro):
    steps = count(n_layer, micro, path)  # every_n_steps=2: steps 0 and 2 are monitored
    monitored, unmonitored = steps[2], steps[3]
    assert unmonitored.total == 0, unmonitored.table()
    assert 1 <= monitored.total <= MONITORED_BOUND, monitored.table()
    assert not monitored.mismatches and not unmonitored.mismatches


def test_the_counter_sees_the_syncs_a_per_layer_copy_would_add(one_thread, monkeypatch):
    """The bound can fail: moving each layer's counters to the host in the backward (as
    flashwatch once did) is counted once per layer and micro-batch."""
    import flashwatch.parallel.sharding as fdist

    real = fdist.wq_grad_sq

    def per_layer_copy(site, grad):
        sq, averaged = real(site, grad)
        return sq.cpu(), averaged

    monkeypatch.setattr(fdist, "wq_grad_sq", per_layer_copy)
    import flashwatch.monitor.capture as fcapture

    monkeypatch.setattr(fcapture, "wq_grad_sq", per_layer_copy)
    monitored = count(4, 2, "sdpa")[2]
    assert monitored.total > MONITORED_BOUND
