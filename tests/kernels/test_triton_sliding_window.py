"""flashwatch.attention(sliding_window=) in the Triton kernels, forward and backward.

The window is Mistral's and Gemma2's, as Hugging Face's sliding_window_overlay defines
it: query i sees key j only if i - j < window (and j <= i with causal). Each case runs
the Triton kernels and the reference backend through the same op and compares both with
the FP64 oracle of tests/_triton.py (2× rule for O, LSE, dq, dk, dv; tie and guard
counters and max logit equal to the reference's), then checks the kernels give the same
bits as the window materialised as a bool attn_mask. Awkward shapes: Nq != Nk, ragged
16-row blocks, window 1, a window smaller than a block and not a multiple of it, a
window >= N, rows that see no key. Block skipping is proved by counting the dots the
interpreter executes. The reference and "paper" backends: tests/kernels/test_attention.py.
"""

from __future__ import annotations

import pytest
import torch

import flashwatch as fw
from tests._triton import (
    ALL_MODES,
    DEVICE,
    assert_compiled_matches_eager,
    check,
    count_dots,
    inputs,
    run,
    ta,
    tuning,
)

# numpy inside the interpreter: 0/0 and log(0) in rows with no visible key (selected away)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def window_mask(nq, nk, window, causal):
    """The window as a materialised bool mask [Nq, Nk] (True = attend)."""
    i = torch.arange(nq, device=DEVICE)[:, None]
    j = torch.arange(nk, device=DEVICE)[None, :]
    return (i - j < window) & ((j <= i) if causal else True)


CASES = [  # (Nq, Nk, window, causal, dtype, D)
    (37, 45, 5, True, torch.bfloat16, 16),  # window < a 16-key block, not a multiple
    (45, 37, 1, True, torch.float16, 32),  # window 1: the diagonal only
    (37, 70, 20, False, torch.bfloat16, 16),  # later keys visible, first blocks skipped
    (70, 37, 7, True, torch.float16, 16),  # rows >= 43 see no key: O = 0, LSE = +inf
    (40, 40, 100, True, torch.bfloat16, 64),  # window >= N: causal alone
    (64, 48, 16, True, torch.float16, 16),  # window = one block, no ragged end
    # windows of 15, 17, 18 (16-row blocks) put each bound's off-by-one on a block edge
    (50, 50, 17, True, torch.bfloat16, 16),
    (45, 45, 15, False, torch.float16, 16),
    (37, 45, 18, True, torch.bfloat16, 16),
]


@pytest.mark.parametrize("nq,nk,window,causal,dtype,d", CASES,
                         ids=[f"{c[0]}x{c[1]}-w{c[2]}-{'causal' if c[3] else 'full'}-"
                              f"{'bf16' if c[4] == torch.bfloat16 else 'fp16'}"
                              for c in CASES])
def test_window_within_the_rule_with_exact_counters_and_equal_to_its_mask(
        nq, nk, window, causal, dtype, d):
    q, k, v, do = inputs(nq, nk, d, dtype, seed=nq + window)
    tri = check(q, k, v, do, causal=causal, scale=0.25, sliding_window=window)
    as_mask = run("triton", q, k, v, do, causal=causal, scale=0.25,
                  attn_mask=window_mask(nq, nk, window, causal))
    for name, t in tri.items():
        assert torch.equal(t, as_mask[name]), name
    i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
    empty = ~((i - j < window) & ((j <= i) if causal else True)).any(-1)
    if empty.any():
        assert (tri["o"][:, :, empty] == 0).all() and (tri["dq"][:, :, empty] == 0).all()
        assert torch.isinf(tri["lse"][:, :, empty]).all()


def test_window_ties_far_apart_are_not_counted():
    # inputs() copies the first third of the keys to the last: exact ties 30 keys apart,
    # which a window of 8 hides from each other (they count without the window).
    q, k, v, do = inputs(45, 45, 16, torch.bfloat16, seed=1)
    wide = check(q, k, v, do, causal=True, scale=0.25)
    narrow = check(q, k, v, do, causal=True, scale=0.25, sliding_window=8)
    assert (narrow["tied"] < wide["tied"]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_window_with_softcap_and_key_padding(dtype):
    # Gemma2's local layers: softcap, then causal, the window and the padding mask.
    nq, nk = 45, 37
    q, k, v, do = inputs(nq, nk, 32, dtype, seed=3)
    mask = torch.ones(2, 1, 1, nk, dtype=torch.bool)
    mask[1, ..., 30:] = False
    mask[0, ..., :3] = False
    check(q, k, v, do, causal=True, scale=0.5, softcap=5.0, sliding_window=6,
          attn_mask=mask.to(DEVICE), exact_max=False)


def visible_block_pairs(nq, nk, window, causal):
    """(query block, key block) pairs of the interpreter's blocks with a visible score."""
    bm, bn = tuning.INTERP_BLOCKS["BLOCK_M"], tuning.INTERP_BLOCKS["BLOCK_N"]
    vis = window_mask(nq, nk, window, causal).cpu()
    return sum(bool(vis[m:m + bm, n:n + bn].any())
               for m in range(0, nq, bm) for n in range(0, nk, bn))


@pytest.mark.skipif(not ta.INTERPRET, reason="counts dots executed by the interpreter")
@pytest.mark.parametrize("nq,nk,window,causal", [
    *((64, 64, w, True) for w in (1, 2, 5, 15, 16, 17, 18, 20)),
    (64, 96, 20, False), (64, 96, 18, False), (96, 48, 1, True), (80, 48, 33, False)])
def test_blocks_outside_the_window_are_never_computed(monkeypatch, nq, nk, window, causal):
    # 16×16 blocks: the forward runs 2 dots (S, P̄V) and the backward 5 per block pair it
    # computes; both compute exactly the pairs holding a visible score (64×64 causal,
    # window 5: 7 of the 10 causal pairs, of 16).
    q, k, v, do = inputs(nq, nk, 16, torch.bfloat16, seed=11)
    q, do = (t[:1, :1].contiguous() for t in (q, do))
    k, v = (t[:1, :1].contiguous() for t in (k, v))
    modes = torch.zeros(1, dtype=torch.int32)
    pairs = visible_block_pairs(nq, nk, window, causal)
    calls = count_dots(monkeypatch)
    o, lse, o32, *_ = torch.ops.flashwatch.attention_fwd(
        q, k, v, modes, causal, 0.25, 2.0, 1e-3, True, "triton", sliding_window=window)
    assert len(calls) == 2 * pairs
    calls.clear()
    torch.ops.flashwatch.attention_bwd(do, q, k, v, o, o32, lse, modes, causal, 0.25,
                                       "triton", sliding_window=window)
    assert len(calls) == 5 * pairs
    assert pairs < visible_block_pairs(nq, nk, nq + nk, causal)  # fewer than no window


def test_a_new_window_size_retunes_and_recompiles_nothing(monkeypatch):
    # The size is data (an int the kernels are not specialised on) and not in the
    # autotune key; only SLIDING (on/off) is.
    for kernel in (ta._fwd_kernel, ta._bwd_kernel):
        dns = getattr(kernel, "do_not_specialize", None)
        if dns is None:  # the interpreter keeps triton.jit's arguments
            dns = kernel.kwargs["do_not_specialize"]
        assert "window" in dns
    for tuned in ta.TUNED:
        monkeypatch.setattr(tuned, "cache", {})
    q, k, v, do = inputs(37, 37, 16, torch.bfloat16, seed=2)
    compiled = []

    def one(window):
        run("triton", q, k, v, do, causal=True, scale=0.25, sliding_window=window)
        compiled.append(sum(len(c[0]) for c in getattr(ta._fwd_kernel, "device_caches",
                                                         {}).values()))

    one(None)
    one(3)
    assert [len(t.cache) for t in ta.TUNED] == [2, 2]  # SLIDING off and on
    for window in (1, 16, 17, 4096):
        one(window)
    assert [len(t.cache) for t in ta.TUNED] == [2, 2]
    assert compiled[2:] == [compiled[1]] * 4  # compiled kernels (GPU; 0 interpreted)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_torch_compile_fullgraph_with_a_window(backend):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    q, k, v, do = inputs(20, 20, 16, torch.bfloat16, seed=9)

    def step(q, k, v, window, stats):
        return fw.attention(q, k, v, causal=True, sliding_window=window, stats=stats,
                            head_modes=ALL_MODES, backend=backend) * 2

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for window in (3, 7, 11):
        assert_compiled_matches_eager(compiled, step, q, k, v, do, window)
    # Dynamo specialises a Python int once, then makes it dynamic: one retrace at most
    assert counter.frame_count <= 2
    torch._dynamo.reset()
