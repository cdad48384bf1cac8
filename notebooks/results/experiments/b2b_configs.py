"""The b2b kernel's configurations where its default lost to eager (session 15, first H200 run:
N1 = 128 at 65536 tokens, N1 = 256 at both): deeper w2 rings (the two consumer warpgroups
share each w2 chunk, so a 2-slot ring keeps them in step and their epilogues coincide),
64-column output tiles, GEMM 1 ring depths. Device time per call, against eager, one process.
Run: ``bash .ci/gpu-run notebooks/results/experiments/b2b_configs.py`` (``$OUT/b2b-configs.json``)."""

import dataclasses

import torch

from wgmma_gemm import measure, save, timed  # the same directory: sys.path[0] when run as a script

from tvm_comfuse.schedule import wgmma_b2b as wb

F = torch.nn.functional


def main(width=1024):
    rows, gen = [], torch.Generator(device="cuda").manual_seed(0)
    for m, n1 in ((65536, 128), (16384, 256), (65536, 256), (65536, 64)):
        rnd = lambda *s: torch.randn(*s, device="cuda", dtype=torch.float16, generator=gen)  # noqa: E731
        x, w1, b1, w2, b2 = rnd(m, width), rnd(n1, width) / width**0.5, rnd(n1), rnd(width, n1) / n1**0.5, rnd(width)
        ref = F.gelu(x.float() @ w1.float().T + b1.float()) @ w2.float().T + b2.float()
        base = dict(op="mlp_gelu", M=m, K=width, N1=n1, N=width)
        rows.append(timed(dict(base, contender="eager"), lambda x=x, w1=w1, b1=b1, w2=w2, b2=b2: F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)))
        line = f"{m} x {n1}: eager {rows[-1]['kernel_us']:.1f}"
        default = wb.default_config(m, n1, width, width)
        cands = [default] + [dataclasses.replace(default, bn2=bn2, stages2=s2, stages=st)
                             for bn2 in (128, 64) for s2 in (2, 3, 4, 6) for st in (2, 3, 4)]
        seen = []
        for cfg in cands:
            if cfg in seen or wb.problems(m, n1, width, width, wb.B2B.mlp(), cfg):
                continue
            seen.append(cfg)
            row = measure(dict(base, contender="b2b", config=dataclasses.asdict(cfg)),
                          lambda c=cfg, m=m, n1=n1: wb.wgmma_b2b(m, n1, width, width, wb.B2B.mlp(), c), [x, w1, b1, w2, b2],
                          torch.empty(m, width, device="cuda", dtype=torch.float16), ref)
            rows.append(row)
            line += f" | bn2 {cfg.bn2} s2 {cfg.stages2} st {cfg.stages}: " + (f"{row['kernel_us']:.1f}" if "us" in row else "ERR")
        print(line, flush=True)
    save("b2b-configs.json", rows)


if __name__ == "__main__":
    main()
