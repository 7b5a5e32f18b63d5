"""flashwatch/parallel/layout.py: the job's head table, built from every rank's layers by
name, the same whatever order or layout the ranks hold them in."""

from __future__ import annotations

import pytest

from flashwatch.parallel import layout


def test_pipeline_stages_are_placed_by_name_in_the_order_first_held():
    t = layout.build([[("layers.0", 4), ("layers.1", 4)], [("layers.2", 4)]])
    assert t.layers == (("layers.0", 4), ("layers.1", 4), ("layers.2", 4))
    assert t.holders == (1,) * 12
    assert t.offset("layers.2") == 8 and t.offset("layers.1", 3) == 7
    assert t.keys[8] == ("layers.2", 0) and t.n == 12


def test_replicas_count_once_per_rank_and_a_rank_with_no_layer_adds_nothing():
    t = layout.build([[("a", 2), ("b", 3)], [("a", 2), ("b", 3)], []])
    assert t.layers == (("a", 2), ("b", 3))
    assert t.holders == (2,) * 5


def test_a_rank_may_list_shared_layers_in_another_order():
    t = layout.build([[("a", 2), ("b", 2)], [("b", 2), ("a", 2)]])
    assert t.layers == (("a", 2), ("b", 2)) and t.holders == (2,) * 4


def test_tensor_parallel_ranges_sit_at_their_global_heads():
    # 2 TP ranks × 2 DP replicas: TP rank r holds heads [2r, 2r + 2) of each layer
    ranks = [[("a", 4, 2 * (r % 2), 2), ("b", 4, 2 * (r % 2), 2)] for r in range(4)]
    t = layout.build(ranks)
    assert t.layers == (("a", 4), ("b", 4)) and t.holders == (2,) * 8
    assert t.offset("b", 2) == 6  # TP rank 1's first head of layer b
    uneven = layout.build([[("a", 4, 0, 2), ("a2", 2)], [("a", 4, 0, 4)]])
    assert uneven.holders == (2, 2, 1, 1, 1, 1)


@pytest.mark.parametrize("ranks, message", [
    ([[("a", 4)], [("a", 2)]], "layer 'a' has 4 heads on rank 0 but 2 on rank 1"),
    ([[("a", 4), ("a", 4)]], "rank 0 watches layer 'a' twice"),
    ([[("a", 4, 3, 2)]], "rank 0 holds heads 3..4 of layer 'a', which has 4"),
    ([[("a", 4, 0, 2)], [("a", 4, 0, 2)]], r"heads \[2, 3\] of layer 'a' are held by no rank"),
    ([[("a", 4, 0, 0)]], "holds heads 0..-1"),
])
def test_inconsistent_layouts_are_refused_by_name(ranks, message):
    with pytest.raises(ValueError, match=message):
        layout.build(ranks)
