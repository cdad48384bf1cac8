"""The elementwise chain between a GEMM and what follows it, as the Hopper kernels compute it.

A group's chain is read off the Relax graph (:mod:`tvm_comfuse.transform.offload_hopper`) as
:class:`Step` s: casts, adds of a ``[N]`` vector or an ``[M, N]`` tile, and activations, each
rounded to the dtype the graph computes it in. :func:`chain_value` writes it as one TIR
expression per accumulator (the post-norm kernel's epilogue before the norm, the GEMM +
elementwise kernel's whole epilogue); :func:`np_chain` is its NumPy model, the oracle the CPU
tests run in a kernel's place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from ..errors import ComFuseError

#: Activations a chain may apply (Relax ``nn.<name>``), computed in fp32.
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")


@dataclass(frozen=True)
class Step:
    """One elementwise op on the running value: ``cast`` to ``dtype``, ``add`` operand
    ``operand`` with the result in ``dtype``, or an activation (:data:`ACTIVATIONS`) with the
    result in ``dtype``. The value stays fp32 in registers and is rounded to ``dtype`` after each
    step, as the graph computes."""

    op: str
    dtype: str
    operand: int | None = None


#: Abramowitz & Stegun 7.1.28: ``erf(x) = 1 - (1 + a1 x + ... + a6 x^6)^-16`` for ``x >= 0``,
#: absolute error at most 3e-7 (erff's own is ~1e-7).
ERF_AS = (0.0705230784, 0.0422820123, 0.0092705272, 0.0001520143, 0.0002765672, 0.0000430638)

_RCP = "comfuse_rcp_approx"
_RCP_SOURCE = (f"__device__ __forceinline__ float {_RCP}(float x) {{\n"
               '  float r;\n  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));\n  return r;\n}\n')


def approx_reciprocal(x):
    """``1 / x`` by one MUFU.RCP (``rcp.approx.ftz``: 1 ulp) whatever the build's flags. TVM
    compiles CUDA with ``--use_fast_math``, where a float division is ``div.approx`` (in SASS
    the same MUFU.RCP and an FMUL); without it (``TVM_CUDA_NVCC_NO_FAST_MATH``, or an nvrtc
    option undoing it) it would be IEEE division: ~7 instructions and a slow-path branch a value.
    (Session 28: for the same reason TVM's own ``silu``, ``v * sigmoid(v)``, is already five
    instructions a value, ``__expf`` and a reciprocal, and is left as TVM legalises it.)"""
    return T.cuda.func_call(_RCP, x, source_code=_RCP_SOURCE, return_type="float32")


def gelu(v, reciprocal=approx_reciprocal):
    """``gelu`` (erf's) of the fp32 expression ``v``: ``v * Phi(v)``, ``Phi(v) = 1 - h`` for
    ``v >= 0`` and ``h`` below, where ``h = 0.5 erfc(|v| / sqrt 2)`` is :data:`ERF_AS`'s
    ``0.5 / p^16`` (the polynomial in ``|v|``, the ``1 / sqrt 2`` folded in; ``reciprocal``:
    the CPU test passes IEEE division, to run the same expression on ``llvm``).

    Why not ``erff``, as TVM legalises ``nn.gelu``: CUDA's ``erff`` evaluates two ranges'
    polynomials and picks one per value (in the b2b kernel's SASS: 9 FSELs and 8 FFMAs a value,
    GELU 24 instructions a value, 6.5% of the 65536 x 256 MLP kernel in session 26). This is 15
    (6 FFMAs, 6 FMULs of which 4 square, one MUFU.RCP, an FADD and an FSETP), without
    cancellation in ``Phi``'s negative tail; measured on an H100 (session 27), the b2b kernel at
    65536 x 256 took 171.3 us against 179.0 with ``erff``, FFN1's GEMM + GELU 9-12% less.

    Max abs error 8e-7 against an exact GELU on [-12, 12] (``tests/test_chain.py``), far below
    the 16-bit rounding that follows, though near enough to its ties that the fp16 result differs
    from an exact GELU's by one ulp for 1.3% of N(0, 1.5^2) values (TVM's formula with a
    correctly rounded erf: 0.3%), the mean absolute error the same to 4e-5 of itself (session 27,
    on CPU). Non-finite values as the graph's formula gives
    them: ``gelu(inf) = inf``; ``gelu(-inf)`` and ``gelu(NaN)`` are NaN (``-inf * 0``)."""
    coefficients = [T.float32(a * 0.5 ** ((i + 1) / 2)) for i, a in enumerate(ERF_AS)]
    bindings = []  # values used more than once, as Lets: CUDA codegen declares each once (a value
    # used twice in a plain expression is printed, and its loads issued, twice)

    def let(name, value):
        bindings.append((tirx.Var(name, "float32"), value))
        return bindings[-1][0]

    v = let("gelu_v", v)
    z = let("gelu_z", T.abs(v))
    p = coefficients[-1]
    for c in coefficients[-2::-1]:
        p = p * z + c
    p = let("gelu_p", p * z + T.float32(1))
    for power in (2, 4, 8):
        p = let(f"gelu_p{power}", p * p)
    h = let("gelu_h", reciprocal(p * p) * T.float32(0.5))
    body = v * tirx.Select(v >= T.float32(0), T.float32(1) - h, h)
    for var, value in reversed(bindings):
        body = tirx.Let(var, value, body)
    return body


def activation(v, name: str):
    """``name`` of the fp32 expression ``v``, as TVM legalises ``relax.nn.<name>`` in fp32 (up
    to the rounding of :func:`gelu`'s erf)."""
    if name == "gelu":
        return gelu(v)
    if name == "gelu_tanh":
        inner = T.float32(math.sqrt(2 / math.pi)) * v * (T.float32(1) + T.float32(0.044715) * v * v)
        return T.float32(0.5) * v * (T.float32(1) + T.tanh(inner))
    if name == "relu":
        return T.max(v, T.float32(0))
    if name == "silu":
        return v * T.sigmoid(v)
    raise ComFuseError(f"activation {name!r} (one of {ACTIVATIONS})")


def chain_value(v, steps, operand_dtypes, read):
    """Apply ``steps`` to the fp32 expression ``v`` (plain Python, run while a kernel is
    parsed: one expression per accumulator); ``read(j)`` is operand ``j``'s element. Returns
    ``(value, the dtype it is held in)``.

    An add whose value is already rounded to the step's 16-bit dtype, of an operand in that
    dtype, is one 16-bit add: IEEE addition rounded once to 11 (or 8) bits equals the fp32 sum
    rounded again (fp32's 24 bits are at least twice as many plus two: double rounding is
    innocuous), so it is the graph's value, in one instruction instead of an unpack, an fp32
    add and a repack per element (session 11: the epilogue's instructions bound the post-norm)."""
    cur = "float32"  # the dtype v is held in
    for step in steps:
        if step.op == "add":
            j = step.operand
            val = read(j)
            if cur == step.dtype == operand_dtypes[j] != "float32":
                v = v + val
                continue
            v = (v if cur == "float32" else T.cast(v, "float32")) + T.cast(val, "float32")
            cur = "float32"
        elif step.op in ACTIVATIONS:
            v, cur = activation(v if cur == "float32" else T.cast(v, "float32"), step.op), "float32"
        if step.dtype != cur:
            v, cur = T.cast(v if cur == "float32" else T.cast(v, "float32"), step.dtype), step.dtype
    return v, cur


def np_dtype(dtype: str):
    """The NumPy dtype of a TVM dtype name (bfloat16 through ml_dtypes)."""
    import ml_dtypes  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel

    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)


def _np_activation(v, name: str):
    import numpy as np  # pylint: disable=import-outside-toplevel

    if name == "gelu":
        erf = np.vectorize(math.erf, otypes=[np.float64])(v * np.float32(0.5**0.5)).astype(np.float32)
        return v * (np.float32(0.5) + erf * np.float32(0.5))
    if name == "gelu_tanh":
        return np.float32(0.5) * v * (1 + np.tanh(np.float32(math.sqrt(2 / math.pi)) * v * (1 + np.float32(0.044715) * v * v)))
    if name == "relu":
        return np.maximum(v, np.float32(0))
    if name == "silu":
        return v / (1 + np.exp(-v))
    raise ComFuseError(f"activation {name!r} (one of {ACTIVATIONS})")


def np_chain(v, steps, operands):
    """NumPy model of :func:`chain_value` on the fp32 array ``v`` (``[M, N]``); ``operands``
    are fp32 arrays, ``[N]`` or reshapeable to ``[M, N]``. Non-finite values propagate as the
    kernel's IEEE arithmetic makes them (silently: the fuzzer feeds NaN and Inf on purpose)."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    with np.errstate(over="ignore", invalid="ignore"):
        for step in steps:
            if step.op == "add":
                p = operands[step.operand]
                v = v + (p.reshape(-1, v.shape[1]) if p.ndim > 1 else p)
            elif step.op in ACTIVATIONS:
                v = _np_activation(v.astype(np.float32), step.op)
            v = v.astype(np_dtype(step.dtype)).astype(np.float32)
    return v
