"""``comfuse bench``: time the post-norm suite on the GPU against every contender."""

from __future__ import annotations

import datetime
import os

from . import subcommand
from .. import bench, workloads
from ..errors import ComFuseError

EXAMPLES = """examples:
  comfuse bench                                   whole suite, LayerNorm, fp16
  comfuse bench --norms layer_norm rms_norm softmax --dtypes float16 bfloat16
  comfuse bench --shapes bert-base-attnout --contenders cublas_gemm comfuse
  comfuse bench --contenders tvm_dlight tvm_metaschedule comfuse    vanilla MetaSchedule, 64 trials per task
  comfuse bench --shapes wide-short-k --contenders tvm_metaschedule comfuse --vanilla-logs ms/   keeping its tuning logs
  comfuse bench --contenders cublas_gemm inductor comfuse comfuse_mma_sync   the portable mma.sync rule too
  comfuse bench --shapes --models bert-base bert-large --batch 32 --seq 128   whole encoders only
  comfuse bench --shapes --attention 128 256 512 1024   multi-head attention, batch x heads 256, head dim 64
  comfuse bench --shapes --mlp 64 128 256         gelu(x @ w1.T + b1) @ w2.T + b2 through a narrow intermediate
"""


#: Contenders that take minutes per shape to build.
_SLOW = ("inductor_max_autotune", "tvm_metaschedule")


def add_parser(sub) -> None:
    p = subcommand(sub, "bench", "time ComFuse against cuBLAS, eager, torch.compile and vanilla TVM on a GPU", bench.__doc__, EXAMPLES, run)
    names = [s.name for s in workloads.SUITE]
    p.add_argument("--shapes", nargs="*", default=names, choices=names, metavar="SHAPE", help=f"from {names}")
    p.add_argument("--models", nargs="*", default=[], choices=list(bench.MODELS), help="whole models, end to end (fp16): BERT encoders, a pre-norm residual stream")
    p.add_argument("--attention", nargs="*", type=int, default=[], metavar="SEQ",
                   help="multi-head attention at these sequence lengths (batch x heads 256, head dim 64, fp16)")
    p.add_argument("--mlp", nargs="*", type=int, default=[], metavar="N1",
                   help="back-to-back GEMM MLPs with these intermediate widths (16384 and 65536 tokens, width 1024, fp16)")
    p.add_argument("--batch", type=int, default=32, help="batch of --models (default 32)")
    p.add_argument("--seq", type=int, default=128, help="sequence length of --models (default 128)")
    p.add_argument("--norms", nargs="+", default=["layer_norm"], choices=["layer_norm", "rms_norm", "softmax"])
    p.add_argument("--dtypes", nargs="+", default=["float16"], choices=["float16", "bfloat16"])
    p.add_argument(
        "--contenders", nargs="+", default=[c for c in bench.CONTENDERS if c not in _SLOW],
        choices=bench.CONTENDERS,
        help=f"{' and '.join(_SLOW)} are off by default: they compile (tune, for vanilla MetaSchedule: "
             f"{bench.VANILLA_TRIALS} trials per task) for minutes per shape",
    )
    p.add_argument("--out", help="results JSON (default notebooks/results/bench-<gpu>-<date>.json), rewritten as each row is measured")
    p.add_argument("--vanilla-logs", metavar="DIR",
                   help="keep the tvm_metaschedule contender's tuning logs in DIR/<shape>-<norm>-<dtype>/ (default: not kept)")


def run(args) -> int:
    import tvm  # pylint: disable=import-outside-toplevel

    if not tvm.cuda(0).exist:
        raise ComFuseError("comfuse bench needs a CUDA GPU and none was found; run it on the GPU machine.")
    shapes = [s for s in workloads.SUITE if s.name in args.shapes]
    out = args.out or os.path.join(
        "notebooks", "results", f"bench-{tvm.cuda(0).device_name.replace(' ', '_')}-{datetime.date.today()}.json"
    )
    log = bench.Checkpoint(out)  # every row lands in `out` as it is measured
    rows = bench.run(shapes, args.norms, args.dtypes, tuple(args.contenders), log, args.vanilla_logs)
    for model in args.models:
        rows += bench.run_model(model, args.batch, args.seq, tuple(args.contenders), log)
    if args.attention:
        rows += bench.run_attention(args.attention, tuple(args.contenders), log)
    if args.mlp:
        rows += bench.run_mlp(args.mlp, tuple(args.contenders), log)
    print(bench.table(rows))
    bench.save(rows, out)
    print(f"results: {out}")
    return 0 if not any(r.error for r in rows if r.contender == "comfuse") else 1
