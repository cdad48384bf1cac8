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


def activation(v, name: str):
    """``name`` of the fp32 expression ``v``, as TVM legalises ``relax.nn.<name>`` in fp32."""
    if name == "gelu":
        return v * (T.float32(0.5) + T.erf(v * T.float32(0.5**0.5)) * T.float32(0.5))
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
