"""Shared fixtures: GPU tests skip cleanly on machines without a CUDA device."""

import pytest


def _have_gpu() -> bool:
    try:
        import tvm  # pylint: disable=import-outside-toplevel

        return bool(tvm.cuda(0).exist)
    except Exception:  # pylint: disable=broad-except
        return False


def pytest_collection_modifyitems(config, items):  # pylint: disable=unused-argument
    if _have_gpu():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine (run `pytest -m gpu` on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def config_record():
    """``record(work_dir, task, target, bind, pick)``: write a tuning record for ``task`` (a
    :class:`tvm_comfuse.tune.Task` on a GPU target) whose trace is the gemm_reduce rule's
    configuration ``pick(configs)``, in a work dir of logs tuned with ``bind``; returns that
    configuration. What ``comfuse tune --bind`` writes when that configuration measures
    fastest, without measuring (so CPU tests can check what compiles pick up)."""

    def record(work_dir, task, target, bind, pick):
        from tvm import s_tir  # pylint: disable=import-outside-toplevel
        from tvm.s_tir import meta_schedule as ms  # pylint: disable=import-outside-toplevel

        from tvm_comfuse.schedule import GemmRowTile  # pylint: disable=import-outside-toplevel
        from tvm_comfuse.tune import WorkDir  # pylint: disable=import-outside-toplevel

        space = GemmRowTile().scheduled(s_tir.Schedule(task.mod["main"]), target)
        cfg, sch = pick(space)
        db = WorkDir(str(work_dir), target, bind).open()
        workload = db.commit_workload(task.mod)
        args = ms.arg_info.ArgInfo.from_prim_func(task.mod["main"])
        db.commit_tuning_record(ms.database.TuningRecord(sch.trace, workload, [1e-5], target, args))
        return cfg

    return record
