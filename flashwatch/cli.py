"""The `flashwatch` command line: `demo`, `report`, `diagnose`, `dashboards`, `info`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _info(_args: argparse.Namespace) -> int:
    import torch

    import flashwatch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    print(f"flashwatch {flashwatch.__version__}")
    print(f"torch      {torch.__version__} (CUDA available: {torch.cuda.is_available()})")
    print(f"triton     {triton_version}")
    print("backends   reference (pure PyTorch, any device); triton (CUDA, bf16/fp16)")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from flashwatch.demo import PortUnavailable, run_demo

    out = args.out or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    try:
        summary = run_demo(steps=args.steps, seed=args.seed, out=out, port=args.port or None,
                           mitigation=args.mitigation, every=args.every)
    except PortUnavailable as e:
        print(f"flashwatch demo: error: {e}", file=sys.stderr)
        return 2
    if summary["ended"] == "interrupted":
        return 130  # the shell's code for Ctrl-C
    return 0


def _report(args: argparse.Namespace) -> int:
    from flashwatch.report.runreport import make_report

    try:
        written = make_report(args.run_dir, args.out)
    except (FileNotFoundError, ValueError, ImportError) as e:  # ImportError: no [report]
        print(f"flashwatch report: error: {e}", file=sys.stderr)
        return 2
    for p in written:
        print(p)
    return 0


def _diagnose(args: argparse.Namespace) -> int:
    from flashwatch.diagnosis.cli import run_diagnose

    try:
        written = run_diagnose(args)
    except (FileNotFoundError, ValueError, TypeError, RuntimeError, ImportError) as e:
        # ImportError: a Hugging Face checkpoint without the [transformers] extra
        print(f"flashwatch diagnose: error: {e}", file=sys.stderr)
        return 2
    for p in written:
        print(p)
    return 0


def dashboard_files() -> dict[str, bytes]:
    """The shipped Grafana dashboard, provisioning, Prometheus rules (+ their promtool
    tests) and scrape-config snippet: {relative path: contents}, from the package data
    flashwatch/dashboards/ (the one copy; the repository's dashboards/ is written from it)."""
    from importlib.resources import files

    root = files("flashwatch") / "dashboards"
    if not root.is_dir():
        raise RuntimeError("flashwatch's package data flashwatch/dashboards/ is missing: "
                           "reinstall flashwatch (pip install --force-reinstall flashwatch)")
    found: dict[str, bytes] = {}
    pending = [(root, "")]
    while pending:
        folder, prefix = pending.pop()
        for entry in folder.iterdir():
            if entry.is_dir():
                pending.append((entry, f"{prefix}{entry.name}/"))
            elif not entry.name.endswith((".py", ".pyc")):
                found[prefix + entry.name] = entry.read_bytes()
    return dict(sorted(found.items()))


def write_dashboards(out: Path | str) -> list[Path]:
    """Write dashboard_files() under `out` (created; existing files are overwritten) and
    return the paths written."""
    if not isinstance(out, (str, Path)):
        raise TypeError(f"out must be a str or Path, got {type(out).__name__}; pass the "
                        f"directory to write the dashboards into")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out={str(out)!r} is a file, not a directory; pass a directory")
    written = []
    for rel, data in dashboard_files().items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        written.append(path)
    return written


def _dashboards(args: argparse.Namespace) -> int:
    try:
        written = write_dashboards(args.out)
    except (OSError, ValueError) as e:
        print(f"flashwatch dashboards: error: --out {args.out}: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a broken install, not the user's --out
        print(f"flashwatch dashboards: error: {e}", file=sys.stderr)
        return 2
    for p in written:
        print(p)
    rules = args.out / "prometheus"
    print(f"next: add {rules / 'flashwatch-scrape.yml'}'s job to prometheus.yml, load "
          f"{rules / 'flashwatch-rules.yml'} (rule_files:), import "
          f"{args.out / 'grafana' / 'flashwatch.json'} in Grafana; step by step: "
          f"https://github.com/flashwatch/flashwatch/blob/main/docs/dashboards.md")
    return 0


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be ≥ 1, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535 (0 = no exporter), "
                                         f"got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    import flashwatch

    parser = argparse.ArgumentParser(
        prog="flashwatch",
        description="Watch attention numerics while a transformer trains in BF16.")
    parser.add_argument("--version", action="version",
                        version=f"flashwatch {flashwatch.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    _add_report(sub)
    _add_diagnose(sub)
    dash = sub.add_parser(
        "dashboards", help="write the Grafana dashboard, Prometheus rules and scrape config",
        description="Write the Grafana dashboard JSON and provisioning files, the Prometheus "
                    "recording/alerting rules (with their promtool tests) and a scrape-config "
                    "snippet for PrometheusSink into a directory (docs/dashboards.md).")
    dash.add_argument("--out", type=Path, default=Path("dashboards"),
                      help="directory to write into (./dashboards); files there are replaced")
    dash.set_defaults(func=_dashboards)
    info = sub.add_parser("info", help="print versions and the available backends")
    info.set_defaults(func=_info)
    return parser


def _add_demo(sub) -> None:
    demo = sub.add_parser(
        "demo", help="train a small GPT on CPU in BF16 with flashwatch switched on",
        description="Train a small GPT (flashwatch/nanogpt.py) on CPU in BF16 autocast with the "
                    "watcher, the JSONL and console sinks and the Prometheus exporter; "
                    "writes a run directory that `flashwatch report` reads.")
    demo.add_argument("--steps", type=_positive, default=600, help="optimizer steps (600)")
    demo.add_argument("--seed", type=int, default=0, help="seed for data, model, watcher")
    demo.add_argument("--out", type=Path, default=None,
                      help="run directory (default runs/demo-<time>)")
    demo.add_argument("--port", type=_port, default=9400,
                      help="Prometheus exporter port on 127.0.0.1 (9400; 0 = off)")
    demo.add_argument("--mitigation", choices=("off", "advise", "auto"), default="auto")
    demo.add_argument("--every", type=_positive, default=2,
                      help="monitor one optimizer step in this many (2)")
    demo.set_defaults(func=_demo)


def _add_report(sub) -> None:
    report = sub.add_parser(
        "report", help="plots and a Markdown summary of a run directory",
        description="Write ties_heatmap.png, drift.png, spectral.png, loss.png and "
                    "report.md for a run directory holding flashwatch.jsonl.")
    report.add_argument("run_dir", type=Path, help="directory with flashwatch.jsonl")
    report.add_argument("--out", type=Path, default=None, help="where to write (RUN_DIR)")
    report.set_defaults(func=_report)


def _add_diagnose(sub) -> None:
    diag = sub.add_parser(
        "diagnose", help="name the attention heads that look like the BF16 failure, exactly",
        description="Measure every attention head of saved checkpoints exactly (FP64, every "
                    "row of the given batches): ties, max logit, the δ error's share of the "
                    "W^Q gradient, its sign across batches, W^Q norms, what QK-clip would do; "
                    "rank the heads and write report.md, diagnose.json and plots "
                    "(docs/diagnose.md).")
    diag.add_argument("checkpoints", nargs="+", metavar="CHECKPOINT",
                      help="Hugging Face folder, nanoGPT ckpt.pt, a state dict file (.pt, "
                           "Lightning .ckpt), a torch.distributed.checkpoint or safetensors "
                           "folder (these need --model), or module:function; several: "
                           "oldest first, for growth between them")
    diag.add_argument("--model", default=None, metavar="BUILDER",
                      help="the model a state dict loads into: module:function (searched "
                           "in the current directory) or a Hugging Face config folder")
    diag.add_argument("--data", required=True,
                      help="token ids (.bin uint16 as nanoGPT writes, .npy, .pt) or a text file")
    # 16: a sign that never changes over n batches has |z| = sqrt(n); 3 needs n ≥ 9
    diag.add_argument("--batches", type=_positive, default=16, help="batches to measure (16)")
    diag.add_argument("--batch-size", type=_positive, default=1, help="rows per batch (1)")
    diag.add_argument("--block", type=_positive, default=None,
                      help="tokens per row (the model's context, at most 1024)")
    diag.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                      help="autocast dtype the model trains in (bfloat16); float32: none")
    diag.add_argument("--device", default=None, help="cuda if available, else cpu")
    diag.add_argument("--tau", type=float, default=100.0, help="QK-clip threshold τ (100)")
    diag.add_argument("--seed", type=int, default=0, help="seed for the batch windows")
    diag.add_argument("--layers", default=None,
                      help="measure only these attention layers: indices and ranges in "
                           "discovery order, e.g. 0,5-7 (default: all)")
    diag.add_argument("--out", type=Path, default=None,
                      help="output directory (default runs/diagnose-<time>)")
    diag.set_defaults(func=_diagnose)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
