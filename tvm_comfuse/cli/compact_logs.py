"""``comfuse compact-logs``: rewrite tuning logs without the indentation TVM leaves inside them.

A MetaSchedule log nests indented JSON documents as strings (every workload's IRModule, every
TransformLayout's index map), about 40% of a GPU log's bytes. The compacted files load as the
same records (checked before a file is replaced) and MetaSchedule keeps appending to them. The
library is tvm_comfuse.tune.logs.compact.
"""

from __future__ import annotations

from . import subcommand
from ..tune.logs import compact

EXAMPLES = """examples:
  comfuse compact-logs tuning_logs/cuda-sm_90a/bert-base      one work directory
  comfuse compact-logs tuning_logs/cuda-sm_90a/*              every shipped H200 log
"""


def add_parser(sub) -> None:
    p = subcommand(sub, "compact-logs", "rewrite tuning logs losslessly without their inner indentation", __doc__, EXAMPLES, run)
    p.add_argument("work_dirs", metavar="WORK_DIR", nargs="+", help="log directories `comfuse tune` wrote")


def run(args) -> int:
    for path in args.work_dirs:
        before, after = compact(path)
        print(f"{path}: {before / 1024:.0f} KiB -> {after / 1024:.0f} KiB")
    return 0
