"""flashwatch/sites/orientation.py: every site's W^Q checked once against its q_module, so a
transposed or mis-sliced weight is refused at discovery with the site's name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from examples.gpt import GPT, GPTConfig
from flashwatch.sites import AttentionSite, find_sites
from flashwatch.sites.orientation import check_orientation
from standins import TinyGPT2, TinyViTish


def _gpt():
    return GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32,
                         bias=True))


def test_discovery_leaves_the_global_rng_alone():
    model = _gpt()
    state = torch.get_rng_state()
    find_sites(model)
    assert torch.equal(torch.get_rng_state(), state)


def test_orientation_check_passes_in_bf16():
    torch.manual_seed(0)
    sites = find_sites(_gpt().to(torch.bfloat16))
    assert sites[0].wq().dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_orientation_check_rejects_a_transposed_linear_weight(dtype):
    torch.manual_seed(0)
    model = _gpt().to(dtype)
    c_attn = model.transformer.h[0].attn.c_attn
    with pytest.raises(RuntimeError, match=r"transformer\.h\.0\.attn.*transposed"):
        find_sites(model, sites={"transformer.h.0.attn": dict(
            num_heads=4, q_module=c_attn, wq=lambda: c_attn.weight[:32].T)})


def test_orientation_check_rejects_conv1d_read_like_linear():
    torch.manual_seed(0)
    model = TinyGPT2()
    c_attn = model.transformer.h[1].attn.c_attn
    # The classic mistake: Conv1D stores [in, out], so [:, :C] without .T is W^Q transposed.
    with pytest.raises(RuntimeError, match=r"transformer\.h\.1\.attn"):
        find_sites(model, sites={"transformer.h.1.attn": dict(
            num_heads=4, q_module="c_attn", wq=lambda: c_attn.weight[:, :32])})


def test_orientation_check_rejects_the_wrong_slice():
    torch.manual_seed(0)
    model = _gpt()
    with pytest.raises(RuntimeError, match="q_slice_of_output"):
        # Channels [C, 2C) are K, but W^Q is read from rows [0, C).
        find_sites(model, sites={"transformer.h.0.attn": dict(
            num_heads=4, q_module="c_attn", q_slice_of_output=(32, 64),
            wq=lambda: model.transformer.h[0].attn.c_attn.weight[:32])})


def test_discovery_inside_autocast_checks_in_the_weights_dtype():
    torch.manual_seed(0)
    model = TinyGPT2()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sites = find_sites(model)
    assert sites[0].wq().dtype == torch.float32


def test_a_wq_of_the_wrong_width_is_named():
    torch.manual_seed(0)
    model = TinyViTish()
    with pytest.raises(RuntimeError, match=r"'blocks.0.attn'.*\[1, 2, 16\].*d_model"):
        find_sites(model, sites={"blocks.0.attn": dict(
            num_heads=4, q_module="qkv", wq=torch.zeros(4, 4, 16))})



class _Returns(nn.Module):
    """A Linear(8, 8) whose forward returns `shape(y)` instead of y."""

    def __init__(self, shape):
        super().__init__()
        self.lin, self.shape = nn.Linear(8, 8), shape

    def forward(self, x):
        return self.shape(self.lin(x))


def _site(q_module, wq):
    return AttentionSite(name="attn", module=nn.Identity(), num_heads=2, num_kv_heads=2,
                         head_dim=4, d_model=8, q_module=q_module, kind="explicit",
                         q_slice_of_output=(0, 8), wq_source=wq)


@pytest.mark.parametrize("shape, what", [(lambda y: (y,), "a tuple"),
                                         (lambda y: y[0], r"a tensor \[2, 8\]")],
                         ids=["tuple", "wrong_shape"])
def test_a_q_module_that_does_not_return_q_is_named(shape, what):
    q = _Returns(shape)
    with pytest.raises(RuntimeError, match=rf"'attn'.*returned {what} for an input \[1, 2, 8\]"):
        check_orientation(_site(q, lambda: q.lin.weight))


def test_what_cannot_be_checked_passes_and_integer_weights_are_refused():
    q = _Returns(lambda y: y)
    check_orientation(_site(None, lambda: q.lin.weight))  # no q_module: no X to check with
    meta = nn.Linear(8, 8, device="meta")
    check_orientation(_site(meta, lambda: meta.weight))
    with pytest.raises(RuntimeError, match=r"'attn'.*torch\.int8.*quantized"):
        check_orientation(_site(q, lambda: torch.zeros(8, 8, dtype=torch.int8)))
    check_orientation(_site(q, lambda: q.lin.weight))  # and the right W^Q passes
