"""OffloadHopperElementwise: GEMM + elementwise groups to the wgmma kernel on sm_90.

Runs right after FuseComputeMemory (and OffloadHopperPostNorm), on its outlined
``gemm_elementwise`` functions. One whose body is

    matmul(x, permute_dims(w)) -> casts, adds (a bias [N], a tile [..., N]) and activations
        (gelu, gelu_tanh, relu, silu) -> one output

as an imported BERT's FFN1 (``gelu(x @ w.T + b)``) and Q, K and V projections (``x @ w.T + b``)
are, is read into an :class:`~tvm_comfuse.schedule.wgmma_elementwise.Elementwise` description;
if the kernel takes its shape (M and N multiples of a tile, static shapes), the kernel is built
for it and the call becomes ``R.call_dps_packed`` of it, as OffloadHopperPostNorm does. Anything
else (another op, a second output, an unused binding, shapes the kernel cannot take) is left to
the ``gemm_elementwise`` rule.

On by default on sm_90 since session 15 (``hopper_groups`` selects the groups). Why: BERT-base's
FFN1 + GELU took 102 us a layer under the rule on the H200 (session 10); the kernel, written on
CPU in session 14 and first run in session 15, takes 48.1 us (eager PyTorch 48.2,
torch.compile 53.9), and the projections writing attention's layouts 12-14 us (eager 19-28).
"""

from __future__ import annotations

import dataclasses
import logging

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..graph import ops
from .offload_hopper import GroupBody, HopperOffload, Kernels, _sinfo, dataflow_blocks, groups_taken, replace_calls, users_of

LOG = logging.getLogger("tvm_comfuse")


def match_elementwise(func: relax.Function):
    """``(spec, roles, (M, N, K), out_shape)`` for a GEMM + elementwise function, or None.

    ``roles`` are the indices of the function's parameters for the kernel's ``x, w, operand 0,
    ...``; ``out_shape`` is ``[*rows, N]``."""
    from ..schedule.chain import ACTIVATIONS  # pylint: disable=import-outside-toplevel
    from ..schedule.wgmma_elementwise import Elementwise  # pylint: disable=import-outside-toplevel

    body = GroupBody(func)
    if body.var2val is None or len(body.outs) != 1 or not isinstance(body.outs[0], relax.Var) or body.outs[0] not in body.var2val:
        return None
    out_shape, out_dtype = _sinfo(body.outs[0])
    read = body.read(body.outs[0], out_shape, ACTIVATIONS) if out_shape is not None else None
    if read is None:
        return None
    found, (steps, operands, roles, mnk) = read
    return Elementwise(_sinfo(found[1])[1], steps, operands, out_dtype), roles, mnk, out_shape


def taken_groups(mod: tvm.IRModule):
    """``(global var, function, match_elementwise's result)`` of each outlined
    ``gemm_elementwise`` group of ``mod`` the wgmma kernel takes."""
    from ..schedule import wgmma_elementwise as we  # pylint: disable=import-outside-toplevel

    return groups_taken(mod, "gemm_elementwise", match_elementwise, we.problems)


def layout_tail(var, users: dict, var2val: dict, out_shape):
    """The layout ops that alone consume the group result ``var`` (``[*rows, N]``): a reshape
    splitting N in two (attention's heads), permutations of the dims, a cast, reshapes of the
    permuted tensor, a ``broadcast_to`` of its own shape, each the only user of the one before.
    Returns ``(tail vars, layout or (), cast dtype or None)`` (the layout as
    :class:`~tvm_comfuse.schedule.wgmma_elementwise.Elementwise` takes it), or None where no
    such op follows."""
    tail, dims, axes, cast, flat, shape, cur = [], None, None, None, False, list(out_shape), var
    while True:
        nxt = users.get(cur, [])
        if len(nxt) != 1 or not isinstance(nxt[0], relax.DataflowVar):
            break
        val = var2val.get(nxt[0])
        name = ops.op_name(val) if isinstance(val, relax.Call) else None
        new_shape, new_dtype = _sinfo(nxt[0])
        if name is None or new_shape is None or not val.args[0].same_as(cur):
            break
        if name == ops.RESHAPE and dims is None:  # [*rows, N] -> [*rows, H, D]
            if new_shape[:-2] != shape[:-1] or new_shape[-2] * new_shape[-1] != shape[-1]:
                break
            dims, axes = tuple(new_shape), tuple(range(len(new_shape)))
        elif name == ops.RESHAPE:
            flat = True  # the permuted tensor's elements in the same order
        elif name == ops.TRANSPOSE and dims is not None and not flat:
            perm = [int(a) for a in val.attrs.axes] if val.attrs.axes is not None else list(reversed(range(len(axes))))
            axes = tuple(axes[a] for a in perm)
        elif name == ops.BROADCAST and new_shape == shape:
            pass
        elif name == "relax.astype" and cast is None and new_dtype in ("float16", "bfloat16", "float32"):
            cast = new_dtype
        else:
            break
        tail.append(nxt[0])
        cur, shape = nxt[0], new_shape
    if not tail:
        return None
    return tail, ((dims, axes, tuple(shape)) if dims is not None else ()), cast


def _tails(mod: tvm.IRModule, names) -> dict:
    """Group name -> ``(tail vars, layout, cast)`` for each group in ``names`` called once, from a
    dataflow block, with a :func:`layout_tail` after it."""
    calls, found = {}, {}
    for func, block in dataflow_blocks(mod):
        users, var2val = None, {b.var: b.value for b in block.bindings}
        for b in block.bindings:
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, relax.GlobalVar) and b.value.op.name_hint in names:
                name = b.value.op.name_hint
                calls[name] = calls.get(name, 0) + 1
                users = users or users_of(block, func.body.body)
                tail = layout_tail(b.var, users, var2val, _sinfo(b.var)[0])
                if tail is not None:
                    found[name] = tail
    return {name: tail for name, tail in found.items() if calls[name] == 1}


@mutator
class _TailRewriter(PyExprMutator):  # pylint: disable=abstract-method
    """Bind each planned group call's kernel call, in its tail's layout and dtype, in place of
    the call, and its tail's variables to it."""

    def __init__(self, mod, plans):
        super().__init__(mod)
        self.plans = plans  # group name -> (symbol, roles, out_shape, out_dtype, tail vars)
        self.tail_of = {}

    def visit_var_binding_(self, binding):  # pylint: disable=arguments-renamed
        value = binding.value
        if isinstance(value, relax.Call) and isinstance(value.op, relax.GlobalVar) and value.op.name_hint in self.plans:
            symbol, roles, shape, dtype, tail = self.plans[value.op.name_hint]
            args = relax.Tuple([self.visit_expr(value.args[i]) for i in roles])
            call = self.builder_.emit(relax.call_dps_packed(relax.ExternFunc(symbol), args, relax.TensorType(shape, dtype)),
                                      tail[-1].name)
            self.tail_of.update({v: call for v in tail})
            return
        if binding.var in self.tail_of:
            self.set_var_remap(binding.var, self.tail_of[binding.var])
            return
        super().visit_var_binding_(binding)


def _rewrite_tails(mod: tvm.IRModule, plans: dict) -> tvm.IRModule:
    rewriter = _TailRewriter(mod, plans)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function) and gv.name_hint not in plans:
            rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
    return rewriter.builder_.get()


def planned_groups(mod: tvm.IRModule):
    """``(global var, function, spec, roles, (M, N, K), out_shape, tail vars or None)`` of each
    group the kernel takes, ``spec`` extended by the layout and cast of the tail after its call
    (what the kernel then writes; ``out_shape`` stays the group's ``[*rows, N]``): what
    :class:`OffloadHopperElementwise` builds and ``comfuse tune`` makes its tasks."""
    from ..schedule.chain import Step  # pylint: disable=import-outside-toplevel

    taken = list(taken_groups(mod))
    tails = _tails(mod, {gv.name_hint for gv, *_ in taken})
    for gv, func, (spec, roles, mnk, out_shape) in taken:
        tail = tails.get(gv.name_hint)
        if tail is not None:  # the layout ops after it: the kernel writes their result
            tail_vars, layout, cast = tail
            spec = dataclasses.replace(spec, steps=spec.steps + ((Step("cast", cast),) if cast else ()),
                                       out_dtype=cast or spec.out_dtype, layout=layout)
        yield gv, func, spec, roles, mnk, out_shape, tail_vars if tail is not None else None


@tvm.transform.module_pass(opt_level=0, name="OffloadHopperElementwise")
class OffloadHopperElementwise(HopperOffload):  # pylint: disable=too-few-public-methods
    """Replace the GEMM + elementwise groups the wgmma kernel takes by calls of it (see the
    module docstring); a no-op unless ``target`` is an sm_90 CUDA target or ``build`` is given.

    ``build(prim_func, symbol, spec, (m, n, k))`` makes each kernel available under ``symbol``,
    as :class:`~tvm_comfuse.transform.OffloadHopperPostNorm`'s does (the CPU tests register a
    NumPy model). Groups that compute the same kernel (a model's layers) share one build.
    ``database``: a group with a record there (``comfuse tune --hopper-groups ... elementwise``)
    runs its fastest configuration, the others the default.
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Build each eligible group's kernel, rewrite its calls, drop the outlined function."""
        from ..schedule import wgmma_elementwise as we  # pylint: disable=import-outside-toplevel
        from ..tune import hopper  # pylint: disable=import-outside-toplevel  (tune imports the pipeline)

        build = self.builder()
        if build is None:
            return mod
        offloads, kernels, plans, tuned = {}, Kernels(build, "comfuse_wgmma_ew"), {}, 0
        for gv, func, spec, roles, mnk, out_shape, tail in planned_groups(mod):
            cfg = self.tuned(lambda: (func, hopper.describe_elementwise(spec, roles, mnk, out_shape)))  # noqa: B023
            tuned += cfg is not None
            symbol = kernels.symbol((spec, mnk, tuple(out_shape), cfg), gv.name_hint,
                                    lambda: we.wgmma_elementwise(*mnk, spec, cfg, lead=out_shape[:-1]), spec, mnk)  # noqa: B023
            offloads[gv.name_hint] = (symbol, roles, out_shape, spec.out_dtype, ("out",))
            if tail is not None:
                plans[gv.name_hint] = (symbol, roles, list(_sinfo(tail[-1])[0]), spec.out_dtype, tail)
        if not offloads:
            return mod
        LOG.info("ComFuse: %d GEMM + elementwise group(s) run as %d wgmma kernel(s), %d writing the layout of the "
                 "reshapes, transposes and casts after them", len(offloads), len(kernels.symbols), len(plans))
        self.report_tuned(tuned, len(offloads), "wgmma GEMM + elementwise groups")
        return replace_calls(_rewrite_tails(mod, plans) if plans else mod, offloads, kernels.modules)
