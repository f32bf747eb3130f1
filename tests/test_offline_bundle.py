"""tools/offline_bundle.py: make a bundle of local wheels (no network), refuse a corrupt or missing part by
name, install into ``--target`` offline."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tools" / "offline_bundle.py"
_spec = importlib.util.spec_from_file_location("offline_bundle", SCRIPT)
ob = importlib.util.module_from_spec(_spec)
sys.modules["offline_bundle"] = ob
_spec.loader.exec_module(ob)


def tiny_wheel(folder: Path, name: str = "sf_tiny_probe", version: str = "0.1") -> Path:
    """A minimal valid pure-Python wheel: one module and its dist-info (METADATA, WHEEL, RECORD)."""
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}.py": b"VALUE = 42\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    whl = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
    return whl


def pyproject(folder: Path) -> Path:
    p = folder / "pyproject.toml"
    p.write_text('[project]\nname = "demo"\nversion = "1"\ndependencies = ["numpy>=1.26"]\n'
                 '[project.optional-dependencies]\ntvm = ["apache-tvm==1", "numpy>=1.26"]\n'
                 'test = ["demo[tvm]", "pytest"]\n')
    return p


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    """A bundle of one local wheel, cut into parts of 1 KiB (several parts)."""
    src = tmp_path / "src"
    src.mkdir()
    whl = tiny_wheel(src)
    # padding: a wheel big enough for three or more parts of 1 KiB
    with zipfile.ZipFile(whl, "a") as z:
        z.writestr("sf_tiny_probe_data.bin", bytes(range(256)) * 16, compress_type=zipfile.ZIP_STORED)
    return ob.make(tmp_path / "out", download=False, project=False, wheels=[whl], split_mib=1 / 1024,
                   pyproject=pyproject(tmp_path))


def test_pins_come_from_pyproject_without_the_project_itself(tmp_path: Path) -> None:
    p = pyproject(tmp_path)
    assert ob.requirements(p, ["tvm"]) == ("demo", ["numpy>=1.26", "apache-tvm==1"])
    assert ob.requirements(p, ["test"]) == ("demo", ["numpy>=1.26", "pytest"])
    with pytest.raises(ob.BundleError, match="no extra 'gpux'"):
        ob.requirements(p, ["gpux"])
    # the project's own: the tvm extra's pins are the bundle's
    name, pins = ob.requirements(REPO / "pyproject.toml", ["tvm"])
    assert name == "spacefusion" and any(x.startswith("apache-tvm==") for x in pins) and "numpy>=1.26" in pins


def test_make_writes_wheels_manifest_and_parts(bundle: Path) -> None:
    sums = ob.read_sums(bundle / "SHA256SUMS")
    assert list(sums) == ["wheels/sf_tiny_probe-0.1-py3-none-any.whl"]
    assert (bundle / "BUNDLE.json").is_file() and (bundle / "offline_bundle.py").is_file()
    parts = ob.read_sums(bundle / "parts" / "SHA256SUMS")
    assert len(parts) >= 3 and all((bundle / "parts" / n).stat().st_size <= 1024 for n in parts)
    ob.verify(bundle / "parts", parts)  # whole


def test_a_corrupt_part_is_refused_by_name(bundle: Path, tmp_path: Path) -> None:
    part = bundle / "parts" / "bundle.tar.001"
    data = bytearray(part.read_bytes())
    data[10] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(ob.BundleError, match=r"corrupt .*bundle\.tar\.001") as e:
        ob.install([bundle / "parts"], target=tmp_path / "t")
    assert "nothing was installed" in str(e.value) and "bundle.tar.000" not in str(e.value)
    assert not (tmp_path / "t").exists()


def test_a_missing_part_is_named_by_the_command(bundle: Path, tmp_path: Path) -> None:
    (bundle / "parts" / "bundle.tar.002").unlink()
    proc = subprocess.run([sys.executable, str(bundle / "parts" / "offline_bundle.py"), "install",
                           str(bundle / "parts"), "--target", str(tmp_path / "t")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1 and "missing: bundle.tar.002" in proc.stderr, proc.stderr


def test_a_corrupt_wheel_in_the_folder_is_named(bundle: Path, tmp_path: Path) -> None:
    whl = bundle / "wheels" / "sf_tiny_probe-0.1-py3-none-any.whl"
    whl.write_bytes(whl.read_bytes()[:-5])
    with pytest.raises(ob.BundleError, match="corrupt .*sf_tiny_probe-0.1-py3-none-any.whl"):
        ob.install([bundle], target=tmp_path / "t")


def test_parts_from_several_folders_install_into_target_offline(bundle: Path, tmp_path: Path) -> None:
    # parts that travelled separately: the first two in one folder, the rest (and the manifest) in another
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    for p in sorted((bundle / "parts").iterdir()):
        (a if p.name in ("bundle.tar.000", "bundle.tar.001") else b).joinpath(p.name).write_bytes(p.read_bytes())
    target = tmp_path / "deps"
    proc = subprocess.run([sys.executable, str(b / "offline_bundle.py"), "install", str(a), str(b),
                           "--target", str(target)], capture_output=True, text=True, timeout=300, check=False,
                          env={"PATH": "/usr/bin:/bin", "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = subprocess.run([sys.executable, "-c", "import sf_tiny_probe; print(sf_tiny_probe.VALUE)"],
                         capture_output=True, text=True, env={"PYTHONPATH": str(target)}, check=True)
    assert out.stdout.strip() == "42"
    # the folder form installs too
    assert ob.install([bundle], target=tmp_path / "deps2") == ["sf_tiny_probe-0.1-py3-none-any.whl"]


def test_target_leaves_out_what_this_python_has(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    have = tiny_wheel(src, name="pytest", version="0.0.1")  # this Python has pytest: left out
    out = ob.make(tmp_path / "out", download=False, project=False, wheels=[have, tiny_wheel(src)],
                  pyproject=pyproject(tmp_path))
    assert ob.install([out], target=tmp_path / "t") == ["sf_tiny_probe-0.1-py3-none-any.whl"]
    assert not (tmp_path / "t" / "pytest-0.0.1.dist-info").exists()
