"""experiments/gpu_suite.py, the one call that runs the cuda suite on the GPU machine: its counts and command."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def suite() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_gpu_suite_under_test", REPO / "experiments" / "gpu_suite.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SAMPLE = '''
import pytest

def test_ok():
    pass

def test_wrong():
    assert 1 == 2, "one is not two"

@pytest.mark.skip(reason="no GPU")
def test_skipped():
    pass

@pytest.fixture
def broken():
    raise RuntimeError("setup broke")

def test_setup_error(broken):
    pass
'''


def test_counts_from_a_real_junit_report(suite: ModuleType, tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "test_unimportable.py").write_text("import no_such_module_here\n")
    junit = tmp_path / "r.xml"
    subprocess.run([sys.executable, "-m", "pytest", str(tmp_path), "-p", "no:cacheprovider", "-q",
                    "--continue-on-collection-errors", f"--junitxml={junit}"], cwd=tmp_path, capture_output=True,
                   check=False)
    c = suite.counts(junit)
    assert (c["passed"], c["failed"], c["errors"], c["skipped"], c["total"]) == (1, 1, 2, 1, 5)
    problems = {p["test"].split("::")[-1]: p for p in c["problems"]}
    assert "one is not two" in problems["test_wrong"]["message"] and problems["test_wrong"]["kind"] == "failure"
    assert problems["test_setup_error"]["kind"] == "error"
    line = suite.summary_line(c, "NVIDIA H100 80GB HBM3 (driver 580)", 12.3)
    assert line == ("GPU suite (pytest -m cuda): 1 passed, 1 failed, 2 errors, 1 skipped of 5 on "
                    "NVIDIA H100 80GB HBM3 (driver 580) in 12 s")


def test_the_command_runs_the_cuda_marker_over_all_tests(suite: ModuleType, tmp_path: Path) -> None:
    cmd = suite.pytest_command(tmp_path / "x.xml", 1, ["-x"])
    assert cmd[1:6] == ["-m", "pytest", "tests", "-m", "cuda"] and cmd[-1] == "-x"
    xdist = importlib.util.find_spec("xdist") is not None
    # one worker: this process (``-n 0`` over the project's ``-n auto`` where xdist is installed)
    assert f"--junitxml={tmp_path / 'x.xml'}" in cmd and (cmd[cmd.index("-n") + 1] == "0" if xdist else "-n" not in cmd)
    assert ("-n" in suite.pytest_command(tmp_path / "x.xml", 8, [])) == xdist


def test_help_describes_the_device_call() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "experiments" / "gpu_suite.py"), "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "offline_bundle.py" in proc.stdout and "--workers" in proc.stdout and "--out" in proc.stdout
