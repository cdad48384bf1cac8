"""OffloadHopperAttention: multi-head attention to one wgmma kernel on sm_90 (issue 5).

Runs after FuseComputeMemory and before OffloadHopperElementwise, on the caller's dataflow. An
attention as an imported HuggingFace encoder computes it,

    q, k, v [B, S, H * D]  -> split into heads (reshape, permute_dims, casts) -> [B * H, S, D] (k: [B * H, D, S])
    softmax(cast(scale * matmul(q, k)) (+ padding mask)) -> cast -> matmul(p, v) -> [B * H, S, D]
        -> heads merged (permute_dims, reshapes) -> [B * S, H * D]

becomes one call of :func:`~tvm_comfuse.schedule.wgmma_attention.wgmma_attention` on ``q`` and
``k`` cast to the kernel's dtype and ``v`` transposed to ``[B * H * D, S]``, written as Relax
ops in the kernel's place: OffloadHopperElementwise then folds those casts and that transpose
into the projections that produce ``q``, ``k`` and ``v``, so no head split or merge runs as a
kernel of its own. The layout ops are checked by where they take elements (:class:`Layout`): any
sequence of reshapes, transposes and no-op broadcasts that arranges the elements as attention
needs is accepted, nothing that does not.

On by default on sm_90 since session 15 (``hopper_groups`` selects the groups). Why: at
BERT-base, batch 32 x 128, the attention's softmax, batched matmuls and head transposes took
2113 of ComFuse's 5346 us on the H200 (session 10), for ~25 MB of traffic a layer; the kernel,
written on CPU in session 14 and first run in session 15, takes 14.6 us a layer (flash
attention: 9.3), and BERT-base with every Hopper kernel 2052 us end to end
(``notebooks/results/session15-h200-2026-12-05/``).
"""

from __future__ import annotations

import logging
import math

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..graph import ops
from .offload_hopper import HopperOffload, Kernels, _sinfo, dataflow_blocks, link, users_of

LOG = logging.getLogger("tvm_comfuse")
_LAYOUT = (ops.RESHAPE, ops.TRANSPOSE, ops.BROADCAST, "relax.astype")


def _back(var, var2val):
    """``(source, layout calls from the source on, the vars they bind)``: ``var`` walked back
    through layout ops."""
    calls, bound = [], []
    while isinstance(var2val.get(var), relax.Call) and ops.op_name(var2val[var]) in _LAYOUT:
        calls.append(var2val[var])
        bound.append(var)
        var = var2val[var].args[0]
    return var, calls[::-1], bound


class Layout:
    """Where a chain of layout ops takes each element from: the source's flat index of each
    flat index of the result (reshapes keep flat indices, a transpose permutes coordinates).
    Two chains arrange a tensor alike when they agree on every index; :meth:`same_as` compares
    them on 20,000 indices (the first, the last and random ones): chains of reshapes and
    transposes that differ anywhere differ on most elements, and a whole index array of a
    long attention's probabilities (B * H * S * S) would take gigabytes."""

    def __init__(self, shape):
        self.shape, self.steps, self.casts = list(shape), [], []

    def reshape(self, shape) -> Layout:
        if math.prod(shape) != math.prod(self.shape):
            raise ValueError(f"reshape of {self.shape} to {shape}")
        self.shape = list(shape)
        return self

    def transpose(self, axes) -> Layout:
        axes = list(axes) if axes is not None else list(reversed(range(len(self.shape))))
        self.steps.append((list(self.shape), axes))
        self.shape = [self.shape[a] for a in axes]
        return self

    @classmethod
    def of(cls, shape, calls) -> Layout | None:
        """The layout of ``calls`` (reshapes, transposes, broadcasts to the same shape, casts) on a
        tensor of ``shape``, its casts' dtypes in ``casts``; None where one is not a layout op."""
        layout = cls(shape)
        for call in calls:
            shape_out, dtype = _sinfo(call)
            name = ops.op_name(call)
            if shape_out is None:
                return None
            if name == ops.RESHAPE and math.prod(shape_out) == math.prod(layout.shape):
                layout.reshape(shape_out)
            elif name == ops.TRANSPOSE:
                layout.transpose([int(x) for x in call.attrs.axes] if call.attrs.axes is not None else None)
            elif name == ops.BROADCAST and layout.shape == shape_out:
                pass
            elif name == "relax.astype":
                layout.casts.append(dtype)
            else:
                return None
        return layout

    def source(self, flat):
        """The source's flat indices of the result's flat indices ``flat``."""
        for shape_in, axes in reversed(self.steps):
            coords = np.unravel_index(flat, [shape_in[a] for a in axes])
            src = [None] * len(axes)
            for i, a in enumerate(axes):
                src[a] = coords[i]
            flat = np.ravel_multi_index(src, shape_in)
        return flat

    def same_as(self, other: Layout, shape: bool = True) -> bool:
        """Whether both arrange the same source alike (and, with ``shape``, in the same shape)."""
        size = math.prod(self.shape)
        if size != math.prod(other.shape) or (shape and self.shape != other.shape):
            return False
        rng = np.random.default_rng(0)
        flat = np.unique(np.concatenate([np.arange(min(size, 4096)), np.arange(max(0, size - 4096), size),
                                         rng.integers(0, size, 12000)]))
        return bool(np.array_equal(self.source(flat), other.source(flat)))


def _scalar(expr, var2val):
    """The value of a scalar constant (possibly cast), or None."""
    while isinstance(expr, relax.Var) and expr in var2val:
        expr = var2val[expr]
    if isinstance(expr, relax.Call) and ops.op_name(expr) == "relax.astype":
        return _scalar(expr.args[0], var2val)
    if isinstance(expr, tvm.ir.expr.Constant) and expr.value.numpy().size == 1:
        return float(expr.value.numpy().reshape(()))
    return None


def match_attention(mm2, var2val, users):
    """For the binding ``mm2 = matmul(p, v)`` of a dataflow block: ``(spec, (q, k, v[, mask]),
    final var, skipped vars)`` if it ends an attention the kernel takes (see the module
    docstring), else None. ``q``, ``k``, ``v`` are the sources before the head split, ``mask`` a
    padding mask added to the scores in fp32 (``[B or 1, 1, 1, S]``); the final var is the
    merged-heads value the kernel writes; the skipped vars are every binding it replaces."""
    from ..schedule.wgmma_attention import Attention  # pylint: disable=import-outside-toplevel

    call = var2val[mm2]
    if ops.op_name(call) != ops.GEMM:
        return None
    p_src, p_calls, p_vars = _back(call.args[0], var2val)
    v_src, v_calls, v_vars = _back(call.args[1], var2val)
    soft = var2val.get(p_src)
    if not isinstance(soft, relax.Call) or ops.op_name(soft) != "relax.nn.softmax" or not ops.reduces_last_axis(soft):
        return None
    x, chain, mask_add = soft.args[0], [], var2val.get(soft.args[0])
    if isinstance(mask_add, relax.Call) and ops.op_name(mask_add) == "relax.add":  # a padding mask, added in fp32
        x = next((a for a in mask_add.args if _sinfo(a)[0] == _sinfo(mask_add)[0]), None)
        mask = next((a for a in mask_add.args if x is not None and not a.same_as(x)), None)
        if x is None or mask is None or _sinfo(mask_add)[1] != "float32":
            return None
    else:
        mask_add = mask = None
    # back from the softmax (or its mask): a cast to fp32, the scaling, layout ops to the first matmul
    while isinstance(var2val.get(x), relax.Call) and ops.op_name(var2val[x]) in (*_LAYOUT, "relax.multiply", "relax.divide"):
        chain.append(var2val[x])
        x = var2val[x].args[0]
    mm1 = var2val.get(x)
    if not isinstance(mm1, relax.Call) or ops.op_name(mm1) != ops.GEMM:
        return None
    scaling = [c for c in chain if ops.op_name(c) in ("relax.multiply", "relax.divide")]
    casts = [c for c in chain if ops.op_name(c) == "relax.astype"]
    if len(scaling) != 1 or [_sinfo(c)[1] for c in casts] != ["float32"] or not chain[0].same_as(casts[0]):
        return None
    if _sinfo(scaling[0])[1] != _sinfo(mm1)[1]:
        return None  # scaled in another dtype than the scores: not what the kernel rounds
    scale = _scalar(scaling[0].args[1], var2val)
    q_src, q_calls, q_vars = _back(mm1.args[0], var2val)
    k_src, k_calls, k_vars = _back(mm1.args[1], var2val)
    qh_shape, src_shape = _sinfo(mm1.args[0])[0], _sinfo(q_src)[0]
    if scale is None or qh_shape is None or len(qh_shape) != 3 or src_shape is None:
        return None
    bh, s, d = qh_shape
    if _sinfo(mm1)[0] != [bh, s, s] or _sinfo(mm2)[0] != [bh, s, d] or src_shape[-1] % d:
        return None
    h = src_shape[-1] // d
    b = bh // h
    if b * h != bh or math.prod(src_shape) != b * s * h * d or any(_sinfo(v)[0] != src_shape for v in (k_src, v_src)):
        return None
    heads = Layout([b, s, h * d]).reshape([b, s, h, d]).transpose([0, 2, 1, 3]).reshape([bh, s, d])
    want = {"q": heads, "k": Layout([b, s, h * d]).reshape([b, s, h, d]).transpose([0, 2, 1, 3]).reshape([bh, s, d]).transpose([0, 2, 1]),
            "v": heads}
    dtypes = set()
    for name, calls, src in (("q", q_calls, q_src), ("k", k_calls, k_src), ("v", v_calls, v_src)):
        got = Layout.of(src_shape, calls)
        if got is None or len(got.casts) > 1 or not got.same_as(want[name]):
            return None
        dtypes.add(got.casts[0] if got.casts else _sinfo(src)[1])
    p_got = Layout.of(_sinfo(p_src)[0], p_calls)  # the probabilities and the scores: memory order kept
    if len(dtypes) != 1 or p_got is None or p_got.casts != list(dtypes) or not p_got.same_as(Layout(p_got.shape)):
        return None
    scores = Layout.of([bh, s, s], [c for c in chain[::-1] if ops.op_name(c) in _LAYOUT[:3]])
    if scores is None or not scores.same_as(Layout([bh, s, s]), shape=False):
        return None
    mask_batch = 1
    if mask is not None:  # one value per batch row (or for all) and key: [B or 1, 1, 1, S], right-aligned
        shape = _sinfo(mask)[0]
        padded = [1] * (4 - len(shape or [])) + list(shape or [0] * 5)
        if len(padded) != 4 or padded[1:] != [1, 1, s] or padded[0] not in (1, b):
            return None
        mask_batch = padded[0]
    # forward from the second matmul: the merged heads, [B * S, H * D] in memory order
    merged = Layout([bh, s, d]).reshape([b, h, s, d]).transpose([0, 2, 1, 3])
    cur, tail, final, out_calls = mm2, [], None, []
    while len(users.get(cur, [])) == 1 and isinstance(users[cur][0], relax.DataflowVar):
        nxt = users[cur][0]
        if ops.op_name(var2val[nxt]) not in _LAYOUT or not var2val[nxt].args[0].same_as(cur):
            break
        out_calls.append(var2val[nxt])
        tail.append(nxt)
        got = Layout.of([bh, s, d], out_calls)
        if got is None or len(got.casts) > 1:
            break
        if got.same_as(merged, shape=False):  # [B * S, H * D], [B, S, H * D], ...: the memory order is what counts
            final = (nxt, len(tail))
        cur = nxt
    if final is None:
        return None
    final_var, used = final
    spec = Attention(b, h, s, d, dtypes.pop(), _sinfo(mm1)[1], scale, ops.op_name(scaling[0])[len("relax."):], _sinfo(final_var)[1],
                     "keys" if mask is not None else "", mask_batch, _sinfo(mask)[1] if mask is not None else "float32")
    skipped = [*p_vars, *v_vars, *q_vars, *k_vars, mm2, *tail[:used]]
    skipped += [v for v, val in var2val.items() if any(val.same_as(c) for c in (soft, mm1, *chain, *([mask_add] if mask_add is not None else [])))]
    if any(u not in skipped for v in skipped if v is not final_var for u in users.get(v, [])):
        return None  # an intermediate value something else reads: keep the graph as it is
    return spec, (q_src, k_src, v_src, *([mask] if mask is not None else [])), final_var, skipped


@mutator
class _AttentionRewriter(PyExprMutator):  # pylint: disable=abstract-method
    """Emit each planned attention's kernel call (and the casts and transpose of its inputs) at
    its final binding, drop the bindings it replaces."""

    def __init__(self, mod, plans):
        super().__init__(mod)
        self.plans = plans  # final var -> (symbol, spec, (q, k, v)); skipped vars
        self.skipped = {v for plan in plans.values() for v in plan[3]}

    def visit_var_binding_(self, binding):  # pylint: disable=arguments-renamed
        if binding.var in self.plans:
            symbol, spec, sources, _ = self.plans[binding.var]
            q, k, v, *mask = (self.visit_expr(a) for a in sources)
            emit = self.builder_.emit
            q16, k16 = (emit(relax.op.astype(a, spec.dtype)) if _sinfo(a)[1] != spec.dtype else a for a in (q, k))
            b, h, s, d = spec.batch, spec.heads, spec.seq, spec.head_dim
            vt = emit(relax.op.reshape(v, (b, s, h, d)))
            vt = emit(relax.op.permute_dims(vt, [0, 2, 3, 1]))
            vt = emit(relax.op.astype(vt, spec.dtype)) if _sinfo(v)[1] != spec.dtype else vt
            vt = emit(relax.op.reshape(vt, (b * h * d, s)))
            out = relax.TensorType(_sinfo(binding.var)[0], spec.out_dtype)
            self.set_var_remap(binding.var, emit(relax.call_dps_packed(relax.ExternFunc(symbol), relax.Tuple([q16, k16, vt, *mask]), out),
                                                 binding.var.name))
            return
        if binding.var in self.skipped:
            return
        super().visit_var_binding_(binding)


def _plans(mod: tvm.IRModule) -> list:
    """:func:`match_attention`'s result for every attention in ``mod``'s functions."""
    found = []
    for func, block in dataflow_blocks(mod):
        var2val, users = {b.var: b.value for b in block.bindings}, users_of(block, func.body.body)
        for binding in block.bindings:
            if isinstance(binding.value, relax.Call) and ops.op_name(binding.value) == ops.GEMM:
                matched = match_attention(binding.var, var2val, users)
                if matched is not None:
                    found.append(matched)
    return found


@tvm.transform.module_pass(opt_level=0, name="OffloadHopperAttention")
class OffloadHopperAttention(HopperOffload):  # pylint: disable=too-few-public-methods
    """Replace the attentions the wgmma kernel takes by calls of it (see the module docstring);
    a no-op unless ``target`` is an sm_90 CUDA target or ``build`` is given. ``build(prim_func,
    symbol, spec, None)`` as OffloadHopperPostNorm's; identical attentions (a model's layers)
    share one kernel."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        from ..schedule.wgmma_attention import wgmma_attention  # pylint: disable=import-outside-toplevel

        build = self.builder()
        if build is None:
            return mod
        plans, kernels = {}, Kernels(build, "comfuse_wgmma_attention")
        for spec, sources, final, skipped in _plans(mod):
            why = spec.problems()
            if why:
                LOG.info("ComFuse: an attention stays with vanilla fusion, the wgmma kernel cannot take %s", "; ".join(why))
                continue
            shapes = [tuple(_sinfo(v)[0]) for v in sources]
            out_shape = tuple(_sinfo(final)[0])
            vt_shape = (spec.batch * spec.heads * spec.head_dim, spec.seq)
            symbol = kernels.symbol((spec, tuple(shapes), out_shape), "", lambda: wgmma_attention(  # noqa: B023
                spec, shapes[0], shapes[1], vt_shape, out_shape, shapes[3] if spec.mask else None), spec, None)
            plans[final] = (symbol, spec, sources, skipped)
        if not plans:
            return mod
        rewriter = _AttentionRewriter(mod, plans)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        LOG.info("ComFuse: %d attention(s) run as %d wgmma kernel(s)", len(plans), len(kernels.symbols))
        return link(rewriter.builder_.get(), kernels.modules)
