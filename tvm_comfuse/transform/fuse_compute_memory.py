"""FuseComputeMemory: outline each compute-memory fusion group into one Relax function.

Run it before ``LegalizeOps``. It first applies :class:`HoistRowReshape` (PyTorch's 3-D
linear imports as a 2-D GEMM followed by a reshape), then each group found by :mod:`tvm_comfuse.graph.analysis` becomes a
dataflow pattern of its own (the exact operator DAG, arguments outside the group as
wildcards) rooted at the group's sink binding; ``FuseOpsByPattern`` then outlines it into a
``Primitive`` function that ``FuseTIR`` later turns into one PrimFunc. Using TVM's own
partitioner means the outlining (parameters, extra outputs for intermediates read
elsewhere, constant handling) is TVM's, and a pattern that does not match exactly is simply
not fused: the module stays as vanilla TVM would compile it.

Inside a group, a half-precision GEMM accumulates in float32 and is cast back right after
(``astype(matmul(a, b, out_dtype="float32"), "float16")``): the tensor-core mainloop
accumulates in fp32 anyway, and vanilla TVM's fp16 accumulation is ten times less accurate
than PyTorch's. LayerNorm/RMSNorm/softmax likewise compute in float32 between casts (TVM
cannot legalise a bf16 LayerNorm at all). The chain sees the same dtypes as before.

The pass records ``{function name: group kind}`` in the module attribute
``comfuse.groups`` (module attributes survive legalisation and FuseTIR) and the kind in the
outlined function's ``comfuse.kind`` attribute; :class:`AnnotateFusedBlocks` copies both
onto the PrimFuncs after FuseTIR.
"""

from __future__ import annotations

from dataclasses import replace

import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.dpl import is_op, wildcard
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..errors import check_module
from ..graph import ops
from ..graph.analysis import find_groups
from ..graph.group import B2B_GEMM, GEMM_ELEMENTWISE, GEMM_REDUCE, KINDS
from ..target import is_gpu, parse_target
from .cast_before_transpose import CastBeforeTranspose
from .fold_rms_norm import FoldRMSNorm
from .hoist_row_reshape import HoistRowReshape
from .user_functions import user_functions

GROUPS_ATTR = "comfuse.groups"
KIND_ATTR = "comfuse.kind"
_PATTERN_PREFIX = "comfuse."


def _relax_functions(mod: tvm.IRModule):
    """``(name, function)`` of the user-level Relax functions of a module."""
    for gv, func in user_functions(mod):
        yield gv.name_hint, func


def _group_pattern(group, var2val):
    """The exact dataflow pattern of ``group``, and a check that pins it to its own sink."""
    pats = {}
    for var in group.bindings:
        call = var2val[var]
        args = [pats[a] if isinstance(a, relax.Var) and a in pats else wildcard() for a in call.args]
        pats[var] = is_op(ops.op_name(call))(*args)
    sink = var2val[group.bindings[-1]]
    return pats[group.bindings[-1]], (lambda ctx: ctx.matched_expr.same_as(sink))


@mutator
class _WidenHalfPrecision(PyExprMutator):  # pylint: disable=abstract-method
    """Half-precision GEMMs accumulate, and normalisations compute, in float32; cast back.

    A norm's cast back that the group only widens to float32 again (the last LayerNorm of a
    model imported in fp16, whose function returns float32) is dropped: the group returns the
    float32 norm, one rounding to half fewer, and the post-norm kernels, which write their
    norm in one dtype, take the group (the matcher declined the cast pair)."""

    def __init__(self):
        super().__init__()
        self.narrowed = []  # (cast back to half, the float32 value it casts)
        self.dropped = False

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        dtype = str(call.ty.dtype) if isinstance(call.ty, relax.TensorType) else ""
        name = ops.op_name(call)
        if name == "relax.astype" and dtype == "float32" and isinstance(call.args[0], relax.Var):
            value = self.lookup_binding(call.args[0])
            wide = next((w for cast, w in self.narrowed if value is not None and value.same_as(cast)), None)
            self.dropped |= wide is not None
            return call if wide is None else wide
        if dtype not in _HALF or not (name == ops.GEMM or name in ops.ROW_NORMS):
            return call
        if name == ops.GEMM:
            wide = relax.op.matmul(call.args[0], call.args[1], out_dtype="float32")
        else:
            args = [self.builder_.emit(relax.op.astype(a, "float32")) for a in call.args]
            wide = relax.Call(call.op, args, call.attrs)
        wide = self.builder_.emit(wide)
        cast = relax.op.astype(wide, dtype)
        if name in ops.ROW_NORMS:  # (a GEMM's rounding stays: the chain after it is written for it)
            self.narrowed.append((cast, wide))
        return cast


_HALF = ("float16", "bfloat16")
#: What :func:`analyze` says of a group each Hopper post-norm kernel takes.
_HOPPER_NOTES = {"cluster": "runs as the Hopper wgmma post-norm kernel",
                 "split": "runs as the Hopper wgmma GEMM with its row statistics in the epilogue, then a norm kernel "
                          "(K of 4096 or more, where it measured faster, or where the post-norm kernel cannot: rows wider "
                          "than a cluster holds, the sum returned too, a chain without a bias)",
                 "exchange": "runs as one Hopper wgmma kernel: the GEMM with its row statistics in the epilogue, combined "
                             "across each row tile's CTAs before the norm is stored (one wave of tiles covers the rows, and "
                             "fills the SMs or the post-norm kernel cannot take the group)"}


def _canonical(func: relax.Function) -> relax.Function:
    """``func`` with no binding of one variable to another (the output's, after a dropped cast back)."""
    return relax.transform.CanonicalizeBindings()(tvm.IRModule({"f": func}))["f"]


def _plan(mod: tvm.IRModule):
    groups = []
    for name, func in _relax_functions(mod):
        groups += find_groups(func, name)
    return groups


def _outline(mod: tvm.IRModule, groups: list, kinds) -> tuple:
    """Outline the groups of the allowed kinds; return the module and {group index: name}."""
    var2val = {}
    for _, func in _relax_functions(mod):
        var2val.update(relax.analysis.get_var2val(func))
    patterns = []
    for i, g in enumerate(groups):
        if g.fused and g.kind in kinds:
            pattern, check = _group_pattern(g, var2val)
            patterns.append((f"{_PATTERN_PREFIX}{g.kind}.{i}", pattern, {}, check))
    if not patterns:
        return mod, {}
    mod = relax.transform.FuseOpsByPattern(
        patterns, bind_constants=False, annotate_codegen=False
    )(mod)
    names = {}
    for gv, func in mod.functions_items():
        composite = (func.attrs or {}).get("Composite") if isinstance(func, relax.Function) else None
        if composite is not None and str(composite).startswith(_PATTERN_PREFIX):
            kind, index = str(composite)[len(_PATTERN_PREFIX) :].rsplit(".", 1)
            names[int(index)] = gv.name_hint
            widen = _WidenHalfPrecision()
            widened = widen.visit_expr(func)
            if widen.dropped:  # the cast back is left unused, the output bound to the float32 variable
                widened = _canonical(relax.analysis.remove_all_unused(widened))
            mod[gv] = widened.with_attr(KIND_ATTR, kind)
    return mod, names


def _wide_note(g, target) -> str:
    return (f"no one-kernel schedule for M={g.gemm[1]}, N={g.gemm[2]} on {target.attrs.get('arch', target.kind.name)} "
            "(rows wider than a thread block holds, or symbolic N or batch); left to vanilla fusion")


def _limit_to_target(groups: list, target, hopper: bool = False) -> tuple:
    """On GPU targets, keep outlined only the gemm_reduce groups the rule can schedule; with
    ``hopper``, rows too wide for the rule stay candidates (the Hopper kernel slices rows over
    a cluster): ``(groups, indices of those)``, decided once outlined."""
    if target is None or not is_gpu(target):
        return groups, set()
    from ..schedule import row_tile_fits  # pylint: disable=import-outside-toplevel

    out, wide = [], set()
    for i, g in enumerate(groups):
        if g.fused and g.kind == GEMM_REDUCE and not row_tile_fits(g.gemm, g.dtype, target):
            if hopper:
                wide.add(i)
            else:
                g = replace(g, fused=False, note=_wide_note(g, target))
        out.append(g)
    return out, wide


def _declined_by_rule(groups: list, mod: tvm.IRModule, names: dict, target, hopper: bool = False, wide=()) -> dict:
    """``{group index: note}`` for the outlined gemm_reduce groups for which the gemm_reduce
    rule has no configuration on a GPU ``target``, found by lowering each group on its own as
    the pipeline does and asking the rule (once per distinct group: a model's layers repeat).

    Why: the shape check before outlining cannot see everything the rule needs (a reshape
    left between the GEMM and the reduction, a 4-D batched GEMM). A fused group the rule
    declines goes to DLight as one GEMM + softmax function, which it schedules far worse than
    the separate kernels of vanilla fusion: on the H200 BERT-base's attention-score groups made
    the whole encoder 3.8x slower than vanilla TVM (58.5 ms against 15.3 ms).

    With ``hopper``, a group the Hopper post-norm kernel takes is kept whatever the rule says
    (OffloadHopperPostNorm replaces it); ``wide`` groups (rows too wide for the rule) are
    kept only then."""
    if target is None or not is_gpu(target):
        return {}
    from .offload_hopper import hopper_takes  # pylint: disable=import-outside-toplevel  (it imports us)

    declined, seen = {}, {}
    for i, name in names.items():
        if groups[i].kind == GEMM_REDUCE and hopper and hopper_takes(mod[name], target):
            continue
        if i in wide:
            declined[i] = _wide_note(groups[i], target)
            continue
        if groups[i].kind != GEMM_REDUCE or groups[i].dtype == "bfloat16":
            # vanilla TVM cannot legalise a bf16 LayerNorm (fuzz seed 304 fails to compile
            # there); the outlined group computes it in fp32, so it stays fused either way
            continue
        func = mod[name]
        key = tvm_ffi.structural_hash(func.body, map_free_vars=True)  # not the attributes: they name the group
        if key not in seen:
            seen[key] = _rule_has_configs(func, target)
        if not seen[key]:
            declined[i] = "the gemm_reduce rule cannot tile its fused function (a re-laid-out or 4-D GEMM tile); left to vanilla fusion"
    return declined


def _rule_has_configs(func: relax.Function, target) -> bool:
    """Whether the gemm_reduce rule has configurations for the PrimFunc that outlined group
    ``func`` becomes."""
    from ..schedule import GemmRowTile  # pylint: disable=import-outside-toplevel
    from .annotate_blocks import AnnotateFusedBlocks  # pylint: disable=import-outside-toplevel

    params = [relax.Var(f"p{i}", p.ty) for i, p in enumerate(func.params)]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        group = bb.add_func(func, "group")
        with bb.dataflow():
            out = bb.emit_output(relax.Call(group, params))
        bb.emit_func_output(out)
    lower = [relax.transform.LegalizeOps(), relax.transform.FuseTIR(), AnnotateFusedBlocks()]
    with target:
        lowered = tvm.transform.Sequential(lower)(bb.get().with_attr(GROUPS_ATTR, {"group": func.attrs[KIND_ATTR]}))
    fused = [f for _, f in lowered.functions_items() if isinstance(f, tvm.tirx.PrimFunc) and KIND_ATTR in (f.attrs or {})]
    # the rule's configurations, not a trial schedule: that would load the tensor-core
    # intrinsics (a minute of TVMScript parsing) into every analysis
    return len(fused) == 1 and bool(GemmRowTile().configs(tvm.s_tir.Schedule(fused[0]), target))


def _outline_schedulable(mod: tvm.IRModule, groups: list, kinds, target, hopper: bool = False, wide=()) -> tuple:
    """:func:`_outline`, leaving to vanilla fusion the groups the rule declines on ``target``
    (and, with ``hopper``, the Hopper kernel does not take); returns the module, {group index:
    name} and the groups (declined ones with their note)."""
    out, names = _outline(mod, groups, kinds)
    declined = _declined_by_rule(groups, out, names, target, hopper, wide)
    if not declined:
        return out, names, groups
    groups = [replace(g, fused=False, note=declined[i]) if i in declined else g for i, g in enumerate(groups)]
    out, names = _outline(mod, groups, kinds)
    return out, names, groups


def _resolve(groups: list, names: dict) -> list:
    """Give each group the name of its outlined function, or say why it was not outlined."""
    out = []
    for i, g in enumerate(groups):
        if i in names:
            g = replace(g, name=names[i])
        elif g.fused:
            g = replace(g, fused=False, note="the pattern did not match at outlining; left to vanilla fusion")
        out.append(g)
    return out


def _canonicalize(mod: tvm.IRModule) -> tvm.IRModule:
    """Exact rewrites that keep layout ops where groups can use them: weight casts before their
    transpose (CastBeforeTranspose), row reshapes out of GEMM chains (HoistRowReshape), and
    RMSNorms written out as arithmetic folded into ``nn.rms_norm`` (FoldRMSNorm)."""
    return HoistRowReshape()(CastBeforeTranspose()(FoldRMSNorm()(mod)))


def analyze(mod: tvm.IRModule, target=None, hopper: bool | None = None) -> list:
    """The fusion groups :func:`FuseComputeMemory` would form, without changing ``mod``.

    With a GPU ``target``, groups whose rows do not fit the target's one-kernel schedule, or
    that the gemm_reduce rule cannot tile, are reported as left to vanilla fusion
    (``fused=False``), as ``get_pipeline(target)`` does; ``hopper`` as in ``get_pipeline``
    (``None``: on sm_90 targets; the Hopper kernel also takes rows too wide for the rule).

    Returns a list of :class:`~tvm_comfuse.graph.group.FusionGroup` (``kind``, ``ops``,
    ``name`` of the function the group becomes, GEMM shape, dtypes, inputs and outputs).
    Groups that are detected but left to vanilla fusion have ``fused=False`` and a ``note``.
    Print them with :func:`tvm_comfuse.format_groups`.
    """
    check_module(mod, "analyze")
    mod = _canonicalize(mod)
    target = parse_target(target) if target is not None else None
    from .offload_hopper import hopper_takes, uses_hopper  # pylint: disable=import-outside-toplevel  (it imports us)

    hopper = target is not None and uses_hopper(target, hopper)
    groups, wide = _limit_to_target(_plan(mod), target, hopper)
    out, names, groups = _outline_schedulable(mod, groups, (GEMM_REDUCE, GEMM_ELEMENTWISE), target, hopper, wide)
    if hopper:
        taken = {i: hopper_takes(out[name], target) for i, name in names.items() if groups[i].kind == GEMM_REDUCE}
        groups = [replace(g, note=_HOPPER_NOTES[taken[i]]) if taken.get(i) else g for i, g in enumerate(groups)]
    return _resolve(groups, names)


@tvm.transform.module_pass(opt_level=0, name="FuseComputeMemory")
class FuseComputeMemory:  # pylint: disable=too-few-public-methods
    """Outline GEMM + memory-intensive chains (bias, residual, activation, LayerNorm,
    RMSNorm, softmax, ...) into one function each, for FuseTIR to turn into one PrimFunc.

    Parameters
    ----------
    target : str, dict or tvm.target.Target, optional
        On a GPU target, gemm_reduce groups whose rows are too wide for one thread block, or
        that the gemm_reduce rule cannot tile, stay with vanilla fusion (``get_pipeline``
        passes its target).
    hopper : bool
        Keep the groups the Hopper post-norm kernels take on sm_90 (rows up to 4096 wide in one
        kernel, wider ones split into a GEMM with row statistics and a norm), for
        OffloadHopperPostNorm to replace (``get_pipeline`` sets it where it runs that pass).
    kinds : tuple of str
        Group kinds to outline. ``"b2b_gemm"`` groups are detected by :func:`analyze` but not
        outlined until a back-to-back schedule exists; their GEMM groups are outlined
        separately.
    """

    def __init__(self, kinds=(GEMM_REDUCE, GEMM_ELEMENTWISE), target=None, hopper: bool = False):
        unknown = [k for k in kinds if k not in KINDS]
        if unknown:
            raise ValueError(f"FuseComputeMemory: unknown group kind(s) {unknown}; choose from {KINDS}")
        self.kinds = tuple(k for k in kinds if k != B2B_GEMM)
        self.target = parse_target(target) if target is not None else None
        self.hopper = hopper

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Find the groups of every Relax function and outline them (no-op without any)."""
        mod = _canonicalize(mod)
        groups, wide = _limit_to_target(_plan(mod), self.target, self.hopper)
        mod, names, groups = _outline_schedulable(mod, groups, self.kinds, self.target, self.hopper, wide)
        if not names:
            return mod
        recorded = dict(mod.attrs[GROUPS_ATTR]) if mod.attrs and GROUPS_ATTR in mod.attrs else {}
        recorded.update({names[i]: groups[i].kind for i in names})
        return mod.with_attr(GROUPS_ATTR, recorded)
