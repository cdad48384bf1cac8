"""The opt-in Hopper kernels of sessions 14 and 15 against PyTorch, at BERT-base's and issue 5's shapes (issues 5 and 6).

Written without a GPU: the GEMM + elementwise kernel (``schedule/wgmma_elementwise.py``) and
the fused attention (``schedule/wgmma_attention.py``). Each is checked against a float32
PyTorch reference, then timed beside the PyTorch kernels doing the same work, same inputs, one
process (``kernel_us``: profiler device time per call):

- FFN1, ``gelu(x @ w.T + b)`` at 4096x768 -> 3072: cuBLAS's GEMM alone, eager, torch.compile,
  and ComFuse's kernel (fp32 bias, GELU in fp32, fp16 out, as the imported graph computes).
- A projection writing attention's head layout, ``(x @ w.T + b)`` -> ``[B * H, S, D]`` in fp16
  (K: ``[B * H, D, S]``): cuBLAS's GEMM alone, eager (linear, view, transpose, contiguous) and
  ComFuse's kernel in both layouts.
- Attention at batch 32, 12 heads, 128 keys of 64: eager (matmul, softmax, matmul), PyTorch's
  ``scaled_dot_product_attention`` (flash on the H200), torch.compile, ComFuse's kernel; then
  issue 5's shapes (batch x heads 256, 128 to 1024 keys).

Prediction: all correct. FFN1 at 0.75-0.85x of cuBLAS's GEMM alone (the plain wgmma GEMM's
0.77x at 4096^3) and under torch.compile's GEMM + GELU; the projections within 1.1x of cuBLAS's
GEMM alone (their layout costs only scattered stores); attention within 2x of PyTorch's flash
kernel (it is one CTA per 128 queries of a head, 384 CTAs for 132 SMs) and 5x under eager; at
1024 keys within 2.5x of flash (each key block's second GEMM waits for its first: no overlap).

Session 15: the back-to-back GEMM kernel rebuilt (``schedule/wgmma_b2b.py``: TMA-stored output,
persistent CTAs fed by two rings) at issue 5's MLP shapes, ``gelu(x @ w1.T + b1) @ w2.T + b2``
with 16384 and 65536 tokens of width 1024 and an intermediate of 64, 128 or 256: two cuBLAS
GEMMs alone (the GEMMs' floor), eager, torch.compile, the kernel's default and its variants
(persistent or not, 64-row blocks). Session 8's kernel took 151, 163 and 193 us at 65536
tokens where eager took 101, 111 and 167. Prediction: all correct; the default under eager at
every shape; at 65536 tokens within 1.2x of moving x and out once at 4 TB/s (67 us) for N1 = 64
and 128, and at N1 = 256 (69 GFLOP) 125-150 us; persistence worth 10-20% at N1 <= 128. FFN1
with its output staged and TMA-stored (the default since session 15) 5-15% faster than with
each thread storing its accumulators (``register_stores``).

Run on the GPU: ``bash .ci/gpu-run notebooks/results/experiments/hopper_opt_in.py`` (writes
``$OUT/hopper-opt-in.json``).
"""

import torch
import tvm

from wgmma_gemm import measure, save, timed  # the same directory: sys.path[0] when run as a script

import dataclasses

from tvm_comfuse.schedule import wgmma_attention as wa
from tvm_comfuse.schedule import wgmma_b2b as wb
from tvm_comfuse.schedule import wgmma_elementwise as we
from tvm_comfuse.schedule.chain import Step

B, S, H, D = 32, 128, 12, 64
M, HID, INTER = B * S, H * D, 4 * H * D
F = torch.nn.functional


def _row(rows, base, name, fn, ref=None):
    err = None if ref is None else float((fn().float() - ref).abs().max())
    rows.append(timed(dict(base, contender=name, max_abs_err=err), fn))
    print(f"  {name}: {rows[-1]['kernel_us']:.1f} us device" + (f", err {err:.3g}" if err is not None else ""), flush=True)


def _ours(rows, base, name, make, inputs, out, ref):
    row = measure(dict(base, contender=name), make, inputs, out, ref)
    rows.append(row)
    print(f"  {name}: " + (f"{row['kernel_us']:.1f} us device, err {row['max_abs_err']:.3g}" if "us" in row else row["error"]), flush=True)


def ffn1(rows, gen):
    x = torch.randn(M, HID, device="cuda", dtype=torch.float16, generator=gen)
    w = torch.randn(INTER, HID, device="cuda", dtype=torch.float16, generator=gen) / HID**0.5
    b = torch.randn(INTER, device="cuda", generator=gen)
    ref = F.gelu(x.float() @ w.float().T + b)
    base = dict(op="ffn1_gelu", M=M, K=HID, N=INTER)
    print(f"FFN1 {M}x{HID}->{INTER}", flush=True)
    bh = b.half()
    compiled = torch.compile(lambda a: F.gelu(F.linear(a, w, bh)), dynamic=False)
    _row(rows, base, "cublas_gemm_alone", lambda: torch.matmul(x, w.T))
    _row(rows, base, "eager", lambda: F.gelu(F.linear(x, w, bh)), ref)
    _row(rows, base, "inductor", lambda: compiled(x), ref)
    spec = we.Elementwise("float16", (Step("cast", "float16"), Step("cast", "float32"), Step("add", "float32", 0),
                                      Step("gelu", "float32"), Step("cast", "float16")), (("float32", False),), "float16")
    out = torch.empty(M, INTER, device="cuda", dtype=torch.float16)
    _ours(rows, base, "comfuse_wgmma_elementwise", lambda: we.wgmma_elementwise(M, INTER, HID, spec), [x, w, b], out, ref)
    _ours(rows, base, "comfuse_wgmma_elementwise_register_stores", lambda: we.wgmma_elementwise(M, INTER, HID, spec, stage=False),
          [x, w, b], out, ref)


def projections(rows, gen):
    x = torch.randn(M, HID, device="cuda", dtype=torch.float16, generator=gen)
    w = torch.randn(HID, HID, device="cuda", dtype=torch.float16, generator=gen) / HID**0.5
    b = torch.randn(HID, device="cuda", generator=gen)
    y = (x.float() @ w.float().T + b).reshape(B, S, H, D)
    bh = b.half()
    steps = (Step("cast", "float16"), Step("cast", "float32"), Step("add", "float32", 0), Step("cast", "float16"))
    for name, axes, perm in (("q_heads", (0, 2, 1, 3), (0, 2, 1, 3)), ("k_heads_transposed", (0, 2, 3, 1), (0, 2, 3, 1))):
        ref = y.permute(*perm).reshape(B * H, *([S, D] if name == "q_heads" else [D, S]))
        base = dict(op=f"projection_{name}", M=M, K=HID, N=HID)
        print(f"projection -> {name}", flush=True)
        _row(rows, base, "cublas_gemm_alone", lambda: torch.matmul(x, w.T))
        _row(rows, base, "eager", lambda p=perm: F.linear(x, w, bh).reshape(B, S, H, D).permute(*p).contiguous(), ref.reshape(B, H, *ref.shape[1:]))
        shape = tuple(ref.shape)
        spec = we.Elementwise("float16", steps, (("float32", False),), "float16", ((B, S, H, D), axes, shape))
        out = torch.empty(shape, device="cuda", dtype=torch.float16)
        _ours(rows, base, "comfuse_wgmma_elementwise", lambda s=spec: we.wgmma_elementwise(M, HID, HID, s, lead=(B, S)),
              [x.reshape(B, S, HID), w, b], out, ref)


def attention(rows, gen, b=B, h=H, s=S, d=D, inductor=True):
    m, hid = b * s, h * d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16, generator=gen) for _ in range(3))
    qh, kh, vh = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    ref = (torch.softmax(qh.float() @ kh.float().transpose(-1, -2) * 0.125, -1) @ vh.float()).permute(0, 2, 1, 3).reshape(m, hid)
    base = dict(op="attention", B=b, S=s, H=h, D=d)
    print(f"attention b{b} h{h} s{s} d{d}", flush=True)

    def eager():
        p = torch.softmax((qh @ kh.transpose(-1, -2)).float() * 0.125, -1).half()
        return (p @ vh).permute(0, 2, 1, 3).reshape(m, hid)

    _row(rows, base, "eager", eager, ref)
    _row(rows, base, "sdpa", lambda: F.scaled_dot_product_attention(qh, kh, vh).permute(0, 2, 1, 3).reshape(m, hid), ref)
    if inductor:
        _row(rows, base, "inductor", torch.compile(eager, dynamic=False), ref)
    vt = v.permute(0, 2, 3, 1).contiguous().reshape(b * h * d, s)
    out = torch.empty(m, hid, device="cuda", dtype=torch.float16)
    _ours(rows, base, "comfuse_wgmma_attention", lambda: wa.wgmma_attention(wa.Attention(b, h, s, d)),
          [q.reshape(m, hid), k.reshape(m, hid), vt], out, ref)


def issue5_attention(rows, gen):
    """Issue 5's attention shapes: head dim 64, batch x heads 256, 128 to 1024 keys (key blocks
    of 128 with the online softmax beyond 128)."""
    for s in (128, 256, 512, 1024):
        attention(rows, gen, 32, 8, s, 64, inductor=False)


def mlp(rows, gen, width=1024):
    """Issue 5's MLPs on the b2b kernel: its default, the default not persistent (or persistent
    where it is not), 64-row blocks."""
    for m in (16384, 65536):
        for n1 in (64, 128, 256):
            rnd = lambda *s: torch.randn(*s, device="cuda", dtype=torch.float16, generator=gen)  # noqa: E731
            x, w1, b1, w2, b2 = rnd(m, width), rnd(n1, width) / width**0.5, rnd(n1), rnd(width, n1) / n1**0.5, rnd(width)
            ref = F.gelu(x.float() @ w1.float().T + b1.float()) @ w2.float().T + b2.float()
            h = F.gelu(F.linear(x, w1, b1))
            base = dict(op="mlp_gelu", M=m, K=width, N1=n1, N=width)
            print(f"MLP {m}x{width} -> {n1} -> {width}", flush=True)
            _row(rows, base, "cublas_two_gemms_alone", lambda x=x, w1=w1, h=h, w2=w2: (torch.matmul(x, w1.T), torch.matmul(h, w2.T))[1])
            _row(rows, base, "eager", lambda x=x, w1=w1, b1=b1, w2=w2, b2=b2: F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2), ref)
            compiled = torch.compile(lambda a, w1=w1, b1=b1, w2=w2, b2=b2: F.linear(F.gelu(F.linear(a, w1, b1)), w2, b2), dynamic=False)
            _row(rows, base, "inductor", lambda c=compiled, x=x: c(x), ref)
            default = wb.default_config(m, n1, width, width)
            variants = {"default": default, "flip_persistent": dataclasses.replace(default, persistent=not default.persistent),
                        "bm64": dataclasses.replace(default, bm=64)}
            for name, cfg in variants.items():
                out = torch.empty(m, width, device="cuda", dtype=torch.float16)
                _ours(rows, dict(base, config=dataclasses.asdict(cfg)), f"comfuse_wgmma_b2b_{name}",
                      lambda c=cfg, m=m, n1=n1: wb.wgmma_b2b(m, n1, width, width, wb.B2B.mlp(), c), [x, w1, b1, w2, b2], out, ref)


def main():
    rows, gen = [], torch.Generator(device="cuda").manual_seed(0)
    assert tvm.cuda(0).exist
    for part in (mlp, attention, ffn1, projections, issue5_attention):  # the newest first: a run cut short keeps them
        part(rows, gen)
    save("hopper-opt-in.json", rows)


if __name__ == "__main__":
    main()
