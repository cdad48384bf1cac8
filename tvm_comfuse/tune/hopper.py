"""The Hopper post-norm kernel as a MetaSchedule task: workload, space, build and lookup.

The wgmma kernel (:mod:`tvm_comfuse.schedule.wgmma_postnorm`) is a tirx program, not a schedule
of an s_tir PrimFunc, so MetaSchedule cannot search it the usual way. What makes it a task:

- **Workload**: the group's own PrimFunc, what LegalizeOps and FuseTIR make of the outlined
  post-norm function (the computation, with the group's parameter order), tagged with the
  kernel's description (:data:`KERNEL_ATTR`: the chain, M/N/K, which parameter is which).
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
space (7 to 112 configurations on the suite's shapes) is small enough for that; the measured
trials-to-best are in ``tuning_logs/README.md``.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import tvm
from tvm import relax, s_tir, tirx
from tvm.s_tir import meta_schedule as ms

from ..schedule import wgmma_postnorm as wp
from ..schedule.wgmma_mainloop import WgmmaConfig
from ..schedule.wgmma_space import configs

LOG = logging.getLogger("tvm_comfuse")
#: Task kind, and the PrimFunc attribute holding the kernel's description (JSON).
KIND = "wgmma_postnorm"
KERNEL_ATTR = "comfuse.wgmma_postnorm"
#: Root-block annotation holding a candidate's configuration (JSON of a WgmmaConfig).
CONFIG_ANN = "comfuse.wgmma_config"
OUTPUTS = ("out", "norm")


@dataclasses.dataclass(frozen=True)
class Description:
    """What the kernel needs beyond a configuration: the chain, the shape, and where its
    parameters ``(x, w, operands..., gamma[, beta], out[, norm])`` are in the group's."""

    spec: wp.PostNorm
    mnk: tuple
    lead: tuple
    roles: tuple  # kernel input i is the group's parameter roles[i]
    order: tuple  # the group's outputs, by name

    def to_json(self) -> str:
        return json.dumps({"spec": dataclasses.asdict(self.spec), "mnk": self.mnk, "lead": self.lead,
                           "roles": self.roles, "order": self.order}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Description:
        d = json.loads(text)
        spec = dict(d["spec"])
        spec["steps"] = tuple(wp.Step(**s) for s in spec["steps"])
        spec["operands"] = tuple(tuple(o) for o in spec["operands"])
        return cls(wp.PostNorm(**spec), tuple(d["mnk"]), tuple(d["lead"]), tuple(d["roles"]), tuple(d["order"]))

    def kernel(self, cfg: WgmmaConfig | None = None) -> tirx.PrimFunc:
        """The kernel for ``cfg`` (None: the default), its parameters in the group's order."""
        func = wp.wgmma_postnorm(*self.mnk, self.spec, cfg, lead=self.lead)
        inputs = len(self.roles)
        if sorted(self.roles) != list(range(inputs)):
            raise ValueError(f"kernel inputs {self.roles} are not a permutation of the group's {inputs} parameters")
        perm = [self.roles.index(i) for i in range(inputs)] + [inputs + OUTPUTS.index(name) for name in self.order]
        return tirx.PrimFunc([func.params[j] for j in perm], func.body, func.ret_type, func.attrs)


def describe(found) -> Description:
    """The :class:`Description` of ``match_postnorm``'s result."""
    spec, roles, mnk, out_shape, order = found
    return Description(spec, tuple(mnk), tuple(out_shape[:-1]), tuple(roles), tuple(order))


def workload(func: relax.Function, desc: Description) -> tvm.IRModule:
    """The task module of the outlined post-norm function ``func``: its fused PrimFunc (as
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


def config_from_json(text) -> WgmmaConfig:
    return WgmmaConfig(**json.loads(str(text)))


def space(_target: tvm.target.Target, _symbolic=None) -> ms.space_generator.SpaceGenerator:
    """One schedule per configuration, the configuration annotated on the root block."""

    def generate(sch: s_tir.Schedule):
        desc = description_of(sch.mod)
        out = []
        for cfg in configs(*desc.mnk, desc.spec):
            one = sch.copy()
            one.annotate(one.get_sblock("root"), CONFIG_ANN, config_json(cfg))
            out.append(one)
        return out

    return ms.space_generator.ScheduleFn(generate, sch_rules=[], postprocs=[], mutator_probs={})


def config_of(trace) -> WgmmaConfig | None:
    """The configuration a candidate's (or record's) trace annotates, or None."""
    for inst in trace.insts:
        if inst.kind.name == "Annotate" and list(inst.attrs) == [CONFIG_ANN]:
            return config_from_json(inst.inputs[1])
    return None


def build_candidate(mod: tvm.IRModule, _target=None, _params=None) -> tvm.runtime.Module:
    """Compile the candidate ``mod`` (a task module with a configuration annotated on its root
    block) for sm_90a, callable with the workload's arguments. Runs in a builder worker."""
    from ..schedule.wgmma_mainloop import build  # pylint: disable=import-outside-toplevel

    cfg = config_from_json(mod["main"].body.block.annotations[CONFIG_ANN])
    return build(description_of(mod).kernel(cfg)).mod


def tuned_config(db: ms.Database, mod: tvm.IRModule) -> WgmmaConfig | None:
    """The configuration of the fastest record for the task module ``mod`` in ``db``, or None
    where it has none (or the record is not a configuration the kernel can run here: logged)."""
    if not db.has_workload(mod):
        return None
    records = db.get_top_k(db.commit_workload(mod), 1)
    if not records:
        return None
    cfg, desc = config_of(records[0].trace), description_of(mod)
    why = ["no configuration annotated"] if cfg is None else wp.problems(*desc.mnk, desc.spec, cfg)
    if why:
        LOG.warning("ComFuse: a tuning record for the wgmma post-norm at M, N, K = %s is unusable (%s); using the default",
                    desc.mnk, "; ".join(why))
        return None
    return cfg
