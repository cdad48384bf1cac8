"""Run one fused post-norm kernel a few times, for a profiler (H200 experiment, session 4).

``ncu --set detailed -k regex:main_kernel python notebooks/results/experiments/profile_kernel.py
M K N '{"bm": 32, ...}'`` shows where that configuration's time goes (throughputs of L2,
shared memory and HBM, warp stall reasons); the default configuration when none is given.
``... M K N wgmma '{"resident": false}'`` (``-k regex:postnorm``) does the same for the Hopper
kernel, its default configuration with those fields replaced (session 11).
``... M K N split '{"stage_tiles": true}' chain`` (``-k regex:gemm_elementwise``) runs the split
post-norm's GEMM kernel, its default configuration with those fields replaced, with its whole
epilogue (``stats``), the bias and residual only (``chain``) or nothing (``plain``): where the
chain's time goes (session 18: 84% over the plain GEMM at 16384 x 256 -> 1024 on the H100).
"""

import json
import sys

import torch
import tvm

from tvm_comfuse import workloads as wl
from tvm_comfuse.schedule.config import MmaConfig
from tvm_comfuse.schedule.gemm_reduce import GemmRowTile, _schedule
from tvm_comfuse.schedule.space_check import build_kernel, fused_group


def hopper(M, K, N, overrides: dict):
    """The fused Hopper post-norm of ``LayerNorm(x @ w.T + b + r)``, run three times."""
    import dataclasses  # pylint: disable=import-outside-toplevel

    from tvm_comfuse.schedule import wgmma_mainloop as wm, wgmma_postnorm as wp  # pylint: disable=import-outside-toplevel

    spec = wp.PostNorm.suite("float16", "layer_norm")
    cfg = dataclasses.replace(wp.default_config(N, M, K, spec, resident=overrides.pop("resident", False)), **overrides)
    kernel = wm.build(wp.wgmma_postnorm(M, N, K, spec, cfg))["main"]
    shapes = [(M, K), (N, K), (N,), (M, N), (N,), (N,), (M, N)]
    args = [tvm.runtime.from_dlpack(torch.randn(*s, device="cuda", dtype=torch.float16)) for s in shapes]
    for _ in range(3):
        kernel(*args)
    torch.cuda.synchronize()
    print(cfg)


def split_gemm(M, K, N, overrides: dict, epilogue: str):
    """The split post-norm's GEMM kernel for ``LayerNorm(x @ w.T + b + r)`` with ``epilogue``
    (``stats``, ``chain`` or ``plain``), run three times."""
    import dataclasses  # pylint: disable=import-outside-toplevel

    from tvm_comfuse.schedule import split_norm as sn, wgmma_mainloop as wm, wgmma_postnorm as wp  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule.wgmma_elementwise import Elementwise, wgmma_elementwise  # pylint: disable=import-outside-toplevel

    spec = wp.PostNorm.suite("float16", "layer_norm")
    cfg = dataclasses.replace(sn.config(M, N, K, spec), **overrides)
    full = sn.gemm_spec(spec)
    gspec = {"stats": full, "chain": dataclasses.replace(full, stats=""), "plain": Elementwise(full.dtype)}[epilogue]
    kernel = wm.build(wgmma_elementwise(M, N, K, gspec, cfg))["main"]
    shapes = [(M, K), (N, K)] + [(M, N) if tile else (N,) for _, tile in gspec.operands] + [(M, N)]
    args = [torch.randn(*s, device="cuda", dtype=torch.float16) for s in shapes]
    args += [torch.empty(M, N // cfg.wg_cols, 2, device="cuda")] if gspec.stats else []
    args = [tvm.runtime.from_dlpack(a) for a in args]
    for _ in range(3):
        kernel(*args)
    torch.cuda.synchronize()
    print(cfg, epilogue)


def main():
    M, K, N = (int(v) for v in (sys.argv[1:4] if len(sys.argv) > 3 else (4096, 768, 768)))
    if len(sys.argv) > 4 and sys.argv[4] == "wgmma":
        hopper(M, K, N, json.loads(sys.argv[5]) if len(sys.argv) > 5 else {})
        return
    if len(sys.argv) > 4 and sys.argv[4] == "split":
        split_gemm(M, K, N, json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}, sys.argv[6] if len(sys.argv) > 6 else "stats")
        return
    target = tvm.target.Target.from_device(tvm.cuda(0))
    func = fused_group(wl.post_norm(M, K, N, "float16", "layer_norm", linear=True), target)
    sch = tvm.s_tir.Schedule(func)
    cfg = MmaConfig(**json.loads(sys.argv[4])) if len(sys.argv) > 4 else GemmRowTile().configs(sch, target)[0]
    kernel = build_kernel(_schedule(sch, cfg), target)["main"]
    shapes = {"x": (M, K), "w": (N, K), "b": (N,), "r": (M, N), "gamma": (N,), "beta": (N,)}
    args = [tvm.runtime.from_dlpack(torch.randn(*shapes.get(p.name, (M, N)), device="cuda", dtype=torch.float16))
            for p in func.params]
    for _ in range(3):
        kernel(*args)
    torch.cuda.synchronize()
    print(cfg)


if __name__ == "__main__":
    main()
