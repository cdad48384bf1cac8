"""ExactSquare: ``power(x, 2)`` inside ComFuse's groups is computed as ``x * x``.

Why: TVM compiles CUDA with ``--use_fast_math``, under which ``powf`` becomes ``__powf``
(``exp2(y * log2(x))``): NaN for every negative base. So vanilla TVM's ``x ** 2`` is NaN
wherever ``x < 0`` on GPUs (GPU fuzz seed 120: 803 NaN where the float64 reference has none,
ComFuse's fused kernel as wrong, in 802 places). ``x * x`` is one correctly rounded product, the
value a correctly rounded ``pow(x, 2)`` has, on every target. Only the functions ComFuse outlines
(those with ``comfuse.kind``) are rewritten: everything outside the groups stays vanilla TVM.
Run it after FuseComputeMemory, before LegalizeOps.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import is_op, rewrite_call, wildcard

from .fuse_compute_memory import KIND_ATTR


def _is_two(expr) -> bool:
    if not isinstance(expr, tvm.ir.expr.Constant):
        return False
    value = expr.value.numpy()
    return value.size == 1 and float(value.reshape(())) == 2.0


def _calls(mod: tvm.IRModule, groups: set) -> dict:
    """GlobalVar name of each group -> the argument tuples of its calls in the module."""
    found = {name: [] for name in groups}

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, relax.GlobalVar) and expr.op.name_hint in found:
            found[expr.op.name_hint].append(list(expr.args))

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, visit)
    return found


def _rewrite(func: relax.Function, calls: list) -> relax.Function:
    """``power(x, e)`` -> ``x * x`` where ``e`` is the constant 2, or a parameter every call
    passes the constant 2 (FuseOpsByPattern lifts a group's constants into parameters)."""
    twos = {p for i, p in enumerate(func.params) if calls and all(_is_two(args[i]) for args in calls)}
    base, exponent = wildcard(), wildcard()
    square = is_op("relax.power")(base, exponent)

    def rewriter(expr, matches):
        e = matches[exponent]
        if not (_is_two(e) or (isinstance(e, relax.Var) and e in twos)) or str(expr.ty.dtype) != str(matches[base].ty.dtype):
            return expr
        return relax.op.multiply(matches[base], matches[base])

    return rewrite_call(square, rewriter, func)


@tvm.transform.module_pass(opt_level=0, name="ExactSquare")
class ExactSquare:  # pylint: disable=too-few-public-methods
    """Rewrite ``power(x, 2)`` as ``x * x`` in ComFuse's outlined groups (see module doc)."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        groups = {gv.name_hint for gv, f in mod.functions_items() if isinstance(f, relax.Function) and f.attrs and KIND_ATTR in f.attrs}
        calls = _calls(mod, groups)
        out = mod.clone()
        for gv, func in mod.functions_items():
            if gv.name_hint in groups:
                out[gv] = _rewrite(func, calls[gv.name_hint])
        return out
