"""The Triton backend through flashwatch.attention: refused inputs with the fix named,
the CPU-without-interpreter hint, torch.compile(fullgraph=True) with modes as data, and
the reference backend through the same op."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import flashwatch as fw
from flashwatch.kernels import reference
from tests._triton import DEVICE, assert_compiled_matches_eager


def test_triton_rejects_float32_and_odd_head_dim():
    q = torch.randn(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(TypeError, match="backend='reference' for float32"):
        fw.attention(q, q, q, backend="triton")
    q = torch.randn(1, 2, 8, 24, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head dims"):
        fw.attention(q, q, q, backend="triton")


def test_triton_on_cpu_without_interpreter_says_how():
    code = (
        "import torch, flashwatch as fw\n"
        "q = torch.zeros(1, 1, 4, 16, dtype=torch.bfloat16)\n"
        "try:\n"
        "    fw.attention(q, q, q, backend='triton')\n"
        "except RuntimeError as e:\n"
        "    print('RAISED', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300)
    assert "RAISED" in out.stdout, out.stdout + out.stderr
    assert "TRITON_INTERPRET=1" in out.stdout and "backend='reference'" in out.stdout


def test_invalid_mode_value_rejected():
    q = torch.zeros(1, 2, 4, 16, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="not a flashwatch.Mode"):
        fw.attention(q, q, q, head_modes=torch.tensor([0, 7]), backend="triton")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_torch_compile_fullgraph(backend):
    from torch._dynamo.testing import CompileCounterWithBackend

    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 3, 20, 16, generator=gen).to(torch.bfloat16).to(DEVICE)
               for _ in range(3))
    do = torch.randn(1, 3, 20, 16, generator=gen).to(torch.bfloat16).to(DEVICE)

    def step(q, k, v, modes, stats):
        return fw.attention(q, k, v, causal=True, head_modes=modes, stats=stats,
                            backend=backend) * 2

    counter = CompileCounterWithBackend("inductor" if backend == "reference" else "aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for modes in ([0, 1, 2], [2, 0, 1]):
        m = torch.tensor(modes, dtype=torch.int32)
        assert_compiled_matches_eager(compiled, step, q, k, v, do, m)
    assert counter.frame_count == 1, "a head-mode change must not recompile"


def test_reference_backend_through_the_op_is_the_reference():
    gen = torch.Generator().manual_seed(13)
    q, k, v, do = (torch.randn(2, 3, 19, 8, generator=gen) for _ in range(4))
    for dtype in (torch.float32, torch.bfloat16):
        args = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
        args_r = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
        st, st_r = fw.AttentionStats.zeros(3), fw.AttentionStats.zeros(3)
        o = fw.attention(*args, causal=True, head_modes=[2, 1, 0], stats=st)  # auto on CPU
        o_r = reference.attention(*args_r, causal=True, head_modes=[2, 1, 0], stats=st_r)
        o.backward(do.to(dtype))
        o_r.backward(do.to(dtype))
        assert torch.equal(o, o_r)
        for a, b in zip(args, args_r, strict=True):
            assert torch.equal(a.grad, b.grad)
        for name in ("tied_rows", "rows", "guarded_rows", "max_logit"):
            assert torch.equal(getattr(st, name), getattr(st_r, name)), name


def test_auto_takes_triton_on_cuda_only_where_triton_is_installed(monkeypatch):
    """Triton is no core dependency (CUDA torch brings it): "auto" on a CUDA tensor runs
    the reference when the package is missing, the Triton kernel when it is there."""
    from types import SimpleNamespace

    from flashwatch.kernels import dispatch

    q = SimpleNamespace(device=SimpleNamespace(type="cuda"), dtype=torch.bfloat16,
                        shape=(1, 2, 8, 64))
    for installed, want in ((False, "reference"), (True, "triton")):
        monkeypatch.setattr(dispatch, "_triton_installed", lambda v=installed: v)
        assert dispatch._resolve_backend("auto", q) == want
    q.device.type = "cpu"
    assert dispatch._resolve_backend("auto", q) == "reference"
