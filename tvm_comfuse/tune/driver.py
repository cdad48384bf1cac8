"""The tuning loop: resumable, budgeted by total trials, one MetaSchedule run per task.

``trials`` is the total for the work directory, split evenly over the tasks; each task tunes
only what its share still lacks, counted from the records already in the logs, so a re-run
with a larger number continues and a re-run with the same number measures nothing.
Tasks are tuned one at a time (``ms.tune_tasks`` on a single TuneContext) so each gets
exactly its share and its own wall time, and the JSONDatabase appends every batch of
records as soon as it is measured: an interrupt or crash loses at most the batch in flight.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from ..errors import ComFuseError
from ..target import is_gpu, tuning_target
from . import measure, space
from .logs import FAILED_SECS, WorkDir, default_work_dir
from .registry import load_workload
from .representative import bind_rows, with_symbolic
from .summary import TaskReport, write_summary
from .tasks import Task, extract_tasks


@dataclass
class TuneOptions:
    """What ``comfuse tune`` was asked for (the CLI maps its flags onto this one to one)."""

    workload: str
    target: object = "llvm"
    trials: int = 64
    work_dir: str | None = None
    seed: int = 0
    quiet: bool = False
    include_vanilla: bool = False
    rpc_tracker: str | None = None
    rpc_key: str | None = None
    layers: int | None = None
    batch: int = 64  # candidates measured per round; records are written after each round
    #: Values of symbolic shape variables to tune at (``{"n": 4096}``; :mod:`.representative`).
    bind: dict | None = None
    #: Tune the Hopper post-norm kernel's configurations where it takes a group (None: on sm_90
    #: targets, as ``get_pipeline`` compiles; False: the mma.sync rule's schedules instead).
    hopper: bool | None = None
    #: The Hopper kernels the compile will run (``get_pipeline``'s ``hopper_groups``): with
    #: ``elementwise``, the GEMM + elementwise kernel's configurations are tuned too.
    hopper_groups: tuple | None = None


@dataclass
class TuneResult:
    work_dir: str
    module: tvm.IRModule = None  # the workload, for compiling it with the logs
    target: tvm.target.Target = None
    reports: list = field(default_factory=list)
    measured: int = 0
    interrupted: bool = False


def shares(total: int, n: int) -> list[int]:
    """``total`` trials split over ``n`` tasks, the remainder to the first ones."""
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def _search_strategy(trials: int) -> ms.search_strategy.EvolutionarySearch:
    """Evolutionary search sized to the round: MetaSchedule's defaults for real runs, a small
    population when only a handful of trials is asked for (CI, smoke tests)."""
    population = max(16, min(512, 8 * trials))
    return ms.search_strategy.EvolutionarySearch(
        population_size=population, init_min_unmeasured=min(50, population), genetic_num_iters=4 if trials >= 64 else 1
    )


def _progress(total: int, quiet: bool):
    from tqdm import tqdm  # pylint: disable=import-outside-toplevel

    return tqdm(total=total, unit="trial", desc="comfuse tune", disable=quiet or total == 0, dynamic_ncols=True)


def _callback(bar, report: TaskReport):
    @derived_object
    class Progress(ms.measure_callback.PyMeasureCallback):
        """Advances the bar and counts build errors as each batch is measured."""

        def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
            report.measured += len(measure_candidates)
            report.build_errors += sum(r.error_msg is not None for r in builder_results)
            bar.update(len(measure_candidates))

    return Progress()


def prepare(options: TuneOptions):
    """All checks, in order, before anything is written: ``(target, module, tasks, WorkDir, runner)``."""
    if options.trials < 0:
        raise ComFuseError(f"--trials must be >= 0, got {options.trials}")
    target = tuning_target(options.target)
    name, mod = load_workload(options.workload, options.layers)
    symbolic, mod = mod, bind_rows(mod, options.bind or {})
    if is_gpu(target) and options.rpc_tracker is None and not tvm.device(target.kind.name, 0).exist:
        raise ComFuseError(
            f"target {target.kind.name!r} needs a {target.kind.name.upper()} device to measure on and none was found "
            "(tvm.cuda(0).exist is False); run on the GPU machine or measure remotely with --rpc-tracker/--rpc-key."
        )
    work = WorkDir(options.work_dir or default_work_dir(target, name), target, options.bind)
    work.check()
    runner = measure.runner(options.rpc_tracker, options.rpc_key)
    # symbolic groups compile with the rule (the Hopper kernel needs static shapes): tune the rule
    tasks = extract_tasks(mod, target, options.include_vanilla, False if options.bind else options.hopper, options.hopper_groups)
    if options.bind:
        with_symbolic(tasks, symbolic, target)
    if not tasks:
        raise ComFuseError(
            f"workload {name!r} has no ComFuse-fused PrimFuncs to tune on {target.kind.name}; "
            "pass --include-vanilla to tune TVM's own fused functions."
        )
    return target, mod, tasks, work, runner


def tune(options: TuneOptions) -> TuneResult:
    """Tune ``options.workload`` into its work directory; see the module docstring."""
    target, mod, tasks, work, runner = prepare(options)
    plan = [(task, share, len(work.run_secs_for(task.mod))) for task, share in zip(tasks, shares(options.trials, len(tasks)))]
    result = TuneResult(work.path, mod, target)
    database = work.open()
    cores = int(target.attrs.get("num-cores", 0)) or os.cpu_count() or 1
    run = _Run(options, target, work.path, database, measure.builder(), runner, cores,
               _progress(sum(max(0, share - have) for _, share, have in plan), options.quiet))
    try:
        for index, (task, share, have) in enumerate(plan):
            report = TaskReport(task.name, task.kind, share)
            result.reports.append(report)
            if share - have > 0:
                _tune_task(run, index, task, share - have, report)
                result.measured += report.measured
    except KeyboardInterrupt:
        result.interrupted = True
    finally:
        run.bar.close()
        write_summary(work, tasks, result.reports, target)
    return result


@dataclass
class _Run:
    """What every task of one ``tune`` call shares."""

    options: TuneOptions
    target: tvm.target.Target
    work_dir: str
    database: ms.Database
    builder: ms.builder.Builder
    runner: ms.runner.Runner
    cores: int
    bar: object


def _measure_default(run: _Run, task: Task, space_gen, report: TaskReport) -> int:
    """Measure the untuned default (the first design space of ComFuse's spaces) unless the logs
    have it: the search samples the space at random and may never draw it, and a log should
    say how far tuning moved from what an untuned compile runs. Returns the trials it took."""
    ctx = ms.TuneContext(mod=task.mod, target=run.target, space_generator=space_gen, task_name=task.name, num_threads=1)
    spaces = ctx.generate_design_space()
    if not spaces:
        return 0
    sch, workload = spaces[0], run.database.commit_workload(task.mod)
    if any(str(rec.trace) == str(sch.trace) for rec in run.database.get_all_tuning_records()
           if tvm_ffi.structural_equal(rec.workload.mod, task.mod)):
        return 0
    args = ms.arg_info.ArgInfo.from_entry_func(sch.mod, remove_preproc=True)
    start = time.perf_counter()
    (built,) = run.builder.build([ms.builder.BuilderInput(sch.mod, run.target)])
    secs = [FAILED_SECS]
    if built.error_msg is None:
        (future,) = run.runner.run([ms.runner.RunnerInput(built.artifact_path, run.target.kind.name, args)])
        result = future.result()
        secs = [float(s) for s in result.run_secs] if result.error_msg is None else secs
        shutil.rmtree(os.path.dirname(built.artifact_path), ignore_errors=True)
    run.database.commit_tuning_record(ms.database.TuningRecord(sch.trace, workload, secs, run.target, args))
    report.measured += 1
    report.build_errors += built.error_msg is not None
    report.wall_s += time.perf_counter() - start
    run.bar.update(1)
    return 1


def _tune_task(run: _Run, index: int, task: Task, trials: int, report: TaskReport) -> None:
    label, space_gen = space.space_for(task.kind, task.mod, run.target, task.symbolic)
    report.space = label
    if label is None:  # no space can schedule it: it stays on the default schedule
        report.error = "; ".join(space_gen)
        return
    if label.startswith("comfuse-"):  # ComFuse's spaces list the untuned default first
        trials -= _measure_default(run, task, space_gen, report)
        space_gen = dict(space.candidates(task.kind, run.target, task.symbolic))[label](run.target)  # a fresh one for the search
        if trials <= 0:
            return
    context = ms.TuneContext(
        mod=task.mod, target=run.target, space_generator=space_gen, search_strategy=_search_strategy(trials),
        task_name=task.name, rand_state=run.options.seed + index, num_threads=run.cores,
    )
    start = time.perf_counter()
    try:
        ms.tune_tasks(
            tasks=[context], task_weights=[1.0], work_dir=run.work_dir, max_trials_global=trials,
            num_trials_per_iter=min(run.options.batch, trials), builder=run.builder, runner=run.runner,
            database=run.database, cost_model=ms.cost_model.XGBModel(num_tuning_cores=run.cores),
            measure_callbacks=ms.measure_callback.MeasureCallback.create("default") + [_callback(run.bar, report)],
        )
    finally:
        report.wall_s += time.perf_counter() - start
