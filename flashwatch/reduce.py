"""Cross-rank reduction of the watcher's per-head numbers, constant size in the world size.

Every rank sums (or maxes) the same named tensors; each kind is packed into one float64
tensor and reduced by one `all_reduce`, so one monitored step costs at most two
collectives whose payload depends on the model (heads, sketch_dim), never on the number
of ranks. With n heads and k = sketch_dim the watcher packs
  SUM  n · (11 + k²) values (tie and row counts, δ sum, gradient rows, the k×k sketch
       G; Σc², rows with and without c, the share's numerator and rows, ‖dW^Q‖²,
       guarded rows)
  MAX  n values (max logit)
i.e. S = 8 · n · (12 + k²) bytes; a ring or tree all_reduce sends and receives about
2·S per rank whatever the world size (n = 5,120, k = 8: S = 3.1 MB, ≈ 6.2 MB each way).
The all_gather this replaces received (world_size − 1)·S per rank (3.2 GB at 1,024).

Adding a summed or maxed quantity is one entry in the dict the caller passes.
"""

from __future__ import annotations

import torch


def all_reduce(sums: dict[str, torch.Tensor], maxes: dict[str, torch.Tensor]
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Sum every tensor of `sums` and max every tensor of `maxes` over all ranks.

    Returns new dicts with the same keys, shapes and float64 CPU tensors. Without an
    initialized process group (or with one rank) the inputs come back as float64 copies.
    Every rank must pass the same keys with the same shapes, in the same order.
    """
    for name, group in (("sums", sums), ("maxes", maxes)):
        if not isinstance(group, dict):
            raise TypeError(f"{name} must be a dict of name -> tensor, got "
                            f"{type(group).__name__}")
        for key, t in group.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}[{key!r}] must be a torch.Tensor, got "
                                f"{type(t).__name__}")
    return _reduce(sums, "sum"), _reduce(maxes, "max")


def _reduce(group: dict[str, torch.Tensor], op: str) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    flat = [t.detach().to("cpu", torch.float64).reshape(-1) for t in group.values()]
    if not flat:
        return {}
    packed = torch.cat(flat)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        device = torch.device("cpu")
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        buf = packed.to(device)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        packed = buf.cpu()
    out, i = {}, 0
    for (key, t), f in zip(group.items(), flat, strict=True):
        out[key] = packed[i:i + f.numel()].view(t.shape)
        i += f.numel()
    return out
