"""OffloadHopperPostNorm: post-norm groups to the wgmma kernel on sm_90 (opt-in, issue 8).

Runs right after FuseComputeMemory, on its outlined ``gemm_reduce`` functions. One whose body is
a post-norm chain, as ComFuse's suite and imported BERT blocks produce it,

    matmul(x, permute_dims(w)) -> casts and two adds (a bias [N], a residual [..., N])
        -> layer_norm / rms_norm / softmax over the last axis, in float32 -> optional cast
        (returned alone, or beside the float32 norm it was cast from)

is read into a :class:`~tvm_comfuse.schedule.wgmma_postnorm.PostNorm` description; if the wgmma
kernel takes its shape, the kernel is built for it (tirx, sm_90a), linked into the executable
through the module's ``external_mods`` (TVM's BYOC path), and the call becomes
``R.call_dps_packed`` of it (3-D activations are read as rows in place: no reshape). A function the
description cannot express exactly (another op, another output, an unused binding) or the
kernel cannot take (M not a multiple of 64, symbolic shapes) is left alone: the ``gemm_reduce``
rule schedules it as before. Rows wider than a cluster's slices hold (N > 4096), and blocks
that also return the sum before the norm (a pre-norm block's residual stream), run split
(:mod:`~tvm_comfuse.schedule.split_norm`): the GEMM kernel writes the sum and its row
statistics, a norm kernel follows, two ``call_dps_packed`` in place of the group's call; where
one wave of the GEMM's tiles covers the rows and the norm is the only output, one kernel whose
CTAs combine their statistics themselves (:mod:`~tvm_comfuse.schedule.row_exchange`). On by
default for sm_90 targets (``get_pipeline(target, hopper=False)`` turns it off), where it
measured faster than the rule on every suite shape (H200, session 8). Softmax groups run on the
same kernels as LayerNorm's (split only, in session 24; the cluster kernel too since session 25),
but split, not the rule, where the cluster kernel cannot take them (M not a multiple of 64).
"""

from __future__ import annotations

import logging
import math

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..graph import ops
from ..target import parse_target
from .fuse_compute_memory import KIND_ATTR

LOG = logging.getLogger("tvm_comfuse")
EXTERNAL_MODS = "external_mods"
_NORMS = {"relax.nn.layer_norm": "layer_norm", "relax.nn.rms_norm": "rms_norm", "relax.nn.softmax": "softmax"}


def _static(shape) -> list | None:
    dims = [int(d) if isinstance(d, tvm.tirx.IntImm) else None for d in shape]
    return None if None in dims else dims


def _sinfo(expr):
    """``(static shape or None, dtype)`` of a tensor-typed Relax expression."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None, None
    shape = _static(ty.shape.values) if isinstance(ty.shape, relax.ShapeExpr) else None
    return shape, str(ty.dtype)


class GroupBody:
    """The one dataflow block of an outlined group function, read backwards from its outputs:
    which bindings a match used (a binding it does not account for makes the match fail: not
    ours to drop), and the chain of elementwise steps back to the GEMM."""

    def __init__(self, func: relax.Function):
        body = func.body
        single = isinstance(body, relax.SeqExpr) and len(body.blocks) == 1
        self.var2val = {b.var: b.value for b in body.blocks[0].bindings} if single else None
        self.outs = (list(body.body.fields) if isinstance(body.body, relax.Tuple) else [body.body]) if single else []
        self.params = {p: i for i, p in enumerate(func.params)}
        self.used = set()

    def value(self, var):
        """The operator call bound to ``var`` (marking it used), or None."""
        self.used.add(var)
        val = self.var2val.get(var)
        return val if isinstance(val, relax.Call) and ops.op_name(val) else None

    def param(self, var):
        """``var`` if it is a parameter, possibly through a cast, else None."""
        if var in self.params:
            return var
        val = self.value(var)
        return val.args[0] if val is not None and ops.op_name(val) == "relax.astype" and val.args[0] in self.params else None

    def all_used(self) -> bool:
        return self.used == set(self.var2val)

    def chain_to_gemm(self, cur, activations=()):
        """Walk back from ``cur`` to ``matmul(x, permute_dims(w))``: ``(chain, x, w, the matmul's
        dtype)`` with ``chain`` the steps from the GEMM on, each ``(op, dtype, operand var)``
        (casts, adds of a parameter, and the ``relax.nn`` ``activations``), or None."""
        chain = []
        while True:
            val = self.value(cur)
            name = ops.op_name(val) if val is not None else None
            if name == "relax.astype":
                chain.append(("cast", str(val.attrs.dtype), None))
                cur = val.args[0]
            elif name == "relax.add":
                a, b = val.args
                if a in self.params:
                    a, b = b, a
                if b not in self.params or a in self.params:
                    return None
                chain.append(("add", _sinfo(val)[1], b))
                cur = a
            elif name is not None and name.startswith("relax.nn.") and name[len("relax.nn."):] in activations:
                chain.append((name[len("relax.nn."):], _sinfo(val)[1], None))
                cur = val.args[0]
            elif name == ops.GEMM:
                x, wt = val.args
                tr = self.value(wt) if x in self.params else None
                if tr is None or ops.op_name(tr) != ops.TRANSPOSE or tr.args[0] not in self.params:
                    return None
                if tr.attrs.axes is not None and [int(a) for a in tr.attrs.axes] != [1, 0]:
                    return None
                return list(reversed(chain)), x, tr.args[0], _sinfo(val)[1]
            else:
                return None

    def read(self, cur, out_shape, activations=()):
        """:meth:`chain_to_gemm` from ``cur``, then :meth:`linear`, when every binding took part:
        ``(the walk's result, linear's)``, or None."""
        found = self.chain_to_gemm(cur, activations)
        if found is None or not self.all_used():
            return None
        linear = self.linear(found, out_shape)
        return None if linear is None else (found, linear)

    def linear(self, found, out_shape):
        """For :meth:`chain_to_gemm`'s result: ``(steps, operands, roles, (M, N, K))`` in the
        kernels' terms (:class:`~tvm_comfuse.schedule.chain.Step` s; each added operand's
        ``(dtype, is_tile)``; the parameter indices of ``x, w`` and the operands), or None where
        the shapes are not static, W is not the 2-D ``[N, K]`` of x's dtype, or an operand is
        neither ``[N]`` nor the output's shape."""
        from ..schedule.chain import Step  # pylint: disable=import-outside-toplevel

        chain, x, w, mm_dtype = found
        (x_shape, dtype), (w_shape, w_dtype) = _sinfo(x), _sinfo(w)
        if None in (x_shape, w_shape) or len(w_shape) != 2 or w_dtype != dtype or x_shape[-1] != w_shape[1]:
            return None
        n, k = w_shape
        steps, operands, roles = [], [], [self.params[x], self.params[w]]
        if mm_dtype != "float32":
            steps.append(Step("cast", mm_dtype))
        for op, step_dtype, operand in chain:
            if op == "add":
                shape, op_dtype = _sinfo(operand)
                if shape not in ([n], out_shape):
                    return None
                operands.append((op_dtype, shape != [n]))
                roles.append(self.params[operand])
            steps.append(Step(op, step_dtype, len(operands) - 1 if op == "add" else None))
        return tuple(steps), tuple(operands), roles, (math.prod(x_shape[:-1]), n, k)


def match_postnorm(func: relax.Function):
    """``(spec, roles, (M, N, K), out_shape, order)`` for a post-norm function, or None.

    ``roles`` are the indices of the function's parameters for the kernel's ``x, w, operand
    0, operand 1`` and the norm's parameters (``PostNorm.params``: gamma and beta, gamma, none); ``out_shape`` is ``[*rows, N]`` (rows ``(M,)`` or ``(B, S)``);
    ``order`` names the function's outputs: ``("out",)``, or with the norm's float32 result
    also returned, ``("out", "norm")`` or ``("norm", "out")``, or with the sum it normalises
    (a pre-norm block's residual stream), ``("out", "sum")`` or ``("sum", "out")``."""
    from ..schedule.wgmma_postnorm import PostNorm  # pylint: disable=import-outside-toplevel

    body = GroupBody(func)
    if body.var2val is None:
        return None
    var2val, outs = body.var2val, body.outs
    if not all(isinstance(v, relax.Var) and v in var2val for v in outs) or len(outs) > 2:
        return None
    order = ("out",)
    if len(outs) == 2:  # the norm's float32 result and its cast (BERT's attention output), or the sum it normalises
        casts = [i for i, v in enumerate(outs) if ops.op_name(var2val[v]) == "relax.astype" and var2val[v].args[0].same_as(outs[1 - i])]
        sums = [i for i in range(2) if _normalises(body, outs[i], outs[1 - i])]
        if len(casts) + len(sums) != 1:
            return None
        i = (casts or sums)[0]
        order = ("out", "norm" if casts else "sum")[:: 1 if i == 0 else -1]
        outs = [outs[i]]
    out_shape, out_dtype = _sinfo(outs[0])
    call = body.value(outs[0])
    if call is not None and ops.op_name(call) == "relax.astype":
        call = body.value(call.args[0])
    if call is None or ops.op_name(call) not in _NORMS or out_shape is None:
        return None
    norm = _NORMS[ops.op_name(call)]
    if not ops.reduces_last_axis(call) or (norm == "layer_norm" and not (call.attrs.center and call.attrs.scale)):
        return None
    gamma, beta = (body.param(call.args[1 + i]) if len(call.args) > 1 + i else None for i in range(2))
    if (gamma is None) != (norm == "softmax") or (beta is None) != (norm != "layer_norm"):
        return None
    if _sinfo(call.args[0])[1] != "float32":
        return None
    read = body.read(call.args[0], out_shape)
    if read is None:
        return None
    found, (steps, operands, roles, mnk) = read
    dtype = _sinfo(found[1])[1]
    g_dtype, b_dtype = (_sinfo(p)[1] if p is not None else None for p in (gamma, beta))
    if beta is not None and b_dtype != g_dtype:
        return None
    roles += [body.params[p] for p in (gamma, beta) if p is not None]
    if "norm" in order and _sinfo(call)[1] != "float32":
        return None
    eps = float(call.attrs.epsilon) if norm != "softmax" else PostNorm.eps
    spec = PostNorm(dtype, steps, operands, norm, eps, g_dtype or dtype, out_dtype, norm_out="norm" in order, sum_out="sum" in order)
    return spec, roles, mnk, out_shape, order


def _normalises(body: GroupBody, out, other) -> bool:
    """Whether output ``out`` is the norm (possibly cast) of output ``other``, or of its fp32
    cast: ``other`` is the sum a pre-norm block also returns (its residual stream)."""
    val = body.var2val.get(out)
    if isinstance(val, relax.Call) and ops.op_name(val) == "relax.astype":
        val = body.var2val.get(val.args[0])
    if not isinstance(val, relax.Call) or ops.op_name(val) not in _NORMS:
        return False
    if val.args[0].same_as(other):
        return True
    wide = body.var2val.get(val.args[0])
    return (isinstance(wide, relax.Call) and ops.op_name(wide) == "relax.astype" and str(wide.attrs.dtype) == "float32"
            and wide.args[0].same_as(other))


def is_hopper(target: tvm.target.Target) -> bool:
    """An sm_90 CUDA target (wgmma needs sm_90a, which every sm_90 part runs)."""
    return target.kind.name == "cuda" and str(target.attrs.get("arch", "")).startswith("sm_90")


def uses_hopper(target, hopper: bool | None = None) -> bool:
    """Whether ComFuse runs post-norm groups as the Hopper kernel on ``target``: ``hopper`` if
    given, else whether ``target`` is an sm_90 GPU (the default since it measured faster than
    the mma.sync rule there, session 8)."""
    return bool(is_hopper(parse_target(target)) if hopper is None else hopper)


#: K from which a post-norm the cluster kernel could take runs split instead. Measured on the H100
#: (session 18, ``experiments/split_norm.py --breakdown``, device us, cluster kernel against split):
#: 8192 x 4096 -> 4096 671.7 against 495.9, 4096 x 4096 -> 1024 63.3 against 56.4; at shorter K
#: the cluster kernel's on-chip row wins or ties (4096 x 1024 -> 1024 20.7 against 24.2, 16384 x
#: 256 -> 1024 49.6 against 65.1; session 17: 4096 x 3072 -> 768 36.9 against 36.7, 4096 x 768
#: -> 768 13.8 against 16.2). Long K is where the cluster kernel's 64-row tiles, reading w from
#: L2 twice as often as the split GEMM's 128-row ones, cost more than the sum's HBM round trip.
SPLIT_MIN_K = 4096


def fills_a_wave(m, n, k, spec) -> bool:
    """Whether the split's one-kernel form takes a group the cluster kernel could: where it takes
    the group (one wave of tiles: :func:`exchange_call`) and its grid fills more than half the
    SMs. Measured there (H100, session 23, ``experiments/residual_load.py``, BERT's post-norms at
    4096 rows: 128 CTAs, device us against the cluster kernel): 32.1 against 37.5 at 4096 x 3072 ->
    768, 13.6 against 13.9 at 4096 x 768 -> 768, 19.8 against 21.1 at 4096 x 1024 -> 1024, with
    its residual staged. Smaller grids keep the cluster kernel, whose 64-row tiles give them twice
    the CTAs (not measured against each other there)."""
    from ..schedule import row_exchange, split_norm as sn, wgmma_postnorm as wp  # pylint: disable=import-outside-toplevel

    return not sn.exchange_problems(m, n, k, spec) and not wp.few_ctas(row_exchange.tiles(m, n, sn.config(m, n, k, spec)))


def postnorm_kernel(m, n, k, spec, split: bool = False) -> tuple:
    """Which Hopper kernel computes a post-norm group: ``("cluster", [])`` where the post-norm
    kernel's cluster holds its rows (:mod:`~tvm_comfuse.schedule.wgmma_postnorm`), else, for
    rows wider than a cluster holds, ``("split", [])`` where the GEMM + row statistics kernel
    and the norm kernel take it (:mod:`~tvm_comfuse.schedule.split_norm`), else ``(None, what
    keeps each)``. Where K is at least :data:`SPLIT_MIN_K` the split takes what it can of the
    cluster kernel's groups too (measured faster there), and so does the split's one-kernel form
    where one wave of its tiles covers the rows and fills the SMs (:func:`fills_a_wave`; measured
    faster there). Groups that also return the sum before
    the norm (a pre-norm block's residual stream) run split too (its GEMM kernel writes that sum
    anyway), and so do chains with other than a bias and a residual (a bias-less projection's
    residual alone, LLaMA's), which the post-norm kernel does not express. Rows a cluster could
    hold but the kernel cannot take otherwise (M not a multiple of 64) stay with the gemm_reduce
    rule's one kernel. ``split``: the split wherever it takes a group the cluster kernel would
    (``hopper_groups`` with ``"split_norm"``)."""
    from ..schedule import split_norm as sn, wgmma_postnorm as wp  # pylint: disable=import-outside-toplevel

    cluster = wp.problems(m, n, k, spec)
    if not cluster:
        long_k = isinstance(k, int) and k >= SPLIT_MIN_K
        return ("split", []) if (split or long_k or fills_a_wave(m, n, k, spec)) and not sn.problems(m, n, k, spec) else ("cluster", [])
    # (softmax's rule is slow: session 24 measured it at 2.7-4.2x cuBLAS's GEMM, so the split takes what the kernel cannot)
    cluster_group = spec.norm != "softmax" and not spec.sum_out and len(spec.operands) == 2
    if not isinstance(n, int) or (wp.slices(n) and cluster_group):
        return None, cluster
    found = sn.problems(m, n, k, spec)
    return ("split", []) if not found else (None, cluster + [f"split into GEMM + norm kernels: {'; '.join(found)}"])


def hopper_takes(func: relax.Function, target: tvm.target.Target) -> str | None:
    """The Hopper kernel (:func:`postnorm_kernel`) :class:`OffloadHopperPostNorm` replaces the
    outlined group ``func`` by on ``target``, or None; ``"exchange"`` for a split one that runs
    as one kernel untuned (:func:`exchange_call`)."""
    from ..schedule import split_norm as sn  # pylint: disable=import-outside-toplevel

    found = match_postnorm(func) if is_hopper(target) else None
    kernel = postnorm_kernel(*found[2], found[0])[0] if found is not None else None
    return "exchange" if kernel == "split" and not sn.exchange_problems(*found[2], found[0]) else kernel


def dataflow_blocks(mod: tvm.IRModule):
    """``(function, dataflow block)`` of every Relax function of ``mod``."""
    for _, func in mod.functions_items():
        if isinstance(func, relax.Function) and isinstance(func.body, relax.SeqExpr):
            for block in func.body.blocks:
                if isinstance(block, relax.DataflowBlock):
                    yield func, block


def users_of(block: relax.DataflowBlock, result) -> dict:
    """Each variable of ``block`` -> the variables bound to expressions that use it (the
    function's ``result`` counts as a user that is not a dataflow variable: None)."""
    users = {}
    for b in block.bindings:
        for v in relax.analysis.free_vars(b.value):
            users.setdefault(v, []).append(b.var)
    for v in relax.analysis.free_vars(result):
        users.setdefault(v, []).append(None)
    return users


def groups_taken(mod: tvm.IRModule, kind: str, match, problems):
    """``(global var, function, match(function))`` of each outlined group of ``kind`` in ``mod``
    that ``match`` reads (``(spec, roles, (M, N, K), ...)``) and ``problems(M, N, K, spec)`` does
    not object to; the groups it objects to are logged with the reason (they stay with the rule)."""
    for gv, func in mod.functions_items():
        if not isinstance(func, relax.Function) or str((func.attrs or {}).get(KIND_ATTR, "")) != kind:
            continue
        found = match(func)
        if found is None:
            continue
        why = problems(*found[2], found[0])
        if why:
            LOG.info("ComFuse: %s stays with the %s rule, the wgmma kernel cannot take %s", gv.name_hint, kind, "; ".join(why))
            continue
        yield gv, func, found


def postnorm_groups(mod: tvm.IRModule, split: bool = False):
    """``(global var, function, match_postnorm's result, kernel)`` of each outlined
    ``gemm_reduce`` group of ``mod`` a Hopper kernel takes (:func:`postnorm_kernel`, ``split``
    as there): what :class:`OffloadHopperPostNorm` replaces."""
    for gv, func, found in groups_taken(mod, "gemm_reduce", match_postnorm, lambda *a: postnorm_kernel(*a)[1]):
        yield gv, func, found, postnorm_kernel(*found[2], found[0], split)[0]


class Kernels:
    """The kernels one pass builds, one per distinct key (a model's layers share theirs): their
    symbols, and the compiled modules to link."""

    def __init__(self, build, prefix: str):
        self.build, self.prefix, self.symbols, self.modules = build, prefix, {}, []

    def symbol(self, key, name: str, make, spec, mnk) -> str:
        """The symbol of the kernel ``key`` stands for; built (``make()``'s PrimFunc) the first time."""
        if key not in self.symbols:
            self.symbols[key] = (f"{self.prefix}_{len(self.symbols)}" + (f"_{name}" if name else ""))[:120]
            module = self.build(make(), self.symbols[key], spec, mnk)
            if module is not None:
                self.modules.append(module)
        return self.symbols[key]


class HopperOffload:
    """What the Hopper offload passes share: their target, how they build a kernel, and the
    tuning logs (``database``, a MetaSchedule Database: ``comfuse tune``'s) they read each
    kernel's configuration from."""

    def __init__(self, target, build=None, database=None):
        self.target = parse_target(target)
        self.build = build
        self.database = database
        self.tuned_configs = {}  # a task's description (JSON) -> its tuned configuration or None

    def tuned(self, task):
        """The fastest tuned configuration of a kernel, or None (no database, no record: the
        untuned default). ``task()`` gives ``(the group's or pair's function, the kernel's
        Description)`` (:mod:`tvm_comfuse.tune.hopper`), asked for only where there are logs.
        Looked up once a task: a model's layers share one (each lookup legalises the group into
        its task module and reads the logs, and would repeat its warnings layer by layer)."""
        if self.database is None:
            return None
        from ..tune import hopper  # pylint: disable=import-outside-toplevel  (tune imports the pipeline)

        func, desc = task()
        if func is None:
            return None
        key = desc.to_json()
        if key not in self.tuned_configs:
            self.tuned_configs[key] = hopper.tuned_config(self.database, hopper.task_module(func, desc))
        return self.tuned_configs[key]

    def report_tuned(self, tuned: int, total: int, what: str) -> None:
        """Tell how many of the ``total`` kernels of ``what`` use tuned configurations (a warning
        when some do not: their records are missing from the logs given)."""
        if self.database is not None:
            (LOG.warning if tuned < total else LOG.info)(
                "ComFuse: %d of %d %s use tuned configurations, %d the untuned defaults", tuned, total, what, total - tuned)

    def builder(self):
        """``build(prim_func, symbol, spec, mnk)``: the one given, else the sm_90a compile; None
        where the pass has nothing to do (none given, and the target is not sm_90)."""
        if self.build is None and not is_hopper(self.target):
            return None
        from ..schedule.split_norm import NormKernel  # pylint: disable=import-outside-toplevel

        return self.build or (lambda func, symbol, spec, _mnk: build_kernel(
            func, symbol, self.target, "default" if isinstance(spec, NormKernel) else "tirx"))


def build_kernel(prim_func, symbol: str, target: tvm.target.Target, tir_pipeline: str = "tirx"):
    """Compile a Hopper kernel's tirx PrimFunc for sm_90a (a scheduled s_tir one with
    ``tir_pipeline="default"``), exported as ``symbol``: the module to link."""
    from ..schedule.wgmma_mainloop import build  # pylint: disable=import-outside-toplevel

    return build(prim_func, host=target.host or tvm.target.Target("llvm"), symbol=symbol, tir_pipeline=tir_pipeline).mod


@mutator
class _CallRewriter(PyExprMutator):  # pylint: disable=abstract-method
    def __init__(self, mod, offloads):
        super().__init__(mod)
        self.offloads = offloads  # GlobalVar name -> (symbol, roles, out_shape, out_dtype, order)

    def visit_call_(self, call):  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        if not isinstance(call.op, relax.GlobalVar) or call.op.name_hint not in self.offloads:
            return call
        if callable(self.offloads[call.op.name_hint]):  # it emits the calls itself
            return self.offloads[call.op.name_hint](self.builder_, call.args)
        symbol, roles, out_shape, out_dtype, order = self.offloads[call.op.name_hint]
        args = relax.Tuple([call.args[i] for i in roles])
        if order == ("out",):
            return relax.call_dps_packed(relax.ExternFunc(symbol), args, relax.TensorType(out_shape, out_dtype))
        outs = [relax.TensorType(out_shape, out_dtype), relax.TensorType(out_shape, "float32")]
        both = self.builder_.emit(relax.call_dps_packed(relax.ExternFunc(symbol), args, outs))
        return relax.Tuple([relax.TupleGetItem(both, ("out", "norm").index(name)) for name in order])


@tvm.transform.module_pass(opt_level=0, name="OffloadHopperPostNorm")
class OffloadHopperPostNorm(HopperOffload):  # pylint: disable=too-few-public-methods
    """Replace the post-norm groups the wgmma kernel takes by calls of it (see the module
    docstring); a no-op unless ``target`` is an sm_90 CUDA target.

    ``build(prim_func, symbol, spec, (m, n, k))`` makes each kernel available under ``symbol``:
    by default it compiles the tirx PrimFunc for sm_90a and returns the module to link through
    ``external_mods``; the CPU tests pass one that links an llvm kernel of the same signature,
    or registers a NumPy model under ``symbol`` (returning None, nothing to link). Groups that
    compute the same kernel (a model's layers) share one build and one symbol.

    ``database`` (a MetaSchedule Database, ``comfuse tune``'s logs): a group with a record
    there runs the configuration tuned for it (:mod:`tvm_comfuse.tune.hopper`), the others the
    untuned default.

    ``split``: every group the split kernels take runs split (:func:`postnorm_kernel`), not only
    rows wider than a cluster holds: ``hopper_groups`` with ``"split_norm"``.
    """

    def __init__(self, target, build=None, database=None, split: bool = False):
        super().__init__(target, build, database)
        self.split = split

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Build each eligible group's kernel, rewrite its calls, drop the outlined function."""
        from ..schedule import wgmma_postnorm as wp  # pylint: disable=import-outside-toplevel
        from ..tune import hopper  # pylint: disable=import-outside-toplevel  (tune imports the pipeline)

        build = self.builder()
        if build is None:
            return mod
        offloads, kernels, tuned, whole = {}, Kernels(build, "comfuse_wgmma"), 0, 0
        for gv, func, found, kernel in postnorm_groups(mod, self.split):
            spec, roles, mnk, out_shape, order = found
            if kernel == "split":
                cfg = self.tuned(lambda: (func, hopper.describe_split(found)))  # noqa: B023
                tuned += cfg is not None
                offloads[gv.name_hint] = split_call(kernels, gv.name_hint, found, cfg)
                continue
            whole += 1
            cfg = self.tuned(lambda: (func, hopper.describe(found)))  # noqa: B023
            tuned += cfg is not None
            symbol = kernels.symbol((spec, mnk, tuple(out_shape), cfg), gv.name_hint,
                                    lambda: wp.wgmma_postnorm(*mnk, spec, cfg, lead=out_shape[:-1]), spec, mnk)  # noqa: B023
            offloads[gv.name_hint] = (symbol, roles, out_shape, spec.out_dtype, order)
        if not offloads:
            return mod
        LOG.info("ComFuse: %d post-norm group(s) run as %d wgmma kernel(s) (%d of them split: the row statistics in the GEMM's "
                 "epilogue, combined by a norm kernel or, within one wave, by the GEMM's CTAs)", len(offloads), len(kernels.symbols),
                 len(offloads) - whole)
        self.report_tuned(tuned, len(offloads), "wgmma post-norm groups")
        return replace_calls(mod, offloads, kernels.modules)


def split_call(kernels: Kernels, name: str, found, cfg=None):
    """Build a split post-norm's two kernels (:mod:`~tvm_comfuse.schedule.split_norm`: the GEMM
    with the chain and the row statistics, on configuration ``cfg`` (None: the default), then
    the norm), or its one-kernel form where that takes the group (:func:`exchange_call`), and
    return what emits their calls in place of the group's: ``emit(block_builder, the group
    call's args)``."""
    from ..schedule import split_norm as sn  # pylint: disable=import-outside-toplevel

    spec, roles, (m, n, k), out_shape, order = found
    if not sn.exchange_problems(m, n, k, spec, cfg):
        return exchange_call(kernels, name, found, cfg)
    lead = tuple(out_shape[:-1])
    built = {}

    def make(part):  # one build of both PrimFuncs; the kernels' builds take their half
        if not built:
            built["gemm"], built["norm"], built["parts"] = sn.kernels(m, n, k, spec, cfg, lead=lead)
        return built[part]

    gemm_spec, parts = sn.gemm_spec(spec), n // sn.config(m, n, k, spec, cfg).wg_cols
    gemm = kernels.symbol(("split-gemm", spec, (m, n, k), lead, cfg), f"{name}_gemm", lambda: make("gemm"), gemm_spec, (m, n, k))
    norm = kernels.symbol(("split-norm", spec, (m, n, k), lead, parts), f"{name}_norm", lambda: make("norm"), sn.NormKernel(spec, parts),
                          (m, n, k))

    def emit(bb, args):
        ins = [args[i] for i in roles]
        operands, params = ins[: 2 + len(spec.operands)], ins[2 + len(spec.operands):]  # x, w, the added ones; gamma (, beta)
        both = bb.emit(relax.call_dps_packed(relax.ExternFunc(gemm), relax.Tuple(operands), [
            relax.TensorType([*lead, n], sn.sum_dtype(spec)), relax.TensorType([m, parts, 2], "float32")]))
        y, stats = bb.emit(relax.TupleGetItem(both, 0)), bb.emit(relax.TupleGetItem(both, 1))
        outs = [relax.TensorType(out_shape, spec.out_dtype)] + ([relax.TensorType(out_shape, "float32")] if spec.norm_out else [])
        call = relax.call_dps_packed(relax.ExternFunc(norm), relax.Tuple([y, stats, *params]), outs if spec.norm_out else outs[0])
        if order == ("out",):
            return call
        normed = bb.emit(call)
        if "sum" in order:
            return relax.Tuple([normed if part == "out" else y for part in order])
        return relax.Tuple([relax.TupleGetItem(normed, ("out", "norm").index(part)) for part in order])

    return emit


def exchange_call(kernels: Kernels, name: str, found, cfg=None):
    """Build the one-kernel form of a split post-norm (:func:`~tvm_comfuse.schedule.split_norm.exchange_kernel`:
    one wave of the GEMM's tiles, a row tile's CTAs combining their statistics at a barrier in
    global memory) and return what emits its call in place of the group's. Measured on the H100
    (session 22, ``experiments/row_exchange.py``, device us, against the split's two kernels):
    BERT-base's FFN2 34.0 / 35.8 and 34.8 / 36.2, its attention output 14.9 / 15.9 and 14.8 /
    16.0, BERT-large's attention output 21.3 / 24.3 and 21.0 / 23.9, its FFN2 55.9 / 54.6, then,
    gamma and beta loaded before the barrier, 54.2 / 54.8; session 23, the residual staged by
    TMA once the ring is full: 32.1, 13.6, 19.8 and 54.0 (``experiments/residual_load.py``). On
    the H200 its first version (a costlier barrier) was slower than the split at three of the
    four; the current one has not run there.

    The barrier's words are a zero constant of the module, one per call (a count that every
    launch leaves a multiple of the row tile's CTAs; :mod:`~tvm_comfuse.schedule.row_exchange`),
    which the VM keeps on the device; the statistics are the call's scratch output."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    from ..schedule import split_norm as sn  # pylint: disable=import-outside-toplevel

    spec, roles, (m, n, k), out_shape, order = found
    assert order == ("out",), order  # (exchange_problems: no second output)
    lead = tuple(out_shape[:-1])
    parts = n // sn.config(m, n, k, spec, cfg).wg_cols
    symbol = kernels.symbol(("exchange", spec, (m, n, k), lead, cfg), f"{name}_exchange",
                            lambda: sn.exchange_kernel(m, n, k, spec, cfg, lead=lead), sn.ExchangeKernel(spec, parts), (m, n, k))
    flags_shape = sn.flags_shape(m, n, k, spec, cfg)

    def emit(bb, args):
        flags = relax.const(np.zeros(flags_shape, "int32"))  # one per call: no two kernels share a count
        both = bb.emit(relax.call_dps_packed(relax.ExternFunc(symbol), relax.Tuple([*(args[i] for i in roles), flags]), [
            relax.TensorType(out_shape, spec.out_dtype), relax.TensorType([m, parts, 2], "float32")]))
        return relax.TupleGetItem(both, 0)

    return emit


def replace_calls(mod: tvm.IRModule, offloads: dict, built: list) -> tvm.IRModule:
    """``mod`` with every call of an outlined group in ``offloads`` (its name -> ``(symbol,
    roles, out_shape, out_dtype, order)``) made an ``R.call_dps_packed`` of the kernel
    ``symbol``, the group functions dropped, and the ``built`` modules linked through the
    module's ``external_mods`` (TVM's BYOC path)."""
    rewriter = _CallRewriter(mod, offloads)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function) and gv.name_hint not in offloads:
            rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
    out = rewriter.builder_.get()
    out = tvm.IRModule({gv: f for gv, f in out.functions_items() if gv.name_hint not in offloads}, attrs=out.attrs)
    return link(out, built)


def link(mod: tvm.IRModule, built: list) -> tvm.IRModule:
    """``mod`` with the compiled kernel modules ``built`` added to its ``external_mods`` (TVM's
    BYOC path: the executable links them, the VM calls them by symbol)."""
    if not built:
        return mod
    existing = list(mod.attrs[EXTERNAL_MODS]) if mod.attrs and EXTERNAL_MODS in mod.attrs else []
    return mod.with_attr(EXTERNAL_MODS, existing + built)
