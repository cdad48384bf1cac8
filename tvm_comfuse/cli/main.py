"""``comfuse`` entry point: parse arguments, dispatch to a subcommand, turn errors into text."""

from __future__ import annotations

import argparse
import sys

from ..errors import ComFuseError
from . import bench, compact_logs, demo, tune

EPILOG = """examples:
  comfuse demo                      fuse, check and generate CUDA for the demo workloads
  comfuse demo --out build/demo     also write the generated CUDA source there
  comfuse bench                     time the post-norm suite on a GPU (writes notebooks/results/)
  comfuse tune tiny-postnorm --trials 8   tune the fused PrimFuncs (logs in tuning_logs/llvm/tiny-postnorm/)
  comfuse compact-logs tuning_logs/llvm/tiny-postnorm   the same logs in fewer bytes (lossless)
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="comfuse",
        description="ComFuse for TVM: fuse GEMMs with the reductions and elementwise chains after them.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo.add_parser(sub)
    bench.add_parser(sub)
    tune.add_parser(sub)
    compact_logs.add_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ComFuseError as err:
        print(f"comfuse {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
