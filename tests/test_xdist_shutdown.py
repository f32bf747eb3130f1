"""A passing pytest-xdist run ends without a KeyboardInterrupt traceback (tests/conftest.py says why).

Two tiny projects run at once under ``-n 2``, each with a worker teardown slower than execnet's 5 s grace and
GC running throughout (what freeing TVM and torch does): one without the hook, which shows the traceback this
guards against (else the mechanism is gone upstream and the test skips), and one with it, which must be clean.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")
pytest.importorskip("hypothesis")

HOOK = Path(__file__).with_name("conftest.py")

TEST = """
from hypothesis import given, strategies as st

@given(st.integers())
def test_h(x):
    assert x == x
"""

SLOW_TEARDOWN = """
import time

def pytest_unconfigure(config):
    if hasattr(config, "workerinput"):  # a worker: 6.5 s of garbage cycles, so GC runs when the SIGINT comes
        end = time.time() + 6.5
        while time.time() < end:
            junk = [[] for _ in range(1000)]
            for a, b in zip(junk, junk[1:]):
                a.append(b)
                b.append(a)
            del junk
"""

WITH_HOOK = f"""
import importlib.util

_spec = importlib.util.spec_from_file_location("suite_conftest", {str(HOOK)!r})
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
pytest_sessionfinish = _mod.pytest_sessionfinish
"""


def _project(root: Path, conftest: str) -> subprocess.Popen:
    root.mkdir()
    (root / "test_a.py").write_text(TEST)
    (root / "conftest.py").write_text(conftest)
    (root / "pytest.ini").write_text("[pytest]\naddopts = -q -p no:cacheprovider\n")
    return subprocess.Popen([sys.executable, "-m", "pytest", "-n", "2"], cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_slow_worker_teardown_prints_no_keyboard_interrupt(tmp_path: Path) -> None:
    bare = _project(tmp_path / "bare", SLOW_TEARDOWN)
    hooked = _project(tmp_path / "hooked", WITH_HOOK + SLOW_TEARDOWN)
    out_bare, out_hooked = bare.communicate(timeout=120)[0], hooked.communicate(timeout=120)[0]
    assert hooked.returncode == 0 and "1 passed" in out_hooked, out_hooked
    assert "KeyboardInterrupt" not in out_hooked, out_hooked
    if "KeyboardInterrupt" not in out_bare:
        pytest.skip("this execnet no longer interrupts a slow worker teardown: nothing to guard against")
