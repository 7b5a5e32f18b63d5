"""The `flashwatch` command line. `demo` and `report` arrive with the watcher (issue 7)."""

from __future__ import annotations

import argparse
import sys


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
    print("backends   reference (CPU and CUDA, pure PyTorch)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    import flashwatch

    parser = argparse.ArgumentParser(
        prog="flashwatch",
        description="Watch attention numerics while a transformer trains in BF16.")
    parser.add_argument("--version", action="version",
                        version=f"flashwatch {flashwatch.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="print versions and the available backends")
    info.set_defaults(func=_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
