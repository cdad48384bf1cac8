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
