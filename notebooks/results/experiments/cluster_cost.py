"""Where does the cluster-split kernel's time go? (H200 experiment, 2026-12-02)

Times, on one post-norm shape and the same inputs, the whole-row default, cluster-split
configurations with more warps, and the 128x192 split kernel with its statistics exchange
replaced by (a) only the two cluster barriers, (b) nothing and no cluster launch (wrong
results: timing only). Run on the GPU machine: ``python notebooks/results/experiments/cluster_cost.py``.
"""

import json
import os
import sys

import torch
import tvm

from tvm_comfuse import workloads as wl
from tvm_comfuse.schedule import cluster
from tvm_comfuse.schedule.config import MmaConfig
from tvm_comfuse.schedule.gemm_reduce import _schedule
from tvm_comfuse.schedule.space_check import _median_us, build_kernel, fused_group

M, K, N = (int(v) for v in (sys.argv[1:4] if len(sys.argv) > 3 else (4096, 768, 768)))
_real_allgather = cluster.allgather


def _variant(mode):
    """An allgather intrinsic whose body keeps only the barriers ("barrier") or nothing ("none")."""

    def allgather(dtype, count, ranks):
        name = f"comfuse_cluster_allgather_{mode}_{dtype}_{count}_x{ranks}" + ("_off" if mode == "none" else "")
        if tvm.s_tir.TensorIntrin.get(name, allow_missing=True) is None:
            body = "" if mode == "none" else (
                '  asm volatile("barrier.cluster.arrive.aligned;\\n\\tbarrier.cluster.wait.aligned;" ::: "memory");\n' * 2)
            ctype = "float" if dtype == "float32" else "half"
            cluster.register(name, dtype, count, f"__forceinline__ __device__ void {name}({ctype}* dst, {ctype}* src) {{\n{body}}}\n")
        return name

    return allgather


def main():
    target = tvm.target.Target.from_device(tvm.cuda(0))
    func = fused_group(wl.post_norm(M, K, N, "float16", "layer_norm", linear=True), target)
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device="cuda", dtype=torch.float16, generator=g)  # noqa: E731
    args = dict(zip(["x", "w", "b", "r", "gamma", "beta"], [rnd(M, K), rnd(N, K) / K**0.5, rnd(N), rnd(M, N), rnd(N), rnd(N)]))
    ref = wl.post_norm_reference([a.float().cpu().numpy() for a in args.values()], "layer_norm", linear=True)[0]
    split = dict(bm=128, bk=32, warps_m=2, warps_n=4, stages=3, splits=4)
    cases = [
        ("whole rows (default)", dict(bm=32, bk=32, warps_m=2, warps_n=8, stages=2), None),
        ("split 128x192", split, None),
        ("split 128x192, barriers only", split, "barrier"),
        ("split 128x192, no exchange, no cluster", split, "none"),
        ("split 128x192, 16 warps", dict(split, warps_m=4, warps_n=4), None),
        ("split 64x384 (S=2), 16 warps", dict(split, bm=64, warps_m=2, warps_n=8, splits=2), None),
        ("split 64x192, 16 warps", dict(split, bm=64, warps_m=4, warps_n=4), None),
        ("split 128x192, 16 warps, bk 64", dict(split, warps_m=4, warps_n=4, bk=64), None),
        ("split 128x96 (S=8), 8 warps", dict(split, warps_m=4, warps_n=2, splits=8), None),
    ]
    rows = []
    for label, cfg, mode in cases:
        cluster.allgather = _variant(mode) if mode else _real_allgather
        try:
            kernel = build_kernel(_schedule(tvm.s_tir.Schedule(func), MmaConfig(**cfg)), target)["main"]
            out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.float16)
            tvm_args = [tvm.runtime.from_dlpack(args.get(p.name, out)) for p in func.params]
            kernel(*tvm_args)
            err = float((out.float().cpu().double() - torch.from_numpy(ref)).abs().max())
            row = dict(label=label, config=cfg, max_abs_err=err, us=_median_us(torch, lambda: kernel(*tvm_args)))
        except Exception as e:  # pylint: disable=broad-except
            row = dict(label=label, config=cfg, error=str(e).strip().splitlines()[-1][:200])
        print(row, flush=True)
        rows.append(row)
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, f"cluster-cost-{M}x{K}x{N}.json"), "w", encoding="utf-8") as f:
        json.dump({"M": M, "K": K, "N": N, "gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    for r in rows:
        print(f"{r['label']:45s} {r.get('us', float('nan')):8.1f} us  err {r.get('max_abs_err', r.get('error'))}")


if __name__ == "__main__":
    main()
