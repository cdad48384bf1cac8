"""``comfuse tune``: logs, resume, interruption, compile from logs, bad inputs, RPC (CPU only)."""

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import tvm
import tvm_ffi

from tvm_comfuse import runtime, workloads
from tvm_comfuse.cli.main import main
from tvm_comfuse.tune import WorkDir, applied_from_database, load_workload, report
from tvm_comfuse.tune.logs import FAILED_SECS, RECORD_FILE, WORKLOAD_FILE

TARGET = '{"kind": "llvm", "num-cores": 2}'


def _tune(*args):
    return main(["tune", "tiny-postnorm", "--target", TARGET, "--quiet", *args])


def _records(work):
    with open(work / RECORD_FILE, "rb") as f:
        return f.read().splitlines(keepends=True)


def _digest(work):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(work.iterdir())}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A work dir tuned with 3 trials, then resumed to 5."""
    work = tmp_path_factory.mktemp("tune") / "logs"
    assert _tune("--trials", "3", "--work-dir", str(work)) == 0
    first = _records(work)
    assert _tune("--trials", "5", "--work-dir", str(work)) == 0
    return work, first


def test_logs_written_and_resume_appends(tuned, capsys):
    work, first = tuned
    assert {WORKLOAD_FILE, RECORD_FILE, "comfuse_meta.json", "summary.txt"} <= set(os.listdir(work))
    assert len(first) == 3
    after = _records(work)
    assert len(after) == 5 and after[:3] == first  # earlier records byte-for-byte
    assert "gemm_reduce" in (work / "summary.txt").read_text()
    before = _digest(work)
    assert _tune("--trials", "5", "--work-dir", str(work)) == 0  # nothing left to do
    assert _records(work) == after
    assert "1 of 1 kernels will compile from these logs" in capsys.readouterr().out
    assert {k: v for k, v in _digest(work).items() if k != "summary.txt"} == {k: v for k, v in before.items() if k != "summary.txt"}


def test_compile_from_logs_matches_vanilla(tuned):
    work, _ = tuned
    _, mod = load_workload("tiny-postnorm")
    assert applied_from_database(mod, "llvm", str(work)) == (1, 1)
    _check_curves(work, [r.decode() for r in _records(work)])
    args = workloads.random_inputs(mod, seed=1)
    dev = tvm.cpu()
    outs = []
    for comfuse, db in ((True, str(work)), (False, None)):
        ex = runtime.compile_module(mod, "llvm", comfuse=comfuse, database=db)
        outs.append(runtime.run(ex, runtime.to_device(args, runtime.param_dtypes(mod), dev), dev))
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def test_compacted_logs_hold_the_same_records_and_keep_growing(tuned, tmp_path, capsys):
    """``comfuse compact-logs``: the logs shrink, load as the same records (the compile applies
    them), and a resumed tune appends to them; a corrupted log is refused and left untouched."""
    import shutil  # pylint: disable=import-outside-toplevel

    work = tmp_path / "logs"
    shutil.copytree(tuned[0], work)
    size = lambda: sum((work / f).stat().st_size for f in (WORKLOAD_FILE, RECORD_FILE))  # noqa: E731
    before = size()
    assert main(["compact-logs", str(work)]) == 0 and "KiB ->" in capsys.readouterr().out
    assert size() < 0.8 * before and len(_records(work)) == 5
    assert applied_from_database(load_workload("tiny-postnorm")[1], "llvm", str(work)) == (1, 1)
    assert _tune("--trials", "6", "--work-dir", str(work)) == 0 and len(_records(work)) == 6
    with open(work / RECORD_FILE, "ab") as f:
        f.write(b'[0, [[["GetSBlock"')
    digest = _digest(work)
    assert main(["compact-logs", str(work)]) == 2
    assert "error" in capsys.readouterr().err and _digest(work) == digest


def test_vanilla_metaschedule_contender_tunes_and_matches_the_reference(tmp_path, monkeypatch):
    """The bench's vanilla-MetaSchedule contender: stock rules tune vanilla fusion's tasks within
    the budget, with ComFuse's build timeout, write MetaSchedule's logs, and the build from them
    computes the post-norm."""
    from tvm.s_tir import meta_schedule as ms  # pylint: disable=import-outside-toplevel

    from tvm_comfuse.tune.measure import BUILD_TIMEOUT_S  # pylint: disable=import-outside-toplevel

    builders, tune_relax = [], ms.relax_integration.tune_relax
    monkeypatch.setattr(ms.relax_integration, "tune_relax", lambda *a, **kw: builders.append(kw.get("builder")) or tune_relax(*a, **kw))
    mod = workloads.post_norm(24, 16, 40, "float32", "layer_norm", linear=True)
    args = workloads.random_inputs(mod, seed=2)
    ex = runtime.compile_vanilla_tuned(mod, "llvm", trials_per_task=2, work_dir=str(tmp_path))
    assert [type(b).__name__ for b in builders] == ["LocalBuilder"] and builders[0].timeout_sec == BUILD_TIMEOUT_S
    dev = tvm.cpu()
    (out,) = runtime.run(ex, runtime.to_device(args, runtime.param_dtypes(mod), dev), dev)
    (ref,) = workloads.post_norm_reference(args, "layer_norm", linear=True)
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)
    records = (tmp_path / RECORD_FILE).read_text().splitlines()
    assert 1 <= len(records) <= 2 * 3  # at most 2 trials for each of vanilla's (at most 3) tasks
    _check_curves(tmp_path, records)


def _check_curves(work, records):
    """``report.best_so_far`` (notebook 04's curves): one non-increasing curve per task, a point
    per record, each curve ending at its task's fastest record."""
    curves = report.best_so_far(str(work))
    assert sum(len(c) for c in curves.values()) == len(records)
    assert all(all(b <= a for a, b in zip(c, c[1:])) for c in curves.values())
    us = lambda secs: sum(secs) / len(secs) * 1e6 if max(secs) < FAILED_SECS else float("inf")  # noqa: E731
    fastest = sorted(min(us(r[1][1]) for r in map(json.loads, records) if r[0] == i) for i in {json.loads(r)[0] for r in records})
    assert sorted(c[-1] for c in curves.values()) == pytest.approx(fastest)


def test_compile_says_how_many_kernels_are_tuned(tuned, caplog):
    """Compiling with logs tells the user how many fused kernels had a record."""
    import logging  # pylint: disable=import-outside-toplevel

    _, mod = load_workload("tiny-postnorm")
    with caplog.at_level(logging.INFO, logger="tvm_comfuse"):
        runtime.compile_module(mod, "llvm", database=str(tuned[0]))
    assert "1 of 1 fused kernels use tuned records, 0 the untuned defaults" in caplog.text


def test_logs_of_another_target_are_refused_at_compile(tuned):
    import tvm_comfuse as cf  # pylint: disable=import-outside-toplevel

    with pytest.raises(cf.ComFuseError, match="tuned for llvm, not for cuda/sm_90"):
        cf.get_pipeline("nvidia/nvidia-h100", database=str(tuned[0]))


def _bad(work, *args, target=TARGET, workload="tiny-postnorm"):
    before = _digest(work)
    code = main(["tune", workload, "--target", target, "--quiet", "--work-dir", str(work), *args])
    assert code == 2
    assert _digest(work) == before
    return code


@pytest.mark.parametrize(
    "case", ["workload", "mismatched-shapes", "target", "other-target", "other-tvm", "corrupt", "truncated", "no-gpu", "tracker",
             "hopper-groups"]
)
def test_bad_inputs_leave_logs_identical(tuned, tmp_path, capsys, case):
    import shutil

    work = tmp_path / "logs"
    shutil.copytree(tuned[0], work)
    if case == "workload":
        _bad(work, workload="no-such-model")
        assert "unknown workload" in capsys.readouterr().err and "tiny-postnorm" in capsys.readouterr().err + "tiny-postnorm"
    elif case == "mismatched-shapes":
        script = tmp_path / "mismatched.py"
        script.write_text(load_workload("tiny-postnorm")[1].script().replace("(48, 32)", "(48, 31)"))
        _bad(work, workload=str(script))
        assert "not a TVMScript IRModule" in capsys.readouterr().err
    elif case == "target":
        _bad(work, target="cuda -arch=sm_90")
        assert "target" in capsys.readouterr().err
    elif case == "other-target":
        _bad(work, target='{"kind": "llvm", "num-cores": 1}')
        assert "tuned for target" in capsys.readouterr().err
    elif case == "other-tvm":
        meta = json.loads((work / "comfuse_meta.json").read_text())
        meta["tvm_version"] = "0.1.0"
        (work / "comfuse_meta.json").write_text(json.dumps(meta))
        _bad(work)
        assert "TVM version" in capsys.readouterr().err
    elif case in ("corrupt", "truncated"):
        data = (work / RECORD_FILE).read_bytes()
        lines = data.splitlines(keepends=True)
        if case == "corrupt":
            lines[1] = b"[0, garbage]\n"
            (work / RECORD_FILE).write_bytes(b"".join(lines))
        else:
            (work / RECORD_FILE).write_bytes(data[: len(data) - len(lines[-1]) // 2])
        _bad(work)
        err = capsys.readouterr().err
        assert RECORD_FILE in err and f"line {2 if case == 'corrupt' else len(lines)}" in err
    elif case == "no-gpu":
        import tvm

        if tvm.cuda(0).exist:
            pytest.skip("a GPU is present")
        _bad(work, target="nvidia/nvidia-h100")
        assert "none was found" in capsys.readouterr().err
    elif case == "hopper-groups":
        _bad(work, "--hopper-groups", "post_norm", "softmax")
        assert "['softmax']" in capsys.readouterr().err
    else:
        _bad(work, "--rpc-tracker", "127.0.0.1:1", "--rpc-key", "k")
        assert "cannot reach the RPC tracker" in capsys.readouterr().err


def test_interrupted_run_keeps_its_records(tmp_path):
    work = tmp_path / "logs"
    cmd = [sys.executable, "-m", "tvm_comfuse.cli.main", "tune", "tiny-postnorm", "--target", TARGET, "--quiet",
           "--trials", "200", "--batch", "2", "--work-dir", str(work)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (work / RECORD_FILE).exists() or (work / RECORD_FILE).stat().st_size == 0:
            assert time.time() < deadline, "no record appeared"
            time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGKILL)  # a crash: no chance to clean up
        proc.wait()
    kept = _records(work)
    assert kept
    WorkDir(str(work), __import__("tvm_comfuse").parse_target(TARGET)).check()  # every line parses
    assert _tune("--trials", str(len(kept) + 2), "--work-dir", str(work), "--batch", "2") == 0
    assert _records(work)[: len(kept)] == kept


def _wait(ready, timeout=90):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if ready():
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError("RPC tracker/server did not come up")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rpc_tracker_on_loopback(tmp_path):
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", str(port), "--port-end", str(port + 1)])]  # 0.27: port-end defaults to 9199
    try:
        _wait(lambda: socket.create_connection(("127.0.0.1", port), timeout=1).close() is None)
        procs.append(subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_server", "--tracker", f"127.0.0.1:{port}", "--key", "ci-cpu"]))
        from tvm import rpc

        _wait(lambda: "ci-cpu" in rpc.connect_tracker("127.0.0.1", port).summary().get("queue_info", {}))
        work = tmp_path / "rpc"
        assert _tune("--trials", "2", "--work-dir", str(work), "--rpc-tracker", f"127.0.0.1:{port}", "--rpc-key", "ci-cpu") == 0
        secs = WorkDir(str(work), __import__("tvm_comfuse").parse_target(TARGET)).scan()[1]
        assert len(secs) == 2 and any(s and s[0] < 1e9 for _, s in secs)  # measured remotely
    finally:
        for p in reversed(procs):
            p.kill()
            p.wait()


def test_help_shows_examples(capsys):
    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    out = capsys.readouterr().out
    assert "comfuse tune tiny-postnorm --trials" in out and "bert-base-attnout" in out


def test_gpu_gemm_reduce_tasks_search_the_rule_space():
    """On a CUDA target the tuner's space for a gemm_reduce task is the ComFuse rule's:
    one complete schedule per configuration that fits (generated here without a GPU)."""
    from tvm.s_tir import meta_schedule as ms  # pylint: disable=import-outside-toplevel

    from tvm_comfuse import workloads  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.pipeline import fusion_passes  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule.config import MmaConfig, candidates  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.tune.space import space_for  # pylint: disable=import-outside-toplevel

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    mod = tvm.transform.Sequential(fusion_passes(target, hopper=False))(workloads.post_norm(512, 256, 768, "float16", linear=True))
    func = mod[str(next(iter(mod.attrs["comfuse.groups"].keys())))].with_attr("global_symbol", "main")
    task = tvm.IRModule({"main": func})
    label, space = space_for("gemm_reduce", task, target)
    assert label == "comfuse-gemm_reduce"
    ctx = ms.TuneContext(mod=task, target=target, space_generator=space, task_name="t", num_threads=1)
    assert len(ctx.generate_design_space()) == len(candidates(MmaConfig, "sm_90", 768)) > 1


def test_shipped_h200_logs_apply_to_their_workloads():
    """The H200 logs in tuning_logs/ are found by the compile path: a change to the pass or the
    rule that alters the fused PrimFuncs would silently orphan them. These four hold records of
    the portable mma.sync rule (session 6), what ``hopper=False`` compiles; all five suite
    shapes' logs hold the cluster post-norm kernel's records (session 13), which the default
    compile applies where that kernel runs: not at K >= SPLIT_MIN_K, which run split since
    session 18 (the split GEMM's task, untuned there), nor at BERT's 4096 rows, whose tiles fill
    one wave of the split's one-kernel form since session 23: BERT-base's logs also hold the split
    GEMM's records (session 24, H100), which that form applies; mlp-65536-256's, the b2b kernel's;
    bert-base's, the fp16 import's six tasks (sessions 30 and 31, H100)."""
    from tvm_comfuse.schedule.wgmma_postnorm import PostNorm  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.transform.offload_hopper import SPLIT_MIN_K, fills_a_wave  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.bench import tuned_logs  # pylint: disable=import-outside-toplevel

    for name in ("bert-base-attnout", "bert-base-ffn2", "bert-large-ffn2", "wide-short-k"):
        logs = tuned_logs(name)
        assert logs is not None, name
        assert applied_from_database(load_workload(name)[1], "nvidia/nvidia-h100", logs, hopper=False) == (1, 1), name
    # and the Hopper kernel's tuned configurations (session 13), what the default sm_90 compile applies
    for shape in workloads.SUITE:
        split = shape.K >= SPLIT_MIN_K or fills_a_wave(shape.M, shape.N, shape.K, PostNorm.suite())
        tuned = 1 if not split or shape.name in ("bert-base-attnout", "bert-base-ffn2") else 0
        assert applied_from_database(load_workload(shape.name)[1], "nvidia/nvidia-h100", tuned_logs(shape.name)) == (tuned, 1), shape.name
    # and the back-to-back GEMM kernel's (session 19), default on sm_90 since session 15
    assert applied_from_database(load_workload("mlp-65536-256")[1], "nvidia/nvidia-h100", tuned_logs("mlp-65536-256")) == (1, 1)
    # and bert-base's fp16 import (sessions 30 and 31, H100): every task
    from tvm_comfuse.pipeline import load_database  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.tune import extract_tasks, hopper  # pylint: disable=import-outside-toplevel

    target = tvm.target.Target("nvidia/nvidia-h100")
    tasks, db = extract_tasks(load_workload("bert-base", 2)[1], target), load_database(tuned_logs("bert-base"), target)
    assert len(tasks) == 6 and all(hopper.tuned_config(db, t.mod) is not None for t in tasks)


def test_symbolic_rows_are_tuned_at_a_representative_size(tmp_path, capsys):
    """A module with symbolic rows ("n") is tuned with n bound (--bind), the binding kept with
    the logs; without it, or with a binding the module or the logs do not have, the error says
    what to pass and nothing is written (MetaSchedule used to crash inside its search)."""
    script = tmp_path / "serving.py"
    script.write_text(workloads.post_norm(tvm.tirx.Var("n", "int64"), 40, 24, "float32", "layer_norm", linear=True).script())
    work = tmp_path / "logs"
    tune = lambda *a: main(["tune", str(script), "--target", TARGET, "--quiet", "--work-dir", str(work), *a])  # noqa: E731
    for args, says in [((), "--bind n=4096"), (("--bind", "m=3"), "does not have"), (("--bind", "n=x"), "VAR=VALUE")]:
        assert tune(*args) == 2
        assert says in capsys.readouterr().err and not work.exists()
    assert tune("--trials", "2", "--bind", "n=64") == 0
    assert json.loads((work / "comfuse_meta.json").read_text())["bind"] == {"n": 64}
    before = _digest(work)
    assert tune("--trials", "4", "--bind", "n=32") == 2
    assert "bound to {'n': 64}" in capsys.readouterr().err and _digest(work) == before


def test_symbolic_groups_compile_with_the_configuration_tuned_at_the_representative_size(tmp_path, config_record, caplog):
    """Compiling the symbolic module from logs tuned at n = 256 schedules its fused group with
    the recorded configuration (here the first one with 16 warps, where the untuned default
    has 8): the kernel is the record's, for every n."""
    from tvm_comfuse import codegen  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.tune import extract_tasks  # pylint: disable=import-outside-toplevel

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host="llvm")
    mod = workloads.post_norm(tvm.tirx.Var("n", "int64"), 768, 768, "float16", "layer_norm", linear=True)
    (task,) = extract_tasks(tvm.relax.transform.BindSymbolicVars({"n": 256})(mod), target, hopper=False)
    cfg = config_record(tmp_path, task, target, {"n": 256}, lambda space: next(p for p in space if p[0].warps == 16))

    def threads(database):
        source = codegen.cuda_source(runtime.compile_module(mod, target, database=database, hopper=False))
        (kernel,) = [k for k in codegen.kernel_names(source) if "matmul" in k]
        return int(re.search(r"__launch_bounds__\((\d+)\)\s*" + kernel, source).group(1))

    import logging  # pylint: disable=import-outside-toplevel

    with caplog.at_level(logging.INFO, logger="tvm_comfuse"):
        assert (threads(None), threads(str(tmp_path))) == (256, 32 * cfg.warps)
    assert "1 of 1 fused kernels use tuned records, 0 the untuned defaults (1 symbolic" in caplog.text


def test_bound_tasks_search_only_configurations_the_symbolic_group_can_use():
    """Tuned at n = 4096 for a module whose rows are symbolic, the space keeps only the
    configurations the symbolic group can be scheduled with (on the H200 the fastest of 16
    unrestricted trials recomputed rows, which needs a static M, and went unused), and every
    one it keeps applies to the symbolic group."""
    from tvm import s_tir  # pylint: disable=import-outside-toplevel
    from tvm.s_tir import meta_schedule as ms  # pylint: disable=import-outside-toplevel

    from tvm_comfuse.pipeline import register_tensor_intrinsics  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.schedule import GemmRowTile  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.tune import extract_tasks, space  # pylint: disable=import-outside-toplevel
    from tvm_comfuse.tune.representative import with_symbolic  # pylint: disable=import-outside-toplevel

    register_tensor_intrinsics()
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
    mod = workloads.post_norm(tvm.tirx.Var("n", "int64"), 768, 768, "float16", "layer_norm", linear=True)
    (task,) = extract_tasks(tvm.relax.transform.BindSymbolicVars({"n": 4096})(mod), target, hopper=False)
    with_symbolic([task], mod, target)

    def designs(symbolic):
        _, gen = space.space_for(task.kind, task.mod, target, symbolic)
        return ms.TuneContext(mod=task.mod, target=target, space_generator=gen, task_name="t", num_threads=1).generate_design_space()

    every, usable = designs(None), designs(task.symbolic)
    assert 0 < len(usable) < len(every)
    everything = GemmRowTile().scheduled(s_tir.Schedule(task.mod["main"]), target)
    kept = [cfg for cfg, sch in everything if any(tvm_ffi.structural_equal(sch.mod, d.mod) for d in usable)]
    assert len(kept) == len(usable)
    assert all(sch is not None for _, sch in GemmRowTile().scheduled(s_tir.Schedule(task.symbolic), target, configs=kept, quiet=True))


def test_symbolic_groups_take_the_fastest_record_that_applies():
    """Logs tuned on the H200 at n = 4096 before the space was restricted (session 10): their
    fastest records recompute rows (static M only), so the symbolic group takes the fastest
    record that applies to it (32.7 us, 16 warps); the logs are only read."""
    from tvm_comfuse import codegen  # pylint: disable=import-outside-toplevel

    logs = os.path.join(os.path.dirname(__file__), "..", "notebooks", "results", "session10-h200-2026-12-04", "representative-logs")
    before = {name: hashlib.sha256(open(os.path.join(logs, name), "rb").read()).hexdigest() for name in os.listdir(logs)}
    meta = json.loads(open(os.path.join(logs, "comfuse_meta.json"), encoding="utf-8").read())
    target = tvm.target.Target(json.loads(meta["target"]), host="llvm")
    mod = workloads.post_norm(tvm.tirx.Var("n", "int64"), 768, 768, "float16", "layer_norm", linear=True)
    source = codegen.cuda_source(runtime.compile_module(mod, target, database=logs, hopper=False))
    assert set(re.findall(r"__launch_bounds__\((\d+)\)", source)) == {"512"}  # untuned: 256
    assert before == {name: hashlib.sha256(open(os.path.join(logs, name), "rb").read()).hexdigest() for name in os.listdir(logs)}
