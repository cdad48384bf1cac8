"""A few rows (batch 1 and 4 of BERT-base at sequence 128): split-K and deeper rings to fill the SMs? (issue 6)

Why: session 31 measured BERT-base at batch 1 x 128 (M = 128) on the H100: ComFuse 649.6 us against
torch.compile's 477.3. The defaults launch few CTAs for 128 rows: the post-norm's cluster kernel
slices a row over at most 8 CTAs of 64 rows (16 CTAs on 132 SMs: FFN2's post-norm 17.4 us a layer
in the model, against ~12.6 here with W hot in L2), and each CTA streams its part of W through a
4-stage ring: one CTA's loads in flight, 64 KiB, bound its bandwidth. ``WgmmaConfig.split_k`` splits
K over the CTAs of a cluster (partials pushed into rank 0's shared memory); the one-kernel split
post-norm (:mod:`tvm_comfuse.schedule.row_exchange`) is not bound to one cluster a row.

Session 32's first run (H100, W hot in L2, rank 0 *reading* its peers' partials) measured split-K
correct but no faster: 11.2 us at best for FFN2's post-norm (64 x 64 tiles, 2 splits) against the
cluster kernel's 12.6 and torch.compile's 8.4, the gather costing 1.4-3.5 us. This run pushes the
partials instead, tries 8-stage rings, and times with W cold as in the model: every call reads the
next of enough copies of w to overflow L2.

Prediction (device us, W cold): the pushed gather costs under 0.5 us; at M = 128 split-K with an
8-stage ring takes FFN2's post-norm from the cluster kernel's ~17 to ~8-10 (torch.compile ~9-10),
and the attention output's from ~8 to ~5.

Outcome (H100, session 32, commit 1e8e401, ``../session32-h100-2026-12-07/small-m-1e8e401.json``,
device us, w cold): correct everywhere (after the timing's launches too). FFN2's post-norm 10.3
on 64 x 64 tiles split 4 ways on 8 stages (cluster kernel 18.3, torch.compile 10.1, cuBLAS's
GEMM alone 7.0; no split on 8 stages 12.8, split 4 on 4 stages 11.3); the attention output's
7.8 at best (64 x 128, no split, 8 stages; cluster kernel 8.2, torch.compile 6.8): refuted
there. The plain GEMMs gained from the deeper ring more than from splits: 128 x 768 -> 768 3.9
on 64 x 64 x 8 stages against 5.3 for the default's 64 x 128 x 4 (cuBLAS 3.8), split 4: 4.7;
128 x 768 -> 3072 4.4 against 5.8 (cuBLAS 4.7). The defaults now follow
(:func:`tvm_comfuse.schedule.wgmma_elementwise.split_config`, ``deeper``).

Session 33 (H100, commit 53cfdf7, ``../session33-h100-2026-12-07/small-m-53cfdf7.json``): the
cluster post-norm kernel on 8 stages (its default since session 32) against 4: FFN2's 12.4
against 17.5, the attention output's 7.1 against 8.1 (torch.compile 6.8); the rest as before
within 0.1 us. In BERT-base at batch 1 that left 14 us to torch.compile (492.4 against 478.4),
mostly FFN2's post-norm (10.3 a layer against cuBLAS's GEMM 5.7 + Triton's LayerNorm 1.6 in
torch.compile's graph) and attention (4.75 against cuDNN's 4.15). Added since: FFN2's GEMM
alone (how much of its post-norm's 10.3 is the epilogue) and the attention kernel on 64 query
rows a CTA (``Attention.q_rows``: 24 CTAs at batch 1 where 128 rows make 12). Prediction:
FFN2's GEMM alone ~7-8 on our best tile (the exchange and norm ~2.5-3 of the 10.3); attention
at batch 1 ~3.5 on 64 rows against ~4.5 on 128 (PyTorch's ~4.1), at batch 4 no gain.

Session 34 (H100, commit b93472b, ``../session34-h100-2026-12-08/small-m-b93472b.json``; the
call's 150 s limit cut it in the GEMM section, before FFN2's GEMM alone): attention on 64 rows
3.30 us against 4.76 on 128 at batch 1 (PyTorch 4.73), 3.74 against 5.03 at batch 4 (PyTorch
4.97). Batch 1's prediction held; batch 4's "no gain" was refuted (26% faster: 96 CTAs of one
warpgroup against 48 of two). The default since takes 64 rows where 128-row CTAs fill at most
half the SMs (``Attention.rows``). The post-norm rows repeat session 33's within 0.5 us.

Contenders per post-norm shape, one process, the same inputs, correctness checked first:
cuBLAS's GEMM alone, torch.compile, the cluster kernel's default, the one-kernel split form per
tile; per plain GEMM shape: cuBLAS and the wgmma GEMM per tile; per attention shape: PyTorch's
``scaled_dot_product_attention`` and the fused kernel on 128 and 64 query rows a CTA.

Run: ``bash .ci/gpu-run notebooks/results/experiments/small_m.py`` (``$OUT/small-m.json``).
"""

import dataclasses
import itertools

import torch
import tvm

from wgmma_gemm import build, error_text, save, timed  # the same directory: sys.path[0] when run as a script

from tvm_comfuse.schedule import split_norm as sn
from tvm_comfuse.schedule.wgmma_attention import Attention, wgmma_attention
from tvm_comfuse.schedule.wgmma_elementwise import Elementwise, problems as ew_problems, wgmma_elementwise
from tvm_comfuse.schedule.wgmma_mainloop import WgmmaConfig
from tvm_comfuse.schedule.wgmma_postnorm import PostNorm, default_config as pn_default, problems as pn_problems, wgmma_postnorm

#: post-norm (M, K, N): BERT-base's FFN2 and attention output at batch 1, sequence 128
POSTNORM = [(128, 3072, 768), (128, 768, 768)]
#: plain GEMM (M, K, N): FFN2's GEMM alone (what its post-norm's epilogue costs beyond it; first:
#: unmeasured, a call's limit cut the GEMM section in session 34), the Q/K/V projections and FFN1
#: at batch 1
GEMMS = [(128, 3072, 768), (128, 768, 768), (128, 768, 3072)]
#: attention (batch, heads, sequence, head dim): BERT-base at batch 1 and 4
ATTENTION = [(1, 12, 128, 64), (4, 12, 128, 64)]
#: (column tile, split-K CTAs, most stages) tried, 64 rows each: post-norms, plain GEMMs
TILES = [(bn, s, st) for bn in (128, 64) for s in (1, 2, 4, 8) for st in (4, 8)] + [(192, 1, 4), (192, 2, 8)]
GEMM_TILES = [(bn, s, st) for bn in (128, 64, 32) for s in (1, 2, 4) for st in (4, 8)]
#: bytes of weight copies cycled through: more than the 50 MiB L2, so every call reads w from HBM
COLD_BYTES = 160 * 2**20


def configs(m, n, k, tiles, fits):
    """The distinct configurations :func:`ring` gives for ``tiles``."""
    return list(dict.fromkeys(c for bn, split, most in tiles for c in [ring(m, n, k, bn, split, most, fits)] if c is not None))


def ring(m, n, k, bn, split, most, fits):
    """The deepest ring (up to ``most`` stages, bk 64 then 32, no more stages than a split's K
    steps) on which ``fits(cfg)`` holds for a 64 x ``bn`` tile over ``split`` CTAs, or None."""
    for bk in (64, 32):
        steps = k // split // bk
        for stages in range(min(most, steps), 1, -1):
            cfg = WgmmaConfig(64, bn, stages, bk, split_k=split)
            if fits(cfg):
                return cfg
    return None


def copies(w):
    """``w`` and copies of it, together over :data:`COLD_BYTES`."""
    return [w] + [w.clone() for _ in range(COLD_BYTES // (w.numel() * w.element_size()))]


def cycling(fn, arg_sets):
    """A call of ``fn(*args)`` on the next of ``arg_sets`` each time."""
    it = itertools.cycle(arg_sets)
    return lambda: fn(*next(it))


def run(row, fn, arg_sets, out, ref):
    """Check ``fn`` on the first arguments (``out`` NaN-filled first) against ``ref``, then time it
    cycling through all of them (and check again: the exchange's barrier words after hundreds of
    launches); records errors in ``row``, prints one line."""
    try:
        errors = []
        for phase in ("before", "after"):
            out.fill_(float("nan"))
            fn(*arg_sets[0])
            torch.cuda.synchronize()
            errors.append(float((out.float() - ref).abs().max()))
            if phase == "before":
                timed(row, cycling(fn, arg_sets))
        row.update(max_abs_err=errors[0], max_abs_err_after_timing=errors[1])
    except Exception as err:  # pylint: disable=broad-except
        row["error"] = error_text(err)
    text = f"{row['kernel_us']:.1f} (err {row['max_abs_err']:.2g}/{row['max_abs_err_after_timing']:.2g})" if "kernel_us" in row else row["error"][:120]
    print(f"  {row['contender']} {row.get('config', '')}: {text}", flush=True)
    return row


def postnorm(rows, gen):
    f = torch.nn.functional
    rnd = lambda *s: torch.randn(*s, device="cuda", dtype=torch.float16, generator=gen)  # noqa: E731
    spec = PostNorm.suite("float16")
    for m, k, n in POSTNORM:
        x, w, b, r, g, be = rnd(m, k), rnd(n, k) / k**0.5, rnd(n), rnd(m, n), rnd(n), rnd(n)
        ref = f.layer_norm(x.float() @ w.float().T + b.float() + r.float(), (n,), g.float(), be.float())
        ws = copies(w)
        base = dict(M=m, K=k, N=n, dtype="float16", op="layer_norm", w_copies=len(ws))
        print(f"{m}x{k}x{n} post-norm ({len(ws)} copies of w):", flush=True)
        out = torch.empty(m, n, device="cuda", dtype=torch.float16)
        cublas = lambda w_: torch.matmul(x, w_.T, out=out)  # noqa: E731,B023
        rows.append(timed(dict(base, contender="cublas_gemm_alone"), cycling(cublas, [(w_,) for w_ in ws])))
        print(f"  cublas_gemm_alone: {rows[-1]['kernel_us']:.1f}", flush=True)
        compiled = torch.compile(lambda a, w_: f.layer_norm(f.linear(a, w_, b) + r, (n,), g, be), dynamic=False)  # noqa: B023
        rows.append(run(dict(base, contender="inductor"), lambda a, w_: out.copy_(compiled(a, w_)), [(x, w_) for w_ in ws], out, ref))
        tv = lambda *ts: [tvm.runtime.from_dlpack(t) for t in ts]  # noqa: E731
        if not pn_problems(m, n, k, spec):  # the default (8 stages since session 32's runs), and on session 31's 4
            default = pn_default(n, m, k, spec)
            for name, cfg in (("cluster_default", default), ("cluster_s4", dataclasses.replace(default, stages=4))):
                kernel = build(wgmma_postnorm(m, n, k, spec, cfg))["main"]
                rows.append(run(dict(base, contender=name, config=dict(bn=cfg.bn, stages=cfg.stages, bk=cfg.bk)), kernel,
                                [tv(x, w_, b, r, g, be, out) for w_ in ws], out, ref))
        for cfg in configs(m, n, k, TILES, lambda c: not sn.exchange_problems(m, n, k, spec, c)):  # noqa: B023
            bn, split = cfg.bn, cfg.split_k
            row = dict(base, contender=f"exchange_bn{bn}_k{split}_s{cfg.stages}", config=dict(bn=bn, split_k=split, stages=cfg.stages, bk=cfg.bk))
            try:
                kernel = build(sn.exchange_kernel(m, n, k, spec, cfg))["main"]
            except Exception as err:  # pylint: disable=broad-except
                rows.append(dict(row, error=error_text(err)))
                print(f"  {row['contender']}: {rows[-1]['error']}", flush=True)
                continue
            flags = torch.zeros(sn.flags_shape(m, n, k, spec, cfg), device="cuda", dtype=torch.int32)
            stats = torch.empty(m, n // cfg.wg_cols, 2, device="cuda")
            rows.append(run(row, kernel, [tv(x, w_, b, r, g, be, flags, out, stats) for w_ in ws], out, ref))
        save("small-m.json", rows)


def gemms(rows, gen):
    for m, k, n in GEMMS:
        a = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=gen)
        b = torch.randn(n, k, device="cuda", dtype=torch.float16, generator=gen) / k**0.5
        ref = a.float() @ b.float().T
        bs = copies(b)
        base = dict(M=m, K=k, N=n, dtype="float16", op="gemm", w_copies=len(bs))
        print(f"{m}x{k}x{n} gemm ({len(bs)} copies of w):", flush=True)
        c = torch.empty(m, n, device="cuda", dtype=torch.float16)
        rows.append(run(dict(base, contender="cublas"), lambda b_: torch.matmul(a, b_.T, out=c), [(b_,) for b_ in bs], c, ref))  # noqa: B023
        for cfg in configs(m, n, k, GEMM_TILES, lambda c_: not ew_problems(m, n, k, Elementwise(), c_)):  # noqa: B023
            bn, split = cfg.bn, cfg.split_k
            row = dict(base, contender=f"wgmma_bn{bn}_k{split}_s{cfg.stages}", config=dict(bn=bn, split_k=split, stages=cfg.stages, bk=cfg.bk))
            try:
                kernel = build(wgmma_elementwise(m, n, k, Elementwise(), cfg))["main"]
            except Exception as err:  # pylint: disable=broad-except
                rows.append(dict(row, error=error_text(err)))
                continue
            rows.append(run(row, kernel, [[tvm.runtime.from_dlpack(t) for t in (a, b_, c)] for b_ in bs], c, ref))
        save("small-m.json", rows)


def attention(rows, gen):
    """The fused attention on 128 and 64 query rows a CTA against PyTorch's fused attention (the
    kernel torch.compile's graph calls), on q, k, v as BERT's projections write them."""
    for b, h, s, d in ATTENTION:
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16, generator=gen) for _ in range(3))
        qh, kh, vh = (t.permute(0, 2, 1, 3) for t in (q, k, v))
        ref = (torch.softmax(qh.float() @ kh.float().transpose(-1, -2) * 0.125, -1) @ vh.float()).permute(0, 2, 1, 3).reshape(b * s, h * d)
        out = torch.empty(b * s, h * d, device="cuda", dtype=torch.float16)
        base = dict(batch=b, heads=h, seq=s, head_dim=d, dtype="float16", op="attention")
        print(f"attention {b} x {h} x {s} x {d}:", flush=True)
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qh, kh, vh)  # noqa: E731,B023
        err = float((sdpa().float().permute(0, 2, 1, 3).reshape(b * s, h * d) - ref).abs().max())
        rows.append(timed(dict(base, contender="torch_sdpa", max_abs_err=err), sdpa))  # its output in [B, H, S, D]: no copy timed
        print(f"  torch_sdpa: {rows[-1]['kernel_us']:.1f} (err {err:.2g})", flush=True)
        vt = v.permute(0, 2, 3, 1).contiguous().reshape(b * h * d, s)
        args = [tvm.runtime.from_dlpack(t) for t in (q.reshape(b * s, h * d), k.reshape(b * s, h * d), vt, out)]
        for q_rows in (128, 64):
            kernel = build(wgmma_attention(Attention(b, h, s, d, q_rows=q_rows)))["main"]
            rows.append(run(dict(base, contender=f"wgmma_rows{q_rows}", config=dict(q_rows=q_rows)), kernel, [args], out, ref))
        save("small-m.json", rows)


def main():
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    attention(rows, gen)
    postnorm(rows, gen)
    gemms(rows, gen)


if __name__ == "__main__":
    main()
