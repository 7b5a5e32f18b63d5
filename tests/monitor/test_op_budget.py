"""Issue 40's device-op budget for a monitored step, counted on the CPU as CUDA would launch
(flashwatch/synccount.py's device ops; benchmarks/bench_ops.py prints the same table):

- forward probe + backward hooks together add at most FWD_BWD_PER_LAYER = 20 device ops
  per watched layer over a never-watched model's forward and backward;
- watcher.step() adds a constant that does not grow with the layers, up to
  STEP_PER_LAYER = 2 ops per layer: step() should work on the packed per-step buffer
  with one tensor op per quantity, not per layer (issue 40, Build 2), and the one thing
  that may still cost per layer is gathering each layer's W^Q into a stacked buffer (a
  copy per separately stored weight) for the batched power iteration, plus one spare;
- an unmonitored step adds none.

Default WatchConfig (every_n_steps=2 only for the cadence: steps 2 and 3 are a monitored
and an unmonitored step after two warm-up steps), flashwatch.nanogpt's GPT at 4 and 12
layers, 4 heads, BF16 autocast. Counts are deterministic: no timing is asserted.
Measured before issue 40's rewrite (commit 0b4ee62): 60.2 (L 4) and 53.4 (L 12)
per layer, step() 71 and 79 ops: the budget test failed then by design.
"""

from __future__ import annotations

import pytest

from benchmarks.bench_ops import extra_ops

FWD_BWD_PER_LAYER = 20
STEP_PER_LAYER = 2
LAYERS = (4, 12)


@pytest.fixture(scope="module")
def extras():
    return {n: extra_ops(n) for n in LAYERS}


def _table(e) -> str:
    return "\n".join(f"{st}: {e[f'monitored_{st}_total']:+d} "
                     f"{dict(e[f'monitored_{st}'].most_common(8))}"
                     for st in ("forward", "backward", "step"))


@pytest.mark.parametrize("n_layer", LAYERS)
def test_forward_and_backward_add_at_most_20_ops_per_layer(one_thread, extras, n_layer):
    e = extras[n_layer]
    added = e["monitored_forward_total"] + e["monitored_backward_total"]
    assert added <= FWD_BWD_PER_LAYER * n_layer, (
        f"{added} extra device ops = {added / n_layer:.1f} per layer > "
        f"{FWD_BWD_PER_LAYER}\n{_table(e)}")


def test_step_does_not_grow_with_layers(one_thread, extras):
    lo, hi = (extras[n]["monitored_step_total"] for n in LAYERS)
    growth = hi - lo
    assert growth <= STEP_PER_LAYER * (LAYERS[1] - LAYERS[0]), (
        f"watcher.step(): {lo} ops at {LAYERS[0]} layers, {hi} at {LAYERS[1]}\n"
        f"{_table(extras[LAYERS[1]])}")


@pytest.mark.parametrize("n_layer", LAYERS)
def test_unmonitored_step_adds_nothing(one_thread, extras, n_layer):
    e = extras[n_layer]
    for st in ("forward", "backward", "optimizer", "step"):
        assert e[f"unmonitored_{st}_total"] == 0, (st, dict(e[f"unmonitored_{st}"]))
    assert e["monitored_optimizer_total"] == 0  # AdamW runs the same ops watched or not
