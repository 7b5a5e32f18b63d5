"""Count the host synchronisations and device ops a piece of torch code would make on CUDA,
on the CPU.

A test hook (tests/test_synccount.py, benchmarks/bench_syncs.py): a GPU user pays for a
monitor in stalls of the host, and a CPU-only machine shows none of them. SyncCounter
replays the CUDA placement on the CPU: it marks which tensors would live on the GPU
("device" tensors) and classifies every op the code dispatches by what CUDA would do.

    with SyncCounter(device=[model, optimizer, x, y]) as sc:
        train_step(); watcher.step()
    print(sc.total, sc.counts); print(sc.table())
    print(sc.device_ops, sc.ops.most_common(10))  # would-be kernel launches

Placement model. Every tensor's storage is "device" or "host"; untracked storages are
host (what `torch.zeros(3)` makes on a CUDA machine too).
  - device: the modules, optimizers and tensors given to `device=` or `mark()`
    (parameters and their gradients, buffers, optimizer state except the "step"
    counters, which torch's optimizers keep on the CPU), and every op output with a
    device input (CUDA ops take CUDA inputs; a 0-dim host tensor is a scalar argument,
    as CUDA allows).
  - `t.device` of a device tensor reads DEVICE (cpu:0, still of type "cpu", so CPU code
    paths are unchanged), so `torch.zeros(n, device=q.device)`, `x.to(q.device)` and
    `t.device != q.device` behave as on CUDA: factories given DEVICE make device tensors.
  - flashwatch/signals/smallops.py takes torch's path while counting (NUMPY_CPU off): its numpy
    path exists for CPU tensors only and would read device tensors as numpy.
  - ops outside aten are opaque, outputs placed with their inputs: flashwatch's
    torch.library attention ops (on CUDA the Triton launcher: host code reading `modes`
    on the host, then kernel launches; the CPU reference standing in for it here is not
    what CUDA runs, so nothing inside counts) and c10d collectives (NCCL queues them on
    the stream; a collective on host tensors is the caller's to count).

Rules: one count each, kind in brackets, only where the tensor read is a device tensor.
  [d2h]      .cpu(), .to(host), .numpy(), .tolist(), np.asarray(t), copy_ into a host
             tensor: the host reads GPU memory, so it waits for the stream (also
             non_blocking: the data is read after a wait). .numpy() of a CUDA tensor
             raises; it counts as the copy the code needs.
  [h2d]      a blocking copy host → device: .to(DEVICE) and copy_ without
             non_blocking=True, torch.tensor/as_tensor(..., device=DEVICE), and host
             index tensors given to a device index/index_put (advanced indexing copies
             them over): cudaMemcpyAsync then a stream synchronise. non_blocking=True is
             not counted (from pageable memory CUDA stages the copy without waiting).
  [item]     aten._local_scalar_dense: .item(), bool(t), int(t), float(t); and each
             device tensor in the list given to torch.tensor/as_tensor.
  [nonzero]  nonzero, argwhere, torch.where(cond): the output's size is the data's.
  [bool_mask] index with a bool mask (x[mask]), index_put with a bool mask and a
             value of more than one element (a one-element host value takes CUDA's
             masked_fill path: no sync), masked_select: a nonzero inside.
  [data_size] unique, repeat_interleave without output_size, bincount: output size
             from the data; aten.equal: returns a bool to the host.
  [linalg]   eigh, svd and _linalg_check_errors: CUDA's solvers check their info flag
             on the host.
Ops mixing a device tensor with a host tensor of ≥ 1 dim outside the index ops are
listed in `mismatches` (CUDA raises), not counted. Not seen: torch.cuda.synchronize(),
CUDA events, syncs inside custom kernels, the allocator's own (cudaMalloc on a miss).
Eager only (not under torch.compile).

Device ops (`device_ops`, per op name in `ops`; benchmarks/bench_ops.py): what a GPU pays
per op before any arithmetic (a launch, ≈ 5–10 µs of host dispatch each). One count per
aten op dispatched with a device tensor among its outputs (in-place ops: their
destination), keyed by the op's name ("aten.mm"), except the ops that launch nothing:
  - views and metadata: ops whose schema returns an alias of an input (`is_view`: view,
    reshape when it is a view, transpose, permute, t, expand, slice, select, as_strided,
    narrow, diagonal, unsqueeze, squeeze, detach, alias, split, chunk, unbind, ...), ops
    tagged inplace_view (unsqueeze_, as_strided_, resize_, set_, ...) and _unsafe_view;
  - allocation only: empty, empty_like, empty_strided, new_empty, new_empty_strided;
  - outside aten: c10d collectives and flashwatch's torch.library ops (their CPU
    stand-ins' inner ops are not seen: the dispatch mode is off inside an op).
A copy to the device counts once ("Tensor.to", "torch.tensor", or aten copy_/_to_copy);
a copy to the host counts none here (it is a d2h sync above). Ops that return no
tensor (.item(), equal, sym sizes) count none. A composite op counts as the aten ops it
decomposes into on the CPU, which for a few ops differs from CUDA (and torch's
optimizers take their per-tensor loop on the CPU, their foreach kernels on CUDA): compare
counts of the same code, e.g. a watched step minus an unwatched one.
"""

from __future__ import annotations

import functools
import os
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

DEVICE = torch.device("cpu", 0)  # what `.device` reads on a device tensor while counting
KINDS = ("d2h", "h2d", "item", "nonzero", "bool_mask", "data_size", "linalg")
_FLASHWATCH = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_FLASHWATCH)
_SKIP = (os.path.dirname(os.path.abspath(torch.__file__)), os.path.abspath(__file__))

_BY_OP = {  # aten overload packet name -> kind, for a device input
    "_local_scalar_dense": "item",
    "nonzero": "nonzero", "argwhere": "nonzero",
    "masked_select": "bool_mask",
    "_unique": "data_size", "_unique2": "data_size", "unique_dim": "data_size",
    "unique_consecutive": "data_size", "unique_dim_consecutive": "data_size",
    "bincount": "data_size", "equal": "data_size",
    "_linalg_eigh": "linalg", "_linalg_svd": "linalg", "_linalg_check_errors": "linalg",
}
_INDEX = ("index", "_unsafe_index", "index_put", "index_put_", "_index_put_impl_")
_D2H_METHODS = ("cpu", "numpy", "tolist", "__array__")
# Ops that return a device tensor but launch nothing (views are found by their schema)
_NO_LAUNCH = ("_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty",
              "new_empty_strided", "lift_fresh")
_FACTORIES = ("tensor", "as_tensor", "asarray")


def _is_device(dev) -> bool:
    if isinstance(dev, str):
        dev = torch.device(dev)
    return isinstance(dev, torch.device) and dev == DEVICE


def _no_launch(func, name: str) -> bool:
    """A view, a metadata change or an allocation: no kernel on CUDA."""
    return (func.is_view or name in _NO_LAUNCH
            or torch.Tag.inplace_view in func.tags)


def _tensors(tree) -> list:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


class SyncCounter:
    """Counts would-be CUDA host syncs of the code run inside `with`, per kind.

    device: modules, optimizers, tensors (or lists of them) that live on the GPU.
    where: directories whose innermost frame names an event (default: flashwatch's and
    its kernels').
    """

    _active = False  # one counter at a time: the patches are global

    def __init__(self, device=(), where=None):
        if where is None:
            from flashwatch import kernels

            where = (_FLASHWATCH, os.path.dirname(os.path.abspath(kernels.__file__)))
        self.where = tuple(os.path.abspath(p) for p in where)
        self.counts: Counter = Counter()
        self.ops: Counter = Counter()  # device op name -> launches (module docstring)
        self.events: list = []  # (kind, op, "file:line in function")
        self.mismatches: list = []  # (op, frame): device and host inputs together
        # storage -> True (device) / False (host); weak keys: a freed storage's address
        # is reused at once by the next temporary
        self._res = WeakIdKeyDictionary()
        self._quiet = 0  # > 0: inside a transfer counted at the Python level or an opaque op
        self._modes = None
        self.mark(device)

    # -- placement ------------------------------------------------------------------
    def mark(self, *objs, device: bool = True) -> None:
        """Mark modules (parameters, their .grad, buffers), optimizers (state but "step"),
        tensors, and lists, tuples and dicts of them."""
        for obj in objs:
            if isinstance(obj, torch.Tensor):
                self._set(obj, device)
            elif isinstance(obj, torch.nn.Module):
                grads = [p.grad for p in obj.parameters() if p.grad is not None]
                self.mark(*obj.parameters(), *grads, *obj.buffers(), device=device)
            elif isinstance(obj, torch.optim.Optimizer):
                for state in obj.state.values():
                    self.mark(*[v for k, v in state.items() if k != "step"], device=device)
            elif isinstance(obj, (list, tuple, dict)):
                self.mark(*(obj.values() if isinstance(obj, dict) else obj), device=device)
            elif obj is not None:
                raise TypeError(f"device= takes modules, optimizers and tensors, got "
                                f"{type(obj).__name__}; pass its tensors instead")

    def on_device(self, t: torch.Tensor) -> bool:
        try:
            return self._res.get(t.untyped_storage(), False)
        except (RuntimeError, NotImplementedError, AttributeError):  # no storage
            return False

    def _set(self, t, device: bool) -> None:
        if isinstance(t, torch.Tensor):
            try:
                self._res[t.untyped_storage()] = device
            except (RuntimeError, NotImplementedError, AttributeError):
                pass

    # -- results --------------------------------------------------------------------
    @property
    def total(self) -> int:
        """Host syncs counted."""
        return sum(self.counts.values())

    @property
    def device_ops(self) -> int:
        """Device ops (would-be kernel launches and copies to the device) counted."""
        return sum(self.ops.values())

    def reset(self) -> None:
        """Forget the counts, device ops and events (placement is kept)."""
        self.counts.clear()
        self.ops.clear()
        self.events.clear()
        self.mismatches.clear()

    def table(self) -> str:
        """One line per (kind, op, frame) with its count, most frequent first."""
        rows = Counter(self.events).most_common()
        return "\n".join(f"{n:4d}  {kind:9s} {op:22s} {frame}" for (kind, op, frame), n in rows)

    def _count(self, kind: str, op: str) -> None:
        if self._quiet:
            return
        self.counts[kind] += 1
        self.events.append((kind, op, self._frame()))

    def _launch(self, op: str) -> None:
        if not self._quiet:
            self.ops[op] += 1

    def _frame(self) -> str:
        stack = traceback.extract_stack()
        mine = [f for f in stack if f.filename.startswith(self.where)
                and not f.filename.startswith(_SKIP)]
        other = [f for f in stack if not f.filename.startswith(_SKIP)]
        f = (mine or other or stack)[-1]
        path = os.path.relpath(f.filename, _ROOT) if f.filename.startswith(_ROOT) else f.filename
        return f"{path}:{f.lineno} in {f.name}"

    # -- context --------------------------------------------------------------------
    def __enter__(self) -> SyncCounter:
        from flashwatch.signals import smallops

        if SyncCounter._active:
            raise RuntimeError("a SyncCounter is already counting; one at a time (it "
                               "patches torch.Tensor): leave the other's `with` first")
        SyncCounter._active = True
        self._numpy_cpu, smallops.NUMPY_CPU = smallops.NUMPY_CPU, False
        self._modes = (_Dispatch(self), _Patches(self))
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        from flashwatch.signals import smallops

        for m in reversed(self._modes):
            m.__exit__(*exc)
        SyncCounter._active = False
        smallops.NUMPY_CPU = self._numpy_cpu

    # -- the op-level rules (aten) --------------------------------------------------
    def _on_op(self, func, args, kwargs, out) -> None:
        name = func.overloadpacket.__name__
        ins = _tensors((args, kwargs))
        dev_in = any(self.on_device(t) for t in ins)
        if func.namespace != "aten":  # opaque kernel: outputs where its inputs are
            placed = dev_in
        elif name == "_to_copy":  # only a copy to DEVICE moves memory here: C++ casts
            # (autocast) name the plain CPU; .cpu() and .to("cpu") count in _Patches
            placed = self._copy(name, self.on_device(args[0]),
                                True if _is_device(kwargs.get("device")) else None,
                                kwargs.get("non_blocking", False))
        elif name == "copy_":
            nb = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            self._copy(name, self.on_device(args[1]), self.on_device(args[0]), nb)
            if self.on_device(args[0]):
                self._launch(str(func.overloadpacket))
            return  # copy_ returns its destination, placed already
        else:
            placed = self._rules(func, name, args, kwargs, ins, dev_in)
        outs = _tensors(out)
        for t in outs:
            self._set(t, placed)
        if placed and outs and func.namespace == "aten" and not _no_launch(func, name):
            self._launch(str(func.overloadpacket))

    def _copy(self, op, src_dev: bool, dst_dev: bool | None, non_blocking) -> bool:
        dst_dev = src_dev if dst_dev is None else dst_dev
        if src_dev and not dst_dev:
            self._count("d2h", op)
        elif dst_dev and not src_dev and not non_blocking:
            self._count("h2d", op)
        return dst_dev

    def _rules(self, func, name, args, kwargs, ins, dev_in) -> bool:
        if kwargs.get("device") is not None:  # a factory, or new_*(device=...)
            return _is_device(kwargs["device"])
        if not dev_in:
            return False
        if name in _BY_OP:
            self._count(_BY_OP[name], str(func))
        elif name == "repeat_interleave" and func._overloadname != "self_int" \
                and kwargs.get("output_size") is None:
            self._count("data_size", str(func))
        elif name in _INDEX:
            self._index(func, name, args)
            return True
        if any(t.dim() > 0 and not self.on_device(t) for t in ins):
            self.mismatches.append((str(func), self._frame()))
        return True

    def _index(self, func, name, args) -> None:
        idx = [t for t in args[1] if isinstance(t, torch.Tensor)]
        if any(not self.on_device(t) and t.dtype not in (torch.bool, torch.uint8) for t in idx):
            self._count("h2d", str(func))  # host index tensors are copied over first
        if not any(t.dtype in (torch.bool, torch.uint8) for t in idx):
            return
        value = args[2] if name.startswith(("index_put", "_index_put")) else None
        masked_fill = (value is not None and len(idx) == 1 and value.numel() == 1
                       and not self.on_device(value))
        if not masked_fill:
            self._count("bool_mask", str(func))


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.c = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        opaque = func.namespace != "aten"  # flashwatch's ops: the CPU stand-in's
        self.c._quiet += opaque  # host code inside is not what CUDA runs
        try:
            out = func(*args, **kwargs)
        finally:
            self.c._quiet -= opaque
        self.c._on_op(func, args, kwargs, out)
        return out


class _Patches:
    """The Python-level rules: `.device`, and transfers that make no aten op on the CPU.

    Patched on torch.Tensor and torch while counting, not a TorchFunctionMode: the
    autograd engine runs backward hooks without the caller's function modes (torch
    2.13), and the watcher's hooks move gradients to the host."""

    TENSOR = ("to", *_D2H_METHODS)

    def __init__(self, counter: SyncCounter):
        self.c = counter
        self.saved: list = []

    def __enter__(self) -> None:
        c, base = self.c, torch._C.TensorBase
        getter = base.device.__get__
        self._patch(torch.Tensor, "device", property(
            lambda t: DEVICE if c.on_device(t) else getter(t)))
        for name in self.TENSOR:
            self._patch(torch.Tensor, name, self._transfer(name, getattr(torch.Tensor, name)))
        for name in _FACTORIES:
            self._patch(torch, name, self._factory(name, getattr(torch, name)))

    def __exit__(self, *exc) -> None:
        for owner, name, old in reversed(self.saved):
            if old is None:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        self.saved.clear()

    def _patch(self, owner, name, new) -> None:
        self.saved.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, new)

    def _transfer(self, name, orig):
        c = self.c

        @functools.wraps(orig)
        def wrapper(src, *args, **kwargs):
            src_dev = c.on_device(src)
            dst_dev, non_blocking = (self._target(args, kwargs) if name == "to"
                                     else (False, False))
            if dst_dev is None or dst_dev == src_dev:
                return orig(src, *args, **kwargs)
            if src_dev:
                c._count("d2h", f"Tensor.{name}")
            else:
                c._launch(f"Tensor.{name}")  # the copy is a stream op, blocking or not
                if not non_blocking:
                    c._count("h2d", f"Tensor.{name}")
            c._quiet += 1
            try:
                out = orig(src, *args, **kwargs)
                if out is src:  # the same CPU memory; on CUDA a new tensor
                    out = out.clone()
            finally:
                c._quiet -= 1
            c._set(out, dst_dev)
            return out
        return wrapper

    def _target(self, args, kwargs) -> tuple:
        """Tensor.to's destination: (on the device? None: unchanged, non_blocking)."""
        if args and isinstance(args[0], torch.Tensor):
            return self.c.on_device(args[0]), kwargs.get("non_blocking", False)
        dev, _, non_blocking, *_ = torch._C._nn._parse_to(*args, **kwargs)
        return (None if dev is None else _is_device(dev)), non_blocking

    def _factory(self, name, orig):
        """torch.tensor(data, device=...) and kin: no aten op shows the copy."""
        c = self.c

        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            src = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if src is None and args:  # a list of device scalars: one .item() each
                for t in _tensors(args[0]):  # (read in C++, unseen by the dispatch)
                    if c.on_device(t):
                        c._count("item", f"torch.{name}")
            c._quiet += 1  # a tensor is copied whole: counted below, not as its aten copy
            try:
                out = orig(*args, **kwargs)
            finally:
                c._quiet -= 1
            src_dev = src is not None and c.on_device(src)
            dev = kwargs.get("device")
            dst_dev = src_dev if dev is None else _is_device(dev)
            if dst_dev and not src_dev:
                c._count("h2d", f"torch.{name}")
                c._launch(f"torch.{name}")
            elif src_dev and not dst_dev:
                c._count("d2h", f"torch.{name}")
            c._set(out, dst_dev)
            return out
        return wrapper
