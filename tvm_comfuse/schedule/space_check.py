"""How many configurations of the rule's design space build (the build-error rate, on CPU),
and, on a GPU, whether each computes the right result and how fast it runs.

``python -m tvm_comfuse.schedule.space_check M K N [--arch sm_90]`` schedules the fused
post-norm group of that shape with every configuration the rule offers, lowers each with
ComFuse's TIR pipeline and compiles it with nvcc, and prints the counts (MetaSchedule's stock
tensor-core rules fail to build ~80% of their candidates on the same GEMMs).

``--gpu`` (on a CUDA machine, torch installed) also runs every configuration on the same
random inputs: max abs error against a float32 reference, then the median of CUDA-event
times over many calls. That is the exhaustive version of what ``comfuse tune`` searches, used
to pick the per-architecture defaults in ``schedules/``; ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import tvm

from .. import codegen, workloads
from ..transform.fuse_compute_memory import KIND_ATTR
from .config import MmaConfig
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


def shared_memory_bytes(sch: tvm.s_tir.Schedule, target: tvm.target.Target) -> dict:
    """``{"shared.dyn": bytes, "shared": bytes}`` a scheduled group's kernels allocate once
    lowered (after TVM merges the dynamic allocations): what the driver checks at launch
    against the per-block limit, dynamic and static together."""
    main, _, _ = tvm.tirx.compilation_pipeline.get_tir_pipeline(TIR_PIPELINE)
    mod = tvm.IRModule({"main": sch.mod["main"].with_attr("target", target)})
    with tvm.transform.PassContext(opt_level=3, config=PASS_CONFIG):
        lowered = main(mod)
    sizes = {"shared.dyn": 0, "shared": 0}
    for _, func in lowered.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc):
            for per_scope in tvm.s_tir.analysis.calculate_allocated_bytes(func).values():
                for scope, n in per_scope.items():
                    if scope in sizes:
                        sizes[scope] += int(n)
    return sizes


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


def time_space(M: int, K: int, N: int, norm: str = "layer_norm", limit: int | None = None, log=print,
               configs: list | None = None) -> list:
    """On the GPU: ``[{config, max_abs_err, us}]`` for every configuration of the rule for
    this post-norm shape (fp16, nn.Linear weight), all on the same inputs; with ``configs``
    (MmaConfig or RowTileConfig), those instead, whether or not the space offers them."""
    import torch  # pylint: disable=import-outside-toplevel

    from .. import workloads as wl  # pylint: disable=import-outside-toplevel

    target = tvm.target.Target.from_device(tvm.cuda(0))
    func = fused_group(wl.post_norm(M, K, N, "float16", norm, linear=True), target)
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device="cuda", dtype=torch.float16, generator=g)  # noqa: E731
    args = dict(zip(["x", "w", "b", "r", "gamma", "beta"], [rnd(M, K), rnd(N, K) / K**0.5, rnd(N), rnd(M, N), rnd(N), rnd(N)]))
    ref = wl.post_norm_reference([a.float().cpu().numpy() for a in args.values()], norm, linear=True)[0]
    rows = []
    for cfg, sch in GemmRowTile().scheduled(tvm.s_tir.Schedule(func), target, limit, configs):
        row = {"config": dataclasses.asdict(cfg), "kind": type(cfg).__name__}
        try:
            if sch is None:
                raise RuntimeError("the rule could not schedule this configuration")
            out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.float16)
            kernel = build_kernel(sch, target)["main"]
            tvm_args = [tvm.runtime.from_dlpack(args.get(p.name, out)) for p in func.params]
            kernel(*tvm_args)
            row["max_abs_err"] = float((out.float().cpu().double() - torch.from_numpy(ref)).abs().max())
            row["us"] = _median_us(torch, lambda: kernel(*tvm_args))
        except Exception as err:  # pylint: disable=broad-except
            row["error"] = str(err).strip().splitlines()[-1][:200] if str(err).strip() else type(err).__name__
        log(f"{M}x{K}x{N} {norm} {cfg}: " + (f"err {row['max_abs_err']:.3g}, {row['us']:.1f} us" if "us" in row else row["error"]))
        rows.append(row)
    return rows


def _median_us(torch, fn, iters: int = 50, reps: int = 11) -> float:
    """Median over ``reps`` of the mean CUDA-event time of ``iters`` back-to-back calls (µs)."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters * 1e3)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("M", type=int)
    parser.add_argument("K", type=int)
    parser.add_argument("N", type=int)
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--gpu", action="store_true", help="run and time every configuration on this machine's GPU")
    parser.add_argument("--norm", default="layer_norm", help="with --gpu: the post-norm variant")
    parser.add_argument("--limit", type=int, help="only the first LIMIT configurations (defaults first)")
    parser.add_argument("--json", help="with --gpu: write the rows here")
    parser.add_argument("--config", action="append", type=json.loads, metavar="JSON",
                        help='with --gpu: time this MmaConfig instead of the space, e.g. \'{"bm": 32, "bk": 32, '
                             '"warps_m": 1, "warps_n": 8, "stages": 2, "epilogue_vec": 4}\' (repeatable)')
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.gpu:
        try:
            configs = [MmaConfig(**c) for c in args.config] if args.config else None
        except TypeError as err:
            parser.error(f"--config: {err} (the fields are those of MmaConfig in tvm_comfuse/schedule/config.py)")
        rows = time_space(args.M, args.K, args.N, args.norm, args.limit, configs=configs)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                from ..bench import environment  # pylint: disable=import-outside-toplevel

                json.dump({"environment": environment(), "M": args.M, "K": args.K, "N": args.N, "norm": args.norm,
                           "rows": rows}, f, indent=1)
        good = [r for r in rows if "us" in r and r["max_abs_err"] <= 5e-2]
        best = min(good, key=lambda r: r["us"]) if good else None
        print(f"{len(rows)} configurations, {len(good)} correct; best {best['us']:.1f} us {best['config']}" if best else "none correct")
        return 0 if len(good) == len(rows) else 1
    results = build_space(args.M, args.K, args.N, args.arch)
    for cfg, err in results:
        print(f"{'ok  ' if err is None else 'FAIL'} {cfg}" + (f": {err}" if err else ""))
    failed = sum(err is not None for _, err in results)
    print(f"{len(results)} configurations, {failed} failed to build "
          f"({100 * failed / max(len(results), 1):.0f}%), {time.perf_counter() - start:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
