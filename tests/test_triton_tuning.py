"""Autotune keys of the Triton kernels (kernels/triton_tuning.py): lengths are bucketed to
their next power of two, so a new exact length reuses the tuned config. Runs the same
autotuned launch the GPU runs, in the interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), where its pick is pruned to the interpreter's blocks."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see conftest)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

import flashwatch as fw  # noqa: E402
from flashwatch.kernels import triton_attention as ta  # noqa: E402
from flashwatch.kernels import triton_tuning as tuning  # noqa: E402

DEVICE = "cpu" if ta.INTERPRET else "cuda"
if not ta.INTERPRET and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device",
                allow_module_level=True)


def test_bucket_is_next_power_of_two():
    assert [tuning.bucket(n) for n in (1, 2, 3, 37, 64, 65, 4095, 4096)] == [
        1, 2, 4, 64, 64, 128, 4096, 4096]


def fwd_bwd(n, gen):
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen).to(torch.bfloat16).to(DEVICE)
               .requires_grad_() for _ in range(3))
    fw.attention(q, k, v, causal=True, backend="triton").sum().backward()


def test_lengths_in_one_bucket_share_one_tuning_entry(monkeypatch):
    for tuned in ta.TUNED:
        monkeypatch.setattr(tuned, "cache", {})
    gen = torch.Generator().manual_seed(0)
    fwd_bwd(37, gen)
    fwd_bwd(45, gen)  # same bucket (64): no new tuning entry
    assert [len(t.cache) for t in ta.TUNED] == [1, 1]
    fwd_bwd(70, gen)  # bucket 128: one more
    assert [len(t.cache) for t in ta.TUNED] == [2, 2]
    keys = sorted(ta.TUNED[1].cache)
    assert [key[:2] for key in keys] == [(64, 64), (128, 128)]  # (N_Q_BKT, N_K_BKT) first


@pytest.mark.parametrize("space,candidates", [(tuning.FWD_SPACE, tuning.FWD_CANDIDATES),
                                              (tuning.BWD_SPACE, tuning.BWD_CANDIDATES)],
                         ids=["fwd", "bwd"])
def test_tuned_spaces_are_measured_candidates(space, candidates):
    # Every config the autotuner may pick was measured by compile_check.py --spills.
    for d, configs in space.items():
        assert configs, f"no config left for D={d}"
        assert set(configs) <= set(candidates), d
