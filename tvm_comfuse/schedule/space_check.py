"""How many configurations of the rule's design space build: the build-error rate, on CPU.

``python -m tvm_comfuse.schedule.space_check M K N [--arch sm_90]`` schedules the fused
post-norm group of that shape with every configuration the rule offers, lowers each with
ComFuse's TIR pipeline and compiles it with nvcc, and prints the counts (MetaSchedule's stock
tensor-core rules fail to build ~80% of their candidates on the same GEMMs).
"""

from __future__ import annotations

import argparse
import time

import tvm

from .. import codegen, workloads
from ..transform.fuse_compute_memory import KIND_ATTR
from .gemm_reduce import GemmRowTile
from .lowering import PASS_CONFIG, TIR_PIPELINE


def build_space(M: int, K: int, N: int, arch: str = "sm_90", dtype: str = "float16", limit: int | None = None):
    """``[(config, error or None)]`` for every schedule in the rule's space for this shape."""
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    func = fused_group(workloads.post_norm(M, K, N, dtype, linear=True), target)
    sch = tvm.s_tir.Schedule(func)
    configs = GemmRowTile().configs(sch, target)[:limit]
    built = dict(GemmRowTile().scheduled(sch, target, limit))
    results = []
    for cfg in configs:
        try:
            if cfg not in built:
                raise RuntimeError("the rule could not schedule this configuration")
            codegen.compile_with_nvcc(codegen.cuda_source(build_kernel(built[cfg], target)), arch)
            results.append((cfg, None))
        except Exception as err:  # pylint: disable=broad-except
            results.append((cfg, str(err).strip().splitlines()[-1][:160] if str(err).strip() else type(err).__name__))
    return results


def fused_group(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.tirx.PrimFunc:
    """The one ComFuse-fused PrimFunc of ``mod`` after fusion, as a standalone entry function."""
    from ..tune.tasks import fused_module  # pylint: disable=import-outside-toplevel

    fused = fused_module(mod, target)
    (func,) = [f for _, f in fused.functions_items() if KIND_ATTR in (f.attrs or {})]
    return func.with_attr("global_symbol", "main")


def build_kernel(sch: tvm.s_tir.Schedule, target: tvm.target.Target):
    """A scheduled group as a runtime module, lowered as ``tvm_comfuse.compile`` lowers it."""
    with tvm.transform.PassContext(opt_level=3, config=PASS_CONFIG):
        return tvm.compile(sch.mod, target=target, tir_pipeline=TIR_PIPELINE)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("M", type=int)
    parser.add_argument("K", type=int)
    parser.add_argument("N", type=int)
    parser.add_argument("--arch", default="sm_90")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = build_space(args.M, args.K, args.N, args.arch)
    for cfg, err in results:
        print(f"{'ok  ' if err is None else 'FAIL'} {cfg}" + (f": {err}" if err else ""))
    failed = sum(err is not None for _, err in results)
    print(f"{len(results)} configurations, {failed} failed to build "
          f"({100 * failed / max(len(results), 1):.0f}%), {time.perf_counter() - start:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
