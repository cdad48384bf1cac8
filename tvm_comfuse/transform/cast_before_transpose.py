"""CastBeforeTranspose: ``astype(permute_dims(w))`` becomes ``permute_dims(astype(w))``.

Why: a GEMM group takes its weight transpose inside (the ``[N, K]`` weight of PyTorch's linear
is what the tensor-core mainloop reads), but TVM's mixed-precision pass casts *after* the
transpose, so the transpose would stay outside the group and the group would see a ``[K, N]``
weight. A cast commutes with a transpose, so swapping them is exact; the cast of a weight is
then folded at compile time when weights are constants, or is one cheap elementwise kernel.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import is_op, rewrite_call, wildcard

from ..graph import ops
from .user_functions import rewrite_user_functions


def _rewrite(func: relax.Function) -> relax.Function:
    weight = wildcard()
    transpose = is_op("relax.permute_dims")(weight)
    cast = is_op("relax.astype")(transpose)

    def rewriter(expr, matches):
        swap = matches[transpose]
        if not ops.is_last_two_axes_swap(swap):
            return expr
        return relax.op.permute_dims(relax.op.astype(matches[weight], expr.attrs.dtype), swap.attrs.axes)

    return rewrite_call(cast, rewriter, func)


@tvm.transform.module_pass(opt_level=0, name="CastBeforeTranspose")
class CastBeforeTranspose:  # pylint: disable=too-few-public-methods
    """Move casts of transposed tensors before the transpose (see module doc)."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_user_functions(mod, _rewrite)
