"""OffloadHopperB2B: back-to-back GEMMs to one wgmma kernel on sm_90 (issue 5).

Runs after FuseComputeMemory, before OffloadHopperElementwise (which would take each half on its
own). FuseComputeMemory outlines an MLP ``act(x @ w1.T + b1) @ w2.T + b2 (+ r)`` as two
``gemm_elementwise`` functions, the second reading the first's result:

    lv  = first(w1, x, b1)          # matmul(x, permute_dims(w1)) -> cast, add, activation
    out = second(w2, lv, b2, ...)   # matmul(lv, permute_dims(w2)) -> cast, adds

(or, with nothing after the second GEMM, a plain ``matmul(lv, permute_dims(w2))`` in the
caller; reshapes that only regroup ``lv``'s rows, as PyTorch exports put around each linear of
3-D activations, are looked through). Where ``lv`` has no other reader, each half reads as an
:class:`~tvm_comfuse.schedule.wgmma_elementwise.Elementwise` chain, and the pair fits the
kernel (:mod:`tvm_comfuse.schedule.wgmma_b2b`: an intermediate ``N1`` of 64 to 256, which is
the on-chip budget: one 64-row slab of it in a warpgroup's registers), both calls become one
``R.call_dps_packed`` of the kernel and the intermediate never reaches memory. Anything else
stays as it was: the halves go on to OffloadHopperElementwise or the ``gemm_elementwise`` rule,
and the pass logs why a candidate pair stayed apart.

On by default on sm_90 (``hopper_groups`` selects the groups): written in session 15 on CPU and
measured on the H200 the same day, faster than eager PyTorch and torch.compile at five of issue
5's six MLP shapes and 4-6x faster than vanilla TVM at all six
(``notebooks/results/session15-h200-2026-12-05/``).
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..graph import ops
from .fuse_compute_memory import KIND_ATTR
from .offload_hopper import HopperOffload, Kernels, _sinfo, dataflow_blocks, link, users_of
from .offload_hopper_elementwise import match_elementwise

LOG = logging.getLogger("tvm_comfuse")


def _group(mod: tvm.IRModule, value):
    """``(global var, function, match_elementwise's result)`` if ``value`` calls an outlined
    ``gemm_elementwise`` group the elementwise reading takes, else None."""
    if not isinstance(value, relax.Call) or not isinstance(value.op, relax.GlobalVar):
        return None
    func = mod[value.op]
    if not isinstance(func, relax.Function) or str((func.attrs or {}).get(KIND_ATTR, "")) != "gemm_elementwise":
        return None
    found = match_elementwise(func)
    return None if found is None else (value.op, func, found)


def _plain_gemm(value, var2val, mid):
    """``(w2, the permute_dims binding's var)`` if ``value`` is ``matmul(mid, permute_dims(w2))``
    (a second GEMM with nothing after it, left in the caller by FuseComputeMemory), else None."""
    if not isinstance(value, relax.Call) or ops.op_name(value) != ops.GEMM or not value.args[0].same_as(mid):
        return None
    wt = value.args[1]
    tr = var2val.get(wt)
    if not isinstance(tr, relax.Call) or ops.op_name(tr) != ops.TRANSPOSE:
        return None
    if tr.attrs.axes is not None and [int(a) for a in tr.attrs.axes] != [1, 0]:
        return None
    (w_shape, w_dtype), (_, x_dtype) = _sinfo(tr.args[0]), _sinfo(mid)
    out_dtype = str(value.attrs.out_dtype) if value.attrs.out_dtype else ""
    if w_shape is None or len(w_shape) != 2 or w_dtype != x_dtype or out_dtype not in ("", x_dtype):
        return None
    return tr.args[0], wt


def pair_function(mod: tvm.IRModule, first: relax.Call, mid: relax.Var, second: relax.Call, args: list) -> relax.Function | None:
    """The pair as one Relax function of the kernel's arguments (fresh parameters, typed as
    ``args``): the outlined groups' bodies inlined, ``first``'s result (``mid`` in the caller,
    maybe after row reshapes) feeding ``second`` (a group call, or the plain ``matmul(mid, permute_dims(w2))``),
    marked primitive, so LegalizeOps and FuseTIR make it the one PrimFunc tuning takes as the
    pair's workload (:mod:`tvm_comfuse.tune.hopper`). None where a group reads something that is
    not among ``args``."""
    params = [relax.Var(f"a{i}", a.ty) for i, a in enumerate(args)]
    sub = {}
    for a, p in zip(args, params):
        sub.setdefault(a, p)
    rest = [a for a in second.args if not a.same_as(mid)] if isinstance(second.op, relax.GlobalVar) else []
    if not all(a in sub for a in [*first.args, *rest]):
        return None
    bb = relax.BlockBuilder()

    def group(call, name):
        func = mod[call.op]
        return bb.add_func(relax.Function(func.params, func.body, func.ret_ty), name)

    with bb.function("pair", params):
        with bb.dataflow():
            h = bb.emit(relax.Call(group(first, "first"), [sub[a] for a in first.args]))
            if _sinfo(h)[0] != _sinfo(mid)[0]:  # rows regrouped between the halves
                h = bb.emit(relax.op.reshape(h, _sinfo(mid)[0]))
            if isinstance(second.op, relax.GlobalVar):
                out = bb.emit_output(relax.Call(group(second, "second"), [h if a.same_as(mid) else sub[a] for a in second.args]))
            else:  # a plain second GEMM: w2 is the kernel's last argument
                out = bb.emit_output(relax.Call(second.op, [h, bb.emit(relax.op.permute_dims(params[-1]))], second.attrs))
        bb.emit_func_output(out)
    return relax.transform.InlinePrivateFunctions()(bb.get())["pair"].with_attr("Primitive", True).without_attr("global_symbol")


def _row_reshapes(var, n1: int, users: dict, var2val: dict) -> list:
    """The reshapes that alone carry ``var`` (``[*rows, N1]``) on, each the only reader of the
    one before and keeping the last dim (rows regrouped: what PyTorch's linear exports put
    between 3-D activations and its 2-D GEMM), in order; the kernel reads rows flat, so they cost
    nothing there."""
    chain = []
    while True:
        nxt = users.get(var, [])
        val = var2val.get(nxt[0]) if len(nxt) == 1 and isinstance(nxt[0], relax.DataflowVar) else None
        shape = _sinfo(nxt[0])[0] if val is not None else None
        if val is None or ops.op_name(val) != ops.RESHAPE or not val.args[0].same_as(var) or shape is None or shape[-1] != n1:
            return chain
        chain.append(nxt[0])
        var = nxt[0]


def planned_pairs(mod: tvm.IRModule):
    """Each pair the kernel takes, as ``(first group's global var, second call's var, spec, args, (M,
    N1, N2, K), (x's rows, the output's rows), dropped vars, pair)``: ``args`` the kernel's
    arguments (x, w1, the first chain's operands, w2, the second's), ``dropped`` the bindings
    the fused call replaces besides the second call (the first call, row reshapes between the
    halves, a plain second GEMM's transpose), ``pair()`` the pair as one function
    (:func:`pair_function`, what tuning sees). Pairs the kernel cannot take are logged with the
    reason."""
    from ..schedule import wgmma_b2b as wb  # pylint: disable=import-outside-toplevel
    from ..schedule.wgmma_elementwise import Elementwise  # pylint: disable=import-outside-toplevel

    for func, block in dataflow_blocks(mod):
        var2val = {b.var: b.value for b in block.bindings}
        users = users_of(block, func.body.body)
        claimed = set()  # bindings a pair already takes: in a chain of three linears, the middle one is not also a first
        for b in block.bindings:
            first = _group(mod, b.value) if b.var not in claimed else None
            if first is None:
                continue
            gv1, _, (spec1, roles1, (m, n1, k), out1) = first
            dropped = [b.var, *_row_reshapes(b.var, n1, users, var2val)]
            mid = dropped[-1]  # what the second GEMM reads
            nxt = users.get(mid, [])
            if len(nxt) != 1 or not isinstance(nxt[0], relax.DataflowVar):
                continue
            use = var2val[nxt[0]]
            second = _group(mod, use)
            if second is not None:
                gv2, _, (spec2, roles2, (m2, n2, k2), out_shape) = second
                if not use.args[roles2[0]].same_as(mid) or sum(a.same_as(mid) for a in use.args) != 1:
                    continue
                w2_ops = [use.args[i] for i in roles2[1:]]
            else:
                plain = _plain_gemm(use, var2val, mid)
                if plain is None:
                    continue
                w2, wt = plain
                (n2, k2), m2, out_shape = _sinfo(w2)[0], m, _sinfo(nxt[0])[0]
                spec2, w2_ops, gv2 = Elementwise(spec1.dtype, (), (), _sinfo(nxt[0])[1]), [w2], "matmul"
                dropped += [wt] if users.get(wt) == [nxt[0]] else []
            spec = wb.B2B(spec1, spec2)
            why = wb.problems(m, n1, n2, k, spec) if (m2, k2) == (m, n1) else [f"shapes {(m2, k2)} after {(m, n1)}"]
            if why:
                LOG.info("ComFuse: %s -> %s stay two kernels, the wgmma b2b kernel cannot take %s", gv1.name_hint,
                         getattr(gv2, "name_hint", gv2), "; ".join(why))
                continue
            args = [b.value.args[i] for i in roles1] + w2_ops
            claimed.update([*dropped, nxt[0]])
            pair = lambda first=b.value, mid=mid, use=use, args=args: pair_function(mod, first, mid, use, args)  # noqa: E731
            yield gv1, nxt[0], spec, args, (m, n1, n2, k), (tuple(out1[:-1]), tuple(out_shape[:-1])), dropped, pair


@mutator
class _PairRewriter(PyExprMutator):  # pylint: disable=abstract-method
    """Bind each planned second call's var to its fused kernel's call, and drop the bindings it replaces."""

    def __init__(self, mod, plans, dropped):
        super().__init__(mod)
        self.plans, self.dropped = plans, dropped  # second call's var -> (symbol, args, shape, dtype); vars to drop

    def visit_var_binding_(self, binding):  # pylint: disable=arguments-renamed
        if binding.var in self.dropped:
            return
        if binding.var in self.plans:
            symbol, args, shape, dtype = self.plans[binding.var]
            call = relax.call_dps_packed(relax.ExternFunc(symbol), relax.Tuple([self.visit_expr(a) for a in args]),
                                         relax.TensorType(shape, dtype))
            self.set_var_remap(binding.var, self.builder_.emit(call, binding.var.name))
            return
        super().visit_var_binding_(binding)


@tvm.transform.module_pass(opt_level=0, name="OffloadHopperB2B")
class OffloadHopperB2B(HopperOffload):  # pylint: disable=too-few-public-methods
    """Replace each GEMM -> elementwise -> GEMM pair the wgmma b2b kernel takes by one call of
    it (see the module docstring); a no-op unless ``target`` is an sm_90 CUDA target or
    ``build`` is given (``build(prim_func, symbol, spec, (m, n1, n2, k))``, as the other Hopper
    offloads take it: the CPU tests register the kernel's NumPy model). Pairs that compute the
    same kernel (a model's layers) share one build. ``database``: a pair with a record there
    (``comfuse tune --hopper-groups ... b2b``) runs its fastest configuration, the others the
    default."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Build each pair's kernel, rewrite the caller, drop the group functions left uncalled."""
        from ..schedule import wgmma_b2b as wb  # pylint: disable=import-outside-toplevel
        from ..tune import hopper  # pylint: disable=import-outside-toplevel  (tune imports the pipeline)

        build = self.builder()
        if build is None:
            return mod
        plans, dropped, kernels, tuned = {}, set(), Kernels(build, "comfuse_wgmma_b2b"), 0
        for _, second, spec, args, mnk, leads, gone, pair in planned_pairs(mod):
            cfg = self.tuned(lambda: (pair(), hopper.describe_b2b(spec, mnk, leads, len(args))))  # noqa: B023
            tuned += cfg is not None
            symbol = kernels.symbol((spec, mnk, leads, cfg), "", lambda: wb.wgmma_b2b(*mnk, spec, cfg, *leads), spec, mnk)  # noqa: B023
            plans[second] = (symbol, args, [*leads[1], mnk[2]], spec.out_dtype)
            dropped.update(gone)
        if not plans:
            return mod
        LOG.info("ComFuse: %d GEMM -> elementwise -> GEMM pair(s) run as %d wgmma b2b kernel(s)", len(plans), len(kernels.symbols))
        self.report_tuned(tuned, len(plans), "wgmma b2b pairs")
        rewriter = _PairRewriter(mod, plans, dropped)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function) and KIND_ATTR not in (func.attrs or {}):
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        out = rewriter.builder_.get()
        called = _called(out)
        out = tvm.IRModule({gv: f for gv, f in out.functions_items()
                            if not isinstance(f, relax.Function) or KIND_ATTR not in (f.attrs or {}) or gv.name_hint in called},
                           attrs=out.attrs)
        return link(out, kernels.modules)


def _called(mod: tvm.IRModule) -> set:
    """Names of the global functions some function of ``mod`` still calls."""
    names = set()
    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, lambda e: names.add(e.op.name_hint) if isinstance(e, relax.Call)
                                            and isinstance(e.op, relax.GlobalVar) else None)
    return names
