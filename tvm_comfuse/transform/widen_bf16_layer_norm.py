"""WidenBF16LayerNorm: a bfloat16 ``nn.layer_norm`` left to vanilla TVM is computed in float32.

Why: TVM 0.27 cannot legalise ``relax.nn.layer_norm`` on bfloat16 ("layer_norm: only support
float32 and float16 for now"), so a bf16 LayerNorm that no ComFuse group takes (no GEMM feeds it,
or rows of one column) failed the whole compile, as it fails vanilla TVM's; the CPU fuzzer found
one in session 21 (seed 3439: a one-column GEMM, then LayerNorm). The fused groups already
compute their norms in float32 and round once (``FuseComputeMemory``'s widening of half
precision), as PyTorch's bf16 LayerNorm accumulates in float32; this gives the norms left outside
the same treatment: ``astype(layer_norm(astype(x, f32), astype(gamma, f32), astype(beta, f32)),
bf16)``. float16 LayerNorms, which TVM legalises, are left as vanilla TVM computes them.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import is_op, rewrite_call, wildcard

from .user_functions import rewrite_user_functions


def _rewrite(func: relax.Function) -> relax.Function:
    pattern = is_op("relax.nn.layer_norm")(wildcard(), wildcard(), wildcard())

    def rewriter(expr, _matches):
        if not isinstance(expr.ty, relax.TensorType) or str(expr.ty.dtype) != "bfloat16":
            return expr
        wide = [relax.op.astype(a, "float32") if str(a.ty.dtype) == "bfloat16" else a for a in expr.args]
        return relax.op.astype(relax.Call(expr.op, wide, expr.attrs), "bfloat16")

    return rewrite_call(pattern, rewriter, func)


@tvm.transform.module_pass(opt_level=0, name="WidenBF16LayerNorm")
class WidenBF16LayerNorm:  # pylint: disable=too-few-public-methods
    """Compute bfloat16 LayerNorms outside ComFuse's groups in float32 (see module doc)."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_user_functions(mod, _rewrite)
