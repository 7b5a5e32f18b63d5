"""flashwatch/synccount.py: each rule counts exactly one sync on a minimal snippet, host
tensors and on-device arithmetic count none, and events name the line they came from;
device ops (would-be kernel launches) counted by hand on small snippets."""

import numpy as np
import pytest
import torch

from flashwatch.signals import smallops
from flashwatch.synccount import DEVICE, SyncCounter


@pytest.fixture
def dev():
    """Two device tensors (x float [4, 3], m bool [4]) and a host tensor h [4]."""
    x = torch.randn(4, 3)
    m = torch.tensor([True, False, True, False])
    return x, m, torch.arange(4)


def _count(fn, *device):
    with SyncCounter(device=list(device)) as sc:
        fn()
    return sc


ONE_SYNC = {  # name: (kind, snippet over (x, m, h))
    "item": ("item", lambda x, m, h: x.sum().item()),
    "bool": ("item", lambda x, m, h: bool(x[0, 0] > 0)),
    "float": ("item", lambda x, m, h: float(x[0, 0])),
    "cpu": ("d2h", lambda x, m, h: x.cpu()),
    "to_cpu": ("d2h", lambda x, m, h: x.to("cpu")),
    "to_cpu_dtype": ("d2h", lambda x, m, h: x.to("cpu", torch.float64)),
    "to_host_tensor": ("d2h", lambda x, m, h: x.to(h)),
    "numpy": ("d2h", lambda x, m, h: x.numpy()),
    "asarray": ("d2h", lambda x, m, h: np.asarray(x)),
    "tolist": ("d2h", lambda x, m, h: x.tolist()),
    "copy_into_host": ("d2h", lambda x, m, h: torch.empty(4, 3).copy_(x)),
    "h2d_to": ("h2d", lambda x, m, h: h.to(x.device)),
    "h2d_to_tensor": ("h2d", lambda x, m, h: h.to(x)),
    "h2d_copy": ("h2d", lambda x, m, h: x[:, 0].copy_(h)),
    "h2d_tensor": ("h2d", lambda x, m, h: torch.tensor([1.0, 2.0], device=x.device)),
    "h2d_as_tensor": ("h2d", lambda x, m, h: torch.as_tensor(h, device=x.device)),
    "tensor_of_scalar": ("item", lambda x, m, h: torch.tensor([x[0, 0]])),
    "h2d_index": ("h2d", lambda x, m, h: x[h[:2]]),
    "nonzero": ("nonzero", lambda x, m, h: m.nonzero()),
    "where": ("nonzero", lambda x, m, h: torch.where(m)),
    "mask_index": ("bool_mask", lambda x, m, h: x[m]),
    "mask_put": ("bool_mask", lambda x, m, h: x.__setitem__(m, torch.zeros(2, 3,
                                                                          device=x.device))),
    "masked_select": ("bool_mask", lambda x, m, h: x[:, 0].masked_select(m)),
    "unique": ("data_size", lambda x, m, h: torch.unique(m)),
    "repeat_interleave": ("data_size", lambda x, m, h: torch.repeat_interleave(m.long())),
    "equal": ("data_size", lambda x, m, h: torch.equal(x, x)),
    "eigh": ("linalg", lambda x, m, h: torch.linalg.eigh(x.T @ x)),
}


@pytest.mark.parametrize("name", sorted(ONE_SYNC))
def test_each_rule_counts_one(dev, name):
    kind, fn = ONE_SYNC[name]
    x, m, h = dev
    sc = _count(lambda: fn(x, m, h), x, m)
    assert dict(sc.counts) == {kind: 1}, sc.table()
    assert sc.total == 1 and len(sc.events) == 1
    assert sc.mismatches == []


@pytest.mark.parametrize("name", sorted(ONE_SYNC))
def test_same_snippet_on_host_counts_none(dev, name):
    """Nothing marked: every tensor is host memory, and reading it costs no sync."""
    x, m, h = dev
    sc = _count(lambda: ONE_SYNC[name][1](x, m, h))
    assert sc.total == 0, sc.table()


def test_on_device_arithmetic_counts_none(dev):
    x, m, h = dev
    w = torch.randn(3, 5, requires_grad=True)

    def step():
        y = torch.relu(x @ w).softmax(-1)
        z = torch.zeros(4, 5, device=x.device) + y * m[:, None]  # a factory on the device
        (z.sum() + torch.tensor(2.0)).backward()  # a 0-dim host tensor is a scalar
        x.masked_fill(m[:, None], 0.0)
        x[m] = 0.0  # a one-element host value: CUDA's masked_fill path
        torch.repeat_interleave(x, 2, dim=0)
        torch.repeat_interleave(x, m.long(), dim=0, output_size=2)
        idx = torch.arange(2, device=x.device)
        x[idx], x.index_select(0, idx), x.double().float(), x.to(x.device)
        h.float().mean().item()  # host tensors: free

    sc = _count(step, x, m, w)
    assert sc.total == 0, sc.table()
    assert sc.mismatches == []
    assert w.grad is not None and sc.on_device(w.grad)


def test_device_reads_as_marker_and_placement_follows(dev):
    x, m, h = dev
    with SyncCounter(device=[x]) as sc:
        assert x.device == DEVICE and h.device == torch.device("cpu")
        assert x.device.type == "cpu"  # CPU code paths stay as they are
        y = (x * 2).view(-1)
        assert sc.on_device(y) and not sc.on_device(h)
        moved = h.to(x.device, non_blocking=True)  # not blocking: no count
        assert sc.on_device(moved)
        back = x.cpu()
        assert back is not x and not sc.on_device(back) and sc.on_device(x)
    assert dict(sc.counts) == {"d2h": 1}
    assert x.device == torch.device("cpu")  # outside the counter: the real device


def test_modules_optimizers_and_step_counters():
    lin = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.randn(1, 3)).sum().backward()
    opt.step()
    x = torch.randn(5, 3)
    with SyncCounter(device=[lin, opt, x]) as sc:
        for _ in range(2):
            lin(x).pow(2).mean().backward()
            opt.step()  # AdamW's step counters stay on the host, as on CUDA
            opt.zero_grad()
    assert sc.total == 0, sc.table()
    assert sc.mismatches == []
    assert all(sc.on_device(v) for s in opt.state.values() for k, v in s.items()
               if k != "step")


def test_events_name_the_line_and_reset(dev):
    x, m, h = dev
    with SyncCounter(device=[x], where=[__file__.rsplit("/", 1)[0]]) as sc:
        x.sum().item()
        x.sum().item()
        x.tolist()
    assert sc.counts == {"item": 2, "d2h": 1}
    kinds = [e[0] for e in sc.events]
    assert kinds == ["item", "item", "d2h"]
    assert all("test_synccount.py" in e[2] and "test_events_name" in e[2] for e in sc.events)
    lines = sc.table().splitlines()
    assert lines[0].split()[0] == "1" or lines[0].split()[0] == "2"
    assert len(lines) == 3  # the two item() calls are on different lines
    sc.reset()
    assert sc.total == 0 and sc.events == []


def test_mismatch_listed_not_counted(dev):
    x, m, h = dev
    sc = _count(lambda: x[:, 0] + h.float(), x)
    assert sc.total == 0
    assert len(sc.mismatches) == 1 and "add" in sc.mismatches[0][0]


def test_numpy_path_off_while_counting():
    before = smallops.NUMPY_CPU
    with SyncCounter():
        assert smallops.NUMPY_CPU is False
    assert smallops.NUMPY_CPU == before


def test_bad_device_argument():
    with pytest.raises(TypeError, match="device="):
        SyncCounter(device=["cuda"])


def test_mark_containers_and_device_strings():
    a, b = torch.ones(2), torch.ones(2)
    with SyncCounter(device={"x": a, "y": (b,)}) as sc:
        assert sc.on_device(a) and sc.on_device(b)
        torch.tensor([1.0], device="cpu:0")  # DEVICE spelled as a string
        torch.tensor([1.0], device="cpu")
    assert dict(sc.counts) == {"h2d": 1}


def test_backward_hooks_are_counted():
    """The autograd engine runs hooks without the caller's torch-function modes: a
    gradient moved to the host in a hook must still count (the watcher does this)."""
    lin = torch.nn.Linear(3, 4)
    x = torch.randn(2, 3)
    seen = []

    def hook(p):
        seen.append(p.grad.device)
        p.grad[:2].square().sum().double().cpu()

    lin.weight.register_post_accumulate_grad_hook(hook)
    with SyncCounter(device=[lin, x]) as sc:
        lin(x).sum().backward()
    assert dict(sc.counts) == {"d2h": 1}
    assert seen == [DEVICE]


def test_one_counter_at_a_time():
    with SyncCounter():
        with pytest.raises(RuntimeError, match="one at a time"):
            SyncCounter().__enter__()
    with SyncCounter() as sc:  # the failed one left nothing behind
        assert sc.total == 0


def test_plain_gpt_training_counts_none():
    """No false positives on a whole training step: forward under bf16 autocast,
    backward, gradient accumulation, AdamW (its state created while counting)."""
    from examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=2, n_embd=16))
    opt = torch.optim.AdamW(model.parameters())
    idx = torch.randint(0, 32, (2, 2, 17))
    with SyncCounter(device=[model, idx]) as sc:
        for _ in range(2):
            for b in idx:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(b[:, :-1], b[:, 1:])[1]
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert sc.total == 0, sc.table()
    assert sc.mismatches == []
    assert all(sc.on_device(p) and sc.on_device(opt.state[p]["exp_avg"])
               for p in model.parameters())
    assert not sc.on_device(next(iter(opt.state.values()))["step"])


# ------------------------------------------------------------------ device ops


def _ops(fn, *device):
    sc = _count(fn, *device)
    return dict(sc.ops), sc


DEVICE_OPS = {  # name: (snippet over (x, w, h), expected ops counted by hand, from CUDA)
    "matmul": (lambda x, w, h: x @ w, {"aten.mm": 1}),
    "arithmetic": (lambda x, w, h: (x * 2 + 1).exp().sum(),
                   {"aten.mul": 1, "aten.add": 1, "aten.exp": 1, "aten.sum": 1}),
    "in_place": (lambda x, w, h: x.clone().add_(1).mul_(2),
                 {"aten.clone": 1, "aten.add_": 1, "aten.mul_": 1}),
    "softmax": (lambda x, w, h: x.softmax(-1), {"aten._softmax": 1}),
    "contiguous_copy": (lambda x, w, h: x.t().contiguous(), {"aten.clone": 1}),
    "reshape_copies": (lambda x, w, h: x.t().reshape(-1), {"aten.clone": 1}),
    "reshape_views": (lambda x, w, h: x.reshape(-1), {}),
    "views": (lambda x, w, h: (x.view(12), x[1:], x[0], x[:, 1], x.unsqueeze(0).squeeze(0),
                               x.expand(2, 4, 3), x.permute(1, 0), x.t(), x.T, x.detach(),
                               x.split(2), x.chunk(2), x.unbind(0), x.narrow(0, 1, 2),
                               x.as_strided((2, 2), (1, 1)), x.diagonal(), x.view_as(x),
                               x.flatten(), x.unflatten(1, (3, 1)), x.movedim(0, 1)), {}),
    "in_place_views": (lambda x, w, h: x.clone().unsqueeze_(0).squeeze_(0).t_(),
                       {"aten.clone": 1}),
    "allocation": (lambda x, w, h: (torch.empty(3, device=x.device), torch.empty_like(x),
                                    x.new_empty(2)), {}),
    "factories_fill": (lambda x, w, h: (torch.zeros(3, device=x.device),
                                        torch.full((2,), 1.0, device=x.device)),
                       {"aten.zeros": 1, "aten.full": 1}),
    "host_copy_in": (lambda x, w, h: (h.to(x.device), torch.tensor([1.0], device=x.device)),
                     {"Tensor.to": 1, "torch.tensor": 1}),
    "copy_into_device": (lambda x, w, h: x[:, 0].copy_(h), {"aten.copy_": 1}),
    "host_reads": (lambda x, w, h: (x.cpu(), x.sum().item(), x.tolist()), {"aten.sum": 1}),
    "host_only": (lambda x, w, h: (h * 2).float().softmax(0).sum(), {}),
    "autocast": (lambda x, w, h: _autocast_mm(x, w), {"aten._to_copy": 2, "aten.mm": 1}),
}


def _autocast_mm(x, w):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return x @ w  # two casts to BF16, then the matmul


@pytest.mark.parametrize("name", sorted(DEVICE_OPS))
def test_device_ops_counted_by_hand(name):
    fn, want = DEVICE_OPS[name]
    x, w, h = torch.randn(4, 3), torch.randn(3, 5), torch.arange(4.0)
    ops, sc = _ops(lambda: fn(x, w, h), x, w)
    assert ops == want
    assert sc.device_ops == sum(want.values())


def test_device_ops_need_a_device_tensor():
    """The same arithmetic on host tensors (nothing marked) launches nothing."""
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    ops, sc = _ops(lambda: ((x @ w).softmax(-1) * 2).sum())
    assert ops == {} and sc.device_ops == 0


def test_device_ops_in_backward_and_hooks():
    """Forward y = x @ W^T (no bias: mm, not addmm), loss = y.sum(); backward: the seed
    (ones_like, a fill), sum's grad is an expand of it (a view), mm for W's grad (x
    needs none; the first grad is stolen, not copied). The hook adds square (pow once
    decomposed, as on CUDA) and sum."""
    lin = torch.nn.Linear(3, 4, bias=False)
    x = torch.randn(2, 3)

    def hook(p):
        p.grad.square().sum()

    lin.weight.register_post_accumulate_grad_hook(hook)
    ops, sc = _ops(lambda: lin(x).sum().backward(), lin, x)
    assert ops == {"aten.mm": 2, "aten.sum": 2, "aten.ones_like": 1, "aten.pow": 1}, ops


def test_opaque_ops_are_not_counted():
    """A torch.library op counts none, nor do the aten ops inside its CPU stand-in."""

    @torch.library.custom_op("synccount_test::twice_plus_one", mutates_args=())
    def twice_plus_one(t: torch.Tensor) -> torch.Tensor:
        return t * 2 + 1

    x = torch.randn(4)
    ops, sc = _ops(lambda: twice_plus_one(x).exp(), x)
    assert ops == {"aten.exp": 1}  # its output is placed on the device: exp counts
    assert sc.on_device(twice_plus_one(x)) is False  # outside the counter: untracked


def test_collectives_are_not_counted(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        x = torch.randn(4)
        ops, sc = _ops(lambda: (dist.all_reduce(x), x.mul_(2)), x)
    finally:
        dist.destroy_process_group()
    assert ops == {"aten.mul_": 1}


def test_device_ops_reset_with_the_counts():
    x = torch.randn(3)
    with SyncCounter(device=[x]) as sc:
        x.exp()
        assert sc.device_ops == 1
        sc.reset()
        assert sc.device_ops == 0 and sc.ops == {}
        x.exp()
    assert sc.ops == {"aten.exp": 1}
