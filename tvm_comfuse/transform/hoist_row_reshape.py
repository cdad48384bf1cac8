"""HoistRowReshape: keep reshapes out of GEMM groups, where no schedule can tile them.

Two rewrites, both exact:

1. A reshape that only splits rows, after a 2-D GEMM chain, moves to the GEMM's input.
PyTorch's linear on 3-D activations imports as ``reshape(add(matmul(x2d, wT), b), [B, S, N])``
(the GEMM is 2-D, the model is 3-D). Inside a fused group that reshape would be a copy whose
flattened indices no schedule can tile. Rewriting it as
``add(matmul(reshape(x2d, [B, S, K]), wT), b)`` computes the same values (a reshape that keeps
the last axis commutes with matmul and with ops that broadcast along that axis), and the
reshape of ``x`` outside the group is a free view.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..graph import ops
from .user_functions import user_functions


def _shape(expr):
    ty = expr.ty
    if isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr):
        return list(ty.shape.values)
    return None


def _same(a, b) -> bool:
    eq = tvm.sym.Analyzer().can_prove_equal
    return a is not None and b is not None and len(a) == len(b) and all(eq(x, y) for x, y in zip(a, b))


@mutator
class _Hoister(PyExprMutator):  # pylint: disable=abstract-method
    def __init__(self, users, mod=None):
        super().__init__(mod)
        self.users = users

    def _chain(self, var):
        """The single-use elementwise chain from a 2-D GEMM to ``var``: ``[(call, tile_arg_index)]``
        ending at the matmul (index -1), or None."""
        chain, shape = [], _shape(var)
        while True:
            if self.users.get(var, 0) != 1:
                return None
            call = self.lookup_binding(var)
            if not isinstance(call, relax.Call):
                return None
            name = ops.op_name(call)
            if name == ops.GEMM:
                a, b = call.args
                ok = len(_shape(a) or []) == 2 and len(_shape(b) or []) == 2
                return chain + [(call, -1)] if ok else None
            if ops.role_of(call) != "elementwise":
                return None
            tiles = [i for i, a in enumerate(call.args) if _same(_shape(a), shape)]
            others_ok = all(len(_shape(a) or []) <= 1 for i, a in enumerate(call.args) if i not in tiles)
            if len(tiles) != 1 or not others_ok:
                return None
            chain.append((call, tiles[0]))
            var = call.args[tiles[0]]

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        new = None
        if isinstance(value, relax.Call) and ops.op_name(value) == ops.RESHAPE:
            new = self._rewrite(value)
        elif isinstance(value, relax.Call) and len(value.args) == 1 and ops.role_of(value) == "elementwise":
            new = self._sink(value)
        if new is not None:
            self.set_var_remap(binding.var, new)  # already emitted
            return
        super().visit_var_binding_(binding)

    def _sink(self, unary: relax.Call):
        """``op(reshape(y))`` -> ``reshape(op(y))`` when the reshape has no other user."""
        arg = unary.args[0]
        if not isinstance(arg, relax.Var) or self.users.get(arg, 0) != 1:
            return None
        reshape = self.lookup_binding(self.visit_expr(arg))
        if not isinstance(reshape, relax.Call) or ops.op_name(reshape) != ops.RESHAPE:
            return None
        inner = self.builder_.emit(relax.Call(unary.op, [reshape.args[0]], unary.attrs, unary.ty_args))
        return self.builder_.emit(relax.op.reshape(inner, reshape.args[1]))

    def _rewrite(self, reshape: relax.Call):
        src, dst = _shape(reshape.args[0]), _shape(reshape)
        if src is None or dst is None or len(src) != 2 or len(dst) <= 2:
            return None
        if not tvm.sym.Analyzer().can_prove_equal(src[-1], dst[-1]):
            return None
        chain = self._chain(reshape.args[0]) if isinstance(reshape.args[0], relax.Var) else None
        if chain is None:
            return None
        gemm = chain[-1][0]
        x, w = gemm.args
        x3 = self.builder_.emit(relax.op.reshape(x, [*dst[:-1], _shape(x)[-1]]))
        expr = self.builder_.emit(relax.op.matmul(x3, w, out_dtype=gemm.attrs.out_dtype))
        for call, index in reversed(chain[:-1]):
            args = list(call.args)
            args[index] = expr
            expr = self.builder_.emit(relax.Call(call.op, args, call.attrs, call.ty_args))
        return expr


def _use_counts(func: relax.Function) -> dict:
    counts = {}
    for block in func.body.blocks:
        for b in block.bindings:
            for v in relax.analysis.free_vars(b.value):
                counts[v] = counts.get(v, 0) + 1
            if not isinstance(b.var, relax.DataflowVar):
                counts[b.var] = counts.get(b.var, 0) + 1
    for v in relax.analysis.free_vars(func.body.body):
        counts[v] = counts.get(v, 0) + 1
    return counts


@tvm.transform.module_pass(opt_level=0, name="HoistRowReshape")
class HoistRowReshape:  # pylint: disable=too-few-public-methods
    """Move row-splitting reshapes after 2-D GEMM chains to the GEMM's input (see module doc)."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite every Relax function; unused old bindings are removed."""
        out = mod.clone()
        for gv, func in user_functions(mod):
            if isinstance(func.body, relax.SeqExpr):
                out[gv] = relax.analysis.remove_all_unused(_Hoister(_use_counts(func), mod).visit_expr(func))
        return out
