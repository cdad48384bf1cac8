"""``comfuse tune``: MetaSchedule-tune the PrimFuncs ComFuse fuses, into resumable logs.

The logs (a MetaSchedule JSONDatabase) are what ``tvm_comfuse.get_pipeline(target,
database=DIR)`` applies. --trials is the total for the work directory, split evenly over
the tasks: re-running with a larger number tunes only the difference, and an interrupted
run keeps every record measured so far. The library is tvm_comfuse.tune.
"""

from __future__ import annotations

import sys

from . import subcommand
from .. import tune as tuning

EXAMPLES = """examples:
  comfuse tune tiny-postnorm --trials 8                    CPU smoke test (llvm), logs in tuning_logs/llvm/tiny-postnorm/
  comfuse tune tiny-postnorm --trials 32                   continue the same logs up to 32 trials in all
  comfuse tune bert-base-attnout --target nvidia/nvidia-h100 --trials 64   the wgmma kernel's configurations
  comfuse tune bert-base-attnout --target nvidia/nvidia-h100 --no-hopper   the portable mma.sync rule instead
  comfuse tune bert-base --layers 3 --target nvidia/nvidia-h100 --hopper-groups post_norm attention elementwise
                                                           the Hopper groups to tune (compile with the same groups)
  comfuse tune mlp-65536-64 --target nvidia/nvidia-h100 --hopper-groups post_norm b2b   the back-to-back GEMM kernel
  comfuse tune bert-base --layers 2 --target '{"kind": "cuda", "arch": "sm_90"}' --include-vanilla
  comfuse tune my_model.py --work-dir logs/mine            a Relax IRModule saved with mod.script()
  comfuse tune serving.py --bind n=4096 --target nvidia/nvidia-h100   symbolic rows ("n"), tuned at n = 4096
  comfuse tune tiny-postnorm --rpc-tracker 127.0.0.1:9190 --rpc-key cpu   measure on a remote device
then compile with the logs:
  ex = tvm_comfuse.compile(mod, target, database="tuning_logs/llvm/tiny-postnorm")

workloads: """ + ", ".join(tuning.WORKLOADS)


def add_parser(sub) -> None:
    p = subcommand(sub, "tune", "tune the fused PrimFuncs of a workload with MetaSchedule (resumable logs)", __doc__, EXAMPLES, run)
    p.add_argument("workload", metavar="WORKLOAD", help="a workload name (see below) or a TVMScript file")
    p.add_argument("--target", default="llvm", help='tag, JSON dict or "llvm" (default llvm)')
    p.add_argument("--trials", type=int, default=64, help="total trials for the work dir, all tasks together (default 64)")
    p.add_argument("--work-dir", help="log directory (default tuning_logs/<target>/<workload>/)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the search (default 0)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--include-vanilla", action="store_true", help="also tune the PrimFuncs ComFuse did not fuse")
    p.add_argument("--no-hopper", action="store_true",
                   help="on sm_90, tune the portable mma.sync rule's kernels (what get_pipeline(target, hopper=False) "
                        "compiles) instead of the Hopper wgmma post-norm kernel's configurations")
    p.add_argument("--hopper-groups", nargs="+", metavar="GROUP",
                   help="on sm_90, the Hopper kernels the compile will run, as get_pipeline(target, hopper_groups=...): "
                        "post_norm, attention, b2b, elementwise (all by default; the post-norm, b2b and elementwise "
                        "kernels' configurations are tuned)")
    p.add_argument("--layers", type=int, help="encoder layers for bert-base/bert-large (default: the real depth)")
    p.add_argument("--batch", type=int, default=64, help="candidates per measurement round; logs grow after each (default 64)")
    p.add_argument("--bind", action="append", metavar="VAR=VALUE",
                   help="tune a symbolic shape variable at this representative value (repeatable); compiles from the "
                        "logs use the tuned configurations for every value")
    p.add_argument("--rpc-tracker", metavar="HOST:PORT", help="measure through this TVM RPC tracker")
    p.add_argument("--rpc-key", metavar="KEY", help="the device key registered with the tracker")


def run(args) -> int:
    options = tuning.TuneOptions(
        workload=args.workload, target=args.target, trials=args.trials, work_dir=args.work_dir, seed=args.seed,
        quiet=args.quiet, include_vanilla=args.include_vanilla, rpc_tracker=args.rpc_tracker,
        rpc_key=args.rpc_key, layers=args.layers, batch=args.batch, bind=tuning.parse_bind(args.bind),
        hopper=False if args.no_hopper else None, hopper_groups=tuple(args.hopper_groups) if args.hopper_groups else None,
    )
    result = tuning.tune(options)
    with open(f"{result.work_dir}/summary.txt", encoding="utf-8") as f:
        print(f.read(), end="")
    tuned, total = tuning.applied_from_database(result.module, result.target, result.work_dir, options.hopper, options.hopper_groups)
    print(f"{tuned} of {total} kernels will compile from these logs, {total - tuned} with the default schedule")
    if result.interrupted:
        print(f"interrupted: {result.measured} trials measured this run are kept in {result.work_dir}", file=sys.stderr)
        return 130
    return 0
