"""What each Relax operator is to ComFuse: an anchor GEMM, a row-wise memory op, or a stop.

ComFuse groups a GEMM with the memory-intensive chain that consumes it. Only operators
whose semantics are known to keep the GEMM's row structure may join a chain: elementwise
ops (their output has the chain's shape), reductions over the last axis only (one statistic
per row) and the fused normalisations over the last axis. Everything else stops the chain,
so an unknown operator can never be mis-fused; it only limits what is grouped.
"""

from __future__ import annotations

import tvm
import tvm.sym
from tvm import relax

GEMM = "relax.matmul"
TRANSPOSE = "relax.permute_dims"
RESHAPE = "relax.reshape"
BROADCAST = "relax.broadcast_to"

#: Elementwise operators (unary, binary with broadcasting, casts, activations, selects).
ELEMENTWISE = frozenset(
    "relax." + name
    for name in (
        "add subtract multiply divide power maximum minimum floor_divide "
        "astype negative abs exp log sqrt rsqrt erf tanh sigmoid square clip "
        "equal not_equal less less_equal greater greater_equal "
        "logical_not logical_and logical_or where full_like zeros_like ones_like "
        "nn.relu nn.gelu nn.gelu_tanh nn.silu nn.leakyrelu"
    ).split()
)

#: Reductions that produce one statistic per row when they reduce the last axis alone.
ROW_REDUCTIONS = frozenset(
    "relax." + name for name in "sum mean max min variance std prod".split()
)

#: Reductions a back-to-back GEMM can carry between its GEMMs (attention's softmax).
B2B_REDUCTIONS = frozenset(("relax.nn.softmax", "relax.max", "relax.sum"))

#: Fused normalisations whose legalised form is a row reduction plus a normalise step.
ROW_NORMS = frozenset(
    "relax.nn." + name for name in "layer_norm rms_norm softmax log_softmax".split()
)


def op_name(call: relax.Call) -> str | None:
    """The registered name of a Relax operator call, or None for calls of functions."""
    op = call.op
    return op.name if isinstance(op, tvm.ir.Op) else None


def _is_last_axis(axes, ndim: int) -> bool:
    if axes is None:
        return ndim == 1
    axes = [int(a) for a in axes]
    return len(axes) == 1 and axes[0] in (-1, ndim - 1)


def reduces_last_axis(call: relax.Call) -> bool:
    """True when a reduction or normalisation reduces exactly the last axis of its input."""
    name = op_name(call)
    ndim = call.args[0].ty.ndim
    if ndim < 1:
        return False
    if name in ROW_REDUCTIONS:
        return _is_last_axis(call.attrs.axis, ndim)
    if name in ("relax.nn.softmax", "relax.nn.log_softmax"):
        return int(call.attrs.axis) in (-1, ndim - 1)
    if name in ("relax.nn.layer_norm", "relax.nn.rms_norm"):
        return _is_last_axis(call.attrs.axes, ndim)
    return False


def is_last_two_axes_swap(call: relax.Call) -> bool:
    """True for ``permute_dims`` that swaps the last two axes (PyTorch's ``w.T`` in linear)."""
    ndim = call.args[0].ty.ndim
    if ndim < 2:
        return False
    axes = call.attrs.axes
    if axes is None:
        return ndim == 2
    expect = list(range(ndim))
    expect[-1], expect[-2] = expect[-2], expect[-1]
    return [int(a) for a in axes] == expect


def role_of(call: relax.Call) -> str | None:
    """Classify a call: "gemm", "elementwise", "reduction", "norm", "reshape" (a layout-only
    op: reshape, or a broadcast_to that changes nothing) or None (stop)."""
    name = op_name(call)
    if name == GEMM:
        return "gemm"
    if name in ELEMENTWISE:
        return "elementwise"
    if name in ROW_REDUCTIONS or name in ROW_NORMS:
        return ("reduction" if name in ROW_REDUCTIONS else "norm") if reduces_last_axis(call) else None
    if name == RESHAPE or (name == BROADCAST and _same_shape(call.args[0], call)):
        return "reshape"
    return None


def _same_shape(a, call) -> bool:
    sa, sb = a.ty.shape, call.ty.shape
    if not isinstance(sa, relax.ShapeExpr) or not isinstance(sb, relax.ShapeExpr):
        return False
    eq = tvm.sym.Analyzer().can_prove_equal
    return len(sa.values) == len(sb.values) and all(eq(x, y) for x, y in zip(sa.values, sb.values))
