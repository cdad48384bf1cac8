"""Persistent CTAs and ping-pong consumers for the GEMM + elementwise kernel (issues 6 and 8).

Why: at BERT-large (batch 32 x 128) FFN1 + GELU took 80 us a layer on the H200 (session 15),
torch.compile's cuBLAS GEMM + Triton GELU ~55, and that layer is most of the 1.10x by which
ComFuse trails torch.compile end to end. The kernel gives each CTA one 128 x 256 tile: every
tile fills an empty ring, and its epilogue (the chain, GELU's erf on 128 values a thread, the
staged stores) runs while the tensor cores idle. FFN1 at BERT-base does 12 K steps a tile; by
the per-SM peak a tile's wgmmas take ~6.7 us, and a wave of tiles took 16.
Two schedules, one switch each in ``WgmmaConfig``:

- ``persistent``: one CTA an SM loops over tiles ``bx, bx + grid, ...``; the producer runs into
  the next tile's K steps while the consumers finish this one (the fill is hidden, the epilogue
  is not); each consumer warpgroup stages its output in a buffer of its own beside the ring.
- ``pingpong``: the same, with two consumer warpgroups taking alternate 64-row tiles whose
  mainloops run in turn, so one's epilogue runs beside the other's wgmmas (CUTLASS's ping-pong;
  the post-norm kernel's resident-W form won 7-16% in session 13). Its cost: a 64-row tile
  reads its W slice from L2 once per 64 rows, twice as often as a 128-row tile.

Prediction (device time, all correct with the default's error): FFN1 at BERT-base from ~48 to
35-42 us with ping-pong (under eager's ~48 and torch.compile's ~54), at BERT-large from ~80 to
55-65; persistent alone 3-8% faster than the default; the projections (one wave of tiles, N =
768) unchanged within 5% or slower (nothing to overlap); the plain 4096^3 GEMM within 5% of
the default (epilogue-light).

Run: ``bash .ci/gpu-run notebooks/results/experiments/persistent_gemm.py`` (``$OUT/persistent-gemm.json``).
"""

import dataclasses

import torch

from wgmma_gemm import measure, save, timed  # the same directory: sys.path[0] when run as a script

from tvm_comfuse.schedule import wgmma_elementwise as we
from tvm_comfuse.schedule.chain import Step
from tvm_comfuse.schedule.wgmma_mainloop import WgmmaConfig

F = torch.nn.functional
GELU = (Step("cast", "float16"), Step("cast", "float32"), Step("add", "float32", 0), Step("gelu", "float32"), Step("cast", "float16"))
BIAS = (Step("cast", "float16"), Step("cast", "float32"), Step("add", "float32", 0), Step("cast", "float16"))
#: M, K, N, the chain: BERT-large's and BERT-base's FFN1, their projections (row-major), a plain GEMM
SHAPES = [(4096, 1024, 4096, GELU), (4096, 768, 3072, GELU), (4096, 1024, 1024, BIAS), (4096, 768, 768, BIAS), (4096, 4096, 4096, ())]
#: the schedules besides the default: (bm, bn, bk, persistent, pingpong), each on its deepest ring
VARIANTS = [(128, 256, 64, True, False), (128, 256, 32, True, False), (64, 256, 64, False, True), (64, 256, 32, False, True),
            (64, 128, 64, False, True), (64, 192, 64, False, True), (128, 128, 64, True, False)]


def deepest(m, n, k, spec, bm, bn, bk, persistent, pingpong):
    """The configuration on the deepest ring (up to 8 stages) that the kernel takes with its
    output staged (TMA stores), or None."""
    for stages in range(8, 1, -1):
        cfg = WgmmaConfig(bm, bn, stages, bk, persistent=persistent, pingpong=pingpong)
        if not we.problems(m, n, k, spec, cfg) and we.stages_output(spec, cfg):
            return cfg
    return None


def main():
    rows, gen = [], torch.Generator(device="cuda").manual_seed(0)
    for m, k, n, steps in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=gen)
        w = torch.randn(n, k, device="cuda", dtype=torch.float16, generator=gen) / k**0.5
        b = torch.randn(n, device="cuda", generator=gen)
        act = (lambda v: F.gelu(v)) if steps == GELU else (lambda v: v)  # noqa: E731
        ref = act(x.float() @ w.float().T + (b if steps else 0))
        spec = we.Elementwise("float16", steps, (("float32", False),) if steps else (), "float16")
        inputs = [x, w, b] if steps else [x, w]
        base = dict(op="gelu" if steps == GELU else "bias" if steps else "gemm", M=m, K=k, N=n)
        bh = b.half()
        eager = (lambda: F.gelu(F.linear(x, w, bh))) if steps == GELU else (lambda: F.linear(x, w, bh)) if steps else (lambda: x @ w.T)
        compiled = torch.compile(eager, dynamic=False)
        line = f"{m}x{k}->{n} {base['op']}:"
        for name, fn in (("cublas_gemm_alone", lambda: torch.matmul(x, w.T)), ("eager", eager), ("inductor", compiled)):
            err = float((fn().float() - ref).abs().max())
            rows.append(timed(dict(base, contender=name, max_abs_err=err), fn))
            line += f" {name} {rows[-1]['kernel_us']:.1f}"
        print(line, flush=True)
        out = torch.empty(m, n, device="cuda", dtype=torch.float16)
        cfgs = [we.default_config(m, n, k, spec)] + [deepest(m, n, k, spec, *v) for v in VARIANTS]
        for cfg in dict.fromkeys(c for c in cfgs if c is not None):
            row = measure(dict(base, contender="wgmma_elementwise", config=dataclasses.asdict(cfg), default=cfg == cfgs[0]),
                          lambda c=cfg: we.wgmma_elementwise(m, n, k, spec, c), inputs, out, ref)
            rows.append(row)
            kind = "pingpong" if cfg.pingpong else "persistent" if cfg.persistent else "default" if cfg == cfgs[0] else "one tile"
            print(f"  {kind} {cfg.bm}x{cfg.bn} s{cfg.stages} bk{cfg.bk}: "
                  + (f"{row['kernel_us']:.1f} us, err {row['max_abs_err']:.3g}" if "us" in row else row["error"]), flush=True)
        save("persistent-gemm.json", rows)


if __name__ == "__main__":
    main()
