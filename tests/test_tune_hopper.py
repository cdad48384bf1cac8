"""The Hopper post-norm kernel as a tuning task (CPU): its space, its workload, candidates that
build with the workload's signature, and a compile that reads the tuned configuration back."""

import dataclasses
import json
import logging
import os

import pytest
import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.arg_info import ArgInfo

from tvm_comfuse import workloads
from tvm_comfuse.schedule import wgmma_postnorm as wp
from tvm_comfuse.schedule.wgmma_mainloop import WgmmaConfig
from tvm_comfuse.schedule.wgmma_space import configs
from tvm_comfuse.transform import FuseComputeMemory, OffloadHopperPostNorm
from tvm_comfuse.tune import applied_from_database, hopper
from tvm_comfuse.tune.logs import RECORD_FILE, WORKLOAD_FILE
from tvm_comfuse.tune.measure import worker_pool
from tvm_comfuse.tune.tasks import extract_tasks

H100 = "nvidia/nvidia-h100"


@pytest.mark.parametrize("shape", workloads.SUITE, ids=lambda s: s.name)
def test_space_is_every_configuration_the_kernel_takes_default_first(shape):
    spec = wp.PostNorm.suite()
    found = configs(shape.M, shape.N, shape.K, spec)
    assert found[0] == wp.default_config(shape.N, shape.M, shape.K, spec)
    assert len(set(found)) == len(found) > 1
    assert all(wp.problems(shape.M, shape.N, shape.K, spec, cfg) == [] for cfg in found)
    if shape.K == 256:  # short K: resident W slices, with and without ping-pong groups
        assert any(c.pingpong for c in found) and any(c.resident and not c.pingpong for c in found)


def test_space_is_empty_where_the_kernel_cannot_take_the_shape():
    assert configs(100, 768, 768, wp.PostNorm.suite()) == []  # M not a multiple of 64


def _task(M=8192, K=768, N=768, **kw):
    """The one task of ``LayerNorm(x @ w.T + b + r)``; by default at 8192 rows, which the cluster
    post-norm kernel runs (at 4096 one wave of the split's tiles fills the SMs: its one-kernel
    form runs, a split GEMM task)."""
    (task,) = extract_tasks(workloads.post_norm(M, K, N, "float16", "layer_norm", linear=True, **kw), tvm.target.Target(H100))
    return task


def test_sm90_tasks_are_the_wgmma_kernel_s_and_stable():
    """On sm_90 a post-norm group the kernel takes is a wgmma_postnorm task whose workload is the
    group's fused PrimFunc, the same module every time it is derived (the compile path's lookup
    depends on it); ``hopper=False`` tunes the rule instead."""
    task = _task(batch=2, M=4096)
    assert task.kind == hopper.KIND and tvm_ffi.structural_equal(task.mod, _task(batch=2, M=4096).mod)
    desc = hopper.description_of(task.mod)
    assert desc.mnk == (8192, 768, 768) and desc.lead == (2, 4096) and hopper.Description.from_json(desc.to_json()) == desc
    # the kernel, its parameters reordered, takes exactly the workload's arguments
    kernel = desc.kernel(configs(*desc.mnk, desc.spec)[1])
    assert [(i.shape, i.dtype) for i in ArgInfo.from_prim_func(kernel)] == [(i.shape, i.dtype) for i in ArgInfo.from_prim_func(task.mod["main"])]
    (rule,) = extract_tasks(workloads.post_norm(8192, 768, 768, "float16", "layer_norm", linear=True), tvm.target.Target(H100), hopper=False)
    assert rule.kind == "gemm_reduce"


def test_a_softmax_on_the_cluster_kernel_is_its_task():
    """Softmax runs on the cluster kernel where LayerNorm does (session 25: 16384 x 256 -> 1024,
    a resident W): a wgmma_postnorm task like LayerNorm's, with the same space (the norm changes
    no configuration's resources but the staged gamma and beta it has none of), whose kernels
    take exactly the workload's arguments (no gamma, no beta)."""
    (task,) = extract_tasks(workloads.post_norm(16384, 256, 1024, "float16", "softmax", linear=True), tvm.target.Target(H100))
    desc = hopper.description_of(task.mod)
    assert task.kind == hopper.KIND and desc.spec.norm == "softmax" and desc.spec.params == ()
    space = desc.configs()
    assert space == configs(16384, 1024, 256, wp.PostNorm.suite()) and space[0].resident and space[0].pingpong
    for cfg in (space[0], space[-1]):
        kernel = desc.kernel(cfg)
        assert [(i.shape, i.dtype) for i in ArgInfo.from_prim_func(kernel)] == [(i.shape, i.dtype) for i in ArgInfo.from_prim_func(task.mod["main"])]


def test_candidates_are_the_space_and_build_for_sm90a():
    """One design space per configuration, each naming it in its trace; a candidate builds (in
    the builder's worker pool) into a module whose entry takes the workload's arguments."""
    task = _task(M=256)
    target = tvm.target.Target(H100)
    ctx = ms.TuneContext(mod=task.mod, target=target, space_generator=hopper.space(target), task_name="t", num_threads=1)
    spaces = ctx.generate_design_space()
    desc = hopper.description_of(task.mod)
    assert [hopper.config_of(s.trace) for s in spaces] == configs(*desc.mnk, desc.spec)
    picks = [spaces[0], spaces[-1]]
    results = worker_pool(workers=2).build([ms.builder.BuilderInput(s.mod, target) for s in picks])
    assert [r.error_msg for r in results] == [None, None] and all(os.path.isfile(r.artifact_path) for r in results)
    assert hopper.build_candidate(picks[1].mod).entry_name == "main"


def _logs(path, task, picks):
    """A log directory with a record per ``(config, seconds)`` of ``picks`` for ``task`` (a config
    or its annotation's text)."""
    target = tvm.target.Target(H100)
    db = ms.database.JSONDatabase(str(path / WORKLOAD_FILE), str(path / RECORD_FILE), allow_missing=True)
    workload = db.commit_workload(task.mod)
    for cfg, secs in picks:
        sch = tvm.s_tir.Schedule(task.mod)
        sch.annotate(sch.get_sblock("root"), hopper.CONFIG_ANN, cfg if isinstance(cfg, str) else hopper.config_json(cfg))
        db.commit_tuning_record(ms.database.TuningRecord(sch.trace, workload, [secs], target, ArgInfo.from_prim_func(task.mod["main"])))
    return str(path)


def _spied_configs(monkeypatch, mod, logs):
    """The configurations OffloadHopperPostNorm builds ``mod``'s groups with, given ``logs``."""
    from tvm_comfuse.pipeline import load_database  # pylint: disable=import-outside-toplevel

    target, seen, real = tvm.target.Target(H100), [], wp.wgmma_postnorm
    monkeypatch.setattr(wp, "wgmma_postnorm", lambda *a, **kw: seen.append(a[4] if len(a) > 4 else kw.get("cfg")) or real(*a, **kw))
    with target:
        grouped = FuseComputeMemory(target=target, hopper=True)(mod)
        OffloadHopperPostNorm(target, build=lambda *_: None, database=load_database(logs, target))(grouped)
    return seen


def test_compile_uses_the_fastest_tuned_configuration(tmp_path, monkeypatch, caplog):
    mod = workloads.post_norm(8192, 768, 768, "float16", "layer_norm", linear=True)
    task = _task()
    desc = hopper.description_of(task.mod)
    space = configs(*desc.mnk, desc.spec)
    logs = _logs(tmp_path, task, [(space[0], 3e-5), (space[7], 2e-5), (space[3], 1e9)])  # 1e9: a failed candidate
    with caplog.at_level(logging.INFO, logger="tvm_comfuse"):
        assert _spied_configs(monkeypatch, mod, logs) == [space[7]]
    assert "1 of 1 wgmma post-norm groups use tuned configurations" in caplog.text
    assert applied_from_database(mod, H100, logs) == (1, 1)
    assert applied_from_database(mod, H100, logs, hopper=False) == (0, 1)  # the rule's task has no record


def test_logs_that_never_measured_the_default_apply_with_a_warning(tmp_path, monkeypatch, caplog):
    """Logs tuned before the untuned default changed (wide-short-k's shipped log predated
    session 25's default, which beat its best by 12%, until session 27 re-tuned it) still
    apply, and the compile warns that the default was never measured against them; where the
    logs have it, no warning."""
    mod = workloads.post_norm(8192, 768, 768, "float16", "layer_norm", linear=True)
    task = _task()
    desc = hopper.description_of(task.mod)
    space = configs(*desc.mnk, desc.spec)
    for picks, warned in (([(space[7], 2e-5), (space[3], 3e-5)], True), ([(space[7], 2e-5), (space[0], 3e-5)], False)):
        path = tmp_path / str(warned)
        path.mkdir()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tvm_comfuse"):
            assert _spied_configs(monkeypatch, mod, _logs(path, task, picks)) == [space[7]]
        assert ("never measured against this version's untuned default" in caplog.text) == warned


def test_a_task_whose_runs_all_failed_compiles_its_default(tmp_path, monkeypatch):
    """Records of failed runs (1e9 s, ComFuse's mark; 1e10 s, MetaSchedule's) are ranked like
    any other, so where every run failed the fastest record is a failure: not a configuration to
    apply. Session 30's H100 tuning of bert-base failed every run of V's task (its task module
    then kept the group's output shape), and the compile applied the first of them as tuned."""
    mod = workloads.post_norm(8192, 768, 768, "float16", "layer_norm", linear=True)
    task = _task()
    desc = hopper.description_of(task.mod)
    space = configs(*desc.mnk, desc.spec)
    logs = _logs(tmp_path, task, [(space[3], 1e9), (space[7], 1e10)])
    assert _spied_configs(monkeypatch, mod, logs) == [None]
    assert applied_from_database(mod, H100, logs) == (0, 1)


def test_a_record_within_min_gain_of_the_default_leaves_the_default(tmp_path, monkeypatch):
    """A tuned configuration replaces the default only where the logs measured it faster by
    MIN_GAIN or more: session 31's BERT-base records 0.6-2.0% faster than the default on the
    runner ran 4-5% slower in the model. The logs still decide (the task counts as tuned)."""
    mod = workloads.post_norm(8192, 768, 768, "float16", "layer_norm", linear=True)
    task = _task()
    desc = hopper.description_of(task.mod)
    space = configs(*desc.mnk, desc.spec)
    near, far = 3e-5 * (1 - hopper.MIN_GAIN / 2), 3e-5 * (1 - 2 * hopper.MIN_GAIN)
    for secs, expect in ((near, space[0]), (far, space[7])):
        path = tmp_path / str(secs)
        path.mkdir()
        logs = _logs(path, task, [(space[7], secs), (space[0], 3e-5)])
        assert _spied_configs(monkeypatch, mod, logs) == [expect]
        assert applied_from_database(mod, H100, logs) == (1, 1)


def test_an_unusable_record_falls_back_to_the_default(tmp_path, monkeypatch, caplog):
    """A record whose configuration the kernel cannot run for this shape (a hand-edited or
    foreign log) is not applied: the default is, with a warning naming why."""
    mod = workloads.post_norm(8192, 768, 768, "float16", "layer_norm", linear=True)
    logs = _logs(tmp_path, _task(), [(WgmmaConfig(64, 384, 9, 64, 2), 1e-6)])  # nine stages overflow shared memory
    with caplog.at_level(logging.WARNING, logger="tvm_comfuse"):
        assert _spied_configs(monkeypatch, mod, logs) == [None]
    assert "unusable" in caplog.text and "shared memory" in caplog.text
    # and where a usable record follows it, that one applies, without a warning
    (tmp_path / "two").mkdir()
    task = _task()
    desc = hopper.description_of(task.mod)
    space = configs(*desc.mnk, desc.spec)
    logs = _logs(tmp_path / "two", task, [(WgmmaConfig(64, 384, 9, 64, 2), 1e-6), (space[7], 2e-5), (space[0], 3e-5)])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tvm_comfuse"):
        assert _spied_configs(monkeypatch, mod, logs) == [space[7]]
    assert "unusable" not in caplog.text


def test_records_of_a_removed_knob_apply_where_it_was_off(tmp_path, monkeypatch, caplog):
    """Records tuned before ``prefetch_tiles`` was removed (session 20) name it in their
    configuration: where it was off they are today's kernel and apply; where it was on the
    kernel is gone, and the default is used with a warning, not a crash."""
    mod = workloads.post_norm(8192, 768, 768, "float16", "layer_norm", linear=True)
    task = _task()
    desc = hopper.description_of(task.mod)
    pick = configs(*desc.mnk, desc.spec)[7]
    for prefetch, expect in ((False, [pick]), (True, [None])):
        old = json.dumps({**dataclasses.asdict(pick), "prefetch_tiles": prefetch}, sort_keys=True)  # as session 19 wrote it
        (tmp_path / str(prefetch)).mkdir()
        logs = _logs(tmp_path / str(prefetch), task, [(old, 1e-6)])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tvm_comfuse"):
            assert _spied_configs(monkeypatch, mod, logs) == expect
        assert ("no longer builds" in caplog.text) == prefetch


def _two_layers(M=512, N=256, dtype="float16"):
    """``LayerNorm(h @ w_i.T + b_i + h)`` twice, each layer with its own parameters."""
    from tvm import relax  # pylint: disable=import-outside-toplevel

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((M, N), dtype))
    layers = [[relax.Var(f"{n}{i}", relax.TensorType((N, N) if n == "w" else (N,), dtype)) for n in ("w", "b", "g", "be")]
              for i in range(2)]
    with bb.function("main", [x] + [p for layer in layers for p in layer]):
        with bb.dataflow():
            h = x
            for w, b, g, be in layers:
                y = bb.emit(relax.op.add(bb.emit(relax.op.matmul(h, bb.emit(relax.op.permute_dims(w)))), b))
                h = bb.emit(relax.op.nn.layer_norm(bb.emit(relax.op.add(y, h)), g, be, axes=[-1]))
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    return bb.get()


def test_layers_share_one_task_and_one_kernel(caplog):
    """Identical post-norm groups (a model's layers) are one task, weighted by their count, and
    compile to one kernel."""
    target = tvm.target.Target(H100)
    mod = _two_layers()
    (task,) = extract_tasks(mod, target)
    assert task.kind == hopper.KIND and task.weight == 2
    with caplog.at_level(logging.INFO, logger="tvm_comfuse"), target:
        grouped = FuseComputeMemory(target=target, hopper=True)(mod)
        OffloadHopperPostNorm(target, build=lambda *_: None)(grouped)
    assert "2 post-norm group(s) run as 1 wgmma kernel(s)" in caplog.text


def test_untuned_default_is_measured_first_and_only_once(tmp_path):
    """Before the search (which samples at random and may never draw it), the task's untuned
    default is measured and logged, so every log says how far tuning moved from it; a resumed
    run does not measure it again. (Builder and runner are stand-ins: no GPU here.)"""
    from tvm.ir.utils import derived_object  # pylint: disable=import-outside-toplevel

    from tvm_comfuse.tune import driver  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.tune.summary import TaskReport  # pylint: disable=import-outside-toplevel

    @derived_object
    class Built(ms.builder.PyBuilder):
        def build(self, build_inputs):
            out = tmp_path / f"artifact{len(list(tmp_path.iterdir()))}"
            out.mkdir()
            return [ms.builder.BuilderResult(str(out / "mod.tar"), None) for _ in build_inputs]

    @derived_object
    class Done(ms.runner.PyRunnerFuture):
        def done(self):
            return True

        def result(self):
            return ms.runner.RunnerResult([2.5e-5], None)

    @derived_object
    class Timed(ms.runner.PyRunner):
        def run(self, runner_inputs):
            return [Done() for _ in runner_inputs]

    class Bar:  # pylint: disable=too-few-public-methods
        def update(self, _n):
            pass

    target, task = tvm.target.Target(H100), _task(M=256)
    logs = tmp_path / "logs"
    logs.mkdir()
    db = ms.database.JSONDatabase(str(logs / WORKLOAD_FILE), str(logs / RECORD_FILE), allow_missing=True)
    run = driver._Run(None, target, str(logs), db, Built(), Timed(), 1, Bar())  # pylint: disable=protected-access
    report = TaskReport(task.name, task.kind, 8)
    assert driver._measure_default(run, task, hopper.space(target), report) == 1  # pylint: disable=protected-access
    desc = hopper.description_of(task.mod)
    (record,) = db.get_all_tuning_records()
    assert hopper.config_of(record.trace) == configs(*desc.mnk, desc.spec)[0] and [float(s) for s in record.run_secs] == [2.5e-5]
    assert report.measured == 1 and report.build_errors == 0
    assert driver._measure_default(run, task, hopper.space(target), report) == 0  # pylint: disable=protected-access
    assert len(db.get_all_tuning_records()) == 1


def test_rule_candidates_build_in_the_worker_pool_too():
    """On machines with the cores (the GPU machines that tune) the mma.sync rule's candidates
    go to the same worker pool: a complete tensor-core schedule survives the trip to a worker
    and builds there with ComFuse's TIR pipeline."""
    from tvm_comfuse.tune.space import space_for  # pylint: disable=import-outside-toplevel

    target = tvm.target.Target(H100)
    (task,) = extract_tasks(workloads.post_norm(256, 256, 256, "float16", "layer_norm", linear=True), target, hopper=False)
    label, space_gen = space_for(task.kind, task.mod, target)
    ctx = ms.TuneContext(mod=task.mod, target=target, space_generator=space_gen, task_name="t", num_threads=1)
    first = ctx.generate_design_space()[0]
    (result,) = worker_pool(workers=1).build([ms.builder.BuilderInput(first.mod, target)])
    assert label == "comfuse-gemm_reduce" and result.error_msg is None and os.path.isfile(result.artifact_path)


@pytest.mark.parametrize("shape", workloads.SUITE, ids=lambda s: s.name)
def test_shipped_tuned_configurations_compile_clean(shape):
    """The configuration the shipped H200 logs give each suite shape (MetaSchedule's runner
    times kernels, it does not check them) compiles for sm_90a with no accumulator read while a
    wgmma may write it and no spills: what the hazard test checks for the defaults. The shapes
    that run split (K >= SPLIT_MIN_K since session 18; at 4096 rows, BERT's, the one-kernel form
    since session 23) have no record for the split's GEMM task but at BERT-base's two (session 24):
    there the record, elsewhere its default (row tiles walked in groups at gpt-4k, the residual
    staged) is checked the same way."""
    from tvm_comfuse import codegen  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.bench import tuned_logs  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.pipeline import load_database  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule.wgmma_mainloop import build  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.transform.offload_hopper import SPLIT_MIN_K, fills_a_wave  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.tune.registry import load_workload  # pylint: disable=import-outside-toplevel

    if codegen.nvdisasm() is None:
        pytest.fail("nvdisasm is missing: pip install nvidia-cuda-nvdisasm (the test extra)")
    target = tvm.target.Target(H100)
    (task,) = extract_tasks(load_workload(shape.name)[1], target)
    desc = hopper.description_of(task.mod)
    cfg = hopper.tuned_config(load_database(tuned_logs(shape.name), target), task.mod)
    if desc.family == "split":
        assert shape.K >= SPLIT_MIN_K or fills_a_wave(shape.M, shape.N, shape.K, wp.PostNorm.suite())
        assert (cfg is not None) == (shape.name in ("bert-base-attnout", "bert-base-ffn2"))
        cfg = cfg or desc.configs()[0]  # the default
    assert cfg is not None
    source = codegen.cuda_source(build(desc.kernel(cfg)))
    assert codegen.wgmma_hazards(codegen.sass(codegen.compile_with_nvcc(source, "sm_90a"))) == []
    assert codegen.ptxas_usage(source)["spill"] == 0


ALL = ("post_norm", "attention", "elementwise")


def _bert_layer():
    return workloads.bert_encoder(layers=1, hidden=128, heads=2, batch=2, seq=128, dtype="float16")[0]


def test_elementwise_groups_are_tasks_with_the_opt_in_group():
    """With ``hopper_groups`` naming ``elementwise``, each GEMM + elementwise group the kernel
    takes is a ``wgmma_elementwise`` task as the compile builds it (Q and K, which the attention
    kernel reads in the projections' own layout, share one; V writes its transpose), no rule
    task is left for them, and the space is every configuration the kernel takes, default first."""
    from tvm_comfuse.schedule import wgmma_elementwise as we  # pylint: disable=import-outside-toplevel

    target = tvm.target.Target(H100)
    tasks = extract_tasks(_bert_layer(), target, hopper_groups=ALL)
    ew = [t for t in tasks if t.kind == "wgmma_elementwise"]
    assert sorted(t.weight for t in ew) == [1, 1, 2] and not [t for t in tasks if t.kind == "gemm_elementwise"]
    assert [t.kind for t in extract_tasks(_bert_layer(), target, hopper_groups=("post_norm",))].count("wgmma_elementwise") == 0
    layouts = {hopper.description_of(t.mod).spec.layout for t in ew}
    assert () in layouts and any(lay and lay[1] == (0, 2, 3, 1) for lay in layouts)
    desc = hopper.description_of(ew[0].mod)
    space = desc.configs()
    assert space[0] == we.default_config(*desc.mnk, desc.spec) and len(set(space)) == len(space) > 1
    ctx = ms.TuneContext(mod=ew[0].mod, target=target, space_generator=hopper.space(target), task_name="t", num_threads=1)
    assert [hopper.config_of(s.trace) for s in ctx.generate_design_space()] == space


def test_an_elementwise_candidate_builds_with_the_workload_signature():
    """A candidate of the GEMM + elementwise kernel builds (in the builder's worker pool) into a
    module whose entry takes the workload's arguments, its output in the layout the tail asks."""
    target = tvm.target.Target(H100)
    task = next(t for t in extract_tasks(_bert_layer(), target, hopper_groups=ALL)
                if t.kind == "wgmma_elementwise" and hopper.description_of(t.mod).spec.layout)
    ctx = ms.TuneContext(mod=task.mod, target=target, space_generator=hopper.space(target), task_name="t", num_threads=1)
    last = ctx.generate_design_space()[-1]
    (result,) = worker_pool(workers=1).build([ms.builder.BuilderInput(last.mod, target)])
    assert result.error_msg is None and os.path.isfile(result.artifact_path)


@pytest.mark.parametrize("half", [False, True], ids=["mixed-import", "fp16-import"])
def test_every_task_takes_its_kernel_s_arguments(half):
    """MetaSchedule's runner calls a candidate with arrays shaped as its task module's
    parameters, so those must be the kernel's: for every Hopper task of a BERT layer (post-norm,
    GEMM + elementwise; the projections written in attention's head layouts, in the mixed import
    cast to fp16 as well), of an MLP's back-to-back pair and of a split post-norm's GEMM.
    Session 30's H100 tuning of bert-base failed all 64 runs of V's task, whose module kept the
    group's own ``[B, S, H * D]`` output where the kernel writes ``[B * H, D, S]``."""
    target = tvm.target.Target(H100)
    layer = workloads.bert_encoder(layers=1, hidden=128, heads=2, batch=2, seq=128, dtype="float16", half=half)[0]
    split = workloads.post_norm(4096, 4096, 1024, "float16", "layer_norm", linear=True)  # K >= 4096: the split's GEMM
    tasks = [t for m, groups in ((layer, ALL), (_mlp(), B2B), (split, ALL)) for t in extract_tasks(m, target, hopper_groups=groups)]
    families, tails = set(), 0
    for task in tasks:
        desc = hopper.description_of(task.mod)
        args = [a.as_json() for a in ArgInfo.from_prim_func(task.mod["main"])]
        assert args == [a.as_json() for a in ArgInfo.from_prim_func(desc.kernel())], task.name
        families.add(desc.family)
        tails += desc.family == "elementwise" and args[-1][2] != [*desc.lead, desc.mnk[1]]
    assert families == {"postnorm", "split", "elementwise", "b2b"}
    assert tails >= 1  # a task whose kernel writes a layout of its own


def test_compile_uses_the_fastest_elementwise_record(tmp_path, monkeypatch, caplog):
    """``get_pipeline(..., database=DIR, hopper_groups=...)``: each GEMM + elementwise group with
    a record builds its fastest configuration, the others the default, and the count says so."""
    from tvm_comfuse.pipeline import load_database  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule import wgmma_elementwise as we  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.transform import OffloadHopperAttention, OffloadHopperElementwise  # pylint: disable=import-outside-toplevel

    target, mod = tvm.target.Target(H100), _bert_layer()
    ffn1 = next(t for t in extract_tasks(mod, target, hopper_groups=ALL)
                if t.kind == "wgmma_elementwise" and hopper.description_of(t.mod).mnk[1] == 512)
    space = hopper.description_of(ffn1.mod).configs()
    logs = _logs(tmp_path, ffn1, [(space[0], 3e-5), (space[5], 2e-5)])
    seen, real = [], we.wgmma_elementwise
    monkeypatch.setattr(we, "wgmma_elementwise", lambda *a, **kw: seen.append(a[4] if len(a) > 4 else kw.get("cfg")) or real(*a, **kw))
    noop = lambda *_: None  # noqa: E731
    with caplog.at_level(logging.INFO, logger="tvm_comfuse"), target:
        grouped = FuseComputeMemory(target=target, hopper=True)(mod)
        grouped = OffloadHopperAttention(target, noop)(OffloadHopperPostNorm(target, noop)(grouped))
        OffloadHopperElementwise(target, noop, load_database(logs, target))(grouped)
    assert space[5] in seen and seen.count(None) == len(seen) - 1
    assert "1 of 4 wgmma GEMM + elementwise groups use tuned configurations" in caplog.text
    assert applied_from_database(mod, H100, logs, hopper_groups=ALL)[0] == 1


B2B = ("post_norm", "b2b", "elementwise")


def _mlp():
    return workloads.mlp(1000, 256, 128, 512, residual=True)


def test_b2b_pairs_are_tasks_with_the_opt_in_group():
    """With ``hopper_groups`` naming ``b2b``, an MLP's GEMM pair is one ``wgmma_b2b`` task (the
    two groups inlined into one PrimFunc of the kernel's inputs), no task is left for its halves,
    and the space is every configuration the kernel takes, default first."""
    from tvm_comfuse.schedule import wgmma_b2b as wb  # pylint: disable=import-outside-toplevel

    target = tvm.target.Target(H100)
    tasks = extract_tasks(_mlp(), target, hopper_groups=B2B)
    assert [t.kind for t in tasks] == ["wgmma_b2b"]
    assert [t.kind for t in extract_tasks(_mlp(), target, hopper_groups=("post_norm", "elementwise"))] == ["wgmma_elementwise"] * 2
    desc = hopper.description_of(tasks[0].mod)
    assert desc.mnk == (1000, 128, 512, 256) and desc.roles == tuple(range(6)) and len(tasks[0].mod["main"].params) == 7
    space = desc.configs()
    assert space[0] == wb.default_config(*desc.mnk, "float16") and len(set(space)) == len(space) > 10
    ctx = ms.TuneContext(mod=tasks[0].mod, target=target, space_generator=hopper.space(target), task_name="t", num_threads=1)
    assert [hopper.config_of(s.trace, "b2b") for s in ctx.generate_design_space()] == space
    (result,) = worker_pool(workers=1).build([ms.builder.BuilderInput(ctx.generate_design_space()[-1].mod, target)])
    assert result.error_msg is None and os.path.isfile(result.artifact_path)


def test_compile_uses_the_fastest_b2b_record(tmp_path, monkeypatch, caplog):
    """``get_pipeline(..., database=DIR, hopper_groups=(..., "b2b"))``: the pair builds its
    fastest recorded configuration, and the count says so."""
    from tvm_comfuse.pipeline import load_database  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule import wgmma_b2b as wb  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.transform import OffloadHopperB2B  # pylint: disable=import-outside-toplevel

    target, mod = tvm.target.Target(H100), _mlp()
    (task,) = extract_tasks(mod, target, hopper_groups=B2B)
    space = hopper.description_of(task.mod).configs()
    logs = _logs(tmp_path, task, [(space[0], 3e-5), (space[4], 2e-5)])
    seen, real = [], wb.wgmma_b2b
    monkeypatch.setattr(wb, "wgmma_b2b", lambda *a, **kw: seen.append(a[5] if len(a) > 5 else kw.get("cfg")) or real(*a, **kw))
    with caplog.at_level(logging.INFO, logger="tvm_comfuse"), target:
        OffloadHopperB2B(target, lambda *_: None, load_database(logs, target))(FuseComputeMemory(target=target, hopper=True)(mod))
    assert seen == [space[4]] and "1 of 1 wgmma b2b pairs use tuned configurations" in caplog.text
    assert applied_from_database(mod, H100, logs, hopper_groups=B2B) == (1, 1)


def test_descriptions_leave_fields_added_later_out_at_their_defaults():
    """A task's workload carries its kernel description's JSON, and records are keyed by the
    workload: a field added to the descriptions (``PostNorm.sum_out``, ``Elementwise.stats``)
    must not appear at its default, or every shipped log stops matching. Set, it round-trips."""
    import dataclasses  # pylint: disable=import-outside-toplevel

    from tvm_comfuse.schedule import wgmma_elementwise as we  # pylint: disable=import-outside-toplevel

    plain = hopper.Description(wp.PostNorm.suite(), (4096, 768, 768), (4096,), (0, 1, 2, 3, 4, 5), ("out",))
    assert not any(f in plain.to_json() for f in hopper.LATER_FIELDS)
    for desc in (dataclasses.replace(plain, spec=dataclasses.replace(plain.spec, sum_out=True)),
                 hopper.Description(we.Elementwise(stats="rms_norm"), (256, 512, 64), (256,), (0, 1), ("out",), "elementwise")):
        assert hopper.Description.from_json(desc.to_json()) == desc


def _wide(norm="rms_norm"):
    return workloads.post_norm(256, 512, 8192, "float16", norm, linear=True)


@pytest.mark.parametrize("norm", ["rms_norm", "softmax"])
def test_split_post_norms_are_tasks_of_their_gemm(norm):
    """A post-norm too wide for a cluster runs split (softmax as LayerNorm): its
    task is the GEMM kernel's (``wgmma_split_gemm``), its workload what that kernel computes (the
    sum and its row statistics, written in TE: on llvm it matches the kernel's NumPy model), its space every
    GEMM + elementwise configuration with the default's warpgroup width (so every candidate
    writes the statistics in the same parts) and kernel form, and a candidate builds with the
    workload's signature."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    from tvm_comfuse.schedule import split_norm as sn  # pylint: disable=import-outside-toplevel

    target = tvm.target.Target(H100)
    (task,) = extract_tasks(_wide(norm), target)
    desc = hopper.description_of(task.mod)
    assert task.kind == "wgmma_split_gemm" and desc.family == "split" and desc.spec.stats == norm
    space = desc.configs()
    assert space[0] == sn.config(256, 8192, 512, wp.PostNorm.suite("float16", norm)) and len(space) > 1
    assert {c.wg_cols for c in space} == {space[0].wg_cols}
    ctx = ms.TuneContext(mod=task.mod, target=target, space_generator=hopper.space(target), task_name="t", num_threads=1)
    assert [hopper.config_of(s.trace, "split") for s in ctx.generate_design_space()] == space
    (result,) = worker_pool(workers=1).build([ms.builder.BuilderInput(ctx.generate_design_space()[-1].mod, target)])
    assert result.error_msg is None and os.path.isfile(result.artifact_path)

    small = hopper.Description(desc.spec, (64, 512, 32), (2, 32), desc.roles, desc.order, "split")
    lib = tvm.compile(tvm.IRModule({"main": hopper.split_workload(small)["main"].without_attr(hopper.KERNEL_ATTR)}), target="llvm")
    rng = np.random.default_rng(0)
    x, w, b, r = (rng.standard_normal(s).astype("float16") for s in ((2, 32, 32), (512, 32), (512,), (2, 32, 512)))
    parts = 512 // small.configs()[0].wg_cols
    args = [tvm.runtime.tensor(a) for a in (x, w, b, r + 3, np.zeros((2, 32, 512), "float16"), np.zeros((64, parts, 2), "float32"))]
    lib["main"](*args)
    y, stats = sn.reference_gemm(wp.PostNorm.suite("float16", norm), x, w, (b, r + 3), parts)
    assert np.abs(args[4].numpy().astype(np.float32) - y.astype(np.float32)).max() <= 1e-2
    assert np.allclose(args[5].numpy(), stats, rtol=1e-3, atol=1e-3)


def test_split_candidates_compile_to_the_default_s_kernels(tmp_path, monkeypatch):
    """Where a split post-norm runs as one kernel on its default (one wave of tiles: BERT-base's
    FFN2), every candidate of its task does too: the task times the GEMM alone, and session 31's
    H100 tuning ranked persistent CTAs first (1.4% faster on the runner), which compiled the group
    as the GEMM and a norm kernel (361.3 + 46.5 us a forward against the one kernel's 360.9). A
    record of such a configuration, logged before, is skipped for the next usable one."""
    from tvm_comfuse.pipeline import load_database  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule import row_exchange, split_norm as sn  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule.wgmma_space import elementwise_configs  # pylint: disable=import-outside-toplevel

    target, mod = tvm.target.Target(H100), workloads.post_norm(4096, 3072, 768, "float16", "layer_norm", linear=True)
    (task,) = extract_tasks(mod, target)
    desc = hopper.description_of(task.mod)
    (m, n, k), space = desc.mnk, desc.configs()
    assert desc.family == "split" and all(row_exchange.one_wave(m, n, c) for c in space)
    persistent = next(c for c in elementwise_configs(m, n, k, desc.spec) if c.persistent and c.wg_cols == space[0].wg_cols)
    assert "two kernel(s)" in "; ".join(desc.problems(persistent))
    logs = _logs(tmp_path, task, [(persistent, 1e-5), (space[-1], 2e-5), (space[0], 3e-5)])
    one, two = [], []
    real_one, real_two = sn.exchange_kernel, sn.kernels
    monkeypatch.setattr(sn, "exchange_kernel", lambda *a, **kw: one.append(a[4]) or real_one(*a, **kw))
    monkeypatch.setattr(sn, "kernels", lambda *a, **kw: two.append(a[4]) or real_two(*a, **kw))
    with target:
        OffloadHopperPostNorm(target, lambda *_: None, load_database(logs, target))(FuseComputeMemory(target=target, hopper=True)(mod))
    assert one == [space[-1]] and two == []


def test_compile_uses_the_fastest_split_record(tmp_path, monkeypatch, caplog):
    """A split post-norm with a record builds its GEMM on the fastest recorded configuration,
    and the count says so."""
    from tvm_comfuse.pipeline import load_database  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule import split_norm as sn  # pylint: disable=import-outside-toplevel

    target, mod = tvm.target.Target(H100), _wide()
    (task,) = extract_tasks(mod, target)
    space = hopper.description_of(task.mod).configs()
    logs = _logs(tmp_path, task, [(space[0], 3e-5), (space[-1], 2e-5)])
    seen, real_two, real_one = [], sn.kernels, sn.exchange_kernel  # the GEMM's build, as two kernels or one
    monkeypatch.setattr(sn, "kernels", lambda *a, **kw: seen.append(a[4]) or real_two(*a, **kw))
    monkeypatch.setattr(sn, "exchange_kernel", lambda *a, **kw: seen.append(a[4]) or real_one(*a, **kw))
    with caplog.at_level(logging.INFO, logger="tvm_comfuse"), target:
        OffloadHopperPostNorm(target, lambda *_: None, load_database(logs, target))(FuseComputeMemory(target=target, hopper=True)(mod))
    assert seen == [space[-1]] and "1 of 1 wgmma post-norm groups use tuned configurations" in caplog.text
    assert applied_from_database(mod, H100, logs) == (1, 1)
