"""FoldRMSNorm: ``x * rsqrt(mean(x ** 2, -1) + eps) * gamma`` becomes ``nn.rms_norm(x, gamma)``.

Why: PyTorch's ``torch.nn.RMSNorm`` (and the hand-written RMSNorms of LLaMA-style models)
export as that arithmetic, not as an RMSNorm, so TVM's frontend imports five elementwise and
reduction ops. A GEMM group ending in them is still fused (the gemm_reduce rule takes any
reduction), but the Hopper kernels read a post-norm's norm off ``relax.nn.rms_norm``
(:mod:`.offload_hopper`): without this pass an exported RMSNorm block never reaches them. The
rewrite is exact in float32, where TVM lowers ``nn.rms_norm`` to the same operations in the
same order (bit-identical results on llvm, checked by the tests), which is where a model under
TVM's mixed precision computes its norms; in 16 bits ``nn.rms_norm`` sums in float32 and the
written-out arithmetic does not, so those are left as they are.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

from .user_functions import rewrite_user_functions


def _last_axis(call, ndim: int) -> bool:
    axis = [int(a) for a in call.attrs.axis] if call.attrs.axis is not None else None
    return axis is not None and len(axis) == 1 and axis[0] % ndim == ndim - 1 and bool(call.attrs.keepdims)


def _scalar(const, value=None):
    """The float a scalar constant holds (None where it is not one, or not ``value``)."""
    data = const.value.numpy()
    if data.size != 1:
        return None
    got = float(data.reshape(()))
    return got if value is None or got == value else None


def _rewrite(func: relax.Function) -> relax.Function:
    x, gamma, two, eps = wildcard(), wildcard(), is_const(), is_const()
    mean = is_op("relax.mean")(is_op("relax.power")(x, two))
    inv = is_op("relax.rsqrt")(is_op("relax.add")(mean, eps))
    normed = is_op("relax.multiply")(x, inv)
    scaled = is_op("relax.multiply")(normed, gamma)

    def rewriter(expr, matches):
        data, weight = matches[x], matches[gamma]
        ty, wty = data.ty, weight.ty
        if not isinstance(ty, relax.TensorType) or not isinstance(wty, relax.TensorType) or ty.ndim < 1 or wty.ndim != 1:
            return expr
        if str(ty.dtype) != "float32" or str(wty.dtype) != "float32" or _scalar(matches[two], 2.0) is None or _scalar(matches[eps]) is None:
            return expr  # (in 16 bits nn.rms_norm sums in float32 and the arithmetic does not: not the same result)
        if not _last_axis(matches[mean], ty.ndim) or not all(isinstance(t.shape, relax.ShapeExpr) for t in (ty, wty)):
            return expr
        if not tvm_ffi.structural_equal(ty.shape.values[-1], wty.shape.values[0]):  # gamma scales the normalised axis
            return expr
        return relax.op.nn.rms_norm(data, weight, axes=[-1], epsilon=_scalar(matches[eps]))

    return rewrite_call(scaled, rewriter, func)


@tvm.transform.module_pass(opt_level=0, name="FoldRMSNorm")
class FoldRMSNorm:  # pylint: disable=too-few-public-methods
    """Fold RMSNorms written out as arithmetic into ``relax.nn.rms_norm`` (see module doc)."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_user_functions(mod, _rewrite)
