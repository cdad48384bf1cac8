"""The ``comfuse`` command line."""

import subprocess
import sys

from tvm_comfuse.cli.main import main


def test_help_shows_examples(capsys):
    try:
        main(["--help"])
    except SystemExit as exit_:
        assert exit_.code == 0
    assert "comfuse demo" in capsys.readouterr().out


def test_demo_runs_checks_and_generates_cuda(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tvm_comfuse.cli.main", "demo", "--skip-bert", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gemm_reduce" in proc.stdout and "[PASS]" in proc.stdout
    assert "all checks passed" in proc.stdout
    assert list(tmp_path.glob("*.cu"))


def test_console_script_is_installed():
    proc = subprocess.run(["comfuse", "demo", "--help"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and "--skip-bert" in proc.stdout


def test_bench_without_a_gpu_says_so_and_its_table_marks_absent_contenders(capsys):
    """``comfuse bench --attention`` and ``--mlp`` parse and, with no GPU, exits 2 naming the problem; the
    results table shows '-' where a contender does not apply to a case (sdpa on a post-norm)."""
    from tvm_comfuse import bench  # pylint: disable=import-outside-toplevel

    assert main(["bench", "--shapes", "--attention", "128", "512"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert main(["bench", "--shapes", "--mlp", "64", "256"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    rows = [bench.Row("attention-b32h8-s128", 4096, 64, 512, "attention", "float16", "sdpa", kernel_us=10.0),
            bench.Row("bert-base-attnout", 4096, 768, 768, "layer_norm", "float16", "comfuse", kernel_us=13.0)]
    text = bench.table(rows)
    assert "attention-b32h8-s128" in text and "10.0" in text and text.splitlines()[2].split()[-3] == "-"  # its sdpa cell


def test_results_record_the_gpu_driver_or_none(monkeypatch, tmp_path):
    """Results files name the driver beside the GPU (kernel times move with it): nvidia-smi's
    answer where there is one, None where it is missing or prints nothing."""
    import os  # pylint: disable=import-outside-toplevel

    from tvm_comfuse import bench  # pylint: disable=import-outside-toplevel

    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 580.159.04\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    env = bench.environment()
    assert env["driver"] == "580.159.04" and {"gpu", "torch", "tvm", "commit", "date"} <= set(env)
    fake.write_text("#!/bin/sh\nexit 9\n")
    assert bench.gpu_driver() is None
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert bench.gpu_driver() is None


def test_bench_compiles_every_case_of_a_run_with_torch_compile():
    """Every case of a bench run compiles the same function (a new closure, the same code), and
    TorchDynamo, which caches by code object, ran the ninth on eagerly (its recompile limit):
    session 24's tenth softmax case was timed as torch.compile but ran eager's kernels. The
    bench's compile starts from empty caches, so twelve cases compile twelve times (a counting
    backend here: no compiler needed), where plain ``torch.compile`` stops at eight."""
    import torch  # pylint: disable=import-outside-toplevel

    from tvm_comfuse import bench  # pylint: disable=import-outside-toplevel

    def count(compile_fn):
        graphs = []

        def backend(gm, _inputs):
            graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()  # pylint: disable=protected-access
        for i in range(12):
            fn = compile_fn(lambda x, i=i: x * i + 1, backend=backend, dynamic=False)
            assert (fn(torch.ones(4)) == i + 1).all()
        return len(graphs)

    assert count(lambda fn, **kw: bench._torch_compile(torch, fn, **kw)) == 12  # pylint: disable=protected-access
    assert count(torch.compile) < 12  # (what the bench did before: Dynamo's limit, 8 by default)


def test_bench_results_file_holds_every_row_as_it_is_measured(tmp_path, capsys):
    """``comfuse bench`` rewrites its results file as each row is measured (a device call cut by
    its time limit keeps what it measured), errors included; ``--vanilla-logs`` parses (without
    a GPU the bench exits 2 saying so)."""
    import json  # pylint: disable=import-outside-toplevel

    from tvm_comfuse import bench  # pylint: disable=import-outside-toplevel

    out, lines = tmp_path / "results.json", []
    log = bench.Checkpoint(str(out), lines.append)

    def wrong():
        raise RuntimeError("no GPU here")

    for i, contender in enumerate(("eager", "comfuse")):
        bench._timed(None, bench.Row("s", 64, 32, 16, "layer_norm", "float16", contender), None, wrong, None, 1.0, log)  # pylint: disable=protected-access
        saved = json.loads(out.read_text())
        assert [r["contender"] for r in saved["rows"]] == ["eager", "comfuse"][: i + 1] and "gpu" in saved["environment"]
    assert saved["rows"][-1]["error"] == "RuntimeError: no GPU here" and len(lines) == 2
    assert main(["bench", "--shapes", "--vanilla-logs", str(tmp_path / "ms")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
