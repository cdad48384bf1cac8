"""What GELU costs in the fused kernels, with CUDA's ``erff`` and with ``chain.gelu`` (session 27).

Why: issue 5's one losing MLP shape, 65536 x 1024 -> 256 -> 1024, trails torch.compile by 1-5%
(session 26), and there the b2b kernel without its GELU took 166.8 against 178.3 us: the GELU,
computed by both consumer warpgroups while the tensor cores wait, costs 6.5%. Its SASS was
CUDA's ``erff`` (two ranges' coefficients picked per value: 9 FSELs) in TVM's legalised form,
24 instructions a value. ``chain.gelu`` computes ``v * Phi(v)`` from Abramowitz & Stegun
7.1.28's ``erfc`` (``0.5 / p(|v|)^16``, one MUFU.RCP): 15 a value; the section between GEMM 1's
last wgmma and GEMM 2's first went from 3,579 to 2,482 instructions a thread (625 without any
GELU). The same chain is FFN1's epilogue (the GEMM + elementwise kernel) in BERT.

Prediction: where the GELU is exposed the kernel gains what its instructions lose: at 65536 x
256 ~4 us (178 -> ~174: level with eager and torch.compile, not clearly ahead); at 65536 x 64
and 128 ~1-2 us; FFN1 (GEMM + bias + GELU) 1-4% where its epilogue is exposed. Errors unchanged
within the fp16 rounding (max abs error against the fp32 reference).

Run on the GPU: ``bash .ci/gpu-run notebooks/results/experiments/gelu_cost.py`` (writes
``$OUT/gelu-cost.json``). Same inputs for every contender; correctness checked before timing.

Outcome (H100, session 27, ``session27-h100-2026-12-07/gelu-cost-ab01816.json``): held in
direction, larger than predicted. The GELU's cost halved at 65536 x 256 (179.0 -> 171.3 us; 163.7
without it; eager 172.3, torch.compile 179.7), 1-3 us at the other MLP shapes, FFN1 9-12% faster
(BERT-large's 74.2 -> 66.4 us). Errors unchanged to three digits.
"""

import contextlib

import torch

from wgmma_gemm import measure, save, timed  # the same directory: sys.path[0] when run as a script

from tvm_comfuse import bench
from tvm_comfuse.schedule import chain, wgmma_b2b as wb, wgmma_elementwise as we
from tvm_comfuse.schedule.chain import Step
from tvm.script import tirx as T

F = torch.nn.functional
MLP = ((65536, 256), (16384, 256), (65536, 128), (65536, 64))
#: M, K, N of FFN1 (GEMM + bias + GELU): BERT-large's and BERT-base's at 4096 tokens, BERT-large's at 16384
FFN1 = ((4096, 1024, 4096), (4096, 768, 3072), (16384, 1024, 4096))


@contextlib.contextmanager
def erff_gelu():
    """Kernels built inside use TVM's legalised GELU, ``v * (0.5 + erf(v / sqrt 2) * 0.5)``."""
    mine = chain.gelu
    chain.gelu = lambda v: v * (T.float32(0.5) + T.erf(v * T.float32(0.5**0.5)) * T.float32(0.5))
    try:
        yield
    finally:
        chain.gelu = mine


def variants(make_gelu, make_plain):
    """``(label, make, ref key)``: the kernel with ``chain.gelu``, with ``erff``, without GELU."""
    def with_erff():
        with erff_gelu():
            return make_gelu()
    return [("gelu", make_gelu, "ref"), ("erff gelu", with_erff, "ref"), ("no gelu", make_plain, "plain")]


def mlp(rows, gen, width=1024):
    for m, n1 in MLP:
        rnd = lambda *s: torch.randn(*s, device="cuda", dtype=torch.float16, generator=gen)  # noqa: E731
        x, w1, b1, w2, b2 = rnd(m, width), rnd(n1, width) / width**0.5, rnd(n1), rnd(width, n1) / n1**0.5, rnd(width)
        refs = dict(ref=F.gelu(x.float() @ w1.float().T + b1.float()) @ w2.float().T + b2.float(),
                    plain=F.linear(F.linear(x.float(), w1.float(), b1.float()).half().float(), w2.float(), b2.float()))
        base = dict(op="mlp_gelu", M=m, K=width, N1=n1, N=width)
        eager = lambda x=x, w1=w1, b1=b1, w2=w2, b2=b2: F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)  # noqa: E731
        compiled = bench._torch_compile(torch, lambda a, w1=w1, b1=b1, w2=w2, b2=b2: F.linear(F.gelu(F.linear(a, w1, b1)), w2, b2),
                                        dynamic=False)  # pylint: disable=protected-access
        line = f"MLP {m} x {width} -> {n1}:"
        for name, fn in (("eager", eager), ("inductor", lambda x=x, c=compiled: c(x))):
            rows.append(timed(dict(base, contender=name, max_abs_err=float((fn().float() - refs["ref"]).abs().max())), fn))
            line += f" {name} {rows[-1]['kernel_us']:.1f}"
        print(line, flush=True)
        cfg = wb.default_config(m, n1, width, width)
        for label, make, key in variants(lambda: wb.wgmma_b2b(m, n1, width, width, wb.B2B.mlp(), cfg),  # noqa: B023
                                         lambda: wb.wgmma_b2b(m, n1, width, width, wb.B2B.mlp(act=None), cfg)):  # noqa: B023
            row = measure(dict(base, contender=f"b2b {label}"), make, [x, w1, b1, w2, b2],
                          torch.empty(m, width, device="cuda", dtype=torch.float16), refs[key])
            rows.append(row)
            print(f"  {label}: " + (f"{row['kernel_us']:.1f} us, err {row['max_abs_err']:.3g}" if "us" in row else row["error"]),
                  flush=True)
        save("gelu-cost.json", rows)  # after each shape: a cut call keeps what was measured


def ffn1(rows, gen):
    cast = (Step("cast", "float16"), Step("cast", "float32"), Step("add", "float32", 0))
    gelu = we.Elementwise("float16", cast + (Step("gelu", "float32"), Step("cast", "float16")), (("float32", False),), "float16")
    plain = we.Elementwise("float16", cast + (Step("cast", "float16"),), (("float32", False),), "float16")
    for m, k, n in FFN1:
        x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=gen)
        w = torch.randn(n, k, device="cuda", dtype=torch.float16, generator=gen) / k**0.5
        b = torch.randn(n, device="cuda", generator=gen)
        refs = dict(plain=x.float() @ w.float().T + b)
        refs["ref"] = F.gelu(refs["plain"])
        base, bh = dict(op="ffn1_gelu", M=m, K=k, N=n), b.half()
        eager = lambda x=x, w=w, bh=bh: F.gelu(F.linear(x, w, bh))  # noqa: E731
        compiled = torch.compile(eager, dynamic=False)
        line = f"FFN1 {m} x {k} -> {n}:"
        for name, fn in (("cublas_gemm_alone", lambda x=x, w=w: torch.matmul(x, w.T)), ("eager", eager), ("inductor", compiled)):
            rows.append(timed(dict(base, contender=name, max_abs_err=float((fn().float() - refs["ref"]).abs().max())), fn))
            line += f" {name} {rows[-1]['kernel_us']:.1f}"
        print(line, flush=True)
        cfg = we.default_config(m, n, k, gelu)
        for label, make, key in variants(lambda: we.wgmma_elementwise(m, n, k, gelu, cfg),  # noqa: B023
                                         lambda: we.wgmma_elementwise(m, n, k, plain, cfg)):  # noqa: B023
            row = measure(dict(base, contender=f"elementwise {label}"), make, [x, w, b],
                          torch.empty(m, n, device="cuda", dtype=torch.float16), refs[key])
            rows.append(row)
            print(f"  {label}: " + (f"{row['kernel_us']:.1f} us, err {row['max_abs_err']:.3g}" if "us" in row else row["error"]),
                  flush=True)
        save("gelu-cost.json", rows)


def main():
    rows, gen = [], torch.Generator(device="cuda").manual_seed(0)
    mlp(rows, gen)
    ffn1(rows, gen)


if __name__ == "__main__":
    main()
