"""Differential fuzzing of ComFuse's fusion groups: random GEMM + row-reduction graphs, two compilers.

Why: the hand-written numerics tests cover the patterns we thought of. This module generates
random Relax graphs around one GEMM (bias, residual, scalar scale, activations, cast round
trips, one or two row reductions, extra outputs, trailing elementwise ops), with awkward shapes
(M=1, primes, nothing a multiple of 8), half precision, large magnitudes and NaN/Inf inputs,
and compiles each twice on ``llvm``: with vanilla TVM and with ComFuse. Whatever ComFuse
outlines must compute what vanilla TVM computes.

A case is a small JSON-able :class:`Case` (shapes, dtype, a list of op tokens, input recipe),
so it can be printed, stored in a report, rebuilt and shrunk. ``build(case)`` makes the Relax
module, ``reference(case, inputs)`` evaluates the same tokens in NumPy float64.

Oracle (``check``), per output, all tolerances relative to ``max(1, max|vanilla output|)``:

* non-finite positions must match, element by element: NaN where vanilla has NaN, same-signed
  Inf where vanilla has Inf, finite where vanilla is finite; or, at an element where they do
  not, what the float64 reference has there (vanilla's half-precision accumulators overflow
  where ComFuse's float32 ones do not; vanilla's fast-math ``powf`` is NaN for a negative base,
  so which near-zero values of a cancellation turn NaN depends on the rounding order, GPU seed
  120); a mismatch says how many elements, and how many each of the three has;
* finite values agree within ``TOL[dtype]`` (float32 1e-4, float16 3e-2, bfloat16 1e-1; the
  dtype is the least precise one the chain casts through, see ``tolerance_dtype``), or,
  where they do not, ComFuse is at least as close to the float64 reference as vanilla TVM
  (ComFuse accumulates half-precision GEMMs and norms in float32 by design, vanilla does not).

Vanilla TVM cannot legalise ``nn.layer_norm`` or ``power`` in bfloat16; such cases are
generated with clean, unit-scale inputs and checked against the NumPy float64 reference alone
(within ``REF_TOL``).

CLI: ``python -m tvm_comfuse.testing.fuzz --cases 1000 --seed 0 --out report.json``; on a GPU,
``--target cuda --jobs 12`` runs both compilers' CUDA kernels (compiled in 12 worker processes).
``--family hopper`` draws from :func:`generate_hopper` instead: post-norm blocks as models
export them (adds in fp16/bf16, the norm in float32), shaped for the sm_90 wgmma kernels, which
the random family's shapes and casts never reach; ``--family hopper_gemm`` from
:func:`generate_hopper_gemm`: GEMM + elementwise blocks (heads split after some) compiled with
the GEMM + elementwise kernel; ``--family b2b`` from :func:`generate_b2b`: two GEMMs around an
elementwise chain (MLPs), compiled with the back-to-back GEMM kernel.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import re
import sys
import time

import ml_dtypes
import numpy as np
import tvm
from tvm import relax

from .. import runtime as rt
from ..transform import analyze

TOL = {"float32": 1e-4, "float16": 3e-2, "bfloat16": 1e-1}
#: Against the float64 reference (bf16 LayerNorm cases): every intermediate rounds to bf16.
REF_TOL = {"float32": 1e-3, "float16": 5e-2, "bfloat16": 1.5e-1}
EPS = 1e-5
NP_DTYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}

#: Elementwise tokens: ("bias",), ("residual",), ("scale", c), ("act", name), ("cast", via),
#: ("square",), ("to",) (a cast back to the case's dtype, one way). Reductions: ("reduce", kind),
#: ("norm32", kind) (the value cast to float32 first, gamma and beta too: a model's post-norm).
#: ("keep",) also returns the current tensor.
ACTS = ("relu", "gelu", "silu", "tanh", "sigmoid")
REDUCTIONS = ("layer_norm", "rms_norm", "softmax", "mean_sub", "sum_sub", "max_sub", "var_scale", "ln_decomposed")
SIZES = (1, 2, 3, 5, 7, 11, 13, 17, 24, 31, 33, 47, 64, 65, 96)
SCALES = (0.5, -2.0, 0.125, 3.0)
#: Input magnitudes per dtype: large enough to stress, small enough that fp16 never overflows
#: in vanilla's fp16 GEMM accumulation but not in ComFuse's fp32 one (a legitimate difference).
BIG = {"float32": 1e3, "float16": 4.0, "bfloat16": 1e3}


@dataclasses.dataclass(frozen=True)
class Case:
    """One fuzz case: everything needed to rebuild the module and its inputs."""

    seed: int
    dtype: str
    M: int
    K: int
    N: int
    batch: int | None = None
    linear: bool = False
    ops: tuple = ()
    scale: float = 1.0
    special: str = ""  # "", "nan", "inf": inject into a few input elements
    input_seed: int = 0
    #: The Hopper kernels the ComFuse build runs (``get_pipeline``'s ``hopper_groups``; empty: its default).
    groups: tuple = ()

    def describe(self) -> str:
        """Human-readable pattern, e.g. ``x@w.T > bias > act:gelu > reduce:layer_norm``."""
        head = "x@w.T" if self.linear else "x@w"
        return " > ".join([head] + [":".join(str(p) for p in op) for op in self.ops])

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"ops": [list(op) for op in self.ops]}

    @staticmethod
    def from_json(d: dict) -> "Case":
        return Case(**(d | {"ops": tuple(tuple(op) for op in d["ops"]), "groups": tuple(d.get("groups", ()))}))


def vanilla_supported(case: Case) -> bool:
    """False where vanilla TVM 0.27 cannot legalise an op (bf16 ``nn.layer_norm``).

    (``relax.power`` in bf16 is rejected when the graph is built, so it is never generated.)
    """
    return case.dtype != "bfloat16" or ("reduce", "layer_norm") not in case.ops


def tolerance_dtype(case: Case) -> str:
    """The least precise dtype a value passes through: it sets the tolerance.

    A cast round trip (``astype(astype(y, "bfloat16"), "float32")``) may or may not round:
    TVM's bf16 legalisation computes bf16 intermediates *inside a fused kernel* in float32,
    so a fused kernel (ComFuse's, or vanilla's ``FuseOps``) keeps the float32 value where the
    unfused vanilla build rounds it. Either is a valid result at bf16 precision.
    """
    order = ("float32", "float16", "bfloat16")
    vias = [case.dtype] + [op[1] for op in case.ops if op[0] == "cast"]
    return max(vias, key=order.index)


# ----------------------------------------------------------------------------- generation


def generate(seed: int) -> Case:
    """A random case from ``seed`` (deterministic)."""
    rng = np.random.default_rng(seed)
    pick = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    dtype = pick(("float32", "float32", "float16", "bfloat16"))

    def elementwise(k):
        out = []
        for _ in range(k):
            kind = pick(("bias", "residual", "scale", "act", "act", "cast", "square"))
            if kind == "square" and dtype == "bfloat16":  # relax.power rejects bf16 outright
                kind = "act"
            if kind == "scale":
                out.append(("scale", float(pick(SCALES))))
            elif kind == "act":
                out.append(("act", pick(ACTS)))
            elif kind == "cast":
                out.append(("cast", pick([d for d in NP_DTYPE if d != dtype])))
            else:
                out.append((kind,))
        return out

    ops = elementwise(int(rng.integers(0, 4)))
    if rng.random() < 0.85:  # else a gemm_elementwise case
        ops.append(("reduce", pick(REDUCTIONS)))
        ops += elementwise(int(rng.integers(0, 2)))
        if rng.random() < 0.3:
            ops.append(("reduce", pick(REDUCTIONS)))
    ops += elementwise(int(rng.integers(0, 3)))
    for _ in range(int(rng.integers(0, 3)) if rng.random() < 0.35 else 0):
        ops.insert(int(rng.integers(0, len(ops))) if ops else 0, ("keep",))
    case = Case(
        seed=seed,
        dtype=dtype,
        M=pick(SIZES),
        K=pick(SIZES),
        N=pick(SIZES),
        batch=pick((None, None, None, 2, 3)),
        linear=bool(rng.random() < 0.4),
        ops=tuple(ops),
        input_seed=seed,
    )
    if vanilla_supported(case):  # the reference-only oracle gets clean unit-scale inputs
        case = dataclasses.replace(
            case,
            scale=BIG[dtype] if rng.random() < 0.25 else 1.0,
            special=pick(("", "", "", "", "nan", "inf")),
        )
    return case


def generate_hopper(seed: int) -> Case:
    """A random post-norm block from ``seed`` as models export it and the sm_90 wgmma kernel
    takes it (deterministic): fp16 or bf16, ``x @ w.T``, the bias and the residual added in that
    dtype in either order, LayerNorm or RMSNorm in float32, then cast back, or returned in float32,
    or both; rows a multiple of 64 (2-D or batched), K a multiple of 32, N from 64 to 1024 (rows
    sliced over clusters of 1 to 8 CTAs), and sometimes 16384 x 256 x 768, where the kernel keeps
    W resident; one case in ten has rows of 5120 or 8192, which no cluster holds (the split GEMM +
    norm kernels), and one in six a softmax in float32 in place of the norm (session 24: the
    split kernels, where N is a multiple of 256; else the rule). One case in eight breaks the
    pattern (an activation before the norm) so the fallback to the gemm_reduce rule is fuzzed
    beside it."""
    rng = np.random.default_rng(seed)
    pick = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    dtype = pick(("float16", "bfloat16"))
    adds = [("bias",), ("residual",)]
    if rng.random() < 0.5:
        adds.reverse()
    if rng.random() < 0.125:
        adds.insert(int(rng.integers(0, 3)), ("act", pick(ACTS)))
    tail = pick(((("to",),), (("keep",), ("to",)), ()))
    if rng.random() < 0.06:
        m, k, n, batch = 16384, 256, 768, None
    else:
        m, k, n, batch = pick((64, 128, 192, 256, 512, 1024, 4096)), pick((64, 96, 128, 256, 320, 768)), \
            pick((64, 128, 192, 256, 384, 512, 768, 1024)), pick((None, None, 2))
    case = Case(seed=seed, dtype=dtype, M=m, K=k, N=n, batch=batch, linear=True,
                ops=(*adds, ("norm32", pick(("layer_norm", "rms_norm"))), *tail), input_seed=seed)
    case = dataclasses.replace(case, scale=BIG[dtype] if rng.random() < 0.25 else 1.0, special=pick(("", "", "", "", "nan", "inf")))
    if rng.random() < 0.1:  # rows wider than a cluster holds: the split GEMM + norm kernels (drawn last: earlier seeds keep their cases)
        case = dataclasses.replace(case, M=pick((64, 256, 1024)), K=pick((64, 256)), N=pick((5120, 8192)), batch=None)
    if rng.random() < 1 / 6:  # softmax in place of the norm (drawn last too)
        case = dataclasses.replace(case, ops=tuple(("norm32", "softmax") if op[0] == "norm32" else op for op in case.ops))
    return case


def generate_hopper_gemm(seed: int) -> Case:
    """A random GEMM + elementwise block from ``seed`` as models export it, compiled with the
    GEMM + elementwise wgmma kernel (deterministic): fp16 or bf16 ``x @ w.T``, a bias,
    an activation the kernel has (relu, gelu, silu), a residual, and, on batched rows, the
    result split into heads (``reshape`` + ``permute_dims``, which the kernel's stores absorb).
    One case in eight has what the kernel does not (N = 96, which no tile divides, or tanh) so
    the fallback is fuzzed beside it."""
    rng = np.random.default_rng(seed)
    pick = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    dtype = pick(("float16", "bfloat16"))
    odd = rng.random() < 0.125
    m, k, batch = pick((64, 128, 256, 512, 1024)), pick((64, 128, 256, 768)), pick((None, 2, 4))
    n = 96 if odd and rng.random() < 0.5 else pick((128, 256, 384, 512, 768, 1024, 3072))
    ops = [("bias",)] if rng.random() < 0.8 else []
    if rng.random() < 0.7:
        ops.append(("act", "tanh" if odd else pick(("relu", "gelu", "silu"))))
    if rng.random() < 0.25:
        ops.append(("residual",))
    heads = [h for h in (2, 4, 8, 12) if n % h == 0 and n // h in (32, 64, 128)]
    if batch and heads and rng.random() < 0.5:
        ops.append(("heads", pick(heads)))
    case = Case(seed=seed, dtype=dtype, M=m, K=k, N=n, batch=batch, linear=True, ops=tuple(ops), input_seed=seed,
                groups=("post_norm", "elementwise"))
    return dataclasses.replace(case, scale=BIG[dtype] if rng.random() < 0.25 else 1.0, special=pick(("", "", "", "", "nan", "inf")))


def generate_b2b(seed: int) -> Case:
    """A random MLP from ``seed``, ``x @ w.T`` -> bias, activation -> ``@ v.T`` (the ``gemm2``
    token) -> bias (-> activation, a third linear, bias: one case in five), residual, compiled
    with the back-to-back GEMM kernel (deterministic):
    fp16 or bf16, rows any count (2-D or batched), an intermediate the kernel holds (64 to 256)
    and an output width it tiles (multiples of 64). One case in six has what it does not (an
    intermediate of 96 or 320, an output of 100) so the two halves' fallback is fuzzed beside it."""
    rng = np.random.default_rng(seed)
    pick = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    dtype = pick(("float16", "bfloat16"))
    odd = rng.random() < 1 / 6
    m, k, batch = pick((64, 100, 128, 200, 512, 1000, 4096)), pick((64, 128, 256, 768)), pick((None, None, 2))
    n1 = pick((96, 320)) if odd and rng.random() < 0.7 else pick((64, 128, 192, 256))
    n2 = 100 if odd and n1 in (64, 128, 192, 256) else pick((64, 128, 256, 320, 512, 1024))
    ops = [("bias",)] if rng.random() < 0.9 else []
    ops += [("act", pick(("relu", "gelu", "silu")))] if rng.random() < 0.8 else []
    ops.append(("gemm2", n2))
    ops += [("bias",)] if rng.random() < 0.7 else []
    if rng.random() < 0.2:  # a third linear: pair candidates that overlap (the middle GEMM ends one, starts the next)
        ops += [("act", pick(("relu", "gelu", "silu"))), ("gemm2", pick((64, 128, 256))), ("bias",)]
    ops += [("residual",)] if rng.random() < 0.3 else []
    case = Case(seed=seed, dtype=dtype, M=m, K=k, N=n1, batch=batch, linear=True, ops=tuple(ops), input_seed=seed,
                groups=("post_norm", "b2b", "elementwise"))
    return dataclasses.replace(case, scale=BIG[dtype] if rng.random() < 0.2 else 1.0, special=pick(("", "", "", "", "nan", "inf")))


#: ``--family`` of the CLI: the generator of each case.
FAMILIES = {"random": generate, "hopper": generate_hopper, "hopper_gemm": generate_hopper_gemm, "b2b": generate_b2b}


# ----------------------------------------------------------------------------- building


def _rows(case):
    return (case.batch, case.M) if case.batch else (case.M,)


def params(case: Case) -> list:
    """``(name, shape)`` of every parameter, in order: x, w, then per-op extras."""
    out, n = [("x", (*_rows(case), case.K)), ("w", (case.N, case.K) if case.linear else (case.K, case.N))], case.N
    for i, op in enumerate(case.ops):
        if op == ("bias",):
            out.append((f"b{i}", (n,)))
        elif op == ("residual",):
            out.append((f"r{i}", (*_rows(case), n)))
        elif op[0] == "gemm2":  # a second GEMM, x @ w.T, to op[1] columns
            out.append((f"v{i}", (op[1], n)))
            n = op[1]
        elif op[0] in ("reduce", "norm32") and op[1] in ("layer_norm", "rms_norm", "ln_decomposed"):
            out.append((f"gamma{i}", (n,)))
            if op[1] != "rms_norm":
                out.append((f"beta{i}", (n,)))
    return out


def build(case: Case) -> tvm.IRModule:
    """The Relax module of ``case`` (function ``main``), built with a BlockBuilder."""
    op = relax.op
    dt = case.dtype
    bb = relax.BlockBuilder()
    vs = {name: relax.Var(name, relax.TensorType(shape, dt)) for name, shape in params(case)}
    const = lambda v: relax.const(v, dt)  # noqa: E731
    with bb.function("main", list(vs.values())):
        with bb.dataflow():
            w = bb.emit(op.permute_dims(vs["w"])) if case.linear else vs["w"]
            y = bb.emit(op.matmul(vs["x"], w))
            kept = []
            for i, tok in enumerate(case.ops):
                kind = tok[0]
                if kind == "keep":
                    kept.append(y)
                elif kind == "bias":
                    y = bb.emit(op.add(y, vs[f"b{i}"]))
                elif kind == "residual":
                    y = bb.emit(op.add(y, vs[f"r{i}"]))
                elif kind == "scale":
                    y = bb.emit(op.multiply(y, const(tok[1])))
                elif kind == "act":
                    fn = getattr(op.nn, tok[1], None) or getattr(op, tok[1])
                    y = bb.emit(fn(y))
                elif kind == "cast":
                    y = bb.emit(op.astype(bb.emit(op.astype(y, tok[1])), dt))
                elif kind == "square":
                    y = bb.emit(op.power(y, const(2.0)))
                elif kind == "to":
                    y = bb.emit(op.astype(y, dt))
                elif kind == "gemm2":
                    y = bb.emit(op.matmul(y, bb.emit(op.permute_dims(vs[f"v{i}"]))))
                elif kind == "heads":  # [B, M, N] -> [B, heads, M, N / heads], as attention splits them
                    y = bb.emit(op.permute_dims(bb.emit(op.reshape(y, (case.batch, case.M, tok[1], case.N // tok[1]))), [0, 2, 1, 3]))
                elif kind == "norm32" and tok[1] == "softmax":
                    y = bb.emit(op.nn.softmax(bb.emit(op.astype(y, "float32")), axis=-1))
                elif kind == "norm32":
                    f32 = lambda v: bb.emit(op.astype(v, "float32"))  # noqa: E731
                    y, g = f32(y), f32(vs[f"gamma{i}"])
                    y = bb.emit(op.nn.layer_norm(y, g, f32(vs[f"beta{i}"]), axes=[-1], epsilon=EPS) if tok[1] == "layer_norm"
                                else op.nn.rms_norm(y, g, axes=[-1], epsilon=EPS))
                else:
                    y = _emit_reduction(bb, y, tok[1], vs, i, const)
            result = bb.emit_output(relax.Tuple([y, *kept]) if kept else y)
        bb.emit_func_output(result)
    return bb.get()


def _emit_reduction(bb, y, kind, vs, i, const):
    """One row reduction over the last axis, combined back with the tile."""
    op = relax.op
    if kind == "layer_norm":
        return bb.emit(op.nn.layer_norm(y, vs[f"gamma{i}"], vs[f"beta{i}"], axes=[-1], epsilon=EPS))
    if kind == "rms_norm":
        return bb.emit(op.nn.rms_norm(y, vs[f"gamma{i}"], axes=[-1], epsilon=EPS))
    if kind == "softmax":
        return bb.emit(op.nn.softmax(y, axis=-1))
    if kind == "mean_sub":
        return bb.emit(op.subtract(y, bb.emit(op.mean(y, axis=[-1], keepdims=True))))
    if kind == "max_sub":
        return bb.emit(op.subtract(y, bb.emit(op.max(y, axis=[-1], keepdims=True))))
    if kind == "sum_sub":
        n = int(y.ty.shape.values[-1])
        s = bb.emit(op.sum(y, axis=[-1], keepdims=True))
        return bb.emit(op.subtract(y, bb.emit(op.multiply(s, const(1.0 / n)))))
    if kind == "var_scale":
        v = bb.emit(op.variance(y, axis=[-1], keepdims=True))
        return bb.emit(op.multiply(y, bb.emit(op.rsqrt(bb.emit(op.add(v, const(EPS)))))))
    if kind == "ln_decomposed":
        mean = bb.emit(op.mean(y, axis=[-1], keepdims=True))
        c = bb.emit(op.subtract(y, mean))
        var = bb.emit(op.mean(bb.emit(op.multiply(c, c)), axis=[-1], keepdims=True))
        inv = bb.emit(op.rsqrt(bb.emit(op.add(var, const(EPS)))))
        return bb.emit(op.add(bb.emit(op.multiply(bb.emit(op.multiply(c, inv)), vs[f"gamma{i}"])), vs[f"beta{i}"]))
    raise ValueError(f"unknown reduction {kind!r}")


def inputs(case: Case) -> list:
    """Seeded inputs (float32 storage, already rounded to ``case.dtype``), NaN/Inf injected."""
    rng = np.random.default_rng(case.input_seed)
    out = []
    for name, shape in params(case):
        a = rng.standard_normal(shape) * case.scale
        if name == "w":
            a /= np.sqrt(case.K)
        elif name[0] == "v":  # a second GEMM's weight [N2, N]
            a /= np.sqrt(shape[-1])
        out.append(a)
    if case.special:
        for _ in range(int(rng.integers(1, 4))):
            a = out[int(rng.integers(len(out)))]
            idx = tuple(int(rng.integers(d)) for d in a.shape)
            a[idx] = np.nan if case.special == "nan" else float(rng.choice([np.inf, -np.inf]))
    return [a.astype(NP_DTYPE[case.dtype]).astype(np.float32) for a in out]


# ----------------------------------------------------------------------------- reference


def _round(a, dtype):
    with np.errstate(over="ignore", invalid="ignore"):
        return a.astype(NP_DTYPE[dtype]).astype(np.float64)


def reference(case: Case, args: list) -> list:
    """The float64 NumPy value of ``case`` on ``args`` (casts round as the graph says)."""
    vs = {name: np.asarray(a, np.float64) for (name, _), a in zip(params(case), args)}
    w = vs["w"].T if case.linear else vs["w"]
    with np.errstate(all="ignore"):
        y = vs["x"] @ w
        kept = []
        for i, tok in enumerate(case.ops):
            kind = tok[0]
            if kind == "keep":
                kept.append(y)
            elif kind == "bias":
                y = y + vs[f"b{i}"]
            elif kind == "residual":
                y = y + vs[f"r{i}"]
            elif kind == "scale":
                y = y * tok[1]
            elif kind == "act":
                y = _np_act(tok[1], y)
            elif kind == "cast":
                y = _round(y, tok[1])
            elif kind == "square":
                y = y * y
            elif kind == "to":
                y = _round(y, case.dtype)
            elif kind == "gemm2":
                y = y @ vs[f"v{i}"].T
            elif kind == "heads":
                y = y.reshape(case.batch, case.M, tok[1], case.N // tok[1]).transpose(0, 2, 1, 3)
            else:
                y = _np_reduction(tok[1], y, vs, i)
    return [y, *kept]


def _np_act(name, v):
    if name == "relu":
        return np.maximum(v, 0)
    if name == "gelu":
        return 0.5 * v * (1 + np.vectorize(math.erf, otypes=[float])(v / math.sqrt(2)))
    if name == "silu":
        return v / (1 + np.exp(-v))
    if name == "tanh":
        return np.tanh(v)
    return 1 / (1 + np.exp(-v))


def _np_reduction(kind, y, vs, i):
    mean = y.mean(-1, keepdims=True)
    var = ((y - mean) ** 2).mean(-1, keepdims=True)
    if kind in ("layer_norm", "ln_decomposed"):
        return (y - mean) / np.sqrt(var + EPS) * vs[f"gamma{i}"] + vs[f"beta{i}"]
    if kind == "rms_norm":
        return y / np.sqrt((y * y).mean(-1, keepdims=True) + EPS) * vs[f"gamma{i}"]
    if kind == "softmax":
        e = np.exp(y - y.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    if kind in ("mean_sub", "sum_sub"):
        return y - mean
    if kind == "max_sub":
        return y - y.max(-1, keepdims=True)
    if kind == "var_scale":
        return y / np.sqrt(var + EPS)
    raise ValueError(kind)


# ----------------------------------------------------------------------------- oracle


def _device(target: str):
    return tvm.cpu() if target == "llvm" else tvm.cuda(0)


def _target(target: str):
    """``"llvm"``, or ``"cuda"``: the GPU this process sees (its architecture, its limits)."""
    return "llvm" if target == "llvm" else tvm.target.Target.from_device(tvm.cuda(0))


def _compile(mod, target, comfuse, groups=()):
    return rt.compile_module(mod, target, comfuse=comfuse, hopper_groups=groups or None)


def _run(executable, mod, args, target: str):
    dev = _device(target)
    return rt.run(executable, rt.to_device(args, rt.param_dtypes(mod), dev), dev)


def _rule_scheduled(mod, target) -> list:
    """The fused functions the gemm_reduce rule schedules itself on ``target`` (the others go to
    DLight's rules: gemm_elementwise by design, gemm_reduce when the rule declines)."""
    from ..schedule import GemmRowTile  # pylint: disable=import-outside-toplevel
    from ..tune.tasks import fused_module  # pylint: disable=import-outside-toplevel

    fused = fused_module(mod, target)
    rule = GemmRowTile()
    return [gv.name_hint for gv, f in fused.functions_items()
            if isinstance(f, tvm.tirx.PrimFunc) and rule.apply(f, target, False) is not None]


def _kernels_of(names, groups) -> list:
    """The fused groups whose function became a CUDA kernel of its own (GPU targets), from the
    kernel names of the ComFuse build (the Hopper kernels carry a ``comfuse_wgmma_<i>_`` prefix)."""
    return [g.name for g in groups
            if g.fused and any(re.fullmatch(rf"(comfuse_wgmma_(ew_)?\d+_)?{re.escape(g.name)}_kernel\w*", k) for k in names)]


def _hopper_kernels(names) -> list:
    """The ComFuse build's kernels that are the sm_90 wgmma kernel."""
    return [k for k in names if k.startswith("comfuse_wgmma_")]


def _mismatch(ours, theirs, ref, dtype, tol_table) -> str:
    """Why ``ours`` disagrees with ``theirs`` (empty when they agree); see the module doc."""
    if ours.shape != theirs.shape:
        return f"shape {ours.shape} vs {theirs.shape}"
    tests = (("NaN", np.isnan), ("+Inf", np.isposinf), ("-Inf", np.isneginf))
    if any((test(ours) != test(theirs)).any() for _, test in tests):
        with np.errstate(over="ignore"):  # the reference as the output's dtype holds it (overflow: Inf)
            ref_out = ref.astype(ours.dtype) if ours.dtype.kind == "f" else ref
        for what, test in tests:  # per element: like vanilla, or else like the reference
            bad = (test(ours) != test(theirs)) & (test(ours) != test(ref_out))
            if bad.any():
                return (f"{what} positions differ from vanilla and the reference ({int(bad.sum())}"
                        f" elements; {what} count: ours {int(test(ours).sum())}, vanilla {int(test(theirs).sum())},"
                        f" reference {int(test(ref_out).sum())})")
        # where vanilla's finiteness is its own, ours is compared with the reference instead
        theirs = np.where(np.isfinite(ours) == np.isfinite(theirs), theirs, ref)
    fin = np.isfinite(theirs) & np.isfinite(ref)
    if not fin.any():
        return ""
    ours, theirs, ref = ours[fin], theirs[fin], ref[fin]
    mag = max(1.0, float(np.abs(theirs).max()))
    err = float(np.abs(ours - theirs).max()) / mag
    if err <= tol_table[dtype]:
        return ""
    ours_ref = float(np.abs(ours - ref).max()) / mag
    theirs_ref = float(np.abs(theirs - ref).max()) / mag
    if ours_ref <= 1.05 * theirs_ref + tol_table[dtype]:
        return ""  # farther from vanilla, but no farther from the exact value than vanilla is
    return f"max rel. error {err:.3g} > {tol_table[dtype]} (vs float64: ours {ours_ref:.3g}, vanilla {theirs_ref:.3g})"


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"


def build_both(case: Case, target: str = "llvm") -> dict:
    """Compile ``case`` with ComFuse and (where it can) vanilla TVM: ``{"comfuse": executable
    or error string, "vanilla": ...}``, and on a GPU ``"rule"``: the functions the gemm_reduce
    rule scheduled. Split from :func:`check` so GPU runs can do this in worker processes
    (compiling dominates) and run in one."""
    mod, out = build(case), {}
    for name, comfuse in (("comfuse", True), ("vanilla", False)):
        if name == "vanilla" and not vanilla_supported(case):
            continue
        try:
            out[name] = _compile(mod, _target(target), comfuse, case.groups if comfuse else ())
        except Exception as e:  # pylint: disable=broad-except
            out[name] = _error(e)
    if target != "llvm" and not isinstance(out["comfuse"], str):
        from .. import codegen  # pylint: disable=import-outside-toplevel

        out["rule"] = _rule_scheduled(mod, _target(target))
        # read here: a CUDA module exported by a worker and loaded back has no source to read
        out["kernel_names"] = codegen.kernel_names(codegen.cuda_source(out["comfuse"]))
    return out


def check(case: Case, target: str = "llvm", built: dict | None = None) -> dict:
    """Compile (unless ``built`` by :func:`build_both`) and run ``case`` both ways on
    ``target`` (``"llvm"`` or ``"cuda"``); return the per-case record (``ok`` says pass/fail).
    On a GPU the record also lists the groups that became a fused kernel (``kernels``)."""
    rec = {"seed": case.seed, "pattern": case.describe(), "dtype": case.dtype, "case": case.to_json(),
           "shapes": {n: list(s) for n, s in params(case)}, "groups": [], "oracle": "vanilla", "ok": False, "error": ""}
    try:
        mod = build(case)
        groups = analyze(mod, None if target == "llvm" else _target(target))
        rec["groups"] = [f"{g.kind}{'' if g.fused else ' (vanilla)'}: " + ">".join(o.rsplit(".", 1)[-1] for o in g.ops)
                         for g in groups]
        built = built if built is not None else build_both(case, target)
        if isinstance(built["comfuse"], str):
            raise RuntimeError(built["comfuse"])
        if target != "llvm":
            rec["kernels"] = _kernels_of(built["kernel_names"], groups)
            rec["rule"] = built["rule"]
            rec["hopper"] = _hopper_kernels(built["kernel_names"])
        args = inputs(case)
        ref = [r.reshape(-1) for r in reference(case, args)]
        ours = [o.reshape(-1) for o in _run(built["comfuse"], mod, args, target)]
    except Exception as e:  # pylint: disable=broad-except
        rec["error"] = f"comfuse: {_error(e)}"
        return rec
    if vanilla_supported(case):
        try:
            if isinstance(built.get("vanilla"), str):
                raise RuntimeError(built["vanilla"])
            theirs = [o.reshape(-1) for o in _run(built["vanilla"], mod, args, target)]
        except Exception as e:  # pylint: disable=broad-except
            rec["error"] = f"vanilla failed ({type(e).__name__}); not a ComFuse verdict"
            rec["ok"] = True
            return rec
        tol = TOL
    else:
        rec["oracle"], theirs, tol = "numpy", ref, REF_TOL
    if len(ours) != len(theirs):
        rec["error"] = f"{len(ours)} outputs vs {len(theirs)}"
        return rec
    why = [m for m in (_mismatch(o, t, r, tolerance_dtype(case), tol) for o, t, r in zip(ours, theirs, ref)) if m]
    rec["error"] = "; ".join(f"output: {m}" for m in why)
    rec["ok"] = not why
    return rec


def fails(case: Case, target: str = "llvm") -> bool:
    """The default shrink predicate: ``check`` reports a mismatch or a ComFuse failure."""
    return not check(case, target)["ok"]


# ----------------------------------------------------------------------------- shrinking


def _smaller(case: Case):
    """Candidate simplifications of ``case``, most aggressive first."""
    rep = dataclasses.replace
    for i in range(len(case.ops)):
        yield rep(case, ops=case.ops[:i] + case.ops[i + 1:])
    if case.batch:
        yield rep(case, batch=None)
    if case.linear:
        yield rep(case, linear=False)
    if case.special:
        yield rep(case, special="")
    if case.scale != 1.0:
        yield rep(case, scale=1.0)
    for dim in ("M", "K", "N"):
        n = getattr(case, dim)
        for smaller in sorted({1, 2, n // 2, n - 1}):
            if 0 < smaller < n:
                yield rep(case, **{dim: smaller})
    if case.dtype != "float32":
        yield rep(case, dtype="float32")


def shrink(case: Case, predicate=fails, budget: int = 300) -> dict:
    """Greedily simplify a failing ``case`` while ``predicate`` still holds.

    Tries fewer ops / outputs, 2-D instead of batched, plain instead of linear weights, clean
    inputs, smaller dims; keeps the first simplification that still fails and starts over.
    Returns ``{"case", "script", "input_seed", "steps"}`` for the minimal case found.
    """
    assert predicate(case), "shrink needs a failing case"
    steps = 0
    improved = True
    while improved and steps < budget:
        improved = False
        for cand in _smaller(case):
            steps += 1
            if predicate(cand):
                case, improved = cand, True
                break
    return {"case": case, "script": build(case).script(), "input_seed": case.input_seed, "steps": steps}


# ----------------------------------------------------------------------------- driver


def _built_in_worker(job):
    """Pool worker: compile one case both ways and export each executable to a shared library."""
    seed, target, folder, family = job
    out = {}
    for name, value in build_both(FAMILIES[family](seed), target).items():
        if isinstance(value, (str, list)):  # an error, or the rule's functions
            out[name] = ("value", value)
        else:
            out[name] = ("library", os.path.join(folder, f"{seed}-{name}.so"))
            value.export_library(out[name][1])
    return seed, out


def _load(built: dict) -> dict:
    return {k: tvm.runtime.load_module(v) if what == "library" else v for k, (what, v) in built.items()}


def _builds(seeds, target: str, jobs: int, family: str = "random"):
    """``(seed, built-or-None)`` in order: compiled here when ``jobs`` is 1, else in a pool."""
    if jobs <= 1:
        for s in seeds:
            yield s, None
        return
    import multiprocessing  # pylint: disable=import-outside-toplevel
    import tempfile  # pylint: disable=import-outside-toplevel

    with tempfile.TemporaryDirectory(prefix="comfuse-fuzz-") as folder:
        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            for s, built in pool.imap(_built_in_worker, [(s, target, folder, family) for s in seeds]):
                yield s, _load(built)


def fuzz(cases: int, seed: int = 0, log=None, target: str = "llvm", jobs: int = 1, progress: int = 0,
         checkpoint: str | None = None, family: str = "random") -> dict:
    """Run ``cases`` cases with seeds ``seed, seed+1, ...`` on ``target``; return the report.
    ``jobs > 1`` compiles in that many worker processes. Every ``progress`` cases a count line
    is logged and the report so far is written to ``checkpoint``: a run cut short by a time
    limit still says how far it got and what it found."""
    records, t0 = [], time.time()
    for s, built in _builds(range(seed, seed + cases), target, jobs, family):
        rec = check(FAMILIES[family](s), target, built)
        records.append(rec)
        if log and not rec["ok"]:
            log(f"FAIL seed={s} {rec['dtype']} {rec['pattern']}: {rec['error']}")
        if progress and len(records) % progress == 0:
            if log:
                log(f"{len(records)} cases, {sum(not r['ok'] for r in records)} failures, {time.time() - t0:.0f} s")
            if checkpoint:
                _write(_report(records, target, t0), checkpoint)
    return _report(records, target, t0, family)


def _report(records: list, target: str, t0: float, family: str = "random") -> dict:
    kinds = collections.Counter(g.split(":")[0] for r in records for g in r["groups"])
    report = {
        "target": target,
        "family": family,
        "cases": len(records),
        "failures": sum(not r["ok"] for r in records),
        "groups": dict(sorted(kinds.items())),
        "oracle": dict(collections.Counter(r["oracle"] for r in records)),
        "seconds": round(time.time() - t0, 1),
        "records": records,
    }
    if target != "llvm":
        report["cases_with_fused_kernels"] = sum(bool(r.get("kernels")) for r in records)
        report["cases_on_the_hopper_kernel"] = sum(bool(r.get("hopper")) for r in records)
        report["cases_scheduled_by_the_rule"] = sum(bool(r.get("rule")) and not r.get("hopper") for r in records)
    return report


def _write(report: dict, path: str) -> None:
    from ..bench import environment  # pylint: disable=import-outside-toplevel  (torch, only for reports)

    with open(path, "w", encoding="utf-8") as f:
        json.dump({"environment": environment(), **report}, f, indent=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tvm_comfuse.testing.fuzz", description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the JSON report here")
    parser.add_argument("--shrink", action="store_true", help="shrink each failure (slow)")
    parser.add_argument("--target", choices=("llvm", "cuda"), default="llvm",
                        help="llvm (CPU), or cuda: the GPU of this machine (fused CUDA kernels against vanilla TVM's)")
    parser.add_argument("--jobs", type=int, default=1, help="compile in this many worker processes")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="random",
                        help="random graphs (default); hopper: post-norm blocks shaped for the sm_90 wgmma kernels; "
                             "hopper_gemm: GEMM + elementwise blocks for the wgmma kernel; "
                             "b2b: MLPs for the back-to-back GEMM kernel")
    args = parser.parse_args(argv)
    if args.target == "cuda" and not tvm.cuda(0).exist:
        parser.error("--target cuda needs a CUDA GPU, and tvm.cuda(0) finds none")
    report = fuzz(args.cases, args.seed, log=lambda line: print(line, flush=True), target=args.target, jobs=args.jobs,
                  progress=10, checkpoint=args.out, family=args.family)
    if args.shrink:
        for rec in report["records"]:
            if not rec["ok"]:
                small = shrink(Case.from_json(rec["case"]), lambda c: fails(c, args.target))
                rec["shrunk"] = {"case": small["case"].to_json(), "script": small["script"]}
                print(f"shrunk seed={rec['seed']}: {small['case'].describe()}\n{small['script']}")
    print(f"cases: {report['cases']}  failures: {report['failures']}  seconds: {report['seconds']}")
    print("groups formed: " + ", ".join(f"{k}={v}" for k, v in report["groups"].items()))
    print("oracle: " + ", ".join(f"{k}={v}" for k, v in report["oracle"].items()))
    if "cases_with_fused_kernels" in report:
        print(f"cases whose ComFuse group ran as its own fused kernel: {report['cases_with_fused_kernels']} "
              f"(on the Hopper wgmma kernel: {report['cases_on_the_hopper_kernel']}; else scheduled by the gemm_reduce rule: "
              f"{report['cases_scheduled_by_the_rule']}; the rest by DLight)")
    if args.out:
        _write(report, args.out)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
