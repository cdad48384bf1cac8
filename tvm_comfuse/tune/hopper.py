"""The Hopper kernels as MetaSchedule tasks: workload, space, build and lookup.

The wgmma kernels (:mod:`tvm_comfuse.schedule.wgmma_postnorm`, the GEMM + elementwise one,
:mod:`tvm_comfuse.schedule.wgmma_elementwise`, the back-to-back GEMM one,
:mod:`tvm_comfuse.schedule.wgmma_b2b`, whose workload is the pair's two groups inlined into
one function, and a split post-norm's GEMM, :mod:`tvm_comfuse.schedule.split_norm`, whose
workload is what it computes, written in TE: each a :class:`Family`) are tirx programs, not
schedules of an s_tir PrimFunc, so MetaSchedule cannot search them the usual way. What makes
one a task:

- **Workload**: the group's own PrimFunc, what LegalizeOps and FuseTIR make of the outlined
  post-norm function (the computation, with the group's parameter order), tagged with the
  kernel's description (:data:`KERNEL_ATTR`: the chain, M/N/K, which parameter is which); a
  GEMM + elementwise group's followed by the layout and cast its kernel writes
  (:func:`with_tail`), so the workload's parameters are the kernel's.
  :class:`~tvm_comfuse.transform.OffloadHopperPostNorm` derives the same module at compile time,
  so a record tuned here is found there.
- **Space**: one schedule per configuration of :func:`~tvm_comfuse.schedule.wgmma_space.configs`
  (the untuned default first), each the workload with the configuration annotated on its root
  block (:data:`CONFIG_ANN`). A record's trace is that annotation, readable by anyone.
- **Build**: :func:`build_candidate` reads both back, generates the kernel, orders its
  parameters as the workload's (MetaSchedule's runner calls it with the workload's arguments)
  and compiles it for sm_90a. Candidates build in a pool of worker processes
  (:func:`tvm_comfuse.tune.measure.worker_pool`): generating a kernel takes ~1 s of Python, so
  64 in a row would cost a minute of GPU time per round.
- **Lookup**: :func:`tuned_config`, the fastest record's configuration, checked again.

The annotations are all that differs between candidates, so the XGBoost cost model sees the same
features for each: it cannot rank them, and the search measures the space in random order. The
post-norm kernel's space (7 to 132 configurations on the suite's shapes) is small enough for
that; the b2b kernel's is larger (189 to 273 at issue 5's MLPs since session 26: 64 random
trials draw one of its three fastest about 60% of the time); the measured trials-to-best are in
``tuning_logs/README.md``.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import tvm
from tvm import relax, s_tir, tirx
from tvm.s_tir import meta_schedule as ms

from ..schedule import wgmma_b2b as wb
from ..schedule import wgmma_elementwise as we
from ..schedule import wgmma_postnorm as wp
from ..schedule.chain import Step
from ..schedule.wgmma_mainloop import WgmmaConfig
from ..schedule.wgmma_space import b2b_configs, configs, elementwise_configs
from .logs import FAILED_SECS, mean_secs

LOG = logging.getLogger("tvm_comfuse")
#: Task kind of the post-norm kernel, and the PrimFunc attribute holding a kernel's description (JSON).
KIND = "wgmma_postnorm"
KERNEL_ATTR = "comfuse.wgmma_postnorm"
#: Root-block annotation holding a candidate's configuration (JSON of its family's configuration dataclass).
CONFIG_ANN = "comfuse.wgmma_config"


def _postnorm_spec(d: dict) -> wp.PostNorm:
    return wp.PostNorm(**{**d, "steps": tuple(Step(**s) for s in d["steps"]), "operands": tuple(tuple(o) for o in d["operands"])})


def _elementwise_spec(d: dict) -> we.Elementwise:
    layout = tuple(tuple(part) for part in d["layout"]) if d["layout"] else ()
    return we.Elementwise(d["dtype"], tuple(Step(**s) for s in d["steps"]), tuple(tuple(o) for o in d["operands"]),
                          d["out_dtype"], layout, d.get("stats", ""))


def _b2b_spec(d: dict) -> wb.B2B:
    return wb.B2B(_elementwise_spec(d["first"]), _elementwise_spec(d["second"]))


@dataclasses.dataclass(frozen=True)
class Family:
    """A Hopper kernel as tuning sees it: its task kind, its outputs by name, how its
    description is read back, its kernel, its configurations (the default first) and what keeps
    a configuration from running."""

    kind: str
    outputs: tuple
    spec: object  # dict -> the kernel's description dataclass
    kernel: object  # (*shape, spec, cfg, lead) -> tirx PrimFunc; shape (m, n, k), or the b2b kernel's (m, n1, n2, k)
    configs: object  # (*shape, spec) -> [config]
    problems: object  # (*shape, spec, cfg) -> [str]
    config: type = WgmmaConfig  # the configurations' dataclass


def _split_form(m: int, n: int, cfg: WgmmaConfig) -> tuple:
    """What a split post-norm's kernels are on GEMM configuration ``cfg``: the parts its row
    statistics come in (the task's output shape) and whether its tiles take one wave, where the
    group runs as one kernel (:func:`~tvm_comfuse.schedule.row_exchange.one_wave`; else the GEMM
    and a norm kernel)."""
    from ..schedule import row_exchange  # pylint: disable=import-outside-toplevel

    return cfg.wg_cols, row_exchange.one_wave(m, n, cfg)


def _split_configs(m: int, n: int, k: int, spec: we.Elementwise) -> list:
    """The split post-norm GEMM's configurations: the GEMM + elementwise kernel's on which the
    group compiles to the kernels it does on the default (:func:`_split_form`). The task measures
    the GEMM alone, so a candidate that also needs the norm kernel where the default runs one
    kernel would be ranked without that kernel's time: session 31 (H100, BERT-base fp16, one
    process) the FFN2's best record, persistent CTAs 1.4% faster on the runner, compiled as two
    kernels, 361.3 + 46.5 us against the default's one, 360.9."""
    found = elementwise_configs(m, n, k, spec)
    return [cfg for cfg in found if _split_form(m, n, cfg) == _split_form(m, n, found[0])]


def _split_problems(m: int, n: int, k: int, spec: we.Elementwise, cfg: WgmmaConfig) -> list:
    """What keeps configuration ``cfg`` from a split post-norm's GEMM: the GEMM + elementwise
    kernel's problems, and a form other than the default's (:func:`_split_configs`; records
    logged before session 31 may have one)."""
    default, found = we.default_config(m, n, k, spec), we.problems(m, n, k, spec, cfg)
    (cols, one), (d_cols, d_one) = _split_form(m, n, cfg), _split_form(m, n, default or cfg)
    if (cols, one) != (d_cols, d_one):
        found.append(f"row statistics in {n // cols} parts, {'one' if one else 'two'} kernel(s), where the default has "
                     f"{n // d_cols}, {'one' if d_one else 'two'}")
    return found


FAMILIES = {
    "postnorm": Family(KIND, ("out", "norm"), _postnorm_spec,
                       lambda m, n, k, spec, cfg, lead: wp.wgmma_postnorm(m, n, k, spec, cfg, lead=lead), configs, wp.problems),
    # a split post-norm's GEMM (schedule/split_norm.py): the sum and its row statistics
    "split": Family("wgmma_split_gemm", ("out", "stats"), _elementwise_spec,
                    lambda m, n, k, spec, cfg, lead: we.wgmma_elementwise(m, n, k, spec, cfg, lead=lead), _split_configs,
                    _split_problems),
    "elementwise": Family("wgmma_elementwise", ("out",), _elementwise_spec,
                          lambda m, n, k, spec, cfg, lead: we.wgmma_elementwise(m, n, k, spec, cfg, lead=lead), elementwise_configs,
                          we.problems),
    # its lead is a pair: x's row dims and the output's
    "b2b": Family("wgmma_b2b", ("out",), _b2b_spec,
                  lambda m, n1, n2, k, spec, cfg, lead: wb.wgmma_b2b(m, n1, n2, k, spec, cfg, *(tuple(d) for d in lead)),
                  b2b_configs, wb.problems, wb.B2BConfig),
}
#: The task kinds of the Hopper kernels.
KINDS = tuple(f.kind for f in FAMILIES.values())


#: Description fields added after logs shipped, with their defaults: left out of a description's
#: JSON at those (the workload a record is keyed by carries that JSON; with them, every shipped
#: log would stop matching its workload).
LATER_FIELDS = {"sum_out": False, "stats": ""}


def _without_later_defaults(d):
    """``d`` (a description as a dict, nested for the back-to-back pair) without the
    :data:`LATER_FIELDS` that hold their defaults."""
    if not isinstance(d, dict):
        return d
    return {k: _without_later_defaults(v) for k, v in d.items() if not (k in LATER_FIELDS and v == LATER_FIELDS[k])}


@dataclasses.dataclass(frozen=True)
class Description:
    """What a Hopper kernel needs beyond a configuration: its family, its description (the chain,
    the norm), the shape, and where its parameters ``(x, w, operands..., [gamma, beta,] out[,
    norm])`` are in the group's."""

    spec: object
    mnk: tuple
    lead: tuple
    roles: tuple  # kernel input i is the group's parameter roles[i]
    order: tuple  # the group's outputs, by name
    family: str = "postnorm"

    def to_json(self) -> str:
        d = {"spec": _without_later_defaults(dataclasses.asdict(self.spec)), "mnk": self.mnk, "lead": self.lead, "roles": self.roles,
             "order": self.order}
        if self.family != "postnorm":  # the post-norm's JSON (what the shipped logs' workloads carry) stays as it was
            d["family"] = self.family
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Description:
        d = json.loads(text)
        family = d.get("family", "postnorm")
        return cls(FAMILIES[family].spec(d["spec"]), tuple(d["mnk"]), tuple(d["lead"]), tuple(d["roles"]), tuple(d["order"]), family)

    @property
    def kind(self) -> str:
        return FAMILIES[self.family].kind

    def configs(self) -> list:
        return FAMILIES[self.family].configs(*self.mnk, self.spec)

    def problems(self, cfg: WgmmaConfig) -> list:
        return FAMILIES[self.family].problems(*self.mnk, self.spec, cfg)

    def kernel(self, cfg: WgmmaConfig | None = None) -> tirx.PrimFunc:
        """The kernel for ``cfg`` (None: the default), its parameters in the group's order."""
        family = FAMILIES[self.family]
        func = family.kernel(*self.mnk, self.spec, cfg, self.lead)
        inputs = len(self.roles)
        if sorted(self.roles) != list(range(inputs)):
            raise ValueError(f"kernel inputs {self.roles} are not a permutation of the group's {inputs} parameters")
        perm = [self.roles.index(i) for i in range(inputs)] + [inputs + family.outputs.index(name) for name in self.order]
        return tirx.PrimFunc([func.params[j] for j in perm], func.body, func.ret_type, func.attrs)


def describe(found) -> Description:
    """The :class:`Description` of ``match_postnorm``'s result."""
    spec, roles, mnk, out_shape, order = found
    return Description(spec, tuple(mnk), tuple(out_shape[:-1]), tuple(roles), tuple(order))


def describe_elementwise(spec, roles, mnk, out_shape) -> Description:
    """The :class:`Description` of a GEMM + elementwise group as the offload builds it (its
    ``spec`` with the layout and cast it writes; ``out_shape`` the group's own ``[*rows, N]``)."""
    return Description(spec, tuple(mnk), tuple(out_shape[:-1]), tuple(roles), ("out",), "elementwise")


def describe_split(found) -> Description:
    """The :class:`Description` of a split post-norm's GEMM kernel (``match_postnorm``'s result):
    its inputs are the group's ``x, w`` and added operands, in the kernel's order."""
    from ..schedule.split_norm import gemm_spec  # pylint: disable=import-outside-toplevel

    spec, roles, mnk, out_shape, _ = found
    return Description(gemm_spec(spec), tuple(mnk), tuple(out_shape[:-1]), tuple(range(2 + len(spec.operands))),
                       ("out", "stats"), "split")


def split_workload(desc: Description) -> tvm.IRModule:
    """The task module of a split post-norm's GEMM kernel (``desc`` from :func:`describe_split`):
    a TE PrimFunc of what the kernel computes, ``(x, w, operands...) -> (the sum, its row
    statistics over the default configuration's parts)``, tagged with ``desc``. Not the group's
    own PrimFunc, as the other kernels' tasks are: that one also normalises, which the split
    leaves to the norm kernel, and its parameters are not this kernel's."""
    from tvm import te  # pylint: disable=import-outside-toplevel

    spec, (m, n, k), lead = desc.spec, desc.mnk, tuple(desc.lead)
    parts = n // desc.configs()[0].wg_cols
    cols = n // parts

    def f32(v):  # a tensor element (its dtype) or an expression (its type), widened
        return v if str(getattr(v, "dtype", None) or v.ty) == "float32" else v.astype("float32")

    x, w = te.placeholder((*lead, k), spec.dtype, "x"), te.placeholder((n, k), spec.dtype, "w")
    ops = [te.placeholder((*lead, n) if tile else (n,), d, f"p{j}") for j, (d, tile) in enumerate(spec.operands)]
    r = te.reduce_axis((0, k), "r")
    acc = te.compute((*lead, n), lambda *i: te.sum(f32(x[(*i[:-1], r)]) * f32(w[i[-1], r]), axis=r), name="gemm")

    def chain(*i):
        v = acc(*i)
        for step in spec.steps:
            if step.op == "add":
                tile = spec.operands[step.operand][1]
                v = v + f32(ops[step.operand](*i) if tile else ops[step.operand](i[-1]))
            elif step.op != "cast":
                raise ValueError(f"a split post-norm's chain has casts and adds only, not {step.op!r}")
            v = v if step.dtype == "float32" else f32(v.astype(step.dtype))
        return v.astype(spec.out_dtype)

    y = te.compute((*lead, n), chain, name="sum")

    def at(row, col):  # y's element at flat row `row`
        index = []
        for d in reversed(lead):
            index.insert(0, row % d)
            row = row // d
        return f32(y[(*index, col)])

    c, c2 = te.reduce_axis((0, cols), "c"), te.reduce_axis((0, cols), "c2")
    rms = spec.stats == "rms_norm"
    if spec.stats == "softmax":  # the part's max and sum of exponentials
        mean = te.compute((m, parts), lambda i, p: te.max(at(i, p * cols + c), axis=c), name="max")
        dev = te.compute((m, parts), lambda i, p: te.sum(te.exp(at(i, p * cols + c2) - mean[i, p]), axis=c2), name="exp_sum")
    else:
        total = te.compute((m, parts), lambda i, p: te.sum(at(i, p * cols + c) * (at(i, p * cols + c) if rms else 1.0), axis=c),
                           name="total")
        mean = te.compute((m, parts), lambda i, p: total[i, p] / cols, name="mean")
        dev = te.compute((m, parts), lambda i, p: te.sum((at(i, p * cols + c2) - mean[i, p]) * (at(i, p * cols + c2) - mean[i, p]),
                                                         axis=c2), name="dev")
    stats = te.compute((m, parts, 2), lambda i, p, s: te.if_then_else(s == 0, mean[i, p], te.const(0.0, "float32") if rms else dev[i, p]),
                       name="stats")
    prim = te.create_prim_func([x, w, *ops, y, stats])
    return tvm.IRModule({"main": prim.with_attr("global_symbol", "main").with_attr(KERNEL_ATTR, desc.to_json())})


def describe_b2b(spec, mnk, leads, inputs: int) -> Description:
    """The :class:`Description` of a back-to-back GEMM pair as the offload builds it: ``leads``
    are x's and the output's row dims (its ``lead``), the workload's parameters the kernel's
    inputs, in its order (:func:`~tvm_comfuse.transform.offload_hopper_b2b.pair_function`)."""
    return Description(spec, tuple(mnk), tuple(tuple(d) for d in leads), tuple(range(inputs)), ("out",), "b2b")


def task_module(func: relax.Function, desc: Description) -> tvm.IRModule:
    """The task module of a Hopper kernel: :func:`split_workload` for a split post-norm's GEMM,
    else the group's own PrimFunc (:func:`workload`), for a GEMM + elementwise group with the
    layout and cast its kernel writes (:func:`with_tail`)."""
    if desc.family == "split":
        return split_workload(desc)
    return workload(with_tail(func, desc.spec) if desc.family == "elementwise" else func, desc)


def with_tail(func: relax.Function, spec) -> relax.Function:
    """The GEMM + elementwise group ``func`` followed by the tail its kernel writes in its place
    (``spec.layout``'s reshape, permutation and reshape, and the cast to ``spec.out_dtype``:
    :func:`~tvm_comfuse.transform.offload_hopper_elementwise.planned_groups`), as one primitive
    function; ``func`` itself where there is no tail.

    Why: MetaSchedule's runner calls a candidate with arrays shaped as the task module's
    parameters, so they must be the kernel's. With the group's own output (``[*rows, N]``), a
    kernel writing attention's head layout (BERT's V projection: ``[B * H, D, S]``) failed every
    run on the argument check (session 30: 64 of 64 on the H100)."""
    from ..transform.offload_hopper import _sinfo  # pylint: disable=import-outside-toplevel  (the transforms import tune)

    shape, dtype = _sinfo(func.body.body)
    if not spec.layout and spec.out_dtype == dtype:
        return func
    bb = relax.BlockBuilder()
    with bb.function("group", func.params, attrs={k: v for k, v in func.attrs.items() if k != "global_symbol"}, private=True):
        with bb.dataflow():
            for block in func.body.blocks:
                for binding in block.bindings:
                    bb.emit_normalized(binding)
            out = func.body.body
            if spec.layout:
                dims, axes, final = spec.layout
                out = bb.emit(relax.op.reshape(bb.emit(relax.op.permute_dims(bb.emit(relax.op.reshape(out, dims)), axes)), final))
            if spec.out_dtype != dtype:
                out = bb.emit(relax.op.astype(out, spec.out_dtype))
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    found = bb.get()["group"]
    assert _sinfo(found.body.body) == (list(spec.layout[2] if spec.layout else shape), spec.out_dtype)
    return found


def workload(func: relax.Function, desc: Description) -> tvm.IRModule:
    """The task module of the outlined group function ``func``: its fused PrimFunc (as
    LegalizeOps and FuseTIR make it) as ``main``, tagged with ``desc``."""
    params = [relax.Var(p.name, p.ty) for p in func.params]
    bb = relax.BlockBuilder()
    group = bb.add_func(func, "group")
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(relax.Call(group, params))
        bb.emit_func_output(out)
    fused = relax.transform.FuseTIR()(relax.transform.LegalizeOps()(bb.get()))
    (prim,) = [f for _, f in fused.functions_items() if isinstance(f, tirx.PrimFunc)]
    return tvm.IRModule({"main": prim.with_attr("global_symbol", "main").with_attr(KERNEL_ATTR, desc.to_json())})


def description_of(mod: tvm.IRModule) -> Description | None:
    """The kernel description a task module carries, or None for any other module."""
    func = mod["main"] if "main" in [gv.name_hint for gv in mod.get_global_vars()] else None
    text = (func.attrs or {}).get(KERNEL_ATTR) if isinstance(func, tirx.PrimFunc) else None
    return Description.from_json(str(text)) if text is not None else None


def config_json(cfg: WgmmaConfig) -> str:
    """The annotation of a candidate's configuration."""
    return json.dumps(dataclasses.asdict(cfg), sort_keys=True)


#: Configuration fields a later version removed, with the value at which the kernel is the one it
#: builds now (``prefetch_tiles``, session 20: refuted on the H200): records tuned before still
#: apply where they hold that value.
REMOVED_FIELDS = {"prefetch_tiles": False}


def config_from_json(text, family: str = "postnorm"):
    """A configuration of ``family``'s kernel from its annotation, or None where it sets a removed
    field (:data:`REMOVED_FIELDS`) to another value: a kernel this version no longer builds."""
    fields = json.loads(str(text))
    if any(fields.get(name, kept) != kept for name, kept in REMOVED_FIELDS.items()):
        return None
    return FAMILIES[family].config(**{k: v for k, v in fields.items() if k not in REMOVED_FIELDS})


def space(_target: tvm.target.Target, _symbolic=None) -> ms.space_generator.SpaceGenerator:
    """One schedule per configuration, the configuration annotated on the root block."""

    def generate(sch: s_tir.Schedule):
        desc = description_of(sch.mod)
        out = []
        for cfg in desc.configs():
            one = sch.copy()
            one.annotate(one.get_sblock("root"), CONFIG_ANN, config_json(cfg))
            out.append(one)
        return out

    return ms.space_generator.ScheduleFn(generate, sch_rules=[], postprocs=[], mutator_probs={})


def config_of(trace, family: str = "postnorm"):
    """The configuration a candidate's (or record's) trace of ``family``'s kernel annotates, or None
    (none annotated, or one this version no longer builds)."""
    for inst in trace.insts:
        if inst.kind.name == "Annotate" and list(inst.attrs) == [CONFIG_ANN]:
            return config_from_json(inst.inputs[1], family)
    return None


def build_candidate(mod: tvm.IRModule, _target=None, _params=None) -> tvm.runtime.Module:
    """Compile the candidate ``mod`` (a task module with a configuration annotated on its root
    block) for sm_90a, callable with the workload's arguments. Runs in a builder worker."""
    from ..schedule.wgmma_mainloop import build  # pylint: disable=import-outside-toplevel

    desc = description_of(mod)
    return build(desc.kernel(config_from_json(mod["main"].body.block.annotations[CONFIG_ANN], desc.family))).mod


#: A tuned configuration replaces the untuned default only where the logs measured it faster by
#: at least this fraction; below it MetaSchedule's runner ranks noise. Session 31 (H100, BERT-base
#: fp16, one process): three tasks' best records, 0.6%, 1.7% and 2.0% faster than the default on
#: the runner, ran 5.0%, 5.3% and 4.0% slower in the model (Q/K's projections 260.6 against 248.2
#: us, V's 155.2 against 147.5, the last post-norm 43.3 against 41.6).
MIN_GAIN = 0.03


def tuned_config(db: ms.Database, mod: tvm.IRModule) -> WgmmaConfig | None:
    """The configuration the logs in ``db`` choose for the task module ``mod``, or None where
    they have no usable record: the fastest record whose configuration the kernel can run here
    (records it cannot are skipped, and logged where none is left), unless the untuned default's
    record is within :data:`MIN_GAIN` of it, then the default. Where the logs never measured this
    version's untuned default (tuned before a default changed), the record is still applied,
    with a warning that says how to measure the default."""
    if not db.has_workload(mod):
        return None
    # a failed run's record (FAILED_SECS) is one MetaSchedule ranks like any other, first where
    # every run failed (session 30: V's task at bert-base): never a configuration to apply
    desc = description_of(mod)
    measured = [(config_of(r.trace, desc.family), mean_secs(r.run_secs)) for r in db.get_top_k(db.commit_workload(mod), 1 << 20)]
    measured = [(cfg, secs) for cfg, secs in measured if secs < FAILED_SECS]
    # the fastest usable one (its problems checked in rank order, not every record's)
    best = next(((cfg, secs) for cfg, secs in measured if cfg is not None and not desc.problems(cfg)), None)
    if best is None:
        if measured:
            cfg = measured[0][0]
            why = ["no configuration annotated, or one this version no longer builds"] if cfg is None else desc.problems(cfg)
            LOG.warning("ComFuse: every tuning record for the %s kernel at M, N, K = %s is unusable (the fastest: %s); using the default",
                        desc.kind, desc.mnk, "; ".join(why))
        return None
    cfg, secs = best
    default = desc.configs()[0]
    if cfg == default:
        return cfg
    defaults = [s for c, s in measured if c == default]
    if not defaults:
        LOG.warning("ComFuse: the logs' best %s configuration at M, N, K = %s was never measured against this version's "
                    "untuned default (%s), which may be faster: run `comfuse tune` on these logs again, which measures the "
                    "default first (at wide-short-k, session 25's default was 12%% faster than the best then logged, on an H100)",
                    desc.kind, desc.mnk, config_json(default))
        return cfg
    return cfg if secs <= (1 - MIN_GAIN) * min(defaults) else default
