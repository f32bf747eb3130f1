"""The GPU machine's documented offline install (docs/architecture.md, "Installing on the GPU machine") works in
a fresh venv with no package registry: run here with ``PIP_NO_INDEX=1`` and ``--no-deps`` (the GPU machine has
torch and cupy preinstalled; this one need not), on a copy of the package sources."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"


def _documented_block() -> str:
    # the section's own text, before its subsections (the TVM bundle's install has a block of its own)
    section = DOC.read_text().split("## Installing on the GPU machine", 1)[1].split("\n## ", 1)[0]
    section = section.split("\n### ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the offline install is one bash block"
    return blocks[0]


def _system_python() -> str | None:
    """A base (non-venv) Python with the build tools the offline install relies on: setuptools >= 64 and
    wheel.  The test venv's own base first, then the distribution's."""
    probe = ("import sys, setuptools, wheel; v = tuple(int(x) for x in setuptools.__version__.split('.')[:2]); "
             "sys.exit(0 if v >= (64, 0) and sys.prefix == sys.base_prefix else 1)")
    for exe in (getattr(sys, "_base_executable", None), "/usr/bin/python3"):
        if exe and Path(exe).is_file() and subprocess.run([exe, "-c", probe], capture_output=True).returncode == 0:
            return exe
    return None


def test_the_documented_command_is_the_offline_one() -> None:
    block = _documented_block()
    assert "python3 -m venv --system-site-packages --without-pip .venv" in block
    assert 'python -m pip install --no-build-isolation -e ".[gpu]"' in block
    for path in [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("spacefusion/runtime/*.py")]:
        text = path.read_text()
        if path != DOC:  # a bare --no-build-isolation in a plain venv fails: bdist_wheel (setuptools 65, no wheel)
            assert "--no-build-isolation" not in text, path
    requires = re.search(r"requires = \[(.*?)\]", (ROOT / "pyproject.toml").read_text()).group(1)
    assert '"setuptools>=64"' in requires and '"wheel"' in requires


def test_the_offline_install_works_in_a_fresh_venv(tmp_path: Path) -> None:
    python = _system_python()
    if python is None:
        pytest.skip("no base Python with setuptools >= 64 and wheel here (the offline install needs them)")
    src = tmp_path / "checkout"
    for name in ("spacefusion", "smg", "schedulers", "search"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    script = _documented_block().replace("python3 -m venv", f"{python} -m venv").replace('-e ".[gpu]"',
                                                                                       '--no-deps -e ".[gpu]"')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV", "PYTHON"))}
    env |= {"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    out = subprocess.run(["bash", "-ec", script], cwd=src, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    venv = src / ".venv" / "bin"
    assert (venv / "spacefusion-measure").is_file()
    found = subprocess.run([venv / "python", "-c", "import spacefusion.runtime as r; print(r.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert found.stdout.strip() == str(src / "spacefusion" / "runtime" / "__init__.py"), found.stderr
