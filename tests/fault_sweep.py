"""A failure at every torch call flashwatch makes in a monitored step, one at a time, on
one rank of a 2-process job: both ranks must train on, in step, with the same modes.

`Inject` is a TorchFunctionMode that counts the torch calls whose nearest caller outside
torch is flashwatch's own code (the forward probe, the backward hooks, step()) and
raises at the n-th. A counting step gives the number of calls M; then for each chosen n
one training step runs with the fault armed at n on rank 1 (forward, backward, optimizer
step and watcher.step(), every step monitored, mitigation "auto", QK-clip on), and both
ranks record whether anything reached the training loop, the errors counted, the step
count and the head modes. Collectives are not torch calls here: they are never the
injected failure, but every one the monitor issues after a failure must still meet its
partner on the other rank, or the job hangs (each run has a 60 s collective timeout).

tests/parallel/test_faults.py runs a sample of the injection points under DDP and FSDP2
in `make test`; `python tests/fault_sweep.py` runs every point (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import functools
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import flashwatch as fw  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402

FW_DIR = os.path.dirname(fw.__file__) + os.sep
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
DIST_DIR = os.path.join(TORCH_DIR, "distributed") + os.sep
MODEL_FILE = os.path.join(FW_DIR, "nanogpt.py")  # the model trained here, not the monitor
SMALL = dict(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32)
KINDS = ("ddp", "fsdp2", "tp")  # 2 processes
KINDS_4 = ("fsdp2_tp",)  # 4 processes: a (dp 2, tp 2) mesh
WARMUP = 2  # steps before the sweep: the first monitored step's one-time work is done


class Inject(TorchFunctionMode):
    """Raise RuntimeError at the `at`-th torch call made from flashwatch's code (-1:
    count only). `fired` names the call that raised and where it was made."""

    def __init__(self, at: int = -1):
        super().__init__()
        self.at, self.count, self.fired = at, 0, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename.startswith(TORCH_DIR)
                                     or frame.f_code.co_name == "__torch_function__"):
            # torch's own Python (F.layer_norm), and flashwatch's interceptor passing the
            # model's own ops through: the call belongs to whoever is above them
            if frame.f_code.co_filename.startswith(DIST_DIR):  # inside a collective
                return func(*args, **(kwargs or {}))
            frame = frame.f_back
        name = frame.f_code.co_filename if frame is not None else ""
        if func is F.scaled_dot_product_attention and frame.f_code.co_name == "on_sdpa":
            name = ""  # the model's own attention call, which the Recorder passes on
        if frame is not None and frame.f_code.co_name in ("on_flex", "on_varlen",
                                                          "_run_flex") \
                and getattr(func, "__name__", "") in ("flex_attention", "_varlen_attn"):
            name = ""  # the same for FlexAttention's and varlen's ops
        if name.startswith(FW_DIR) and name != MODEL_FILE:
            n, self.count = self.count, self.count + 1
            if n == self.at:
                where = f"{frame.f_code.co_filename[len(FW_DIR):]}:{frame.f_lineno}"
                self.fired = f"{getattr(func, '__name__', func)} at {where}"
                if os.environ.get("FW_SWEEP_TRACE"):
                    print(f"fault_sweep: raising at {self.fired}", file=sys.stderr, flush=True)
                raise RuntimeError(f"injected fault: torch call {n} ({self.fired})")
        return func(*args, **(kwargs or {}))


def _model(kind: str, mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    if kind == "tp":  # heads split over the 2 ranks (torchtitan's plan), no QK-clip
        from scaled_heads import tp_model

        return tp_model(mesh)
    if kind == "fsdp2_tp":  # TP over mesh["tp"], FSDP2 over mesh["dp"], QK-clip on
        from scaled_heads import tp_model

        model = tp_model(mesh["tp"])
        for blk in model.layers.values():
            fully_shard(blk, mesh=mesh["dp"])
        return fully_shard(model, mesh=mesh["dp"])
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL))
    if kind == "fsdp2":
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    return DDP(model)


def _train_step(model, opt, w, i: int, rank: int):
    tp = not isinstance(getattr(model, "module", model), GPT)  # TP ranks share a batch
    g = torch.Generator().manual_seed(100 * i + (rank // 2 if tp else rank))
    idx = torch.randint(0, SMALL["vocab_size"], (4, 17), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if tp:
            loss = F.cross_entropy(model(idx[:, :-1]).float().reshape(
                -1, SMALL["vocab_size"]), idx[:, 1:].reshape(-1))
        else:
            _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return w.step()


def sweep(rank: int, kind: str, mesh, points: str, out_path: str | None = None) -> dict:
    """Run the sweep on this rank (both ranks call it). points: "all", or "every:K" (every
    K-th call, the first and the last). Returns per point what this rank saw."""
    import torch.distributed as dist

    model = _model(kind, mesh)
    w = fw.watch(model, every_n_steps=1, rows_per_head=8, mitigation="auto",
                 qk_clip_threshold={"tp": None, "fsdp2_tp": 3.0}.get(kind, 50.0),
                 collective_timeout_s=60.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = 0
    for _ in range(WARMUP):
        _train_step(model, opt, w, step, rank)
        step += 1
    counter = Inject()
    with counter if rank == 1 else _nothing():
        _train_step(model, opt, w, step, rank)
    step += 1
    m = torch.tensor([counter.count])
    dist.broadcast(m, src=1)
    calls = int(m)
    if points == "all":
        todo = list(range(calls))
    elif points.startswith("range:"):  # range:A:B, for a closer look at a few points
        todo = list(range(*map(int, points.split(":")[1:])))
    else:
        k = int(points.split(":")[1])
        todo = sorted(set(range(0, calls, k)) | {calls - 1})
    out = dict(calls=calls, points=[], kind=kind, rank=rank)
    t0 = time.perf_counter()
    for n in todo:
        if os.environ.get("FW_SWEEP_TRACE") and rank == 1:
            print(f"fault_sweep: {kind} point {n}", file=sys.stderr, flush=True)
        before = w.monitor_errors_total
        inject = Inject(n) if rank == 1 else None
        escaped = None
        try:
            with inject if inject is not None else _nothing():
                report = _train_step(model, opt, w, step, rank)
        except Exception as e:  # reached the training loop: the run would be down
            escaped, report = f"{type(e).__name__}: {e}", None
        step += 1
        modes = w._pipeline.global_modes().tolist()  # every head of the job (TP: not local)
        out["points"].append(dict(
            n=n, fired=inject.fired if inject else None, escaped=escaped,
            errors=w.monitor_errors_total - before, step=w.step_count, modes=modes,
            reported=report is not None, broken=w._pipeline.monitor.broken))
        if escaped is not None:
            break  # DDP's collectives are out of step now: stop both ranks here
        if out_path:
            torch.save(out, out_path)
    out["seconds"] = time.perf_counter() - t0
    w.remove()
    if out_path:
        torch.save(out, out_path)
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def check(r0: dict, r1: dict) -> list[str]:
    """What went wrong at each point, as lines (empty: every point survived)."""
    bad = []
    if len(r0["points"]) != len(r1["points"]):
        bad.append(f"ranks ran {len(r0['points'])} and {len(r1['points'])} points")
    for a, b in zip(r0["points"], r1["points"], strict=False):
        where = f"{r0['kind']} call {b['n']} ({b['fired']})"
        if a["escaped"] or b["escaped"]:
            bad.append(f"{where}: reached training: {a['escaped'] or b['escaped']}")
        if a["step"] != b["step"]:
            bad.append(f"{where}: step counts {a['step']} != {b['step']}")
        if a["modes"] != b["modes"]:
            bad.append(f"{where}: modes differ {a['modes']} != {b['modes']}")
        if a["broken"] or b["broken"]:
            bad.append(f"{where}: the monitor's group broke: {a['broken'] or b['broken']}")
        if b["fired"] and b["errors"] < 1:
            bad.append(f"{where}: the fault was not counted on rank 1")
        if a["errors"]:
            bad.append(f"{where}: rank 0 counted {a['errors']} error(s)")
        if not a["reported"]:
            bad.append(f"{where}: rank 0 made no report")
    return bad


def _worker(rank, world, init_file, out_dir, kinds=KINDS, points="every:1"):
    from _helpers import on_mesh

    on_mesh(rank, world, init_file, out_dir, lambda mesh: [
        (kind, functools.partial(sweep, rank, kind, mesh, points)) for kind in kinds])


def _worker_4(rank, world, init_file, out_dir, kinds=KINDS_4, points="every:1"):
    """A rank of the 4-process kinds, on a (dp 2, tp 2) mesh; rank 1 injects."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    results = {}
    for kind in kinds:
        results[kind] = sweep(rank, kind, mesh, points)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def check_all(results: list[dict], kind: str) -> list[str]:
    """`check` of rank 1 (which injects) and of every other rank against rank 0."""
    bad = check(results[0][kind], results[1][kind])
    for r in results[2:]:
        bad += check(results[0][kind], r[kind])
        bad += [f"{kind} call {p['n']}: rank {r[kind].get('rank')} counted {p['errors']} "
                f"error(s)" for p in r[kind]["points"] if p["errors"]]
    return bad


def worker_4_every(k: int):
    """The 4-rank worker for tests/parallel/test_faults.py: FSDP2 × TP, every k-th call."""
    return functools.partial(_worker_4, kinds=KINDS_4, points=f"every:{k}")


def worker_every(k: int):
    """The worker for tests/parallel/test_faults.py: DDP, FSDP2 and TP, every k-th call."""
    return functools.partial(_worker, kinds=KINDS, points=f"every:{k}")


if __name__ == "__main__":
    import argparse
    import tempfile
    from pathlib import Path

    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--points", default="all", help='"all" or "every:K"')
    p.add_argument("--kinds", default=",".join(KINDS + KINDS_4))
    args = p.parse_args()
    kinds = tuple(args.kinds.split(","))
    for world, group in ((2, [k for k in kinds if k not in KINDS_4]),
                         (4, [k for k in kinds if k in KINDS_4])):
        if not group:
            continue
        out = Path(tempfile.mkdtemp())
        mp.spawn(_worker if world == 2 else _worker_4,
                 args=(world, str(out / "init"), str(out), tuple(group), args.points),
                 nprocs=world)
        results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
        for kind in group:
            r1 = results[1][kind]
            bad = check_all(results, kind)
            fired = sum(1 for p in r1["points"] if p["fired"])
            print(f"{kind} ({world} ranks): {r1['calls']} torch calls from flashwatch in a "
                  f"monitored step; {len(r1['points'])} injected ({fired} fired) in "
                  f"{r1['seconds']:.0f} s; {len(bad)} failures")
            for line in bad[:30]:
                print("  " + line)
