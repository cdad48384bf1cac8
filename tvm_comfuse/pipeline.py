"""get_pipeline: vanilla TVM's Relax pipeline with ComFuse's fusion and scheduling inserted.

The order matters: FuseComputeMemory must see Relax operators (before LegalizeOps), and the
schedule stage must see the fused PrimFuncs (after FuseTIR). Everything else, library
dispatch, FuseOps for the rest of the graph, the dataflow lowering and finalisation, is TVM's
own per-target pipeline, so a module without fusion groups compiles exactly as vanilla TVM
compiles it.
"""

from __future__ import annotations

import importlib
import json
import logging
import os

import tvm
from tvm import relax
from tvm.s_tir import dlight as dl
from tvm.s_tir import meta_schedule as ms

from .errors import ComFuseError
from .schedule import GemmRowTile
from .target import is_gpu, parse_target
from .transform import (AnnotateFusedBlocks, FuseComputeMemory, OffloadHopperAttention, OffloadHopperB2B,
                        OffloadHopperElementwise, OffloadHopperPostNorm, WidenBF16LayerNorm)
from .transform.fuse_compute_memory import KIND_ATTR
from .transform.offload_hopper import uses_hopper

LOG = logging.getLogger("tvm_comfuse")


def load_database(database, target: tvm.target.Target | None = None) -> ms.Database:
    """A MetaSchedule database from a Database or a directory of MetaSchedule JSON logs.

    A directory's logs must have been measured on ``target``'s kind and architecture: a record
    is looked up by the PrimFunc alone, so logs from another GPU would silently apply kernels
    tuned (or not even valid) for it.
    """
    from .tune.logs import RECORD_FILE, WORKLOAD_FILE  # pylint: disable=import-outside-toplevel  (tune imports us)

    if isinstance(database, ms.Database):
        return database
    path = os.fspath(database)
    workload = os.path.join(path, WORKLOAD_FILE)
    records = os.path.join(path, RECORD_FILE)
    if not (os.path.isfile(workload) and os.path.isfile(records)):
        raise ComFuseError(
            f"{path!r} is not a MetaSchedule log directory (it needs {WORKLOAD_FILE} and "
            f"{RECORD_FILE}). Pass the --work-dir that `comfuse tune` wrote, "
            "or a tvm.s_tir.meta_schedule.Database."
        )
    if target is not None:
        _check_logs_target(path, records, target)
    if target is None or is_gpu(target):
        register_tensor_intrinsics(records)
    return ms.database.JSONDatabase(path_workload=workload, path_tuning_record=records, allow_missing=False)


def register_tensor_intrinsics(records: str | None = None) -> None:
    """Register TVM's CUDA tensor intrinsics (~20 s, once per process), and the cluster
    exchanges the tuning records in the file ``records`` name. A JSONDatabase parses every trace
    when it opens, and the tensor-core kernels' traces name these intrinsics: without them,
    loading GPU logs fails with "TensorIntrin 'mma_fill_16x16_f32' is not registered" (or, for
    a row split over a cluster, 'comfuse_cluster_allgather_float32_64_x2', which the rule
    registers only when it schedules one)."""
    import tvm.s_tir.tensor_intrin.cuda  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import

    from .schedule.cluster import register_named  # pylint: disable=import-outside-toplevel

    if records is None or not os.path.isfile(records):
        return
    with open(records, encoding="utf-8", errors="replace") as f:
        register_named(f.read())


def _machine(target: tvm.target.Target) -> tuple:
    arch = str(target.attrs.get("arch", "") or target.attrs.get("mcpu", "") or "")
    return target.kind.name, arch[:-1] if arch.startswith("sm_") and arch.endswith("a") else arch


def _check_logs_target(path: str, records: str, target: tvm.target.Target) -> None:
    """Raise ComFuseError if the logs in ``path`` were measured for another kind/architecture."""
    from .tune.logs import read_meta  # pylint: disable=import-outside-toplevel  (tune imports us)

    tuned, meta = None, read_meta(path)
    try:
        if meta is not None:
            tuned = tvm.target.Target(meta["target"])
        else:
            with open(records, encoding="utf-8") as f:
                first = f.readline()
            if first.strip():
                tuned = tvm.target.Target(json.loads(first)[1][2])
    except Exception as err:  # pylint: disable=broad-except  (unreadable meta/record: say which file)
        raise ComFuseError(f"{path}: cannot tell which target these logs were tuned for ({type(err).__name__}: {err})") from None
    if tuned is not None and _machine(tuned) != _machine(target):
        raise ComFuseError(
            f"{path}: these logs were tuned for {'/'.join(filter(None, _machine(tuned)))}, not for "
            f"{'/'.join(filter(None, _machine(target)))}. Tuned kernels do not transfer between targets: "
            "tune for this target (`comfuse tune ... --target ...`) or compile without database=."
        )


def vanilla_fusion_passes():
    """TVM's own legalisation and operator fusion, as its default pipeline runs them."""
    return [
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
    ]


#: The Hopper kernels ComFuse has, by the groups they take: ``post_norm`` (GEMM + row norm),
#: ``attention`` (multi-head attention), ``b2b`` (GEMM -> elementwise -> GEMM through a narrow
#: intermediate), ``elementwise`` (GEMM + elementwise chain); ``split_norm``: post-norms split
#: into the GEMM with row statistics and a norm kernel wherever those take them, not only for
#: rows wider than a cluster holds (:mod:`tvm_comfuse.schedule.split_norm`).
HOPPER_GROUPS = ("post_norm", "attention", "b2b", "elementwise", "split_norm")
#: Those ``get_pipeline`` runs on sm_90 unless told otherwise: all but ``split_norm``, each
#: measured faster on the H200 than what it replaces (session 15,
#: ``notebooks/results/session15-h200-2026-12-05/``: BERT-base end to end 2052 us against 5359
#: with the post-norm kernel alone; ``("post_norm",)`` is that earlier default). ``split_norm``
#: (session 17) is opt-in until it is measured.
DEFAULT_HOPPER_GROUPS = ("post_norm", "attention", "b2b", "elementwise")


def resolve_hopper_groups(groups) -> tuple:
    """``groups`` (None: :data:`DEFAULT_HOPPER_GROUPS`) as a tuple; an unknown name is an error
    that lists the known ones."""
    groups = DEFAULT_HOPPER_GROUPS if groups is None else tuple(groups)
    unknown = sorted(set(groups) - set(HOPPER_GROUPS))
    if unknown:
        raise ComFuseError(f"hopper_groups {unknown}: ComFuse's Hopper kernels take {', '.join(HOPPER_GROUPS)}")
    return groups


def fusion_passes(target=None, hopper: bool | None = None, database=None, build=None, hopper_groups=None):
    """FuseComputeMemory (and, with ``hopper`` (``None``: on sm_90 targets), the wgmma kernels of
    ``hopper_groups`` (default :data:`DEFAULT_HOPPER_GROUPS`), configured from ``database`` where
    it has their records), then the vanilla legalisation and fusion of the
    rest, then the annotation of the fused PrimFuncs: everything up to scheduling. ``build``: as
    :class:`OffloadHopperPostNorm`'s. The attention pass runs before the elementwise one, which
    folds the casts and the transpose it leaves on the projections' outputs into their kernels;
    the b2b pass too, which takes GEMM + elementwise pairs the elementwise one would take apart.
    A bf16 LayerNorm no group took is then widened to float32 (:class:`WidenBF16LayerNorm`: TVM
    cannot legalise it in bf16)."""
    groups = resolve_hopper_groups(hopper_groups)
    offload, norms = [], "post_norm" in groups or "split_norm" in groups
    if target is not None and uses_hopper(target, hopper):
        offload += [OffloadHopperPostNorm(target, build, database, split="split_norm" in groups)] if norms else []
        offload += [OffloadHopperAttention(target, build)] if "attention" in groups else []
        offload += [OffloadHopperB2B(target, build, database)] if "b2b" in groups else []
        offload += [OffloadHopperElementwise(target, build, database)] if "elementwise" in groups else []
    keeps = bool(offload) and norms  # groups the rule declines stay whole for the post-norm kernels
    return [FuseComputeMemory(target=target, hopper=keeps), *offload, WidenBF16LayerNorm(), *vanilla_fusion_passes(),
            AnnotateFusedBlocks()]


def schedule_passes(target: tvm.target.Target, database=None, static: dict | None = None):
    """Tuned records first, then the ComFuse rules for fused groups, then DLight's defaults
    for what is still unscheduled (GPU only). ``static``: for groups with symbolic shapes, the
    task modules their records were tuned on at a representative size
    (:func:`tvm_comfuse.tune.representative.counterparts`).

    CPU targets need no schedule to be correct; they compile the fused PrimFuncs as they are.
    """
    passes = []
    if database is not None:
        passes.append(_apply_database(load_database(database, target), target, static or {}))
    if is_gpu(target):
        passes.append(
            dl.ApplyDefaultSchedule(
                GemmRowTile(),
                *(
                    _NextRuleOnError(rule)
                    for rule in (dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback())
                ),
            )
        )
    return passes


class _NextRuleOnError(dl.ScheduleRule):
    """A DLight rule that gives way to the next rule instead of raising. DLight's rules fail an
    assertion or a schedule check midway on some functions where they should have declined:
    ComFuse's (several outputs of one GEMM chain, casts after a GEMM), and also some that
    vanilla fusion forms (fuzz seed 330: DLight's GEMV rule asserts, and vanilla TVM cannot
    compile the module). The last rule, Fallback, schedules anything."""

    def __init__(self, rule: dl.ScheduleRule):
        self.rule = rule

    def apply(self, func, target, tunable):
        try:
            return self.rule.apply(func, target, tunable)
        except Exception as err:  # pylint: disable=broad-except  (AssertionError, ScheduleError, ...)
            whose = "a ComFuse" if KIND_ATTR in (func.attrs or {}) else "a vanilla-fused"
            LOG.info("DLight %s declined %s function: %s", type(self.rule).__name__, whose,
                     str(err).strip().splitlines()[-1][:200] if str(err).strip() else type(err).__name__)
            return None


def count_scheduled(funcs) -> int:
    """How many of the PrimFuncs ``funcs`` a database already scheduled."""
    return sum(bool((f.attrs or {}).get("tirx.is_scheduled", False)) for f in funcs)


def _apply_database(db: ms.Database, target: tvm.target.Target, static: dict):
    """Apply the tuned records (symbolic groups through their representative-size
    counterparts in ``static``, which only GPU targets have), and say how many fused kernels had one (the rest
    take the defaults of ``schedules/<arch>.json`` in the next pass)."""
    from .tune.representative import apply_records  # pylint: disable=import-outside-toplevel  (tune imports us)

    @tvm.transform.module_pass(opt_level=0, name="ComFuseApplyDatabase")
    def _apply(mod, _ctx):
        with db:
            mod = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)
        mod, symbolic = apply_records(mod, db, target, static) if static else (mod, 0)
        fused = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc) and KIND_ATTR in (f.attrs or {})]
        tuned = count_scheduled(fused)
        if fused:
            (LOG.warning if tuned < len(fused) else LOG.info)(
                "ComFuse: %d of %d fused kernels use tuned records, %d the untuned defaults%s", tuned, len(fused),
                len(fused) - tuned, f" ({symbolic} symbolic, with a configuration tuned at a representative size)" if symbolic else "",
            )
        return mod

    return _apply


def _backend(target: tvm.target.Target):
    """TVM's per-target pipeline module (its stages are not all re-exported in 0.27)."""
    name = {"cuda": "cuda", "rocm": "rocm", "llvm": "cpu_generic"}.get(target.kind.name)
    if name is None and is_gpu(target):
        name = "gpu_generic"
    if name is None:
        raise ComFuseError(
            f"target kind {target.kind.name!r} has no Relax pipeline in TVM; use a CUDA target "
            "(e.g. \"nvidia/nvidia-h100\") or \"llvm\"."
        )
    return importlib.import_module(f"tvm.relax.backend.{name}.pipeline")


def get_pipeline(target, database=None, hopper: bool | None = None, hopper_groups=None) -> tvm.transform.Pass:
    """The Relax pipeline for ``tvm.compile(mod, target, relax_pipeline=get_pipeline(target))``.

    Parameters
    ----------
    target : str, dict or tvm.target.Target
        A target tag (``"nvidia/nvidia-h100"``), a JSON dict (``{"kind": "cuda", "arch":
        "sm_90"}``) or ``"llvm"``.
    database : str, os.PathLike or tvm.s_tir.meta_schedule.Database, optional
        Tuning logs to apply before the defaults: the configurations tuned for the wgmma
        post-norm kernels, and the schedules tuned for the other fused PrimFuncs. Logs tuned with symbolic shapes bound
        (``comfuse tune --bind n=4096``) also serve the symbolic groups on GPUs: each is scheduled
        with the configuration tuned at that size.
    hopper : bool, optional
        Run the post-norm groups the Hopper kernel takes (warp-specialised TMA + wgmma mainloop,
        rows up to 4096 wide sliced over a thread-block cluster) as that kernel instead of the
        mma.sync rule's, including rows too wide for the rule. ``None`` (the default): on sm_90
        targets, where it measured faster than the rule on every suite shape (H200, session 8:
        1.02-2.7x, and 5.5x over vanilla TVM at 8192x4096x4096, which the rule cannot fuse);
        ``False`` keeps the portable mma.sync rule.
    hopper_groups : sequence of str, optional
        With ``hopper``, which groups run as Hopper kernels (:data:`HOPPER_GROUPS`, all by
        default): ``"post_norm"`` (GEMM + LayerNorm/RMSNorm), ``"attention"`` (multi-head
        attention in one kernel, :mod:`tvm_comfuse.transform.offload_hopper_attention`),
        ``"b2b"`` (GEMM -> elementwise -> GEMM through a narrow intermediate,
        :mod:`tvm_comfuse.transform.offload_hopper_b2b`), ``"elementwise"`` (``gelu(x @ w.T +
        b)``, ``x @ w.T + b``, writing attention's head layout where it follows:
        :mod:`tvm_comfuse.transform.offload_hopper_elementwise`) and, opt-in, ``"split_norm"``
        (post-norms as the GEMM with row statistics + a norm kernel wherever those take them:
        :mod:`tvm_comfuse.schedule.split_norm`).
    """
    from .tune.logs import read_meta  # pylint: disable=import-outside-toplevel  (tune imports us)
    from .tune.representative import counterparts  # pylint: disable=import-outside-toplevel

    target = parse_target(target)
    backend = _backend(target)
    bind = {}
    if database is not None:
        if not isinstance(database, ms.Database):
            bind = (read_meta(os.fspath(database)) or {}).get("bind", {})  # tuned at a representative size
        database = load_database(database, target)  # fail now, with the path in the message, not mid-compile

    @tvm.transform.module_pass(opt_level=0, name="ComFusePipeline")
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        with target:
            static = counterparts(mod, target, bind) if bind and is_gpu(target) else {}
            seq = tvm.transform.Sequential(
                backend.library_dispatch_passes(target)
                + fusion_passes(target, hopper, database, hopper_groups=hopper_groups)
                + schedule_passes(target, database, static)
                + backend.dataflow_lower_passes(target)
                + backend.finalize_passes(target)
            )
            return seq(mod)

    return _pipeline
